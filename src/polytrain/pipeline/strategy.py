"""`PipelineStrategy`: the training loop's view of a pipeline with flushes (GPipe, 1F1B).

GPipe (Huang et al. 2019) and PipeDream-flush / 1F1B (Narayanan et al. 2021); PipeDream with
weight stashing (Narayanan et al. SOSP 2019) is the subclass `pipeline.pipedream.
PipeDreamStrategy`, which replaces the step and keeps the rest; see docs/pipeline.md.

Each rank holds one stage of one pipeline replica: mesh coordinate ``pp`` is the stage, ``dp``
the replica. Replica ``r`` trains on data-parallel slice ``r`` of the global batch, cut into
``m`` micro-batches (contract 1), so the synchronous schedules reproduce the single-process run.

[Note: pipeline and data parallel] After a synchronous step's flush, every stage averages its
gradients over its ``dp`` peers (the same stage of the other replicas) with one flat all-reduce
(`comm.collectives`); there is no DDP wrapper, because DDP's reducer expects each backward to follow
its own forward, which 1F1B's interleaving breaks. The all-reduce is not overlapped with the
backward. Gradient clipping uses the global norm: squared norms are summed over the pipeline.
PipeDream averages over ``dp`` after every micro-batch's backward, then clips per stage (a
global norm would need a collective across stages that run asynchronously).

[Note: pipeline NaN check] A NaN can enter one stage's gradients while the loss (computed on
the last stage) stays finite. After the dp all-reduce each rank computes
`core.nonfinite_flag` of its stage's gradients and stacks it with its loss share in the one
world all-reduce that already sums the loss (`core.finish_step`, [Note: one step contract]), so
every stage of every replica takes the same branch: ``train.on_nonfinite = "stop"`` raises
naming the (1-based) step, ``"skip"`` drops the update everywhere. PipeDream updates inside the
stream (`core.apply_update`), so it flags each update's gradients and stops when the step's
result is read (`core.nonfinite_outcome`), after the next step has run ([Note: deferred step
results] in `core.strategy`; the bad update is already applied, ``skip`` is refused).

[Note: process groups] Training activations and gradients travel on two private process groups
per pipeline (one per direction, [Note: one connection per direction] in `comm.p2p`),
evaluation on a third one, and the final weight gather on the default group.
PipeDream leaves one activation per link in flight across step boundaries; a receive posted on
another group (an evaluation between steps, another strategy in the same processes) can never
be matched against it. The mesh's own ``pp`` group is not used for p2p because a mesh axis
that spans the whole world may share the default group.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import torch
from torch import nn

from polytrain.comm.collectives import all_reduce_mean_flat_, all_reduce_sum_
from polytrain.comm.mesh import Mesh
from polytrain.comm.p2p import P2P, new_group_of
from polytrain.config.job import JobConfig
from polytrain.config.parallel import RecomputePolicy
from polytrain.core.batchnorm import convert_batchnorm
from polytrain.core.compile import apply_compile
from polytrain.core.loss_scale import loss_scale_of
from polytrain.core.modules import train_mode
from polytrain.core.optim import build_optimizer
from polytrain.core.step import AUTOCAST_DTYPES, StepRules, finish_step, sum_over
from polytrain.core.strategy import StepOutput, Strategy
from polytrain.core.tensor_parallel import (
    apply_tensor_parallel_to_stage,
    full_tensors,
    grad_square_sum,
    local_tensor,
)
from polytrain.data.datasets import Inputs
from polytrain.data.sampler import Batches
from polytrain.models.base import BlockModel, inputs_to, one_input
from polytrain.models.split import LayerSplit
from polytrain.observe.trace import Tracer
from polytrain.pipeline.checks import check_pipeline_job
from polytrain.pipeline.evaluation import forward_validation, gather_full_state, keys_per_stage
from polytrain.pipeline.layer_rank import build_layer_rank
from polytrain.pipeline.layer_stage import LayerStage
from polytrain.pipeline.partition import block_ranges
from polytrain.pipeline.profile import choose_partition
from polytrain.pipeline.runtime import Feed, StageRuntime, WeightStash, training_p2p
from polytrain.pipeline.schedule import Action, build_staged, lower, validate
from polytrain.pipeline.sharded import StageSharding
from polytrain.pipeline.stage import StageModule, build_stage
from polytrain.pipeline.ties import CrossRankTies
from polytrain.pipeline.trials import time_partitions

__all__ = ["SYNC_ONLY", "PipelineStrategy"]

SYNC_ONLY = " (synchronous schedules only)"
_PLACEHOLDER = torch.empty(0)  # a layer pipeline's first-stage "input": the inputs are context


def _sync_index(step: int, offset: int, microbatch: int) -> tuple[int, int]:
    """(step, micro-batch of the step) of micro-batch ``microbatch`` of one flush."""
    return step, offset + microbatch


class PipelineStrategy(Strategy):
    """One stage of a (possibly data-parallel) pipeline."""

    def __init__(
        self,
        job: JobConfig,
        model: BlockModel,
        mesh: Mesh,
        batches: Batches,
        device: torch.device,
    ) -> None:
        check_pipeline_job(job)
        self.job, self.mesh, self.batches, self.device = job, mesh, batches, device
        self.schedule_name = job.pipeline.schedule
        self.pp, self.pp_rank = mesh.dims.pp, mesh.coord("pp")
        self.microbatches = job.pipeline.microbatches
        # Which rank holds which stage ([Note: stages and ranks] in pipeline.schedule.stage_map).
        _, self.stage_map = build_staged(
            self.schedule_name,
            self.pp,
            self.microbatches,
            virtual_stages=job.pipeline.virtual_stages,
        )
        self.num_stages = self.stage_map.num_stages
        self.stage_indices = self.stage_map.stages_of(self.pp_rank)
        self.stage_index = self.stage_indices[0]  # the rank's only stage, under one per rank
        self.dp, self.dp_rank = mesh.dims.dp, mesh.coord("dp")
        self.accum = job.train.grad_accum
        self.per_step = self.microbatches * self.accum  # micro-batches per optimizer step
        self.pp_ranks = pp_ranks = mesh.dims.group_ranks("pp", mesh.rank)
        r = self.pp_rank
        self.prev_rank = pp_ranks[r - 1] if r > 0 else None
        self.next_rank = pp_ranks[r + 1] if r < self.pp - 1 else None
        # Private groups for training and for evaluation; see [Note: process groups].
        pp_groups = mesh.dims.all_groups("pp")
        self.eval_p2p = P2P(new_group_of(pp_groups, mesh.rank), device)
        self._act_group = new_group_of(pp_groups, mesh.rank)
        self._grad_group = new_group_of(pp_groups, mesh.rank)
        self.tp = mesh.dims.tp
        self._dtype = AUTOCAST_DTYPES.get(job.train.dtype)
        self.stage: StageModule | LayerStage  # every block this rank holds, keyed like the model
        self.stages: dict[int, StageModule | LayerStage]  # stage index -> module, for the runtime
        self.layer_split: LayerSplit | None = None
        self.ties = CrossRankTies()  # parameters tied across ranks ([Note: layer pipeline])
        if model.layers:
            self._build_layer_stage(job, model)
        else:
            self._build_block_stage(job, model)
        if job.train.compile:  # after tensor parallel and the partition trials, which run eager
            apply_compile(model)
        if self.dp > 1 and job.model.batchnorm == "global":  # [Note: BatchNorm parity]
            # Layer stages share one model (pipeline.layer_stage): convert it once.
            for stage in self.stages.values() if self.layer_split is None else [self.stage]:
                convert_batchnorm(stage, mesh.group("dp"), owned_only=True)
            if len(self.stages) > 1:  # a converted block is a new module: gather them again
                self.stage = _rank_module(self.stages, job.parallel.recompute_policy)
        self.sharding: StageSharding | None = None  # ZeRO: FSDP2 over the stage's dp peers
        if job.parallel.zero:  # each stage its own FSDP2 root, before the optimizer
            self.sharding = StageSharding.of(self.stages, model, mesh, job.parallel, device)
            self.ties.refind(self.stage)  # FSDP2 replaced the parameters
        self.optimizer: torch.optim.Optimizer = build_optimizer(self.stage.parameters(), job.optim)
        self.tracer = Tracer(mesh.rank, enabled=bool(job.observe.trace))
        self._accuracy: float | None = None  # of the last evaluation, on classification data
        self.modules = [self.stage]
        self.rules = StepRules.of(job)
        self._data_step = -1
        self._data: dict[int, tuple[Inputs, torch.Tensor]] = {}
        suffix = (f"-dp{self.dp}" if self.dp > 1 else "") + (f"-tp{self.tp}" if self.tp > 1 else "")
        suffix += f"-zero{job.parallel.zero}" if job.parallel.zero else ""
        v = f"-v{len(self.stage_indices)}" if self.schedule_name == "interleaved-1f1b" else ""
        self.name = f"{self.schedule_name}-pp{self.pp}{v}-m{self.microbatches}{suffix}"
        self._init_runtime(job, model)

    def _build_block_stage(self, job: JobConfig, model: BlockModel) -> None:
        mesh, device, batches = self.mesh, self.device, self.batches
        x, y = batches.train(0, self.dp_rank, self.dp, 0, self.per_step)
        sample = (one_input(x).to(device), y.to(device))
        # The model is already on `device` (trainer/build.py), so `auto` profiles it there.
        counts = choose_partition(
            job,
            model,
            sample,
            self.num_stages,
            verbose=mesh.rank == 0,
            # Stages are tensor-parallel only after the partition; trials would time them without.
            measure=partial(self._time_partitions, model, sample) if self.tp == 1 else None,
        )
        self.ranges = block_ranges(counts)
        policy = job.parallel.recompute_policy
        self.stages = {
            s: build_stage(model, *self.ranges[s], recompute=policy).to(device)
            for s in self.stage_indices
        }
        if self.tp > 1:  # tensor parallel inside the stage, before dp (docs/tensor_parallel.md)
            (stage,) = self.stages.values()  # one stage per rank (pipeline.checks)
            apply_tensor_parallel_to_stage(
                stage, model, mesh.sub("tp"), job.model.name, job.parallel.tp_plan
            )
        self.stage = _rank_module(self.stages, policy)
        self._stage_keys = keys_per_stage(model, self.ranges)

    def _build_layer_stage(self, job: JobConfig, model: BlockModel) -> None:
        """[Note: layer pipeline] in `models.split`: stages over a user model's layers."""
        batch = self.batches.train(0, self.dp_rank, self.dp, 0, self.per_step)
        rank = build_layer_rank(job, model, batch, self.stage_map, self.mesh, self.device)
        self.layer_split, self.ranges, self._stage_keys = rank.split, rank.ranges, rank.stage_keys
        self.stages, self.stage, self.ties = dict(rank.stages), rank.stage, rank.ties

    def _init_runtime(self, job: JobConfig, model: BlockModel) -> None:
        """The stage's runtime and this stage's program of the synchronous schedule
        (`pipeline.pipedream.PipeDreamStrategy` overrides it with its stream)."""
        self.runtime = self._make_runtime(model)
        self.loss_scale = loss_scale_of(job.train.dtype, self.device)
        self.runtime.loss_scale = self.loss_scale
        self._program = self._stage_program(self.schedule_name, self.microbatches, check=True)
        if self.sharding is not None:
            self.sharding.track(self._program)

    def _make_runtime(
        self,
        model: BlockModel,
        stash: WeightStash | None = None,
        after_backward: Callable[[int], None] | None = None,
    ) -> StageRuntime:
        return StageRuntime(
            self.stages,
            self.stage_map,
            self.pp_ranks,
            self._p2p(),
            loss_fn=model.loss_fn,
            tracer=self.tracer,
            device=self.device,
            autocast_dtype=self._dtype,
            stash=stash,
            after_backward=after_backward,
            before_backward=self.sharding.before_backward if self.sharding else None,
        )

    def _stage_program(
        self, schedule: str, num_microbatches: int, *, check: bool = False
    ) -> list[Action]:
        """This rank's lowered actions of ``schedule``; ``check`` validates the whole schedule."""
        v = self.job.pipeline.virtual_stages
        compute, stage_map = build_staged(schedule, self.pp, num_microbatches, virtual_stages=v)
        assert stage_map == self.stage_map, (stage_map, self.stage_map)
        lowered = lower(compute, stage_map=stage_map)
        if check:
            validate(lowered, self.pp, num_microbatches, stage_map=stage_map)
        return [a for a in lowered[self.pp_rank] if a is not None]

    def _p2p(self) -> P2P:
        """Channels for training traffic: activations and gradients on their own groups."""
        return training_p2p(self._act_group, self._grad_group, self.num_stages, self.device)

    def _time_partitions(
        self,
        model: BlockModel,
        sample: tuple[torch.Tensor, torch.Tensor],
        candidates: list[list[int]],
    ) -> list[float]:
        """Seconds per synchronous step of each candidate partition (`pipeline.trials`)."""
        name = "1f1b" if self.schedule_name == "pipedream" else self.schedule_name
        return time_partitions(
            model,
            sample,
            candidates,
            stage_index=self.stage_index,
            program=self._stage_program(name, self.microbatches),
            microbatches=self.microbatches,
            recompute=self.job.parallel.recompute_policy,
            runtime_for=lambda stages: StageRuntime(
                stages,
                self.stage_map,
                self.pp_ranks,
                self._p2p(),
                loss_fn=model.loss_fn,
                tracer=Tracer(self.mesh.rank, enabled=False),
                device=self.device,
                autocast_dtype=self._dtype,
            ),
            device=self.device,
        )

    # -- training ------------------------------------------------------------------------------

    def _micro(self, step: int, index: int) -> tuple[Inputs, torch.Tensor]:
        """Micro-batch ``index`` of this replica's slice of step ``step`` (cached per step)."""
        if step != self._data_step:
            self._data_step, self._data = step, {}
        if index not in self._data:
            self._data[index] = self.batches.train(
                step, self.dp_rank, self.dp, index, self.per_step
            )
        return self._data[index]

    def train_step(self, step: int) -> StepOutput:
        train_mode(self.stage)
        self.optimizer.zero_grad(set_to_none=True)
        m, accum = self.microbatches, self.accum
        loss = torch.zeros((), device=self.device)
        for k in range(accum):
            if self.sharding is not None:  # [Note: ZeRO inside stages]: reduce in the last run
                self.sharding.final_run = k == accum - 1
            feed = self._feed(partial(_sync_index, step, k * m), 1.0 / (m * accum), step)
            loss += self.runtime.run(self._program, feed)
            self.runtime.finish()
        grads = self._grads()
        self.ties.sum_grads()  # [Note: layer pipeline]: tied copies get the sum
        if self.dp > 1 and self.sharding is None:  # ZeRO stages reduce-scattered in backward
            with self.tracer.span("allreduce_grads", cat="comm", step=step):
                all_reduce_mean_flat_([local_tensor(g) for g in grads], self.mesh.group("dp"))
        # Every tp rank of the last stage of every replica holds the loss: divide by dp * tp.
        return finish_step(
            step,
            loss,
            self.stage.parameters(),
            self.rules,
            reduce=sum_over(None, self.dp * self.tp),
            optimizer=self.optimizer,
            grad_norm=self._global_norm,
            tracer=self.tracer,
            hint=SYNC_ONLY,
            loss_scale=self.loss_scale,
        )

    def _feed(self, where: Callable[[int], tuple[int, int]], scale: float, step: int) -> Feed:
        if self.layer_split is not None:  # every stage gets the model inputs as context
            return Feed(
                inputs=lambda i: _PLACEHOLDER,
                targets=lambda i: self._micro(*where(i))[1],
                scale=scale,
                step=step,
                context=lambda i: inputs_to(self._micro(*where(i))[0], self.device),
            )
        return Feed(
            inputs=lambda i: one_input(self._micro(*where(i))[0]),
            targets=lambda i: self._micro(*where(i))[1],
            scale=scale,
            step=step,
        )

    def _grads(self) -> list[torch.Tensor]:
        for p in self.stage.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
        return [p.grad for p in self.stage.parameters() if p.grad is not None]

    def _global_norm(self, grads: Sequence[torch.Tensor]) -> torch.Tensor:
        """The whole model's gradient norm: squared norms summed over the pipeline."""
        counted = self.ties.counted_in_norm(grads)  # a tied tensor counts once
        if self.sharding is not None:  # dp shards summed ([Note: ZeRO inside stages])
            squares = self.sharding.square_sum(counted)
        else:  # tp shards summed, replicas counted once
            squares = grad_square_sum(counted, self.mesh)
        return all_reduce_sum_(squares, self.mesh.group("pp")).sqrt()

    # -- evaluation and weights ----------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self, num_batches: int) -> float:
        """Forward-only through the pipeline on the live weights; the loss (and on
        classification data the top-1 accuracy) reaches every rank."""
        self.stage.eval()

        def val(i: int) -> tuple[Inputs, torch.Tensor]:
            return self.batches.val(i, self.dp_rank, self.dp)

        layered = self.layer_split is not None  # every stage gets the model inputs as context
        sums = forward_validation(
            self.runtime,
            self.eval_p2p,
            num_batches,
            first_input=(lambda i: _PLACEHOLDER) if layered else (lambda i: one_input(val(i)[0])),
            targets=lambda i: val(i)[1],
            context=(lambda i: inputs_to(val(i)[0], self.device)) if layered else None,
        )
        train_mode(self.stage)
        if self.sharding is not None:
            self.sharding.reshard()
        # Summed over the world: only last stages hold values; tp peers hold equal ones, so
        # the loss is divided by tp and the accuracy's ratio is unchanged.
        sums = all_reduce_sum_(sums, None)
        self._accuracy = float(sums[1] / sums[2]) if float(sums[2]) else None
        return float(sums[0]) / self.dp / self.tp / num_batches

    def evaluation_metrics(self) -> dict[str, float]:
        return {} if self._accuracy is None else {"val_accuracy": self._accuracy}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective: the whole model's weights on global rank 0, ``{}`` elsewhere
        (`pipeline.evaluation.gather_full_state`)."""
        state = self.stage.state_dict()
        if self.sharding is not None:  # gather the dp shards (collective over dp)
            state = full_tensors(state)
        elif self.tp > 1 and self.dp_rank == 0:  # gather the tp shards (collective over tp)
            state = full_tensors(state)
        return gather_full_state(state, self._stage_keys, self.stage_map, self.mesh, self.device)


def _rank_module(
    stages: dict[int, StageModule | LayerStage], recompute: RecomputePolicy
) -> StageModule | LayerStage:
    """The one module of everything a rank holds, keyed like the model: its stage (any of its
    layer stages), or a `StageModule` over all its stages' blocks (shared) for parameters,
    ``state_dict``, the optimizer and train/eval mode. Its forward is never called: the blocks
    of a rank's stages are not contiguous; the runtime runs each stage's own module."""
    first = next(iter(stages.values()))
    if len(stages) == 1 or isinstance(first, LayerStage):  # a layer stage holds the rank's share
        return first
    blocks: dict[int, nn.Module] = {}
    for stage in stages.values():
        assert isinstance(stage, StageModule)
        blocks.update({int(i): block for i, block in stage.blocks.items()})
    return StageModule(blocks, recompute=recompute)
