"""Search: enumerate layouts, drop those that do not fit, rank by time or cost under limits.

PAI's performance-estimation question (a model and a budget in time or money -> how many
devices, which strategy) and its automatic model sharding: a model that fits no single device
gets tensor, pipeline or ZeRO layouts that do, because only those survive the memory filter.
Derivation: docs/planner.md "Search". Pure Python, no torch.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from functools import cache
from typing import Literal

from polytrain.errors import PlanError
from polytrain.pipeline.schedule import zero_stages_problem
from polytrain.planner.catalog import device, device_names
from polytrain.planner.cluster import Cluster
from polytrain.planner.cost import Env, predict
from polytrain.planner.cost.decentralized import TOPOLOGIES, topology_fits
from polytrain.planner.recompute import has_ops_stats
from polytrain.planner.schedules import pipeline_problem
from polytrain.planner.types import HostProfile, Layout, ModelStats, Prediction, launch_shape

__all__ = [
    "Plan",
    "PlanRequest",
    "PlanResult",
    "device_counts",
    "duration_text",
    "enumerate_layouts",
    "search",
]

Objective = Literal["time", "cost"]
SCHEDULES = ("gpipe", "1f1b", "pipedream")
# (schedule, virtual_stages) offered with PlanRequest.next_schedules
NEXT_SCHEDULES = (("interleaved-1f1b", 2), ("zb-h1", 1), ("zbv", 1))
# (recompute, recompute_every, recompute_ops), least recomputation first ([Note: pruning]):
# none, every second block (parallel.recompute = "every:2", torchtitan's layer frequency),
# every block's element-wise operators ("ops": where the statistics counted them, [Note:
# pricing selective recomputation] in planner/recompute.py), every block
RECOMPUTE_VARIANTS = ((False, 1, False), (True, 2, False), (True, 1, True), (True, 1, False))


@dataclass(frozen=True)
class PlanRequest:
    stats: ModelStats
    cluster: Cluster  # the largest cluster on offer; smaller device counts cut it
    global_batch: int
    steps: int
    min_devices: int = 1
    max_devices: int = 0  # 0 = the whole cluster
    dtype: str = "fp32"
    objective: Objective | None = None  # None: cost when a deadline is given, else time
    deadline_s: float | None = None
    budget: float | None = None  # dollars
    profile: HostProfile | None = None
    bucket_bytes: float = 25.0 * 2**20
    allow_async: bool = False  # PipeDream, async/SSP PS, gossip and local SGD change semantics
    localsgd_period: int = 8  # localsgd.period of the local-SGD layouts (a convergence choice)
    # price interleaved 1F1B (v = 2), ZB-H1 and ZBV among the candidates (`plan
    # --new-schedules`); off by default until calibration times them and `plan --validate`
    # has held their prices against measurement
    next_schedules: bool = False


@dataclass(frozen=True)
class Plan:
    prediction: Prediction
    total_s: float  # steps x step time (+ process start-up when calibrated)
    cost: float | None  # dollars, None without a price
    meets: bool  # fits memory and meets the budget and the deadline
    why: str = ""  # why it is not first: out of memory, over budget, bubble, communication...

    @property
    def layout(self) -> Layout:
        return self.prediction.layout

    @property
    def devices(self) -> int:
        return self.prediction.layout.devices


@dataclass(frozen=True)
class PlanResult:
    plans: list[Plan]  # best first: meeting plans by objective, then the rest
    objective: Objective
    note: str = ""  # what happened when nothing met the limits or nothing fit
    extremes: dict[str, Plan] = field(default_factory=dict)  # "cheapest", "fastest"

    @property
    def best(self) -> Plan | None:
        return self.plans[0] if self.plans and self.plans[0].meets else None


def device_counts(cluster: Cluster, lo: int, hi: int) -> list[int]:
    """Device counts worth pricing in [lo, hi]: powers of two, whole hosts, and both ends."""
    hi = hi or cluster.size
    if lo < 1 or hi < lo:
        raise PlanError(f"--devices {lo}:{hi}: expected 1 <= MIN <= MAX")
    if hi > cluster.size:
        raise PlanError(
            f"--devices up to {hi} but the cluster {cluster.describe()} has {cluster.size}: "
            f"use at most {cluster.size} or a larger cluster"
        )
    out = {lo, hi}
    n = 1
    while n <= hi:
        if n >= lo:
            out.add(n)
        n *= 2
    out |= {
        h * cluster.per_host
        for h in range(1, cluster.hosts + 1)
        if lo <= h * cluster.per_host <= hi
    }
    # a count the launcher cannot start with the same nproc on every node is not a plan
    return sorted(n for n in out if launch_shape(n, cluster.per_host) is not None)


@cache
def _divisors(n: int) -> tuple[int, ...]:
    return tuple(d for d in range(1, n + 1) if n % d == 0)


def enumerate_layouts(
    n: int,
    stats: ModelStats,
    cluster: Cluster,
    global_batch: int,
    localsgd_period: int = 8,
    next_schedules: bool = False,
) -> Iterator[Layout]:
    """Every layout on ``n`` devices the runtime can run (its pre-flight rules) for the batch;
    with ``next_schedules``, also interleaved 1F1B (v = 2; v = 1 is 1F1B), ZB-H1 and ZBV where
    `planner.schedules.pipeline_problem` finds nothing against them (over a user's layers too:
    several slices per rank, [Note: several layer stages per rank] in pipeline.layer_stage).
    With dp > 1 a pipeline also runs ZeRO-2 and ZeRO-3 inside its stages where
    `pipeline.schedule.zero_stages_problem`, the runtime's pre-flight rule, finds nothing
    against it (and, over a user's layers, only with one stage per rank)."""
    blocks = len(stats.pipeline_blocks)
    layered = bool(stats.layer_blocks)  # [Note: layer view] in measure/layer_stats.py
    selective = has_ops_stats(stats)
    for tp in _divisors(n):
        if cluster.per_host % tp:  # tensor parallel stays inside a host and tiles it
            continue
        if tp > 1 and stats.tp_divisor and stats.tp_divisor % tp:
            continue  # heads (or the hidden width) must split evenly
        for pp in _divisors(n // tp):
            dp = n // (tp * pp)
            if pp > blocks or global_batch % dp:
                continue
            per_replica = global_batch // dp
            for recompute, every, ops in RECOMPUTE_VARIANTS:
                if ops and not selective:
                    continue
                if pp == 1:
                    for zero in (0, 2, 3) if dp > 1 else (0,):
                        yield Layout(
                            dp=dp,
                            tp=tp,
                            zero=zero,
                            recompute=recompute,
                            recompute_every=every,
                            recompute_ops=ops,
                        )
                    if dp > 1 and tp == 1 and any(b.linears for b in stats.blocks):
                        yield Layout(
                            dp=dp,
                            sufficient_factor=True,
                            recompute=recompute,
                            recompute_every=every,
                            recompute_ops=ops,
                        )
                    continue
                # [Note: micro-batch counts] every count from one micro-batch per stage to
                # one sample per micro-batch that divides the replica's batch
                # ZeRO inside the stages, over their dp peers, where the runtime runs it
                zeros = (0, 2, 3) if dp > 1 else (0,)
                for m in (m for m in _divisors(per_replica) if m >= pp):
                    for schedule, zero in itertools.product(SCHEDULES, zeros):
                        if schedule == "pipedream" and (tp > 1 or layered):
                            continue  # pre-flight rejects tp and layer pipelines with PipeDream
                        if zero_stages_problem(zero, schedule, tp, pp) is None:
                            yield Layout(
                                dp=dp,
                                tp=tp,
                                pp=pp,
                                zero=zero,
                                schedule=schedule,
                                microbatches=m,
                                recompute=recompute,
                                recompute_every=every,
                                recompute_ops=ops,
                            )
                    if not next_schedules or tp > 1:  # the runtime refuses tp there
                        continue
                    for (schedule, v), zero in itertools.product(NEXT_SCHEDULES, zeros):
                        if layered and zero:
                            continue  # ZeRO shards one layer stage per rank (pre-flight)
                        layout = Layout(
                            dp=dp,
                            tp=tp,
                            pp=pp,
                            zero=zero,
                            schedule=schedule,
                            virtual_stages=v,
                            microbatches=m,
                            recompute=recompute,
                            recompute_every=every,
                            recompute_ops=ops,
                        )
                        if pipeline_problem(layout, blocks) is None:
                            yield layout
    if n >= 2 and global_batch % n == 0:  # whole-model replicas only (JobConfig's rule)
        for topology in TOPOLOGIES:
            if topology_fits(topology, n):
                yield Layout(dp=n, sync="gossip", topology=topology)
        yield Layout(dp=n, sync="localsgd", period=localsgd_period)
    if cluster.device.key != "cpu":
        return  # ps/checks.py: parameter servers run on CPU workers only
    for servers in (1, 2):
        workers = n - servers
        if workers >= 1 and global_batch % workers == 0:
            # one leaf server per host where the workers span hosts (ps.leaves = "host")
            per_host = cluster.per_host
            leaves = (0, per_host) if workers > per_host > 1 else (0,)
            for mode in ("sync", "async", "ssp"):
                for g in leaves:
                    yield Layout(
                        dp=workers, sync="ps", ps_servers=servers, ps_mode=mode, ps_leaves=g
                    )


def _with_accumulation(layout: Layout, pred: Prediction, req: PlanRequest, env: Env) -> Prediction:
    """Out of memory? Try gradient accumulation (smaller micro-steps, same global batch)."""
    if layout.pp > 1 or layout.sync == "ps":
        return pred  # a pipeline already splits the batch into micro-batches; PS workers don't
    per_replica = req.global_batch // layout.dp
    accum = 2
    while not pred.fits and accum <= per_replica:
        if per_replica % accum == 0:
            pred = predict(
                replace(layout, grad_accum=accum),
                req.stats,
                env,
                req.global_batch,
                time_unfit=False,
            )
        accum *= 2
    return pred


def search(req: PlanRequest) -> PlanResult:
    """Price every layout on every device count and rank them; see the module docstring.

    [Note: synchronous by default] PipeDream and asynchronous/SSP parameter servers update
    with stale weights, and gossip and local SGD train replicas that differ between exchanges,
    so none reproduces the single-process run (contract 1); they are priced only when the
    request allows asynchrony (``--allow-async``).

    [Note: pruning] `enumerate_layouts` yields a mesh's layouts without recomputation first;
    once the plain (no ZeRO, no recomputation) layout of a mesh fits, its recomputing variants
    are skipped: they run the same collectives plus one more forward, so they cannot be faster.
    Likewise a layout recomputing every block is skipped where the same layout recomputing
    every second block, or only every block's element-wise operators (both yielded before
    it), fits.

    [Note: micro-batch counts] A pipeline is offered every micro-batch count m >= pp that
    divides the replica's batch (one sample per micro-batch at most): published runs use
    counts such as 12 pp (Megatron's 145.6B: 96 micro-batches on 8 stages).

    [Note: untimed layouts] A layout that does not fit its devices is priced for memory only:
    its step time is infinite and shown as "-" (it could not run, and what would fit is said
    by `_what_would_fit`). A large model's search is mostly such layouts, and timing them
    cost most of it: pipeline simulations of thousands of micro-batch actions each (the
    3,072-GPU Megatron setup: 509 of its 520 pipeline layouts do not fit).
    """
    if req.global_batch < 1 or req.steps < 1:
        raise PlanError(f"global batch {req.global_batch} and steps {req.steps} must be >= 1")
    objective: Objective = req.objective or ("cost" if req.deadline_s is not None else "time")
    price = req.cluster.price_per_device_hour
    if price is None and (objective == "cost" or req.budget is not None):
        raise PlanError(
            f"the catalog has no price for {req.cluster.device.key}: write a cluster TOML with "
            "price_per_device_hour, or plan with --objective time and no --budget"
        )
    plans: list[Plan] = []
    startup = req.profile.startup_s if req.profile else 0.0
    for n in device_counts(req.cluster, req.min_devices, req.max_devices):
        cluster = req.cluster.with_size(n)
        env = Env(cluster, req.dtype, req.profile, req.bucket_bytes)
        fit_plain: set[tuple[int, int, int]] = set()
        fit_partly: set[Layout] = set()  # every:2 and ops layouts that fit, as full ones
        layouts = enumerate_layouts(
            n, req.stats, cluster, req.global_batch, req.localsgd_period, req.next_schedules
        )
        for layout in layouts:
            if not req.allow_async and (
                (layout.schedule == "pipedream" and layout.pp > 1)
                or layout.ps_mode != "sync"
                or layout.sync in ("gossip", "localsgd")
            ):
                continue  # [Note: synchronous by default]
            if layout.recompute and (layout.dp, layout.tp, layout.pp) in fit_plain:
                continue  # [Note: pruning] recomputation only adds time once memory fits
            if layout in fit_partly:
                continue  # [Note: pruning] all of every block where less sufficed
            pred = predict(layout, req.stats, env, req.global_batch, time_unfit=False)
            if layout.sufficient_factor and not pred.breakdown.get("late_multiply"):
                continue  # no layer is cheaper with factors: the same as plain dp
            pred = _with_accumulation(layout, pred, req, env)
            if pred.fits and not layout.recompute and layout.zero == 0:
                fit_plain.add((layout.dp, layout.tp, layout.pp))
            if pred.fits and (layout.every_k or layout.recompute_ops):
                fit_partly.add(replace(layout, recompute_every=1, recompute_ops=False))
            total = req.steps * pred.step_s + startup
            cost = n * price * total / 3600 if price is not None else None
            plans.append(_judge(pred, total, cost, req))
    return _rank(plans, objective, req)


def _judge(pred: Prediction, total: float, cost: float | None, req: PlanRequest) -> Plan:
    if not pred.fits:
        return Plan(pred, total, cost, False, pred.why)
    if req.budget is not None and cost is not None and cost > req.budget:
        return Plan(pred, total, cost, False, f"over budget (${cost:.2f} > ${req.budget:.2f})")
    if req.deadline_s is not None and total > req.deadline_s:
        return Plan(
            pred,
            total,
            cost,
            False,
            f"misses the deadline ({duration_text(total)} > {duration_text(req.deadline_s)})",
        )
    return Plan(pred, total, cost, True)


def _key(plan: Plan, objective: Objective) -> tuple[float, float, int]:
    # whole cents: a layout that saves a fraction of a cent is not cheaper, it is a tie
    cost = round(plan.cost, 2) if plan.cost is not None else 0.0
    if objective == "cost":
        return (cost, plan.total_s, plan.devices)
    return (plan.total_s, cost, plan.devices)


def _rank(plans: list[Plan], objective: Objective, req: PlanRequest) -> PlanResult:
    meeting = sorted((p for p in plans if p.meets), key=lambda p: _key(p, objective))
    fitting = [p for p in plans if p.prediction.fits]
    rest = sorted(
        (p for p in plans if not p.meets), key=lambda p: (not p.prediction.fits, _key(p, objective))
    )
    if meeting:
        best = meeting[0]
        ranked = [best] + [replace(p, why=_why_lost(p, best, objective)) for p in meeting[1:]]
        return PlanResult(ranked + rest, objective)
    if fitting:
        cheapest = min(fitting, key=lambda p: _key(p, "cost"))
        fastest = min(fitting, key=lambda p: _key(p, "time"))
        limits = []
        if req.budget is not None:
            limits.append(f"a budget of ${req.budget:.2f}")
        if req.deadline_s is not None:
            limits.append(f"a deadline of {duration_text(req.deadline_s)}")
        note = f"no layout meets {' and '.join(limits)}: the cheapest and the fastest instead"
        return PlanResult(rest, objective, note, {"cheapest": cheapest, "fastest": fastest})
    return PlanResult(rest, objective, _what_would_fit(rest, req))


def _why_lost(plan: Plan, best: Plan, objective: Objective) -> str:
    b = plan.prediction.breakdown
    step = plan.prediction.step_s or 1.0
    comm = b.get("dp_comm", 0.0) + b.get("tp_comm", 0.0)
    if (
        objective == "cost"
        and plan.cost is not None
        and best.cost is not None
        and plan.cost > best.cost
    ):
        if plan.total_s < best.total_s:
            return f"faster but costs ${plan.cost - best.cost:.2f} more"
    if b.get("bubble", 0.0) / step >= 0.15 and b.get("bubble", 0.0) >= comm:
        return f"bubble ({b['bubble'] / step:.0%} of the step)"
    if comm / step >= 0.15:
        return f"communication-bound ({comm / step:.0%} of the step)"
    if plan.devices < best.devices:
        return f"fewer devices ({plan.devices} vs {best.devices})"
    if plan.devices > best.devices and objective == "cost":
        return f"more devices ({plan.devices} vs {best.devices}) cost more"
    slower = plan.total_s / best.total_s - 1 if best.total_s else 0.0
    return f"{slower:.1%} slower" if slower > 0 else "more expensive"


def _what_would_fit(plans: list[Plan], req: PlanRequest) -> str:
    least = min(plans, key=lambda p: p.prediction.memory_per_rank) if plans else None
    have = req.cluster.device
    if least is None:
        return f"no layout of the model on {req.cluster.describe()} exists for a batch of {req.global_batch}"
    need = least.prediction.memory_per_rank
    bigger = [k for k in device_names() if device(k).memory >= need and k != "cpu"]
    where = (
        f"devices with at least {need / 2**30:.1f} GiB: {', '.join(bigger)}"
        if bigger
        else "no catalog device is that large"
    )
    # Model states and activations shrink about linearly with devices in the leanest layouts.
    devices = -(-least.devices * need // have.memory)
    return (
        f"the model fits no layout on {req.cluster.describe()} ({have.memory / 2**30:.0f} GiB each): the leanest, "
        f"{least.layout.describe()}, needs {need / 2**30:.1f} GiB per rank; would fit: about "
        f"{devices:.0f} x {have.key}, or {where}"
    )


def duration_text(seconds: float) -> str:
    """``2.00 h``, ``12.5 min`` or ``42.0 s``."""
    if seconds >= 3600:
        return f"{seconds / 3600:.2f} h"
    if seconds >= 60:
        return f"{seconds / 60:.1f} min"
    return f"{seconds:.1f} s"
