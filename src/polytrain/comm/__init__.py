"""Communication: the only package (with launch/ and testing/) that imports torch.distributed."""

from polytrain.comm.init import DistContext, init_distributed, shutdown
from polytrain.comm.mesh import Mesh, build_mesh

__all__ = ["DistContext", "Mesh", "build_mesh", "init_distributed", "shutdown"]
