"""One rank's share of a pipeline over a user model's repeated layers ([Note: layer pipeline]
in `models.split`): trace the model's sides of its layers, choose the layers per stage, build
this rank's stages (tensor parallel inside them) and find its parameters tied to other ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from polytrain.comm.mesh import Mesh
from polytrain.config.job import JobConfig
from polytrain.core.recompute import apply_recompute
from polytrain.core.tensor_parallel import parallelize_layer_stage, resolve_tp_plan
from polytrain.data.datasets import Inputs
from polytrain.models.base import BlockModel, inputs_to
from polytrain.models.split import (
    LayerSplit,
    counts_from_split_points,
    stage_keys,
    tied_stages,
    trace_sides,
)
from polytrain.pipeline.evaluation import KeyMeta
from polytrain.pipeline.layer_profile import profile_job_layers
from polytrain.pipeline.layer_stage import LayerStage, build_layer_stages, cross_rank_ties
from polytrain.pipeline.partition import block_ranges
from polytrain.pipeline.profile import choose_counts, leaves_no_trace
from polytrain.pipeline.schedule import StageMap
from polytrain.pipeline.ties import CrossRankTies

__all__ = ["LayerRank", "build_layer_rank"]


@dataclass
class LayerRank:
    """What `build_layer_rank` gives `PipelineStrategy`."""

    split: LayerSplit
    ranges: list[tuple[int, int]]  # layers of every stage, half-open
    stage_keys: list[list[KeyMeta]]  # every stage's state-dict keys, in the model's order
    stages: dict[int, LayerStage]  # this rank's stages, sharing one model
    stage: LayerStage  # the rank's first stage: it holds the rank's whole share
    ties: CrossRankTies


def build_layer_rank(
    job: JobConfig,
    model: BlockModel,
    batch: tuple[Inputs, torch.Tensor],
    stage_map: StageMap,
    mesh: Mesh,
    device: torch.device,
) -> LayerRank:
    """Collective: every rank takes part in choosing ``auto`` counts (`choose_counts`) and in
    creating every tie's process group (`CrossRankTies.of`). ``batch`` is this replica's first
    training micro-batch: the tracing forward and the layer profile run on it."""
    user = model.blocks[0]
    list_path = model.layers[0].rpartition(".")[0]
    num_layers = len(model.layers)
    num_stages, pp_rank, tp = stage_map.num_stages, mesh.coord("pp"), mesh.dims.tp
    indices = stage_map.stages_of(pp_rank)
    x, y = batch
    sample = inputs_to(x, device)
    with leaves_no_trace(model, device):  # the tracing forward changes no buffer
        split = trace_sides(
            user,
            list_path,
            lambda: user(**sample) if isinstance(sample, dict) else user(sample),
        )
    if job.pipeline.split_points:
        counts = counts_from_split_points(user, model.layers, job.pipeline.split_points, num_stages)
    else:  # uniform, explicit, or `auto` ([Note: layer profile] in pipeline.layer_profile)
        counts = choose_counts(
            job,
            num_layers,
            num_stages,
            partial(profile_job_layers, job, model, split, (sample, y.to(device))),
            verbose=mesh.rank == 0,
        )
    ranges = block_ranges(counts)
    if job.parallel.recompute:  # each layer re-run in backward; names unchanged
        apply_recompute(model, job.parallel.recompute_policy)
    full = model.state_dict()
    keys = stage_keys(user, split, ranges, "blocks.0.")
    metas = [[(k, full[k].shape, full[k].dtype) for k in ks] for ks in keys]
    ties = cross_rank_ties(tied_stages(user, split, ranges), stage_map.rank_of)
    # The plan is resolved on the whole model, before the stage demotes what it does not own.
    rows = job.parallel.tp_plan
    tp_assignment = resolve_tp_plan(job.model.name, model, tp, rows) if tp > 1 else {}
    stages = build_layer_stages(model, split, ranges, indices)
    stage = stages[indices[0]].to(device)
    mine = {id(p) for p, ranks in ties if pp_rank in ranks}
    tied_names = [n for n, p in stage.named_parameters() if id(p) in mine]
    if tp_assignment:  # tensor parallel inside the stage (docs/models.md)
        parallelize_layer_stage(stage, mesh.sub("tp"), tp_assignment)
    tied = CrossRankTies.of(ties, tied_names, stage, mesh)
    return LayerRank(split, ranges, metas, stages, stage, tied)
