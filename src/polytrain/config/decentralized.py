"""Config sections of decentralized training: ``gossip`` and ``localsgd`` (docs/decentralized.md).

Each section checks its own ranges; what depends on the world size (peers, a torus shape) or on
``parallel.sync`` (compression a mode cannot use) is checked by `check_decentralized`, which
`JobConfig` calls once the world is known.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from polytrain.config.base import option, positive
from polytrain.errors import ConfigError

__all__ = ["GossipConfig", "LocalSGDConfig", "check_decentralized"]


def _torus_ok(n: int) -> bool:
    """``n = r x c`` with ``r, c >= 2`` (the rule of `polytrain.gossip.graphs.torus_shape`,
    which config cannot import: config sits below the strategy packages)."""
    return any(n % r == 0 and n // r >= 2 for r in range(2, n))


@dataclass
class GossipConfig:
    topology: Literal["ring", "torus", "exponential", "complete", "random"] = option(
        "ring", "sync = 'gossip': neighbour graph (random = 'peers' new peers every step)"
    )
    peers: int = option(1, "topology = 'random': peers each worker pushes to per step")
    compress: Literal["none", "fp16", "bf16", "topk", "sign"] = option(
        "none",
        "gossip messages and local-SGD averages: fp16/bf16 copies, or top-k / 1-bit sign "
        "with error feedback",
    )
    topk_ratio: float = option(0.01, "compress = 'topk': fraction of the values sent")
    consensus_lr: float = option(
        0.5, "gossip with compress = 'topk'/'sign' (CHOCO): step toward the neighbours' copies"
    )
    seed: int = option(0, "seed of the random peer draws (all ranks draw the same graph)")
    mode: Literal["sync", "async"] = option(
        "sync", "async: nobody waits for a peer, and the run survives dead workers but rank 0"
    )
    overlap: bool = option(
        False,
        "sync gossip: send a step's parameters while the next step computes and mix them in "
        "one step late (Overlap SGP)",
    )
    straggler_delay_s: float = option(
        0.0, "fault injection (benchmarks, tests): the last rank sleeps this long every step"
    )

    def __post_init__(self) -> None:
        if not 0 < self.topk_ratio <= 1:
            raise ConfigError(f"gossip.topk_ratio = {self.topk_ratio}: expected a value in (0, 1]")
        if not 0 < self.consensus_lr <= 1:
            raise ConfigError(
                f"gossip.consensus_lr = {self.consensus_lr}: expected a value in (0, 1]"
            )
        if self.straggler_delay_s < 0:
            raise ConfigError(
                f"gossip.straggler_delay_s = {self.straggler_delay_s}: expected >= 0 seconds"
            )
        if self.peers < 1:
            raise ConfigError(f"gossip.peers = {self.peers}: expected at least 1 peer")


@dataclass
class LocalSGDConfig:
    period: int = option(8, "sync = 'localsgd': average the replicas every H local steps")
    hierarchical: bool = option(
        False, "average inside a host every step, across hosts every 'period' steps"
    )
    ranks_per_host: int = option(0, "hierarchical: ranks per host (0 = launch.nproc)")
    outer: Literal["none", "nesterov"] = option(
        "none", "outer optimizer on the averaged delta: 'nesterov' is DiLoCo's"
    )
    outer_lr: float = option(0.7, "outer = 'nesterov': learning rate of the outer step")
    outer_momentum: float = option(0.9, "outer = 'nesterov': momentum of the outer step")

    def __post_init__(self) -> None:
        if self.period < 1:
            raise ConfigError(
                f"localsgd.period = {self.period}: expected at least 1 local step between "
                "averages (1 = average after every step)"
            )
        if self.ranks_per_host < 0:
            raise ConfigError(f"localsgd.ranks_per_host = {self.ranks_per_host}: expected >= 0")
        positive("localsgd", "outer_lr", self.outer_lr)  # NaN is not positive either
        if not 0.0 <= self.outer_momentum < 1.0:
            raise ConfigError(
                f"localsgd.outer_momentum = {self.outer_momentum}: expected a value in [0, 1)"
            )


def check_decentralized(
    sync: str, world: int, nproc: int, gossip: GossipConfig, local: LocalSGDConfig
) -> None:
    """What the two sections cannot check alone: against the world size and ``sync``."""
    c = gossip.compress
    if sync not in ("gossip", "localsgd") and c != "none":
        fix = (
            "use --grad-compression for all-reduce"
            if sync == "allreduce"
            else "use --sync gossip/localsgd or --compress none"
        )
        raise ConfigError(
            f"gossip.compress = {c!r} compresses gossip and local-SGD messages, but "
            f"parallel.sync = {sync!r} sends none: {fix}"
        )
    sparse = c in ("topk", "sign")
    if sync == "gossip" and sparse and gossip.mode == "async":
        raise ConfigError(
            f"gossip.compress = {c!r} keeps copies of the neighbours' models in step with "
            "every round (CHOCO), which asynchronous gossip has not: use --compress bf16/fp16 "
            "or gossip.mode = 'sync'"
        )
    if sync == "gossip" and sparse and gossip.topology == "random":
        raise ConfigError(
            f"gossip.compress = {c!r} needs a fixed graph (it keeps a copy of each neighbour's "
            "model), not topology 'random': use --topology ring/torus/exponential/complete"
        )
    if gossip.overlap:
        if sync != "gossip" or gossip.mode != "sync":
            raise ConfigError(
                f"gossip.overlap = true overlaps synchronous gossip rounds, not parallel.sync = "
                f"{sync!r} with gossip.mode = {gossip.mode!r}: use --sync gossip with "
                "gossip.mode = 'sync', or drop --overlap"
            )
        if sparse:
            raise ConfigError(
                f"gossip.overlap = true with gossip.compress = {c!r}: CHOCO's copies must be "
                "in step every round; use --compress none/fp16/bf16 or drop --overlap"
            )
    if sync == "localsgd" and local.hierarchical and c != "none":
        raise ConfigError(
            f"gossip.compress = {c!r} with localsgd.hierarchical: torch's hierarchical "
            "averager sends fp32; drop one of the two"
        )
    if sync == "gossip":
        if gossip.topology == "random" and gossip.peers >= world:
            raise ConfigError(
                f"gossip.peers = {gossip.peers} needs more than {gossip.peers} other workers, "
                f"but the world has {world} rank(s): use --peers {max(world - 1, 1)} or fewer"
            )
        if gossip.topology == "torus" and not _torus_ok(world):
            raise ConfigError(
                f"gossip.topology = 'torus' needs a world of r x c ranks with r, c >= 2, not "
                f"{world}: use --nproc 4, 6, 8, 9... or --topology ring"
            )
    if sync == "localsgd" and local.hierarchical:
        per_host = local.ranks_per_host or nproc
        if world % per_host or per_host == world:
            raise ConfigError(
                f"localsgd.hierarchical: {per_host} ranks per host must divide the world of "
                f"{world} into at least 2 hosts: set localsgd.ranks_per_host or --nnodes"
            )
