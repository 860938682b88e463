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

import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn

from polytrain.comm.collectives import (
    all_reduce_max_,
    all_reduce_mean_flat_,
    all_reduce_sum_,
    barrier,
)
from polytrain.comm.mesh import Mesh
from polytrain.comm.p2p import (
    P2P,
    PendingSends,
    new_group_of,
    new_group_or_none,
    recv_into,
    send_all,
)
from polytrain.config.job import JobConfig
from polytrain.config.parallel import RecomputePolicy
from polytrain.core.batchnorm import convert_batchnorm
from polytrain.core.compile import apply_compile
from polytrain.core.loss_scale import loss_scale_of
from polytrain.core.modules import train_mode
from polytrain.core.optim import build_optimizer
from polytrain.core.recompute import apply_recompute
from polytrain.core.step import (
    AUTOCAST_DTYPES,
    StepRules,
    finish_step,
    sum_over,
)
from polytrain.core.strategy import StepOutput, Strategy
from polytrain.core.tensor_parallel import (
    apply_tensor_parallel_to_stage,
    full_tensors,
    grad_square_sum,
    like_param,
    local_tensor,
    parallelize_layer_stage,
    resolve_tp_plan,
)
from polytrain.data.datasets import Inputs
from polytrain.data.sampler import Batches
from polytrain.models.base import BlockModel, inputs_to, one_input
from polytrain.models.contract import top1_correct
from polytrain.models.split import (
    LayerSplit,
    counts_from_split_points,
    stage_keys,
    tied_stages,
    trace_sides,
)
from polytrain.observe.trace import Tracer
from polytrain.pipeline.checks import check_pipeline_job
from polytrain.pipeline.layer_profile import profile_job_layers
from polytrain.pipeline.layer_stage import LayerStage, build_layer_stages, cross_rank_ties
from polytrain.pipeline.partition import block_ranges
from polytrain.pipeline.profile import choose_counts, choose_partition, leaves_no_trace
from polytrain.pipeline.runtime import (
    Feed,
    StageRuntime,
    WeightStash,
    training_p2p,
)
from polytrain.pipeline.schedule import Action, build_staged, lower, validate
from polytrain.pipeline.sharded import StageSharding
from polytrain.pipeline.stage import StageModule, build_stage

__all__ = ["SYNC_ONLY", "PipelineStrategy"]

