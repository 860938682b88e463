"""The one door to torch's private APIs (STYLE 18): every ``torch`` name with a leading
underscore that polytrain touches is imported or reached for here, and nowhere else.

Each symbol has a smoke test in ``tests/unit/test_torch_private.py``, so a torch upgrade that
moves or renames one fails that file by name instead of a distant strategy at run time; a scan
in the same file keeps other modules from reaching past this door. Where torch has a public
equivalent we use it instead (``torch.utils.checkpoint``, ``DTensor.to_local``), so what is left
here has none in torch 2.13:

- ``replicate``: FSDP2-based data parallelism that accepts DTensor parameters (DDP does not);
  ``torch.distributed._composable`` is not yet public.
- ``queue_backward_callback``: run a function once the current backward pass has finished
  (the autograd engine's ``queue_callback``; no public hook fires after the whole pass).
- ``ddp_ignore``: the parameters DDP must leave alone (a private static method of DDP).
- ``default_store``: the default process group's key-value store (c10d keeps it private).
- ``storage_key``: the identity of a tensor's storage, shared by its views and valid on the meta
  device, where every ``data_ptr`` is 0.
- ``MonitoredAgent``: the elastic agent's per-poll worker check and its process context, and its
  shutdown grace (torch stops workers with a fixed 30 s grace otherwise).
- ``forget_shared_store`` / ``set_store_server_factory``: the rendezvous handler's store cache
  and the one extension point that makes its shared store.
- ``gloo_options``: backend options carrying a timeout, the only way to give the groups a
  ``DeviceMesh`` creates a timeout other than torch's 30-minute default (``init_device_mesh``
  reads ``pg_options._timeout``; [Note: group timeouts] in comm/init.py).
- ``TorchDispatchMode``: a mode that sees every ATen operator call, forward and backward (the
  planner counts operator calls and the bytes the non-matmul ones move; torch's public
  ``FlopCounterMode`` is built on it but counts FLOPs only).
- ``scale_``: multiply a list of tensors by one device scalar in one multi-tensor kernel per
  device and dtype (``torch._foreach_mul_``; torch's public ``clip_grads_with_norm_`` takes
  parameters, not the local shards of DTensor gradients our clipping scales).
- ``step_skipped_if``: the ``found_inf`` protocol of torch's fused optimizers (GradScaler's):
  with ``optimizer.found_inf`` set, a fused Adam/AdamW/SGD step is a no-op on the device when
  the flag is non-zero (its step counts are put back too), so the step's non-finite decision
  never reaches the host. ``supports_found_inf`` tells whether an optimizer honours it
  (``_step_supports_amp_scaling``, set by torch on fused optimizers).
- ``update_loss_scale``: torch's in-place update of a dynamic loss scale and its growth counter
  from a found-inf flag (``torch._amp_update_scale_``, GradScaler's kernel), on the device.
- ``attention_ops``: the ATen operators of fused scaled-dot-product attention (flash,
  memory-efficient, CPU flash, cuDNN), whose outputs selective recomputation keeps
  ([Note: selective recomputation] in core/recompute.py); ATen names them with a leading
  underscore and torch has no public list of them.
- ``strided_shard``: DTensor's ``_StridedShard`` placement, the only one that describes a fused
  projection split so that each rank holds its share of every chunk ([q_r | k_r | v_r] of
  GPT-2's ``c_attn``) while ``full_tensor()`` and state dicts keep the user's layout.
"""

from __future__ import annotations

import datetime
import inspect
import os
import signal
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.api import PContext
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler
from torch.nn.parallel import DistributedDataParallel
from torch.utils._python_dispatch import TorchDispatchMode

if TYPE_CHECKING:  # [Note: lazy torch.distributed] in _lazy_dist.py
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor.placement_types import Placement

__all__ = [
    "MonitoredAgent",
    "TorchDispatchMode",
    "attention_ops",
    "ddp_ignore",
    "default_store",
    "forget_shared_store",
    "gloo_options",
    "queue_backward_callback",
    "replicate",
    "scale_",
    "set_store_server_factory",
    "step_skipped_if",
    "storage_key",
    "strided_shard",
    "supports_found_inf",
    "update_loss_scale",
]


def replicate(module: nn.Module, *, mesh: DeviceMesh) -> FSDPModule:
    """FSDP2-based data parallelism of ``module`` over ``mesh``: parameters kept whole on every
    rank, gradients all-reduced per wrapped module (torch's ``replicate_with_fsdp``, imported
    here on first use: it brings FSDP and DTensor, [Note: lazy torch.distributed])."""
    from torch.distributed._composable.replicate_with_fsdp import replicate as _replicate

    return _replicate(module, mesh=mesh)


