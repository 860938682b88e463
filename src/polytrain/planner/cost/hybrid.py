"""A layout's prediction: its memory, then its step priced by its family's cost model.

Each strategy family's registry row (`core.registry.StrategyFamily.cost_model`) names the
module here whose step function prices it; `step_model` is the planner's side of that table
(keyed by the layout's ``sync`` and ``pp``, since the planner never imports a family):
SPMD `cost.spmd`, pipelines `cost.stages`, parameter servers `cost.ps`, gossip and local SGD
`cost.decentralized`. tests/unit/test_families.py checks the two sides agree.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

from polytrain.planner.cost.common import Env, Shape
from polytrain.planner.cost.decentralized import replicas_step
from polytrain.planner.cost.ps import ps_layout_step
from polytrain.planner.cost.spmd import spmd_step
from polytrain.planner.cost.stages import stages_layout_step
from polytrain.planner.memory import memory_per_rank, ps_server_memory
from polytrain.planner.partition import balanced_stages
from polytrain.planner.schedules import check_pipeline, layout_compute
from polytrain.planner.types import Layout, ModelStats, Prediction

__all__ = ["StepModel", "predict", "step_model"]

StepModel = Callable[[Layout, ModelStats, Env, Shape], tuple[float, dict[str, float]]]
# parallel.sync -> the step of the families that run whole-model replicas (no mesh)
_REPLICA_FAMILIES: dict[str, StepModel] = {
    "ps": ps_layout_step,
    "gossip": replicas_step,
    "localsgd": replicas_step,
}


def step_model(layout: Layout) -> StepModel:
    """The step function that prices ``layout``: its family's cost model."""
    if layout.sync in _REPLICA_FAMILIES:
        return _REPLICA_FAMILIES[layout.sync]
    return stages_layout_step if layout.pp > 1 else spmd_step


def predict(
    layout: Layout, stats: ModelStats, env: Env, global_batch: int, *, time_unfit: bool = True
) -> Prediction:
    """Step time, memory and breakdown of ``layout`` for a step of ``global_batch`` samples.

    ``time_unfit=False``: a layout that does not fit its devices is not timed (its ``step_s``
    is infinite), which spares the search the pipeline simulations of the many layouts of a
    large model that cannot run ([Note: untimed layouts] in planner/search.py)."""
    if layout.pp > 1 and stats.layer_blocks:  # a user's model cut at its layers: their stages
        stats = replace(stats, blocks=stats.layer_blocks)  # [Note: layer view]
    num_stages = 1
    if layout.pp > 1:  # virtual stages: p x v for interleaved 1F1B, 2p for ZBV
        check_pipeline(layout, len(stats.blocks))
        num_stages = layout_compute(layout)[1].num_stages
    stages = balanced_stages(stats.blocks, num_stages)
    replica_samples = global_batch / layout.dp
    micro = layout.microbatches if layout.pp > 1 else layout.grad_accum
    if layout.pp > 1:
        micro *= layout.grad_accum
    mb_samples = replica_samples / micro
    mem = memory_per_rank(stats, layout, stages, mb_samples)
    total = mem.total
    if layout.sync == "ps":  # a server rank may be the busiest: it holds the optimizer state
        total = max(total, ps_server_memory(stats, layout).total)
    fits = total <= env.cluster.device.memory
    why = "" if fits else f"out of memory ({_gib(total)} > {_gib(env.cluster.device.memory)})"
    if not fits and not time_unfit:
        step, breakdown = math.inf, dict[str, float]()
    else:
        shape = Shape(stages, replica_samples, mb_samples)
        step, breakdown = step_model(layout)(layout, stats, env, shape)
    # the busiest rank's memory by kind (a parameter server's server rank may be busier)
    breakdown |= {"memory_" + kind: nbytes for kind, nbytes in mem.as_dict().items()}
    breakdown["memory_total"] = total
    if layout.pp > 1:  # the stages priced here are the ones `overrides` makes the runtime run
        layout = replace(layout, partition=tuple(len(s) for s in stages))
    return Prediction(layout, step, total, breakdown, fits, why)


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.1f} GiB"
