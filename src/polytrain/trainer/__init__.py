"""Composes everything: mesh -> model -> strategy -> loop; metrics; export."""

from polytrain.trainer.loop import TrainResult, train

__all__ = ["TrainResult", "train"]
