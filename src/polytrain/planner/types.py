"""The planner's vocabulary: what it knows of a model, a host and a layout (pure, no torch).

`ModelStats` comes from `measure.stats` (the one torch-facing module), `HostProfile` from
`polytrain calibrate`, `Layout` is what the search enumerates and what `--strategy auto` runs:
every field maps onto a `JobConfig` field (contract 3: the planner emits exactly these fields).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any

from polytrain.errors import PlanError

__all__ = [
    "BACKWARD_FLOPS_PER_FORWARD",
    "BlockStats",
    "Curve",
    "HostProfile",
    "Layout",
    "ModelStats",
    "Prediction",
    "TPModule",
    "launch_shape",
    "splits_inputs",
]


# A backward pass computes the gradient of both operands of every matmul, each as costly as the
# forward product: twice the forward's FLOPs (Narayanan et al. SC21, eq. 3's 3x for forward and
# backward, recomputation aside). The cost model's backward pass and MFU's FLOPs per sample.
BACKWARD_FLOPS_PER_FORWARD = 2.0


def launch_shape(devices: int, per_host: int) -> tuple[int, int] | None:
    """(``launch.nproc``, ``launch.nnodes``) that run ``devices`` ranks on hosts of
    ``per_host`` (0 = one host): as few hosts as hold them, the same process count on each (the
    launcher starts ``nproc`` on every node); None when no even split exists (5 on hosts of 4)."""
    if not per_host or devices <= per_host:
        return devices, 1
    nodes = -(-devices // per_host)
    if devices % nodes:
        return None
    return devices // nodes, nodes


def splits_inputs(style: str) -> bool:
    """Whether a tensor-parallel ``style`` (`core.tp_plans.Style`) splits a Linear by its
    inputs (the row-parallel ones) rather than by its outputs (the others)."""
    return style in ("rowwise", "rowwise_split")


@dataclass(frozen=True)
class TPModule:
    """One module a tensor-parallel plan parallelizes ([Note: tensor-parallel modules])."""

    style: str  # core.tp_plans.Style: colwise, colwise_gather, rowwise, rowwise_split, ...
    divisor: int  # the dimension it splits: applied at degree tp iff tp divides it
    tensors: int  # its parameter tensors (DTensors once applied)
    in_bytes: float  # its input's bytes per sample (0 for token ids), unsplit
    out_bytes: float  # its output's bytes per sample, unsplit
    # (in_features, out_features) of an nn.Linear, unsplit; (0, 0) for any other module
    linear: tuple[int, int] = (0, 0)

    def shard(self, tp: int) -> tuple[int, int]:
        """The Linear's (fan_in, fan_out) on one of ``tp`` ranks: row-parallel styles split
        its inputs, the others its outputs ([Note: matmul size at a shard] in cost/common.py)."""
        fan_in, fan_out = self.linear
        if splits_inputs(self.style):
            return fan_in // tp, fan_out
        return fan_in, fan_out // tp


@dataclass(frozen=True)
class BlockStats:
    """One block of the model's block view (what a pipeline stage holds a run of)."""

    name: str  # the module path, e.g. "blocks.3"
    params: int  # parameter count
    param_bytes: int  # bytes of its parameters in the training dtype
    fwd_flops: float  # forward FLOPs for ONE sample (one sequence / one example)
    saved_bytes: float  # activation bytes saved for backward, for one sample
    output_bytes: float  # bytes of the block's output for one sample (pipeline p2p payload)
    fwd_s: float | None = None  # measured forward seconds per sample on this host, if asked
    bwd_s: float | None = None  # measured backward seconds per sample on this host, if asked
    # (fan_in, fan_out) of the block's Linear layers, for sufficient-factor pricing; () = unknown
    linears: tuple[tuple[int, int], ...] = ()
    rows_per_sample: int = 1  # rows a Linear sees per sample (tokens per sequence for a GPT)
    tensors: int = 0  # parameter tensors (the optimizer's per-tensor costs); 0 = unknown
    # [Note: non-matmul time] ATen operator calls of one forward / backward call of the block
    # (independent of the batch) and bytes the non-matmul ones read and write, per sample
    fwd_ops: int = 0
    bwd_ops: int = 0
    fwd_moved_bytes: float = 0.0
    bwd_moved_bytes: float = 0.0
    # [Note: tensor-parallel shards] (bytes, divisor) pairs covering param_bytes: tensor
    # parallel of degree tp splits a pair's bytes tp ways iff tp divides its divisor, else every
    # rank holds them whole (divisor 1: LayerNorms, row-parallel biases, position tables).
    # () = unknown: everything is split.
    tp_shards: tuple[tuple[float, int], ...] = ()
    # [Note: tensor-parallel activations] of saved_bytes, what every tensor-parallel rank holds
    # whole (per sample): the inputs of the column-parallel layers, layer norms, residual
    # stream; the rest (from a column-parallel output to a row-parallel input) is split tp
    # ways. 0 = unknown: everything is split (the old estimate).
    saved_whole_bytes: float = 0.0
    # bytes one pass saves whatever its batch (autocast's low-precision weight copies; [Note:
    # counted under autocast] in measure/stats.py), once per micro-batch in flight
    saved_fixed_bytes: float = 0.0
    # [Note: tensor-parallel modules] in planner/cost/tp.py: each module of the block the
    # runtime's tensor-parallel plan parallelizes (resolved at tp = 1, every conditional row in)
    # as (style, divisor: it applies at degree tp iff tp divides it, its parameter tensors, its
    # input's and its output's bytes per sample, unsplit). None = unknown: the old estimate.
    tp_modules: tuple[TPModule, ...] | None = None
    # a layer-view block's parameters that are one tensor with another block's (GPT-2's wte /
    # lm_head on the first and the last stage) as (the tensor's name, bytes, divisor as in
    # tp_shards): a rank holding both blocks holds it once (planner/memory.py)
    tied: tuple[tuple[str, float, int], ...] = ()
    # [Note: attention kernels] in measure/kernels.py: each scaled-dot-product attention call
    # of one forward as (T, S, D, forward FLOPs per sample, 4 H T S D), and how many of
    # fwd_flops `FlopCounterMode` counted inside those calls (meta: the math path's bmm's;
    # CPU's fused kernel: none). () = unknown: priced inside fwd_flops as before.
    attention: tuple[tuple[int, int, int, float], ...] = ()
    attention_counted: float = 0.0  # per sample
    # [Note: elementwise kernels] in measure/kernels.py: of the moved bytes, the operators whose
    # arithmetic per element is heavy (GELU, softmax, ...) as (op, output elements, bytes) per
    # sample, forward and backward; () = unknown (priced by their bytes alone)
    fwd_elementwise: tuple[tuple[str, float, float], ...] = ()
    bwd_elementwise: tuple[tuple[str, float, float], ...] = ()
    # [Note: selective recomputation's statistics] in measure/ops_stats.py: under
    # parallel.recompute = "ops", bytes per sample the block keeps and rebuilds in backward, and
    # the forward work it reruns (FLOPs and bytes per sample, operator calls); kept None = not
    # counted: priced as keeping what it saves and rerunning nothing (planner/recompute.py)
    ops_kept_bytes: float | None = None
    ops_rebuilt_bytes: float = 0.0
    ops_rerun_flops: float = 0.0
    ops_rerun_ops: int = 0
    ops_rerun_moved_bytes: float = 0.0
    ops_rerun_elementwise: tuple[tuple[str, float, float], ...] = ()

    def tp_applied(self, tp: int) -> tuple[TPModule, ...]:
        """The `tp_modules` the plan parallelizes at degree ``tp`` (none at tp = 1)."""
        if tp <= 1 or not self.tp_modules:
            return ()
        return tuple(m for m in self.tp_modules if m.divisor % tp == 0)

    def linears_at(self, tp: int) -> tuple[tuple[int, int], ...]:
        """`linears` as one of ``tp`` tensor-parallel ranks runs them: each Linear the plan
        parallelizes at its shard's shape (`TPModule.shard`), the rest whole; without the
        plan's modules, every Linear split by its outputs (the old estimate)."""
        if tp > 1 and self.tp_modules is None:
            return tuple((fan_in, fan_out // tp) for fan_in, fan_out in self.linears)
        shapes = list(self.linears)
        for module in self.tp_applied(tp):
            if module.linear in shapes:
                shapes[shapes.index(module.linear)] = module.shard(tp)
        return tuple(shapes)

    def bytes_per_tp_rank(self, tp: int) -> float:
        """Parameter bytes one of ``tp`` tensor-parallel ranks holds of this block."""
        if tp <= 1:
            return float(self.param_bytes)
        if not self.tp_shards:
            return self.param_bytes / tp
        return sum(b / tp if d % tp == 0 else b for b, d in self.tp_shards)

    def saved_per_tp_rank(self, tp: int) -> float:
        """Saved activation bytes per sample one of ``tp`` tensor-parallel ranks holds."""
        whole = min(self.saved_whole_bytes, self.saved_bytes)
        return whole + (self.saved_bytes - whole) / max(tp, 1)

    def params_per_tp_rank(self, tp: int) -> float:
        """Parameters one of ``tp`` tensor-parallel ranks holds (the same split as the bytes)."""
        if self.param_bytes <= 0:
            return self.params / max(tp, 1)
        return self.params * self.bytes_per_tp_rank(tp) / self.param_bytes


@dataclass(frozen=True)
class ModelStats:
    """Per-block statistics of a model; sums are derived, never stored twice."""

    name: str
    blocks: tuple[BlockStats, ...]
    dtype_bytes: int = 4
    tokens_per_sample: int = 1
    optimizer_state_per_param: int = 2  # AdamW: exp_avg + exp_avg_sq; SGD momentum: 1
    tp_divisor: int = 0  # a tensor-parallel degree must divide this (attention heads); 0 = any
    optimizer: str = "adamw"  # optim.name: which calibrated update cost applies
    # optim.fused: the trainer runs torch's fused kernel (priced at the calibrated "<name>_fused"
    # figures on plain tensors); False in statistics stored before it existed
    fused_optimizer: bool = False
    grad_clip: bool = True  # optim.grad_clip > 0: the step clips by the global norm
    # bytes of the tensors behind the training and validation data (each storage once): every
    # worker loads the whole data set ([Note: a worker's own memory] in planner/memory.py)
    data_bytes: int = 0
    # resident bytes a worker adds by importing a user's model factory and building the model
    # (transformers: ~120 MiB); 0 for the built-ins ([Note: a worker's own memory])
    import_bytes: float = 0.0
    # a user's one-module model as its layer pipeline cuts it, one block per repeated layer
    # ([Note: layer view] in measure/layer_stats.py): what a pipeline's stages are priced on;
    # empty when `blocks` are the pipeline's units (the built-ins) or it has none
    layer_blocks: tuple[BlockStats, ...] = ()
    # a user's one-module model's FSDP2 units ([Note: FSDP units of a user's model] in
    # measure/layer_stats.py), (parameter bytes, tensors) each in forward order, the root (what is
    # not in a repeated layer) first; empty when `blocks` are the units (the built-ins)
    fsdp_units: tuple[tuple[float, int], ...] = ()

    @property
    def pipeline_blocks(self) -> tuple[BlockStats, ...]:
        """The units a pipeline's stages are cut from."""
        return self.layer_blocks or self.blocks

    @property
    def params(self) -> int:
        return sum(b.params for b in self.blocks)

    @property
    def param_bytes(self) -> int:
        return sum(b.param_bytes for b in self.blocks)

    @property
    def fwd_flops(self) -> float:
        return sum(b.fwd_flops for b in self.blocks)

    @property
    def train_flops(self) -> float:
        """Forward + backward FLOPs per sample (`BACKWARD_FLOPS_PER_FORWARD`), every attention
        call counted in full whichever device counted it ([Note: attention kernels]: a CPU's
        fused kernel is not in `fwd_flops`): MFU's count."""
        fwd = sum(
            b.fwd_flops - b.attention_counted + sum(a[3] for a in b.attention) for b in self.blocks
        )
        return (1.0 + BACKWARD_FLOPS_PER_FORWARD) * fwd


@dataclass(frozen=True)
class Curve:
    """Measured (bytes, seconds) points of one operation; `seconds` interpolates between them.

    Outside the measured range it extrapolates with the alpha-beta fit of the two nearest points
    (latency + bytes / bandwidth), which is what a link looks like at both ends; where those
    two points fall with size (noise: a bandwidth cannot be negative) it keeps what a monotone
    curve allows instead: below the range the faster of the two, above it the slower.
    """

    points: tuple[tuple[float, float], ...]  # sorted by bytes

    def seconds(self, nbytes: float) -> float:
        pts = sorted(self.points)
        if not pts:
            raise ValueError("empty curve")
        if len(pts) == 1:
            return pts[0][1] * max(nbytes, 1.0) / max(pts[0][0], 1.0)
        lo, hi = pts[0], pts[1]
        for a, b in itertools.pairwise(pts):
            lo, hi = a, b
            if nbytes <= b[0]:
                break
        slope = (hi[1] - lo[1]) / (hi[0] - lo[0]) if hi[0] != lo[0] else 0.0
        if slope < 0 and not pts[0][0] <= nbytes <= pts[-1][0]:
            # smaller messages take no longer, larger ones no less: the monotone reading
            return min(lo[1], hi[1]) if nbytes < pts[0][0] else max(lo[1], hi[1])
        return max(lo[1] + slope * (nbytes - lo[0]), 0.0)

    @property
    def bandwidth(self) -> float:
        """Bytes per second at the largest measured size."""
        size, secs = max(self.points)
        return size / secs if secs > 0 else math.inf


@dataclass(frozen=True)
class HostProfile:
    """What `polytrain calibrate` measured on one host (saved as JSON, reused until
    `fingerprint`, the hardware and torch identity, changes)."""

    fingerprint: str
    device: str  # "cpu" or the accelerator's name
    matmul_flops: dict[str, float]  # dtype ("fp32", "bf16", ...) -> achieved FLOP/s, large sizes
    mem_bw: float  # bytes per second
    # op ("all_reduce", "all_gather", "reduce_scatter", "p2p", "p2p_posted": a message whose
    # receive is already posted, [Note: posted receives] in comm/probe.py) -> world size -> curve
    collectives: dict[str, dict[int, Curve]] = field(default_factory=dict)
    startup_s: float = 0.0  # seconds to start a worker process group
    # dtype -> matrix size n (n x n @ n x n) -> achieved FLOP/s; `matmul_flops` is the largest n
    matmul_by_size: dict[str, dict[int, float]] = field(default_factory=dict)
    baseline_bytes: float = 0.0  # resident bytes of a started worker before it builds a model
    # resident bytes a worker adds beyond its model states and activations once it has built its
    # optimizer and run a step: torch._dynamo (imported by the first optimizer) and the pages of
    # the kernels a step runs ([Note: a worker's own memory] in planner/memory.py); 0 = unknown
    runtime_bytes: float = 0.0
    threads: int = 1  # intra-op threads per process the numbers were measured with
    # processes computing at once -> fp32 FLOP/s of each (cores are shared past the core count)
    matmul_concurrent: dict[int, float] = field(default_factory=dict)
    # processes computing at once -> how much longer a transformer layer's forward + backward
    # takes on each than on one alone ([Note: shared cores, measured on a step] in
    # measure/contention.py); {} = not measured (the matmul rates above decide)
    step_slowdown: dict[int, float] = field(default_factory=dict)
    # ranks that wait for each other every step -> the seconds that waiting for the slowest of
    # them adds per synchronization, and the share of the compute between synchronizations it
    # adds ([Note: ranks' skew] in measure/contention.py); {} = not measured (none priced;
    # profiles saved before the seconds were measured hold the share alone)
    sync_wait_s: dict[int, float] = field(default_factory=dict)
    step_skew: dict[int, float] = field(default_factory=dict)
    # ranks of a mesh -> seconds per call of the clip over DTensor gradients on it beyond its
    # per-tensor cost, its norm's all-reduce included ([Note: DTensor clip per call] in
    # measure/probes.py); {} = not measured (the clip's reduce priced as a small all-reduce)
    dtensor_clip_call_s: dict[int, float] = field(default_factory=dict)
    # [Note: per-step costs] part of the end of a step -> (seconds per tensor, seconds per
    # byte) of one process alone: "adamw", "sgd" (``optimizer.step()``), "clip" (the
    # global-norm clip), "check" (the non-finite check); "dtensor <part>" the same on DTensor
    # parameters, the check and the updates on a mesh of two ranks (one before commit 2c98492:
    # it read low), [Note: DTensor end of step] in measure/probes.py; absent: the plain ones.
    # {} = not calibrated: the cost model falls back to the memory-bound update alone.
    step_costs: dict[str, tuple[float, float]] = field(default_factory=dict)
    op_s: float = 0.0  # seconds per ATen operator call on tiny tensors (dispatch); 0 = unknown
    # ZeRO stage (0: FSDP2's replicate) -> seconds FSDP2's hooks add per wrapped module to a
    # forward + backward ([Note: FSDP2 unit overhead] in measure/probes.py); {} = unknown
    fsdp_unit_s: dict[int, float] = field(default_factory=dict)
    # ZeRO stage (0: replicate) -> seconds per parameter tensor a wrapped module holds beyond
    # two ([Note: FSDP2 tensor overhead] in measure/probes.py); {} = unknown (none priced)
    fsdp_tensor_s: dict[int, float] = field(default_factory=dict)
    # ZeRO stage -> (a unit's parameter bytes, seconds its all-gathers and reduce-scatter take
    # inside a step on two ranks, FSDP2's copies and waits included, its hooks not): [Note: FSDP2
    # collectives in a step] in measure/probes.py; {} = not measured (the isolated curves)
    fsdp_in_step: dict[int, Curve] = field(default_factory=dict)
    # [Note: DTensor module overhead] in measure/probes.py: seconds tensor parallelism's
    # DTensor dispatch adds per parallelized module to one forward + backward; 0 = unknown
    tp_module_s: float = 0.0
    # ranks on the host -> (bytes, seconds one tensor-parallel all-reduce takes inside a step
    # on tp groups of two, its DTensor dispatch not included): [Note: tensor-parallel
    # collectives in a step] in measure/probes.py; {} = not measured (the isolated curves)
    tp_in_step: dict[int, Curve] = field(default_factory=dict)
    # ranks -> seconds one all-reduce of a few floats (the end of step's loss, flag and norm)
    # takes when the ranks reach it from their compute: [Note: the step's reductions in a step]
    # in measure/contention.py; {} = not measured (the isolated curves)
    reduce_in_step: dict[int, float] = field(default_factory=dict)
    # [Note: loop overhead] in measure/calibrate_worker.py: seconds a training step spends in its own
    # Python beyond what the rest of the profile prices, once per step and once per micro-batch
    # (one process alone, a CPU host); 0 = not calibrated
    loop_step_s: float = 0.0
    loop_microbatch_s: float = 0.0
    # [Note: pipeline runtime overhead] in measure/calibrate_worker.py: pipeline schedule ->
    # seconds the pipeline runtime adds to every F and every B of a stage beyond the loop's
    # share, and seconds it adds once per flush (PipeDream: per step), two stages on one host
    # (priced as measured, whatever the ranks on the host); {} = not calibrated
    pipe_action_s: dict[str, float] = field(default_factory=dict)
    pipe_flush_s: dict[str, float] = field(default_factory=dict)
    # [Note: parameter-server exchange] in measure/calibrate_wire.py: mode ("sync", "async") ->
    # workers at one server -> fixed seconds per step of the exchange; {} = not calibrated
    ps_exchange_s: dict[str, dict[int, float]] = field(default_factory=dict)
    # [Note: timing rounds] in measure/timing.py: measured figure ("matmul fp32 1024",
    # "memory bandwidth", "training loop") -> interquartile range / median of its rounds
    spread: dict[str, float] = field(default_factory=dict)
    # [Note: cold operands] in measure/kernels.py: weight size s -> fp32 FLOP/s of a Linear's
    # forward (rows x s) @ (s x s) on operands not in cache, one process alone; {} = unknown
    # (the square matmuls of `matmul_by_size` price the Linears, as before)
    gemm_by_size: dict[int, float] = field(default_factory=dict)
    # [Note: attention kernels] in measure/kernels.py: (sequence length, head size) -> (forward,
    # backward) fp32 FLOP/s of causal scaled-dot-product attention, one process alone;
    # {} = unknown (attention priced at the matmul rate)
    attention_rates: dict[tuple[int, int], tuple[float, float]] = field(default_factory=dict)
    # [Note: elementwise kernels] in measure/kernels.py: ATen operator ("aten.gelu") -> fp32
    # seconds per output element, one process alone; {} = unknown (priced by bytes moved)
    elementwise_s: dict[str, float] = field(default_factory=dict)
    # [Note: host drift] in planner/drift.py: speed figure ("matmul fp32", "matmul half",
    # "operator", "copy") -> its rate (higher is faster), the mean of its timings at the start
    # and the end of the calibration; {} = not measured (the profile cannot be rescaled)
    speed: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Layout:
    """One candidate layout; `overrides` turns it into `JobConfig` dotted keys."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0
    sync: str = "allreduce"  # allreduce | ps | gossip | localsgd
    schedule: str = "1f1b"  # pipeline schedule when pp > 1
    microbatches: int = 1
    # interleaved 1F1B's model chunks per rank (pipeline.virtual_stages); 1 for every other
    # schedule (ZBV's two per rank are its own): planner/schedules.py
    virtual_stages: int = 1
    recompute: bool = False
    # with recompute: only the blocks whose model index is a multiple of it recompute
    # (parallel.recompute = "every:K"; torchtitan's layer frequency); 1 = every block
    recompute_every: int = 1
    # with recompute: selectively, op by op (parallel.recompute = "ops"; every block)
    recompute_ops: bool = False
    grad_accum: int = 1
    ps_servers: int = 0
    ps_mode: str = "sync"
    ps_leaves: int = 0  # workers per leaf server (ps.leaves; 0 = none): cost/ps.py
    sufficient_factor: bool = False  # late multiply for Linear layers (plain data parallel)
    # blocks per pipeline stage the cost model priced (set by `cost.predict`), one count per
    # virtual stage in model order where a rank holds several (p x v); () = uniform
    partition: tuple[int, ...] = ()
    topology: str = "ring"  # sync = "gossip": the peer graph (gossip.topology)
    period: int = 8  # sync = "localsgd": local steps between averages (localsgd.period)

    def describe(self) -> str:
        """Short name, e.g. ``dp4``, ``dp2-tp2-zero3``, ``pp4-1f1b-m8-dp2``,
        ``pp4-interleaved-1f1b-v2-m8``, ``ps-async-w3-s1``, ``ps-sync-w8-s1-l4`` (leaves of 4)."""
        if self.sync == "ps":
            leaves = f"-l{self.ps_leaves}" if self.ps_leaves else ""
            return f"ps-{self.ps_mode}-w{self.dp}-s{self.ps_servers}{leaves}"
        if self.sync == "gossip":
            return f"gossip-{self.topology}-w{self.dp}"
        if self.sync == "localsgd":
            return f"localsgd-h{self.period}-w{self.dp}"
        parts = [f"dp{self.dp}"] if self.dp > 1 or (self.tp == 1 and self.pp == 1) else []
        if self.tp > 1:
            parts.append(f"tp{self.tp}")
        if self.pp > 1:
            chunks = f"-v{self.virtual_stages}" if self.virtual_stages > 1 else ""
            parts.append(f"pp{self.pp}-{self.schedule}{chunks}-m{self.microbatches}")
        if self.zero:
            parts.append(f"zero{self.zero}")
        if self.sufficient_factor:
            parts.append("sf")
        if self.recompute:
            kind = "-ops" if self.recompute_ops else f"-every{self.recompute_every}" * self.every_k
            parts.append("recompute" + kind)
        if self.grad_accum > 1:
            parts.append(f"accum{self.grad_accum}")
        return "-".join(parts)

    @property
    def every_k(self) -> bool:
        """Recomputes some blocks only (``every:K`` with K > 1)."""
        return self.recompute and self.recompute_every > 1

    def recomputes(self, index: int) -> bool:
        """Whether block ``index`` of the model (its block view) recomputes its forward."""
        return self.recompute and index % self.recompute_every == 0

    def _recompute_value(self) -> bool | str:
        if self.recompute and self.recompute_ops:
            return "ops"
        return f"every:{self.recompute_every}" if self.every_k else self.recompute

    @property
    def devices(self) -> int:
        return self.dp * self.tp * self.pp + (self.ps_servers if self.sync == "ps" else 0)

    def overrides(self, per_host: int = 0) -> dict[str, Any]:
        """The `JobConfig` fields of this layout. ``per_host``: devices per host of the cluster
        it was planned for (0 = all on one host). A layout larger than a host runs on as few
        nodes as hold it with the same ``launch.nproc`` on each (`launch_shape`: 16 ranks on
        hosts of 8 are 8 x 2 nodes, not ``nproc = 16``); one with no such split is a
        `PlanError` (the search does not offer it). A multi-node layout still needs
        ``launch.rdzv_endpoint`` from the user."""
        shape = launch_shape(self.devices, per_host)
        if shape is None:
            raise PlanError(
                f"layout {self.describe()} has {self.devices} ranks, which no number of hosts "
                f"of {per_host} holds with the same process count on each: plan for "
                f"{per_host} or a multiple of it"
            )
        nproc, nnodes = shape
        out: dict[str, Any] = {
            "parallel.dp": self.dp,
            "parallel.tp": self.tp,
            "parallel.pp": self.pp,
            "parallel.zero": self.zero,
            "parallel.sync": self.sync,
            "parallel.recompute": self._recompute_value(),
            "train.grad_accum": self.grad_accum,
            "launch.nproc": nproc,
            "launch.nnodes": nnodes,
        }
        if self.pp > 1:
            out["pipeline.schedule"] = self.schedule
            out["pipeline.microbatches"] = self.microbatches
            if self.virtual_stages > 1:
                out["pipeline.virtual_stages"] = self.virtual_stages
            if self.partition:  # what the cost model priced is what runs
                out["pipeline.partition"] = list(self.partition)
        if self.sufficient_factor:
            out["parallel.sufficient_factor"] = "auto"  # the layers where factors are cheaper
        if self.sync == "ps":
            out["ps.servers"] = self.ps_servers
            out["ps.mode"] = self.ps_mode
            if self.ps_leaves:  # a host's workers, or groups of ps_leaves that divide them
                host = self.ps_leaves == per_host or self.dp % self.ps_leaves
                out["ps.leaves"] = "host" if host else self.ps_leaves
        if self.sync == "gossip":
            out["gossip.topology"] = self.topology
        if self.sync == "localsgd":
            out["localsgd.period"] = self.period
        return out


@dataclass(frozen=True)
class Prediction:
    """The cost model's answer for one layout on one cluster."""

    layout: Layout
    step_s: float
    memory_per_rank: float  # peak bytes on the busiest rank
    breakdown: dict[str, float] = field(default_factory=dict)  # compute, comm, bubble, ... (s)
    fits: bool = True
    why: str = ""  # why it lost or does not fit: "out of memory", "bubble", "communication"