EVAL = "eval"
SYNC_ONLY = " (synchronous schedules only)"
_PLACEHOLDER = torch.empty(0)  # a layer pipeline's first-stage "input": the inputs are context
PARTITION_TRIAL_ROUNDS = 3  # timed steps per candidate ([Note: partition trials])


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
        self._tie_group: Any = None
        self._tied: list[nn.Parameter] = []  # tied across ranks ([Note: layer pipeline])
        self._tie_counted = True  # whether this rank counts the tied tensors in the global norm
        self._tied_names: list[str] = []
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
            if self._tied:  # FSDP2 replaced the parameters: find the tied ones again by name
                params = dict(self.stage.named_parameters())
                self._tied = [params[name] for name in self._tied_names]
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
        self._stage_keys = self._keys_per_stage(model)

    def _build_layer_stage(self, job: JobConfig, model: BlockModel) -> None:
        """[Note: layer pipeline] in `models.split`: stages over a user model's layers."""
        user = model.blocks[0]
        list_path = model.layers[0].rpartition(".")[0]
        num_layers = len(model.layers)
        x, y = self.batches.train(0, self.dp_rank, self.dp, 0, self.per_step)
        sample = inputs_to(x, self.device)
        with leaves_no_trace(model, self.device):  # the tracing forward changes no buffer
            split = trace_sides(
                user,
                list_path,
                lambda: user(**sample) if isinstance(sample, dict) else user(sample),
            )
        self.layer_split = split
        if job.pipeline.split_points:
            counts = counts_from_split_points(
                user, model.layers, job.pipeline.split_points, self.num_stages
            )
        else:  # uniform, explicit, or `auto` ([Note: layer profile] in pipeline.layer_profile)
            counts = choose_counts(
                job,
                num_layers,
                self.num_stages,
                partial(profile_job_layers, job, model, split, (sample, y.to(self.device))),
                verbose=self.mesh.rank == 0,
            )
        self.ranges = block_ranges(counts)
        if job.parallel.recompute:  # each layer re-run in backward; names unchanged
            apply_recompute(model, job.parallel.recompute_policy)
        full = model.state_dict()
        keys = stage_keys(user, split, self.ranges, "blocks.0.")
        self._stage_keys = [[(k, full[k].shape, full[k].dtype) for k in ks] for ks in keys]
        ties = cross_rank_ties(tied_stages(user, split, self.ranges), self.stage_map.rank_of)
        # The plan is resolved on the whole model, before the stage demotes what it does not own.
        rows = job.parallel.tp_plan
        tp_assignment = resolve_tp_plan(job.model.name, model, self.tp, rows) if self.tp > 1 else {}
        self.stages = dict(build_layer_stages(model, split, self.ranges, self.stage_indices))
        self.stage = self.stages[self.stage_index].to(self.device)
        mine = {id(p) for p, ranks in ties if self.pp_rank in ranks}
        tied_names = [n for n, p in self.stage.named_parameters() if id(p) in mine]
        if tp_assignment:  # tensor parallel inside the stage (docs/models.md)
            parallelize_layer_stage(self.stage, self.mesh.sub("tp"), tp_assignment)
        self._setup_ties(ties, tied_names)

    def _setup_ties(
        self, ties: list[tuple[nn.Parameter, tuple[int, ...]]], tied_names: list[str]
    ) -> None:
        """A process group per set of pipeline ranks sharing tensors (every rank creates every
        one); this rank's tied parameters by name (tensor parallel replaced them by DTensors)."""
        pp_groups = self.mesh.dims.all_groups("pp")
        for ranks in sorted({ranks for _, ranks in ties}):
            group = new_group_or_none([[g[r] for r in ranks] for g in pp_groups], self.mesh.rank)
            if self.pp_rank in ranks:
                assert self._tie_group is None, "one set of ranks per model is supported"
                self._tie_group = group
                self._tie_counted = self.pp_rank == ranks[0]
        params = dict(self.stage.named_parameters())
        self._tied_names = tied_names
        self._tied = [params[name] for name in tied_names]

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
        """Seconds per synchronous step of each candidate partition (the same on every rank).

        [Note: partition trials] in `pipeline.profile`. This rank runs its stage of every
        candidate on ``sample`` (every micro-batch the same) with the job's schedule (1F1B's
        order for PipeDream), forward and backward only: gradients are dropped, no update, and
        the RNG and buffers are restored (`leaves_no_trace`), so training is unchanged. Every
        step starts after a barrier and lasts until its slowest rank is done (the maximum over
        the world). The candidates are interleaved over rounds, so drift in the machine's load
        hits all alike; each gets the median of its rounds after the first.
        """
        m = self.microbatches
        name = "1f1b" if self.schedule_name == "pipedream" else self.schedule_name
        program = self._stage_program(name, m)
        x, y = sample
        feed = Feed(inputs=lambda i: x, targets=lambda i: y, scale=1.0 / m)
        runtimes = []
        for counts in candidates:  # one stage per rank: `auto` is refused otherwise (checks.py)
            start, stop = block_ranges(counts)[self.stage_index]
            stage = build_stage(model, start, stop, recompute=self.job.parallel.recompute_policy)
            runtimes.append(
                StageRuntime(
                    {self.stage_index: stage},
                    self.stage_map,
                    self.pp_ranks,
                    self._p2p(),  # fresh channels: boundary shapes differ between candidates
                    loss_fn=model.loss_fn,
                    tracer=Tracer(self.mesh.rank, enabled=False),
                    device=self.device,
                    autocast_dtype=self._dtype,
                )
            )
        rounds = 1 + PARTITION_TRIAL_ROUNDS  # the first round warms up
        times = torch.zeros(rounds, len(candidates), dtype=torch.float64)
        with leaves_no_trace(model, self.device):
            for r in range(rounds):
                for n, runtime in enumerate(runtimes):
                    barrier()  # every rank starts the step together: no skew from the last one
                    t0 = time.perf_counter()
                    runtime.run(program, feed)
                    runtime.finish()
                    times[r, n] = time.perf_counter() - t0
                    for module in runtime.stages.values():
                        for param in module.parameters():
                            param.grad = None
        step = all_reduce_max_(times, None)  # a step lasts until its slowest rank is done
        return [float(v) for v in step[1:].median(dim=0).values]

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
        if self._tie_group is not None:  # [Note: layer pipeline]: tied copies get the sum
            for param in self._tied:
                if param.grad is not None:  # a tp shard pairs with the same shard (same tp rank)
                    param.grad = like_param(param.grad, param)
                    all_reduce_sum_(local_tensor(param.grad), self._tie_group)
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
        counted = list(grads)
        if not self._tie_counted:  # a tied tensor counts once, on the first stage holding it
            tied = {id(p.grad) for p in self._tied}
            counted = [g for g in grads if id(g) not in tied]
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
        total = torch.zeros((), device=self.device)
        counts = torch.zeros(2, device=self.device)  # [correct, rows] on the last stage
        pending = PendingSends()
        last = self.num_stages - 1
        for i in range(num_batches):
            if self.layer_split is not None:
                context = inputs_to(self.batches.val(i, self.dp_rank, self.dp)[0], self.device)
                for stage in self.stages.values():
                    assert isinstance(stage, LayerStage)
                    stage.set_context(context)
            out: Any = None
            for s in self.stage_indices:  # in model order: a local neighbour's output is `out`
                if s == 0:
                    x = (
                        _PLACEHOLDER
                        if self.layer_split is not None
                        else one_input(self.batches.val(i, self.dp_rank, self.dp)[0])
                    )
                elif self.stage_map.is_local(s, s - 1):
                    x = out
                else:
                    x = self.eval_p2p.recv(self._rank_of(s - 1), f"{EVAL}{s - 1}")
                with self.tracer.span("eval_F", cat="eval", microbatch=i, stage=s):
                    out = self.runtime.forward_only(s, x)
                if s == last:
                    y = self.batches.val(i, self.dp_rank, self.dp)[1].to(self.device)
                    total += self.runtime.loss_fn(out, y).float()
                    correct = top1_correct(out, y)
                    if correct is not None:
                        counts += torch.stack([correct, torch.tensor(float(len(y)))]).to(
                            self.device
                        )
                elif not self.stage_map.is_local(s, s + 1):
                    self.eval_p2p.isend(out, self._rank_of(s + 1), f"{EVAL}{s}", pending)
        pending.wait()
        train_mode(self.stage)
        if self.sharding is not None:
            self.sharding.reshard()
        # Summed over the world: only last stages hold values; tp peers hold equal ones, so
        # the loss is divided by tp and the accuracy's ratio is unchanged.
        sums = all_reduce_sum_(torch.cat([total.reshape(1), counts]), None)
        self._accuracy = float(sums[1] / sums[2]) if float(sums[2]) else None
        return float(sums[0]) / self.dp / self.tp / num_batches

    def evaluation_metrics(self) -> dict[str, float]:
        return {} if self._accuracy is None else {"val_accuracy": self._accuracy}

    def _keys_per_stage(self, model: BlockModel) -> list[list[tuple[str, torch.Size, torch.dtype]]]:
        """Every stage's state-dict keys, shapes and dtypes, in the full model's order."""
        out: list[list[tuple[str, torch.Size, torch.dtype]]] = [[] for _ in self.ranges]
        for key, value in model.state_dict().items():
            block = int(key.split(".")[1])
            stage = next(s for s, (a, b) in enumerate(self.ranges) if a <= block < b)
            out[stage].append((key, value.shape, value.dtype))
        return out

    def _rank_of(self, stage: int) -> int:
        """Global rank holding ``stage`` in this rank's pipeline replica."""
        return self.pp_ranks[self.stage_map.rank_of(stage)]

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective: ranks of replica 0 send their stages' weights to global rank 0 (tensors
        only), each rank its stages' in stage order."""
        state = self.stage.state_dict()
        if self.sharding is not None:  # gather the dp shards (collective over dp)
            state = full_tensors(state)
        elif self.tp > 1 and self.dp_rank == 0:  # gather the tp shards (collective over tp)
            state = full_tensors(state)
        keys = self._stage_keys
        if self.dp_rank == 0 and self.pp_rank > 0 and self.mesh.coord("tp") == 0:
            send_all([state[k] for s in self.stage_indices for k, _, _ in keys[s]], dst=0)
        if self.mesh.rank != 0:
            return {}
        parts = {
            s: {k: state[k].detach().cpu().clone() for k, _, _ in keys[s]}
            for s in self.stage_indices
        }
        for r in range(1, self.pp):
            stages = self.stage_map.stages_of(r)
            metas = [meta for s in stages for meta in keys[s]]
            buffers = [
                torch.empty(shape, dtype=dtype, device=self.device) for _, shape, dtype in metas
            ]
            recv_into(buffers, src=self.mesh.dims.rank_of(pp=r, dp=0))
            received = iter(zip(metas, buffers, strict=True))
            for s in stages:
                parts[s] = {k: b.cpu() for (k, _, _), b in (next(received) for _ in keys[s])}
        return {k: v for s in range(self.num_stages) for k, v in parts[s].items()}


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
