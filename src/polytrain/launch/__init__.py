"""Start worker processes through PyTorch's elastic agent (the machinery behind torchrun)."""

from polytrain.launch.local import WorkerFailure, launch

__all__ = ["WorkerFailure", "launch"]