def queue_backward_callback(fn: Callable[[], None]) -> None:
    """Call ``fn`` once the backward pass now running has finished (only valid inside one)."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)


def ddp_ignore(model: nn.Module, names: Iterable[str]) -> None:
    """Make a DDP wrapper built later over ``model`` skip these parameters and buffers."""
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, list(names))


def default_store() -> dist.Store | None:
    """The store of the default process group (None without one)."""
    if not dist.is_initialized():
        return None
    return dist.distributed_c10d._get_default_store()


def storage_key(tensor: torch.Tensor) -> int:
    """Identity of ``tensor``'s storage: equal for its views, distinct for other storages, also
    on the meta device (where ``data_ptr`` is 0 for all)."""
    return int(tensor.untyped_storage()._cdata)


# torch 2.12 gave the agent a configurable grace before SIGKILL; older ones wait a fixed 30 s.
_AGENT_GRACE = "shutdown_timeout" in inspect.signature(LocalElasticAgent.__init__).parameters


class MonitoredAgent(LocalElasticAgent):
    """``LocalElasticAgent`` whose periodic worker check a subclass may replace with `monitor`,
    and whose grace between SIGTERM and SIGKILL is ``shutdown_timeout`` seconds (on a torch
    whose agent has no such setting, torch's fixed 30 s).

    The agent polls ``_monitor_workers`` every ``monitor_interval``; torch's version fails the
    whole group when any worker exits non-zero."""

    def __init__(self, *args: Any, shutdown_timeout: int = 30, **kwargs: Any) -> None:
        if _AGENT_GRACE:
            kwargs["shutdown_timeout"] = shutdown_timeout
        super().__init__(*args, **kwargs)
        self._grace_s = shutdown_timeout

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        return self.monitor(worker_group, self._pcontext)

    def monitor(self, worker_group: WorkerGroup, pcontext: PContext | None) -> RunResult:
        """torch's check: override to decide otherwise, call this to fall back on it."""
        return LocalElasticAgent._monitor_workers(self, worker_group)

    def _shutdown(
        self, death_sig: signal.Signals = signal.SIGTERM, timeout: int | None = None
    ) -> None:
        # [Note: stopped ranks] in launch/local.py: torch's _stop_workers calls this without a
        # timeout (a fixed 30 s grace before SIGKILL); use the agent's configured grace.
        if _AGENT_GRACE:
            grace = self._grace_s if timeout is None else timeout
            super()._shutdown(death_sig, grace)  # type: ignore[call-arg,unused-ignore]
        else:
            super()._shutdown(death_sig)


def forget_shared_store(handler: DynamicRendezvousHandler) -> None:
    """Make ``handler`` create a fresh shared store (and bootstrap info) at its next round."""
    handler._shared_tcp_store_server = None
    handler._bootstrap_store_info = None


def set_store_server_factory(
    handler: DynamicRendezvousHandler, factory: Callable[[str, int], dist.TCPStore]
) -> None:
    """Build the agent's shared store (the one its workers join) with ``factory(addr, port)``."""
    handler._create_tcp_store_server = factory  # type: ignore[method-assign,assignment]


def gloo_options(timeout: datetime.timedelta) -> Any:
    """Gloo process-group options whose collectives time out after ``timeout`` (typed ``Any``:
    their class lives in ``torch._C``).

    They carry the device (network interface) gloo connects over, chosen as torch chooses it
    for a group without options: one per name in ``GLOO_SOCKET_IFNAME``, else the default
    (this host's name). torch 2.13 builds its gloo groups from the timeout alone, but a torch
    that hands the options to ``ProcessGroupGloo`` as they are refuses options without a
    device ("No device(s) specified", seen with torch 2.11 on every gloo mesh group)."""
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._timeout = timeout
    names = [n for n in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if n]
    gloo = dist.ProcessGroupGloo
    options._devices = (
        [gloo.create_device(interface=n) for n in names]
        if names
        else [gloo.create_default_device()]
    )
    return options


def strided_shard(dim: int, chunks: int) -> Placement:
    """Split ``dim`` into ``chunks`` equal chunks, and each chunk over the mesh dimension: a
    rank's local tensor is its piece of every chunk, concatenated in chunk order."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return _StridedShard(dim, split_factor=chunks)


def scale_(tensors: Sequence[torch.Tensor], factor: torch.Tensor) -> None:
    """``t *= factor`` for every tensor of ``tensors`` (plain tensors, any devices and dtypes),
    one multi-tensor kernel per device and dtype; ``factor`` is a 0-d tensor."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    for (device, _), group in groups.items():
        torch._foreach_mul_(group, factor.to(device))


def supports_found_inf(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step`` honours a ``found_inf`` flag on the device (torch's fused
    Adam, AdamW and SGD)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def step_skipped_if(optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> None:
    """``optimizer.step()``, a no-op on the device where ``found_inf`` (a 0-d float tensor on
    the parameters' device) is non-zero. Only for optimizers that `supports_found_inf`."""
    optimizer.found_inf = found_inf  # type: ignore[attr-defined]
    try:
        optimizer.step()
    finally:
        del optimizer.found_inf  # type: ignore[attr-defined]


def update_loss_scale(
    scale: torch.Tensor,
    good_steps: torch.Tensor,
    found_inf: torch.Tensor,
    growth: float,
    backoff: float,
    interval: int,
) -> None:
    """In place: ``scale *= backoff`` and ``good_steps = 0`` where ``found_inf`` is non-zero;
    else ``good_steps += 1``, and ``scale *= growth`` once it reaches ``interval``."""
    torch._amp_update_scale_(scale, good_steps, found_inf, growth, backoff, interval)


def attention_ops() -> set[Any]:
    """The fused attention operators of this torch build (the ones it has)."""
    names = (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_cudnn_attention",
    )
    return {getattr(torch.ops.aten, n).default for n in names if hasattr(torch.ops.aten, n)}
