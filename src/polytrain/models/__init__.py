"""Reference models, each a sequence of blocks so pipelines can split them."""

from polytrain.models.base import BlockModel
from polytrain.models.registry import build_model, resolve_factory

__all__ = ["BlockModel", "build_model", "resolve_factory"]
