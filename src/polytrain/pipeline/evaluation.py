"""A pipeline read without training: a forward-only pass of validation batches through this
rank's stages, and every stage's weights gathered on global rank 0 (`PipelineStrategy`'s
``evaluate`` and ``full_state_dict``).

Evaluation sends on its own process group ([Note: process groups] in `pipeline.strategy`), the
weight gather on the default group.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from polytrain.comm.mesh import Mesh
from polytrain.comm.p2p import P2P, PendingSends, recv_into, send_all
from polytrain.models.base import BlockModel
from polytrain.models.contract import top1_correct
from polytrain.pipeline.layer_stage import LayerStage
from polytrain.pipeline.runtime import StageRuntime
from polytrain.pipeline.schedule import StageMap

__all__ = ["KeyMeta", "forward_validation", "gather_full_state", "keys_per_stage"]

EVAL = "eval"
KeyMeta = tuple[str, torch.Size, torch.dtype]  # a state-dict key, its shape and dtype


@torch.no_grad()
def forward_validation(
    runtime: StageRuntime,
    p2p: P2P,
    num_batches: int,
    *,
    first_input: Callable[[int], Any],
    targets: Callable[[int], torch.Tensor],
    context: Callable[[int], Any] | None = None,
) -> torch.Tensor:
    """This rank's ``[loss sum, correct, rows]`` over ``num_batches`` validation batches, on
    the live weights: ``first_input(i)`` enters stage 0, ``targets(i)`` meets the last stage's
    output, ``context(i)`` (a layer pipeline) reaches every stage. Only the last stage holds
    non-zero values; correct and rows stay zero on data that is not classification."""
    total = torch.zeros((), device=runtime.device)
    counts = torch.zeros(2, device=runtime.device)  # [correct, rows] on the last stage
    pending = PendingSends()
    last = runtime.num_stages - 1
    stage_map = runtime.stage_map
    for i in range(num_batches):
        if context is not None:
            inputs = context(i)
            for stage in runtime.stages.values():
                assert isinstance(stage, LayerStage)
                stage.set_context(inputs)
        out: Any = None
        for s in sorted(runtime.stages):  # in model order: a local neighbour's output is `out`
            if s == 0:
                x = first_input(i)
            elif stage_map.is_local(s, s - 1):
                x = out
            else:
                x = p2p.recv(runtime.pp_ranks[stage_map.rank_of(s - 1)], f"{EVAL}{s - 1}")
            with runtime.tracer.span("eval_F", cat="eval", microbatch=i, stage=s):
                out = runtime.forward_only(s, x)
            if s == last:
                y = targets(i).to(runtime.device)
                total += runtime.loss_fn(out, y).float()
                correct = top1_correct(out, y)
                if correct is not None:
                    counts += torch.stack([correct, torch.tensor(float(len(y)))]).to(runtime.device)
            elif not stage_map.is_local(s, s + 1):
                p2p.isend(out, runtime.pp_ranks[stage_map.rank_of(s + 1)], f"{EVAL}{s}", pending)
    pending.wait()
    return torch.cat([total.reshape(1), counts])


def keys_per_stage(model: BlockModel, ranges: list[tuple[int, int]]) -> list[list[KeyMeta]]:
    """Every stage's state-dict keys, shapes and dtypes, in the full model's order."""
    out: list[list[KeyMeta]] = [[] for _ in ranges]
    for key, value in model.state_dict().items():
        block = int(key.split(".")[1])
        stage = next(s for s, (a, b) in enumerate(ranges) if a <= block < b)
        out[stage].append((key, value.shape, value.dtype))
    return out


def gather_full_state(
    state: dict[str, torch.Tensor],
    keys: list[list[KeyMeta]],
    stage_map: StageMap,
    mesh: Mesh,
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """Collective: ranks of replica 0 send their stages' weights (``state``, unsharded) to
    global rank 0 (tensors only), each rank its stages' in stage order; rank 0 returns the
    whole model's, the others ``{}``."""
    pp_rank = mesh.coord("pp")
    mine = stage_map.stages_of(pp_rank)
    if mesh.coord("dp") == 0 and pp_rank > 0 and mesh.coord("tp") == 0:
        send_all([state[k] for s in mine for k, _, _ in keys[s]], dst=0)
    if mesh.rank != 0:
        return {}
    parts = {s: {k: state[k].detach().cpu().clone() for k, _, _ in keys[s]} for s in mine}
    for r in range(1, mesh.dims.pp):
        stages = stage_map.stages_of(r)
        metas = [meta for s in stages for meta in keys[s]]
        buffers = [torch.empty(shape, dtype=dtype, device=device) for _, shape, dtype in metas]
        recv_into(buffers, src=mesh.dims.rank_of(pp=r, dp=0))
        received = iter(zip(metas, buffers, strict=True))
        for s in stages:
            parts[s] = {k: b.cpu() for (k, _, _), b in (next(received) for _ in keys[s])}
    return {k: v for s in range(stage_map.num_stages) for k, v in parts[s].items()}
