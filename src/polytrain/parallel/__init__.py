"""SPMD strategies, each an ``apply_*(module, mesh, cfg)`` function (STYLE 3).

Composition order: tensor parallel -> activation recomputation (`core.recompute`, shared with
the other families) -> data parallel / ZeRO.
"""

from polytrain.parallel.data_parallel import apply_data_parallel
from polytrain.parallel.zero import apply_zero

__all__ = ["apply_data_parallel", "apply_zero"]
