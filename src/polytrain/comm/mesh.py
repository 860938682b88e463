"""Device mesh and one process group per mesh axis, handed out by axis name (STYLE 1)."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from polytrain.comm.init import mesh_timeout_options
from polytrain.errors import MeshError
from polytrain.topology import AXES, ParallelDims

__all__ = ["Mesh", "build_mesh"]


@dataclass(frozen=True)
class Mesh:
    """A `ParallelDims` bound to live process groups for one rank."""

    dims: ParallelDims
    device_mesh: DeviceMesh
    rank: int

    def group(self, axis: str) -> dist.ProcessGroup:
        if axis not in AXES:
            raise MeshError(f"unknown mesh axis {axis!r}: valid axes are {', '.join(AXES)}")
        return self.device_mesh.get_group(axis)

    def sub(self, axis: str) -> DeviceMesh:
        """The 1-D sub-mesh along ``axis`` that contains this rank."""
        return self.device_mesh[axis]

    def coord(self, axis: str) -> int:
        return self.dims.coords(self.rank)[axis]

    def describe(self) -> str:
        return self.dims.describe(self.rank)


def build_mesh(dims: ParallelDims, device_type: str = "cpu") -> Mesh:
    """Create the ``(pp, dp, tp)`` mesh over all ranks of the default group."""
    world = dist.get_world_size()
    if dims.world_size != world:
        raise MeshError(
            f"mesh {dims} needs {dims.world_size} ranks but the process group has {world}"
        )
    device_mesh = init_device_mesh(
        device_type, dims.shape, mesh_dim_names=AXES, backend_override=mesh_timeout_options(AXES)
    )
    return Mesh(dims=dims, device_mesh=device_mesh, rank=dist.get_rank())
