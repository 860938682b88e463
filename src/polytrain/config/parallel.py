"""The parallel sections of the job description: the mesh and how replicas combine
(`ParallelConfig`), the pipeline (`PipelineConfig`) and the parameter servers (`PSConfig`).
`config.job.JobConfig` composes them and checks what spans sections.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from polytrain.config.base import option, positive
from polytrain.errors import ConfigError

__all__ = ["PSConfig", "ParallelConfig", "PipelineConfig", "RecomputePolicy", "recompute_policy"]


@dataclass(frozen=True)
class RecomputePolicy:
    """Which blocks recompute their activations in backward, and how.

    ``mode``: "none"; "full" (the block's whole forward runs again; it keeps only its input);
    "ops" (selective, op level: the outputs of matrix multiplications and attention are kept,
    the cheap element-wise ops between them are recomputed, as torchtitan's selective op
    checkpointing and Korthikanti et al. 2022's "selective recomputation"). ``every``: only the
    blocks whose index is a multiple of it (torchtitan's layer frequency; Megatron's "block"
    method recomputes a count of layers instead)."""

    mode: Literal["none", "full", "ops"] = "none"
    every: int = 1

    def covers(self, index: int) -> bool:
        """Whether block (or repeated layer) ``index`` of the model is recomputed."""
        return self.mode != "none" and index % self.every == 0


_RECOMPUTE_FORMS = "true, false, 'full', 'ops' or 'every:K' (K >= 1: every K-th block)"


def recompute_policy(value: bool | str) -> RecomputePolicy:
    """The policy a ``parallel.recompute`` value names (true = 'full', false = none)."""
    if isinstance(value, bool):
        return RecomputePolicy("full" if value else "none")
    text = value.strip().lower()
    if text in ("full", "ops", "none"):
        return RecomputePolicy(text)  # type: ignore[arg-type]
    head, sep, count = text.partition(":")
    if head == "every" and sep and count.isdigit() and int(count) >= 1:
        return RecomputePolicy("full", int(count))
    raise ConfigError(f"parallel.recompute = {value!r}: expected {_RECOMPUTE_FORMS}")


@dataclass
class ParallelConfig:
    dp: int = option(0, "data-parallel degree (0 = whatever the world size leaves)")
    tp: int = option(1, "tensor-parallel degree")
    pp: int = option(1, "pipeline-parallel degree (stages)")
    zero: int = option(0, "ZeRO stage: 0 (replicated, DDP), 2 or 3 (FSDP2)")
    sync: Literal["allreduce", "ps", "gossip", "localsgd"] = option(
        "allreduce",
        "how replicas combine: all-reduce gradients, parameter servers, gossip with neighbours, "
        "or periodic model averaging",
    )
    bucket_mb: float = option(25.0, "DDP gradient bucket size in MiB")
    grad_compression: Literal["none", "bf16", "fp16", "powersgd", "topk", "sign"] = option(
        "none",
        "compress gradients for the all-reduce: to this dtype, rank-1 PowerSGD, or top-k / "
        "1-bit sign packets all-gathered (the last three with error feedback)",
    )
    grad_topk_ratio: float = option(
        0.01, "grad_compression = 'topk': fraction of each gradient bucket's values sent"
    )
    sufficient_factor: Literal["auto", "on", "off"] = option(
        "off", "sufficient-factor (late multiply) exchange for large linear layers"
    )
    recompute: bool | str = option(
        False,
        "recompute activations in backward instead of storing them: true or 'full' (every "
        "block), 'every:K' (every K-th block), 'ops' (keep matmul and attention outputs, "
        "recompute the element-wise ops), false",
    )

    @property
    def recompute_policy(self) -> RecomputePolicy:
        return recompute_policy(self.recompute)

    hierarchical: Literal["auto", "on", "off"] = option(
        "auto",
        "DDP all-reduce in two levels (reduce inside a host, all-reduce across hosts, broadcast "
        "back): on, off, or auto (measured at start-up, used where faster)",
    )
    tp_plan: list[str] = option(
        [],
        "tensor-parallel plan rows 'module.path.pattern=style' (colwise, colwise_gather, "
        "rowwise, vocab); empty = the built-in plan of gpt / mlp",
    )

    hybrid: list[str] = option(
        [],
        "hybrid parallelism (PAI; Krizhevsky's 'one weird trick'): the Linear layers these "
        "tp-plan rows name ('pattern=style') are split over the data-parallel ranks and run on "
        "the whole batch, the rest stays data parallel; ['auto'] picks the layers whose weights "
        "outweigh their activations; [] = off",
    )

    spatial: int = option(
        1,
        "spatial parallelism: split every image's rows over this many ranks (all of them: "
        "spatial = the data-parallel degree), halos exchanged before each convolution; 1 = off",
    )

    def __post_init__(self) -> None:
        if isinstance(self.recompute, str) and self.recompute.strip().lower() in ("true", "false"):
            self.recompute = self.recompute.strip().lower() == "true"  # a command-line value
        if isinstance(self.recompute, str) and recompute_policy(self.recompute).mode == "none":
            self.recompute = False
        recompute_policy(self.recompute)  # a one-line error for anything else
        positive("parallel", "dp", self.dp, allow_zero=True)
        positive("parallel", "spatial", self.spatial)
        positive("parallel", "tp", self.tp)
        positive("parallel", "pp", self.pp)
        positive("parallel", "bucket_mb", self.bucket_mb)
        if self.zero == 1:
            raise ConfigError(
                "parallel.zero = 1 is not offered: FSDP2 has no optimizer-only sharding; use "
                "zero = 2 (shards optimizer state and gradients, a superset of ZeRO-1's saving)"
            )
        if self.zero not in (0, 2, 3):
            raise ConfigError(f"parallel.zero = {self.zero!r}: expected one of 0, 2, 3")
        if not 0 < self.grad_topk_ratio <= 1:
            raise ConfigError(
                f"parallel.grad_topk_ratio = {self.grad_topk_ratio}: expected a value in (0, 1] "
                "(the fraction of each gradient bucket sent)"
            )
        if self.zero and self.grad_compression not in ("none", "bf16", "fp16"):
            raise ConfigError(
                f"parallel.grad_compression = {self.grad_compression!r} is a DDP hook, and ZeRO "
                f"{self.zero} (FSDP2) reduce-scatters without DDP: use --grad-compression "
                "bf16/fp16 (FSDP2's reduce dtype) or --zero 0"
            )
        if self.tp > 1 and self.grad_compression != "none":
            raise ConfigError(
                f"parallel.grad_compression = {self.grad_compression!r} is a DDP hook, and a "
                f"tensor-parallel model (parallel.tp = {self.tp}) is replicated without DDP: "
                "set --grad-compression none"
            )
        if self.hierarchical == "on" and self.grad_compression != "none":
            raise ConfigError(
                "parallel.hierarchical = 'on' and parallel.grad_compression = "
                f"{self.grad_compression!r} are both DDP communication hooks and DDP takes one: "
                "drop one of them"
            )
        if self.spatial > 1:
            self._plain_dp_only(
                "spatial",
                "splits images over the data-parallel ranks and ",
                tuple(_PLAIN_DP_CLASHES),
                "drop that option or set parallel.spatial = 1",
            )
        if self.hybrid:
            self._plain_dp_only(
                "hybrid",
                "splits layers over the data-parallel ranks and ",
                tuple(k for k in _PLAIN_DP_CLASHES if k != "hybrid"),
                "drop that option or set parallel.hybrid = []",
            )
        if self.sufficient_factor != "off":
            self._plain_dp_only(
                "sufficient_factor",
                "",
                ("tp", "pp", "zero", "sync", "grad_compression"),
                "set --sufficient-factor off or drop that option",
            )

    def _plain_dp_only(self, option: str, does: str, others: tuple[str, ...], fix: str) -> None:
        """A `ConfigError` naming the first of ``others`` (`_PLAIN_DP_CLASHES`) that is on, for
        ``option``, which works with plain data parallel only."""
        for name in others:
            if _PLAIN_DP_CLASHES[name](self):
                raise ConfigError(
                    f"parallel.{option} = {getattr(self, option)!r} {does}works with plain data "
                    f"parallel only, but parallel.{name} = {getattr(self, name)!r}: {fix}"
                )


@dataclass
class PipelineConfig:
    schedule: Literal["gpipe", "1f1b", "pipedream", "interleaved-1f1b", "zb-h1", "zbv"] = option(
        "1f1b", "pipeline schedule"
    )
    microbatches: int = option(1, "micro-batches per replica per step")
    virtual_stages: int = option(
        1,
        "interleaved-1f1b: model chunks (stages) per rank, 2 or more; the model is cut into "
        "pp * virtual_stages stages",
    )
    partition: str | list[int] = option(
        "uniform", "'auto' (profiled), 'uniform', or blocks per stage, e.g. [3, 5]"
    )
    memory_limit_mb: float = option(0.0, "per-stage memory limit in MiB for 'auto' (0 = none)")
    split_points: list[str] = option(
        [],
        "a user model's layers where stages 2, 3, ... begin, as module paths (e.g. "
        "'transformer.h.2'); overrides partition (pp - 1 paths)",
    )
    partition_trials: int = option(
        4,
        "'auto': time the profile's best partition and up to N - 1 neighbours (one boundary "
        "moved by 1-2 blocks) for a few steps inside the pipeline and keep the fastest "
        "(0 or 1: the profile's choice)",
    )
    pipedream_update: Literal["step", "microbatch"] = option(
        "step",
        "pipedream: one update per step from its micro-batches' gradients (PipeDream-2BW), "
        "or one after every micro-batch (PipeDream 2019)",
    )

    def __post_init__(self) -> None:
        positive("pipeline", "microbatches", self.microbatches)
        positive("pipeline", "virtual_stages", self.virtual_stages)
        positive("pipeline", "memory_limit_mb", self.memory_limit_mb, allow_zero=True)
        positive("pipeline", "partition_trials", self.partition_trials, allow_zero=True)
        if isinstance(self.partition, str) and self.partition not in ("auto", "uniform"):
            raise ConfigError(
                f"pipeline.partition = {self.partition!r}: expected 'auto', 'uniform' or a list "
                "of block counts such as [3, 5]"
            )
        # A list of counts is checked against the model and parallel.pp in pre-flight, in one
        # place (`pipeline.partition.check_counts`).


@dataclass
class PSConfig:
    servers: int = option(1, "dedicated parameter-server ranks")
    mode: Literal["sync", "async", "ssp"] = option("sync", "consistency model")
    staleness: int = option(0, "ssp: how many clocks a worker may run ahead of the slowest")
    hierarchical: bool = option(False, "reduce within a host first; one worker per host talks")
    leaves: int | Literal["host"] = option(
        0, "leaf servers: 'host' (one per host) or workers per leaf (0 = none)"
    )
    chunk_kb: int = option(
        0, "chunk size of pipelined pushes and pulls in KiB (0 = auto: from the shard size)"
    )
    overlap: bool = option(
        True, "sync: push each layer's gradient from backward, pull first layers into forward"
    )
    colocate: bool = option(
        False, "sync: no server ranks; worker ranks 0..servers-1 also serve one shard each"
    )
    ranks_per_host: int = option(
        0, "hierarchical: worker ranks per host (0 = LOCAL_WORLD_SIZE, else launch.nproc)"
    )
    worker_timeout_s: float = option(
        300.0, "async/ssp: a worker silent this long is dropped (a closed connection at once)"
    )
    spare_workers: int = option(
        0, "async/ssp: the last N worker ranks join the running job after join_delay_s"
    )
    join_delay_s: float = option(2.0, "seconds a spare worker waits before it joins")
    straggler_delay_s: float = option(
        0.0, "fault injection (benchmarks): the last worker sleeps this long every step"
    )

    def __post_init__(self) -> None:
        positive("ps", "servers", self.servers)
        positive("ps", "chunk_kb", self.chunk_kb, allow_zero=True)
        positive("ps", "ranks_per_host", self.ranks_per_host, allow_zero=True)
        positive("ps", "worker_timeout_s", self.worker_timeout_s)
        positive("ps", "spare_workers", self.spare_workers, allow_zero=True)
        positive("ps", "join_delay_s", self.join_delay_s, allow_zero=True)
        positive("ps", "straggler_delay_s", self.straggler_delay_s, allow_zero=True)
        if self.staleness < 0:
            raise ConfigError(
                f"ps.staleness = {self.staleness}: expected a non-negative number of clocks "
                f"(0 means synchronous)"
            )
        if self.staleness and self.mode != "ssp":  # the rule of ps.consistency.check_consistency
            raise ConfigError(
                f"ps.staleness = {self.staleness} has no effect with ps.mode = {self.mode!r}: "
                f"set ps.mode = 'ssp' to bound staleness, or remove ps.staleness"
            )
        if self.leaves != "host" and (isinstance(self.leaves, bool) or self.leaves < 0):
            raise ConfigError(
                f"ps.leaves = {self.leaves!r}: expected 'host', a number of workers per leaf, "
                f"or 0 for no leaf servers"
            )
        if self.leaves and (self.colocate or self.hierarchical or self.spare_workers):
            raise ConfigError(
                f"ps.leaves = {self.leaves!r} with ps.colocate = {self.colocate}, hierarchical = "
                f"{self.hierarchical}, spare_workers = {self.spare_workers}: leaf servers replace "
                f"the per-host reduction and serve fixed groups of workers; set those to "
                f"false / 0, or ps.leaves = 0"
            )
        if self.colocate and (self.mode != "sync" or self.hierarchical):
            raise ConfigError(
                f"ps.colocate = true with ps.mode = {self.mode!r}, hierarchical = "
                f"{self.hierarchical}: colocated servers run in sync mode without host "
                f"reduction; set ps.mode = 'sync' and ps.hierarchical = false, or ps.colocate = false"
            )
        if self.spare_workers and (self.mode == "sync" or self.hierarchical):
            raise ConfigError(
                f"ps.spare_workers = {self.spare_workers}: joining workers need ps.mode = "
                f"'async' or 'ssp' without ps.hierarchical (got mode {self.mode!r}, "
                f"hierarchical {self.hierarchical}); set ps.spare_workers = 0"
            )

    def workers_per_leaf(self, ranks_per_host: int) -> int:
        """Workers per leaf server: ``leaves``, or ``ranks_per_host`` for ``"host"``; 0 for
        none. ``ranks_per_host``: the host size the runtime sees (``ps.ranks_per_host``, else
        the launcher's LOCAL_WORLD_SIZE, else ``launch.nproc``)."""
        return ranks_per_host if self.leaves == "host" else self.leaves


# Options that combine ranks in other ways than plain data parallel, in the order a clash is
# named: spatial parallelism takes none of them, hybrid parallelism none of the others, the
# sufficient-factor exchange none of the first five.
_PLAIN_DP_CLASHES: dict[str, Callable[[ParallelConfig], bool]] = {
    "tp": lambda c: c.tp > 1,
    "pp": lambda c: c.pp > 1,
    "zero": lambda c: c.zero > 0,
    "sync": lambda c: c.sync != "allreduce",
    "grad_compression": lambda c: c.grad_compression != "none",
    "sufficient_factor": lambda c: c.sufficient_factor != "off",
    "hybrid": lambda c: bool(c.hybrid),
    "recompute": lambda c: bool(c.recompute),
}
