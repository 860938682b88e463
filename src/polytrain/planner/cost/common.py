"""What every cost family shares: the compute rate and the alpha-beta collectives.

[Note: collective formulas] Ring algorithms on N ranks moving a buffer of X bytes over a link of
bandwidth B (one direction) and per-hop latency alpha (Patarasuk and Yuan 2009; Thakur et al.
2005; NCCL's own model in src/graph/tuning.cc):

* all-reduce      2 (N-1)/N * X / B + 2 (N-1) alpha + base
* all-gather      (N-1)/N * X / B + (N-1) alpha + base     (X = the gathered, full size)
* reduce-scatter  (N-1)/N * X / B + (N-1) alpha + base     (X = the full input size)
* p2p             X / B + alpha + base

With a calibrated `HostProfile` a group inside the calibrated host uses the measured curve of
that operation and world size instead (the nearest measured world size, rescaled by the ring
factor above when the exact one was not measured).

[Note: shared cores] On a CPU host every rank is a process with one intra-op thread, and the
ranks of one host share its cores: past the core count (and on a host others also use) each
process computes slower than one alone. `polytrain calibrate` measures the fp32 matmul rate of
each of N processes multiplying at once (`HostProfile.matmul_concurrent`); the cost model
prices compute at the rate for the number of ranks that compute at once on one host
(`Env.computing`, default: the cluster's devices per host), interpolated linearly between
measured counts and, past the largest, shared evenly (rate(n) = rate(k) k / n). Every other
CPU-bound time measured in one process alone (measured block times, the per-step costs) slows
by the same factor rate(1) / rate(n). A profile that measured the slowdown on a transformer
layer's step (`HostProfile.step_slowdown`, [Note: shared cores, measured on a step] in
measure/contention.py) uses that instead of the matmul rates: `host_slowdown`. Accelerators do not
share: there it is 1.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from functools import cached_property

from polytrain.planner.catalog import Link
from polytrain.planner.cluster import Cluster
from polytrain.planner.cost.rates import (
    grid_rate,
    host_slowdown,
    interpolated,
    size_rate,
)
from polytrain.planner.types import BACKWARD_FLOPS_PER_FORWARD, BlockStats, HostProfile

__all__ = ["Env", "Shape", "ring_factor"]


@dataclass(frozen=True)
class Shape:
    """How one step divides the global batch: the stages (each a list of blocks; one stage
    without a pipeline), samples per replica and per micro-batch."""

    stages: list[list[BlockStats]]
    replica_samples: float
    mb_samples: float


def ring_factor(op: str, n: int) -> float:
    """Bytes on the wire per byte of X, per rank, for a ring ``op`` on ``n`` ranks."""
    if n <= 1:
        return 0.0
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) / n
    return 1.0  # p2p


def _hops(op: str, n: int) -> int:
    if op == "all_reduce":
        return 2 * (n - 1)
    if op in ("all_gather", "reduce_scatter"):
        return n - 1
    return 1


@dataclass(frozen=True)
class Env:
    """Cluster + optional calibrated profile + the job's compute dtype."""

    cluster: Cluster
    dtype: str = "fp32"
    profile: HostProfile | None = None
    bucket_bytes: float = 25.0 * 2**20  # parallel.bucket_mb
    ps_chunk_bytes: float = 256.0 * 1024  # ps.chunk_kb
    straggler_s: float = 0.0  # extra seconds the slowest worker takes per step
    # ranks computing at once on one host, on average (0 = every device of a host); [Note:
    # shared cores], [Note: a pipeline's shared cores] in cost/stages.py
    computing: float = 0

    # -- compute -------------------------------------------------------------------------
    @cached_property
    def cpu_slowdown(self) -> float:
        """How much slower one process computes beside the host's other computing ranks than
        alone (>= 1; 1 without a CPU profile with concurrent rates). [Note: shared cores]"""
        prof = self.profile
        if prof is None or self.cluster.device.key != "cpu":
            return 1.0
        return host_slowdown(
            self.host_ranks, step=prof.step_slowdown, matmul=prof.matmul_concurrent
        )

    @property
    def host_ranks(self) -> float:
        """Ranks computing at once on one host: `computing`, else every device of a host the
        cluster uses. [Note: shared cores]"""
        return self.computing or min(self.cluster.per_host, self.cluster.size)

    @cached_property
    def flops_rate(self) -> float:
        """Achieved FLOP/s of one rank: measured when calibrated (at the shared-core rate on a
        CPU host), else catalog peak x efficiency."""
        if self.profile is not None and self.profile.matmul_flops:
            rate = self.profile.matmul_flops.get(self.dtype) or self.profile.matmul_flops.get(
                "fp32"
            )
            if rate:
                return rate / self.cpu_slowdown
        dev = self.cluster.device
        return dev.flops(self.dtype) * dev.efficiency

    @property
    def mem_bw(self) -> float:
        if self.profile is not None and self.profile.mem_bw > 0:
            return self.profile.mem_bw
        return self.cluster.device.mem_bw

    def matmul_rate(self, block: BlockStats, rows: float = 0.0, tp: int = 1) -> float:
        """[Note: matmul size] The FLOP/s of ``block``'s matmuls when ``rows`` rows (samples x
        rows per sample: every tensor-parallel rank sees them all) go through one of ``tp``
        shards of it. `flops_rate` is the rate of the calibrated largest square matmul;
        smaller matmuls run slower, so with a calibrated rate by size and the block's Linear
        shapes the rate is read at the block's matmul size, interpolated in log-log between
        the calibrated sizes and clamped to their range: the FLOP-weighted geometric mean over
        its Linears of

        * on a CPU host, the smaller weight dimension: one thread's blocked loops are set by the
          weights (this CPU: 55 GFLOP/s at 128 against 86 at 1024), the rows a batch brings are
          many more and change little;
        * on an accelerator, the side of the square matmul with the same FLOPs,
          (rows x fan_in x fan_out)^(1/3): a GPU fills its multiprocessors with output tiles,
          so the rows count as much as the weights (an H100 runs a 512-cube matmul at a few
          percent of its 8192-cube rate).

        Without them, `flops_rate`. On a CPU host in fp32 with the Linear-shaped rates on
        operands out of cache ([Note: cold operands] in measure/kernels.py), those instead of
        the square matmuls' (at the shared-core rate, [Note: shared cores]).

        [Note: matmul size at a shard] Under tensor parallelism a rank multiplies by its shard
        of each parallelized Linear (`BlockStats.linears_at`): gpt tiny's q, k, v and attention
        projection are 128 x 64 on each of two ranks, a smaller matmul than the 128 x 128 they
        were priced at (this CPU, 2026-11-26: 87 GFLOP/s at 64 against 121 at 128, cold)."""
        rate = self.flops_rate
        prof = self.profile
        by_size = prof.matmul_by_size.get(self.dtype) if prof is not None else None
        cpu = self.cluster.device.key == "cpu"
        if cpu and prof is not None and prof.gemm_by_size and self.dtype == "fp32":
            by_size = prof.gemm_by_size
            rate = by_size[max(by_size)] / self.cpu_slowdown  # the largest size's, as above
        if not by_size or not block.linears or (not cpu and rows <= 0):
            return rate
        linears = block.linears_at(tp)
        weights = [fi * fo for fi, fo in linears]
        if cpu:
            sides = [float(min(fi, fo)) for fi, fo in linears]
        else:
            sides = [(rows * fi * fo) ** (1 / 3) for fi, fo in linears]
        dim = math.exp(
            sum(w * math.log(side) for w, side in zip(weights, sides, strict=True)) / sum(weights)
        )
        return rate * size_rate(by_size, dim) / by_size[max(by_size)]

    def fwd_s(self, block: BlockStats, samples: float, tp: int = 1) -> float:
        """Forward seconds of ``samples`` samples through one of ``tp`` tensor-parallel shards
        of ``block`` (measured when known); see [Note: non-matmul time]."""
        return self._pass_s(block, samples, tp, 0)

    def bwd_s(self, block: BlockStats, samples: float, tp: int = 1) -> float:
        """Backward = input and weight gradients = `BACKWARD_FLOPS_PER_FORWARD` x the forward
        FLOPs (measured when known), plus its own operators' overhead and memory traffic."""
        return self._pass_s(block, samples, tp, 1)

    def _pass_s(self, block: BlockStats, samples: float, tp: int, direction: int) -> float:
        """Seconds of one pass (``direction`` 0 forward, 1 backward: twice the forward's matmul
        FLOPs) of ``samples`` samples through one of ``tp`` shards of ``block``."""
        measured = (block.fwd_s, block.bwd_s)[direction]
        if measured is not None:
            return measured * samples * self.cpu_slowdown / tp
        rate = self.matmul_rate(block, samples * block.rows_per_sample, tp)
        flops, attention = self._attention(block, samples / tp, direction, rate)
        counted = (block.fwd_elementwise, block.bwd_elementwise)[direction]
        kept, heavy = self._elementwise(counted, samples / tp)
        scale = (1.0, BACKWARD_FLOPS_PER_FORWARD)[direction]
        matmul = scale * flops * samples / rate / tp + attention + heavy
        moved = (block.fwd_moved_bytes, block.bwd_moved_bytes)[direction] * samples / tp - kept
        return self._compute_s(matmul, (block.fwd_ops, block.bwd_ops)[direction], moved)

    def _elementwise(
        self, counted: tuple[tuple[str, float, float], ...], samples: float
    ) -> tuple[float, float]:
        """[Note: elementwise kernels] (bytes moved to take out of the memory term, seconds
        instead) of the heavy elementwise operators ``counted`` over ``samples`` samples: on a
        CPU host each operator the profile calibrated costs its output elements x its seconds
        per element (slowed by shared cores), in place of its bytes at ``mem_bw``; the rest,
        an accelerator and a profile without them: (0, 0), the bytes as before."""
        prof = self.profile
        if prof is None or not prof.elementwise_s or self.cluster.device.key != "cpu":
            return 0.0, 0.0
        if self.dtype != "fp32" or prof.op_s <= 0:
            return 0.0, 0.0
        nbytes = seconds = 0.0
        for op, elements, moved in counted:
            per = prof.elementwise_s.get(op)
            if per is not None:
                nbytes += moved * samples
                seconds += elements * samples * per * self.cpu_slowdown
        return nbytes, seconds

    def _attention(
        self, block: BlockStats, samples: float, direction: int, rate: float
    ) -> tuple[float, float]:
        """[Note: attention kernels] (``block``'s forward FLOPs per sample left to price at the
        matmul rate, seconds of its attention calls over ``samples`` samples in ``direction``
        0 forward / 1 backward). On a CPU host each recorded call is priced at the calibrated
        attention rate of its (T, D) (slowed by shared cores), or without one at the matmul
        ``rate``; the FLOPs `FlopCounterMode` counted inside the calls leave the matmul part.
        An accelerator keeps its FLOP count as counted."""
        prof = self.profile
        if self.cluster.device.key != "cpu" or not block.attention:
            return block.fwd_flops, 0.0
        grid = {}
        if prof is not None and self.dtype == "fp32":
            grid = {key: pair[direction] for key, pair in prof.attention_rates.items()}
        seconds = 0.0
        scale = (1.0, BACKWARD_FLOPS_PER_FORWARD)[direction]
        for t, _, d, flops in block.attention:
            per = grid_rate(grid, t, d) / self.cpu_slowdown if grid else rate
            seconds += scale * flops * samples / per
        return max(block.fwd_flops - block.attention_counted, 0.0), seconds

    def _compute_s(self, matmul_s: float, ops: int, moved_bytes: float) -> float:
        """[Note: non-matmul time] With a calibrated operator cost (``HostProfile.op_s``), the
        operator calls' dispatch and the bytes the non-matmul operators move at the calibrated
        memory bandwidth come on top of the matmuls. Without one, the matmuls alone: the
        catalog's efficiency factor already folds the rest into the FLOP rate.

        On a CPU host the one thread does all of it in turn, slowed like all CPU work by shared
        cores. [Note: asynchronous devices] An accelerator runs kernels while the host thread
        is still dispatching the next ones (CUDA's launch queue), so a block takes the longer
        of the host's dispatch (operator calls x ``op_s``, which `polytrain calibrate` measures
        on the device: dispatch, launch and the tiny kernel) and the device's own work
        (matmuls and bytes moved). Taking it per block is exact for a stack of equal blocks
        (a transformer); a deep queue can also carry one block's slack into the next."""
        if self.profile is None or self.profile.op_s <= 0:
            return matmul_s
        dispatch = ops * self.profile.op_s
        if self.cluster.device.key != "cpu":
            return max(dispatch, matmul_s + moved_bytes / self.mem_bw)
        return matmul_s + (dispatch + moved_bytes / self.mem_bw) * self.cpu_slowdown

    def fsdp_overhead_s(self, stage: int, units: int, tensors: float = 0.0) -> float:
        """FSDP2's hook overhead for ``units`` sharded modules holding ``tensors`` parameter
        tensors in one forward + backward, as calibrated ([Note: FSDP2 unit overhead], [Note:
        FSDP2 tensor overhead] in measure/probes.py: per unit, and per tensor beyond two a
        unit); 0 without a profile that measured it."""
        prof = self.profile
        if prof is None:
            return 0.0
        per_unit = prof.fsdp_unit_s.get(stage, 0.0)
        per_tensor = prof.fsdp_tensor_s.get(stage, 0.0) * max(tensors - 2 * units, 0.0)
        return (per_unit * units + per_tensor) * self.cpu_slowdown

    def fsdp_in_step_s(self, stage: int, nbytes: float, dp: int, stride: int) -> float | None:
        """Seconds of one unit's ZeRO-``stage`` collectives inside a step, for a unit of
        ``nbytes`` parameter bytes, as measured on two ranks of this host ([Note: FSDP2
        collectives in a step] in measure/probes.py); None for another group size, a group
        that leaves the calibrated host, or a profile without it (the isolated curves)."""
        prof = self.profile
        curve = prof.fsdp_in_step.get(stage) if prof is not None else None
        if curve is None or dp != 2 or self.link(stride, dp) is not self.cluster.intra:
            return None
        return curve.seconds(nbytes)

    def tp_collective_s(self, op: str, nbytes: float, tp: int, stride: int = 1) -> float:
        """Seconds of one tensor-parallel ``op`` of ``nbytes`` over ``tp`` ranks inside a step.
        For a group of two on the calibrated CPU host with a profile that measured it, the
        all-reduce the probe ran there with the nearest count of ranks on the host ([Note:
        tensor-parallel collectives in a step] in measure/probes.py), another operation that
        curve times the isolated curves' ratio; otherwise `collective_s`."""
        prof = self.profile
        curves = prof.tp_in_step if prof is not None else {}
        if not curves or tp != 2 or nbytes <= 0 or self.link(stride, tp) is not self.cluster.intra:
            return self.collective_s(op, nbytes, tp, stride)
        ranks = self.host_ranks
        in_step = curves[min(curves, key=lambda n: (abs(n - ranks), n))].seconds(nbytes)
        if op == "all_reduce":
            return in_step
        isolated = self.collective_s(op, nbytes, tp, stride)
        reduce = self.collective_s("all_reduce", nbytes, tp, stride)
        return in_step * isolated / reduce if reduce > 0 else isolated

    def skew_s(self, compute_s: float, ranks: int, syncs: float = 0.0, stride: int = 1) -> float:
        """Seconds that waiting for the slowest of ``ranks`` ranks adds to a step with
        ``compute_s`` seconds of each rank's own work and ``syncs`` synchronizations priced
        without that wait ([Note: ranks' skew] in measure/contention.py): the calibrated
        seconds per synchronization and share of the compute for that many ranks (between two
        measured counts, in proportion; past them, the nearest) on a calibrated CPU host whose
        group stays on it; 0 otherwise (not measured: an accelerator's, or across hosts)."""
        prof = self.profile
        share = self._on_host(prof.step_skew if prof else {}, ranks, stride)
        wait = self._on_host(prof.sync_wait_s if prof else {}, ranks, stride)
        return compute_s * (share or 0.0) + syncs * (wait or 0.0)

    def dtensor_clip_call_s(self, ranks: int) -> float:
        """Seconds per step of the clip over DTensor gradients on a mesh of ``ranks`` beyond its
        per-tensor cost, its norm's all-reduce included ([Note: DTensor clip per call] in
        measure/probes.py): the calibrated figure for that mesh size (between two measured
        sizes, in proportion; past them, the nearest) on a calibrated CPU host whose mesh stays
        on it; 0 otherwise (not measured: the caller prices the clip's reduce instead)."""
        seconds = self._on_host(self.profile.dtensor_clip_call_s if self.profile else {}, ranks)
        return seconds if seconds is not None else 0.0

    def _on_host(self, measured: dict[int, float], ranks: int, stride: int = 1) -> float | None:
        """A figure calibrated per group size (``measured``: ranks -> value) for a group of
        ``ranks`` at ``stride``: between two measured sizes in proportion, past them the
        nearest; None where it does not apply (one rank, not measured, not a CPU host, or a
        group that leaves the host)."""
        if ranks <= 1 or not measured or self.cluster.device.key != "cpu":
            return None
        if self.link(stride, ranks) is not self.cluster.intra:
            return None
        return interpolated(measured, ranks)

    def step_reduce_s(self, ranks: int, together: bool = True) -> float:
        """Seconds of one of the end of step's all-reduces of a few floats (loss, non-finite
        flag, squared norm) over ``ranks`` ranks. Reached ``together`` (every rank from the
        same compute) on the calibrated CPU host with a profile that measured it: the figure
        for that world size ([Note: the step's reductions in a step] in measure/contention.py; past
        the largest measured, that figure times the isolated curves' ratio between the two
        sizes); otherwise (or after some ranks waited for others, as pipeline stages do)
        `collective_s` of 8 bytes."""
        isolated = self.collective_s("all_reduce", 8.0, ranks, 1)
        prof = self.profile
        measured = prof.reduce_in_step if prof is not None else {}
        if not together or not measured or ranks <= 1:
            return isolated
        if self.link(1, ranks) is not self.cluster.intra:
            return isolated
        if ranks in measured:
            return measured[ranks]
        near = min(measured, key=lambda n: (abs(n - ranks), -n))
        base = self.collective_s("all_reduce", 8.0, near, 1)
        return measured[near] * isolated / base if base > 0 else isolated

    def step_cost_s(
        self, parts: tuple[str, ...], tensors: float, nbytes: float, dtensors: float = 0.0
    ) -> float:
        """Calibrated seconds of the end-of-step ``parts`` over ``tensors`` tensors of
        ``nbytes`` bytes on one rank (0 for a part the profile lacks); [Note: per-step costs].
        ``dtensors`` of the tensors are DTensors (their share of the bytes with them): those
        are priced at the ``"dtensor <part>"`` figures where calibrated ([Note: DTensor end of
        step] in measure/probes.py), else at the plain ones."""
        costs = self.profile.step_costs if self.profile is not None else {}
        share = min(dtensors / tensors, 1.0) if tensors > 0 else 0.0
        total = 0.0
        for part in parts:
            plain = costs.get(part, (0.0, 0.0))
            dist = costs.get("dtensor " + part, plain)
            for (per_tensor, per_byte), frac in ((plain, 1.0 - share), (dist, share)):
                total += frac * (per_tensor * tensors + per_byte * nbytes)
        return total * self.cpu_slowdown

    def optimizer_s(
        self,
        params: float,
        state_per_param: int,
        dtype_bytes: int,
        *,
        tensors: float = 0.0,
        optimizer: str = "adamw",
        clip: bool = False,
        dtensors: float = 0.0,
        fused: bool = False,
    ) -> float:
        """One rank's end of step over ``params`` parameters in ``tensors`` tensors: the
        non-finite check, the clip (``clip``) and the optimizer update, as calibrated
        ([Note: per-step costs]; ``dtensors`` of the tensors DTensors, see `step_cost_s`);
        ``fused``: torch's fused optimizer, as a parameter server runs it (a profile without
        it prices the default one). Uncalibrated: the memory-bound update alone (read p, g and
        the states, write p and the states)."""
        if self.profile is None or optimizer not in self.profile.step_costs:
            return params * dtype_bytes * (3 + 2 * state_per_param) / self.mem_bw
        if fused and f"{optimizer}_fused" in self.profile.step_costs:
            optimizer = f"{optimizer}_fused"
        parts = (optimizer, "check", "clip") if clip else (optimizer, "check")
        return self.step_cost_s(parts, tensors, params * dtype_bytes, dtensors)

    # -- communication -------------------------------------------------------------------
    def link(self, stride: int, size: int) -> Link:
        return self.cluster.link_for(stride, size)

    def collective_s(self, op: str, nbytes: float, size: int, stride: int = 1) -> float:
        """Seconds of one ``op`` over ``size`` ranks ``stride`` apart; see [Note: collective
        formulas]. ``nbytes`` is X: the full buffer (all-reduce input, gathered output)."""
        if size <= 1 or nbytes <= 0:
            return 0.0
        link = self.link(stride, size)
        measured = self._measured(op, nbytes, size, link)
        if measured is not None:
            return measured
        return (
            ring_factor(op, size) * nbytes / self.cluster.bandwidth_for(stride, size)
            + _hops(op, size) * link.latency
            + link.base
        )

    def p2p_s(self, nbytes: float, stride: int) -> float:
        """One message to the rank ``stride`` away."""
        if nbytes <= 0:
            return 0.0
        return self.collective_s("p2p", nbytes, 2, stride)

    def posted_p2p_s(self, nbytes: float, stride: int) -> float:
        """One pipeline message to the rank ``stride`` away: its receive is posted before it is
        sent ([Note: early receives] in pipeline/runtime.py), so on the calibrated host it costs
        the posted curve ([Note: posted receives] in comm/probe.py) up to its largest size; past
        it, or without it, what `p2p_s` costs."""
        prof = self.profile
        curve = prof.collectives.get("p2p_posted", {}).get(2) if prof is not None else None
        link = self.link(stride, 2)
        if nbytes <= 0 or curve is None or link is not self.cluster.intra:
            return self.p2p_s(nbytes, stride)
        if nbytes > max(curve.points)[0]:
            return self.p2p_s(nbytes, stride)
        return curve.seconds(nbytes)

    def ps_exchange_s(self, mode: str, workers: int) -> float | None:
        """Fixed seconds per step of a parameter-server exchange with ``workers`` workers at a
        server, as calibrated ([Note: parameter-server exchange] in measure/calibrate_wire.py):
        linear between the measured worker counts and past them (ssp prices as async); None
        without it or for a group that leaves the calibrated host."""
        prof = self.profile
        by_workers = prof.ps_exchange_s.get("sync" if mode == "sync" else "async") if prof else None
        if not by_workers or self.link(1, workers + 1) is not self.cluster.intra:
            return None
        counts = sorted(by_workers)
        if len(counts) == 1:
            return by_workers[counts[0]] * max(workers, 1) / counts[0]
        i = min(max(bisect.bisect_left(counts, workers), 1), len(counts) - 1)
        lo, hi = counts[i - 1], counts[i]
        slope = (by_workers[hi] - by_workers[lo]) / (hi - lo)
        return max(by_workers[lo] + slope * (workers - lo), 0.0)

    def _measured(self, op: str, nbytes: float, size: int, link: Link) -> float | None:
        # A profile describes the calibrated host only: groups that leave it use the catalog.
        if self.profile is None or link is not self.cluster.intra:
            return None
        curves = self.profile.collectives.get(op)
        if not curves:
            return None
        if size in curves:
            return curves[size].seconds(nbytes)
        nearest = min(curves, key=lambda n: abs(n - size))
        scale = ring_factor(op, size) / max(ring_factor(op, nearest), 1e-12)
        return curves[nearest].seconds(nbytes) * scale
