"""The cost model: one small module per strategy family, composed in `cost.hybrid.predict`.

Derivations: docs/planner.md. Pure Python, no torch.
"""

from polytrain.planner.cost.common import Env
from polytrain.planner.cost.hybrid import predict

__all__ = ["Env", "predict"]
