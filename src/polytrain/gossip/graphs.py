"""Peer graphs and mixing matrices for decentralized training (pure: no torch).

Lian et al., "Can Decentralized Algorithms Outperform Centralized Algorithms?" (D-PSGD, NeurIPS
2017) mix each replica with its neighbours through a doubly stochastic matrix ``W``; Assran et
al., "Stochastic Gradient Push for Distributed Deep Learning" (SGP, ICML 2019) use push-sum
weights on directed graphs, whose matrix is only column stochastic. Every rank computes the
same graph for round ``t`` from the topology, the world size, the shared seed and ``t``, so
ranks agree on who talks to whom without talking.

[Note: mixing matrix convention] ``M[i][j]`` is the weight node ``i`` gives to node ``j``'s
value: ``x_i' = sum_j M[i][j] * x_j``. Node ``j`` *sends* ``M[i][j] * x_j`` to every ``i != j``
with ``M[i][j] > 0`` and keeps ``M[j][j] * x_j`` (the push form), so one exchange code serves both
kinds. Undirected graphs use Metropolis-Hastings weights ``1 / (1 + max(d_i, d_j))``: symmetric,
hence doubly stochastic, and uniform ``1 / (d + 1)`` on the regular graphs offered here. Directed
graphs use push-sum weights: node ``j`` splits its value equally over itself and its
out-neighbours (column ``j`` sums to 1); where in-degrees differ the rows do not, and replicas
carry a push-sum weight ``w`` (their model is ``x / w``).

Topologies (``n`` nodes):

    ring         i <-> i +- 1                     undirected, degree 2 (1 for n = 2)
    torus        r x c grid, wrap-around          undirected, degree <= 4; r, c >= 2
    exponential  i -> i + 2^k  (2^k < n)          directed, out-degree floor(log2(n - 1)) + 1
    complete     i <-> every j                    undirected: uniform weights = exact average
    random       i -> k peers drawn per round     directed; the draw is seeded by (seed, round)
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "TOPOLOGIES",
    "Graph",
    "RoundPlan",
    "Topology",
    "graph_for_round",
    "is_doubly_stochastic",
    "mixing_matrix",
    "round_plan",
    "torus_shape",
]

Topology = Literal["ring", "torus", "exponential", "complete", "random"]
TOPOLOGIES: tuple[str, ...] = ("ring", "torus", "exponential", "complete", "random")


@dataclass(frozen=True)
class Graph:
    """Out-neighbours of every node (no self-loops); ``directed`` picks the weight rule."""

    out: tuple[tuple[int, ...], ...]
    directed: bool

    @property
    def size(self) -> int:
        return len(self.out)

    def in_neighbours(self, node: int) -> tuple[int, ...]:
        return tuple(j for j in range(self.size) if node in self.out[j])


@dataclass(frozen=True)
class RoundPlan:
    """What one node does in one round: keep a share, send weighted copies, receive."""

    keep: float  # M[i][i]
    send: tuple[tuple[int, float], ...]  # (peer, M[peer][i]): the share this node pushes
    recv: tuple[int, ...]  # peers whose pushes arrive here, in increasing order


def torus_shape(n: int) -> tuple[int, int] | None:
    """The most square ``r x c = n`` with ``r, c >= 2`` (``r <= c``), or None if there is none."""
    for r in range(math.isqrt(n), 1, -1):
        if n % r == 0:
            return r, n // r
    return None


def _undirected(n: int, edges: set[tuple[int, int]]) -> Graph:
    out: list[set[int]] = [set() for _ in range(n)]
    for a, b in edges:
        if a != b:
            out[a].add(b)
            out[b].add(a)
    return Graph(tuple(tuple(sorted(s)) for s in out), directed=False)


def _ring(n: int) -> Graph:
    return _undirected(n, {(i, (i + 1) % n) for i in range(n)})


def _torus(n: int) -> Graph:
    shape = torus_shape(n)
    if shape is None:
        raise ValueError(f"a torus needs a world of r x c nodes with r, c >= 2, not {n}")
    r, c = shape
    edges = set()
    for i in range(n):
        row, col = divmod(i, c)
        edges.add((i, row * c + (col + 1) % c))
        edges.add((i, ((row + 1) % r) * c + col))
    return _undirected(n, edges)


def _exponential(n: int) -> Graph:
    hops = [1 << k for k in range(max(n - 1, 1).bit_length()) if (1 << k) < n]
    out = tuple(tuple(sorted({(i + h) % n for h in hops} - {i})) for i in range(n))
    return Graph(out, directed=True)


def _complete(n: int) -> Graph:
    return Graph(tuple(tuple(j for j in range(n) if j != i) for i in range(n)), directed=False)


def _random(n: int, peers: int, seed: int, round_index: int) -> Graph:
    if not 1 <= peers < n:
        raise ValueError(f"random peers: expected 1 <= peers < {n} nodes, got {peers}")
    # One generator for the whole graph, seeded by (seed, round): every rank draws the same.
    rng = random.Random(f"polytrain-gossip:{seed}:{round_index}")
    out = []
    for i in range(n):
        others = [j for j in range(n) if j != i]
        out.append(tuple(sorted(rng.sample(others, peers))))
    return Graph(tuple(out), directed=True)


def graph_for_round(
    topology: str, n: int, round_index: int, *, peers: int = 1, seed: int = 0
) -> Graph:
    """The graph of round ``round_index`` (fixed topologies ignore the round)."""
    if n < 1:
        raise ValueError(f"a graph needs at least one node, got {n}")
    if n == 1:
        return Graph(((),), directed=False)
    if topology == "ring":
        return _ring(n)
    if topology == "torus":
        return _torus(n)
    if topology == "exponential":
        return _exponential(n)
    if topology == "complete":
        return _complete(n)
    if topology == "random":
        return _random(n, peers, seed, round_index)
    raise ValueError(f"unknown topology {topology!r}: expected one of {', '.join(TOPOLOGIES)}")


def mixing_matrix(graph: Graph) -> list[list[float]]:
    """``M`` ([Note: mixing matrix convention]): Metropolis-Hastings or push-sum weights."""
    n = graph.size
    m = [[0.0] * n for _ in range(n)]
    if graph.directed:
        for j in range(n):
            share = 1.0 / (len(graph.out[j]) + 1)
            m[j][j] = share
            for i in graph.out[j]:
                m[i][j] = share
        return m
    degree = [len(o) for o in graph.out]
    for i in range(n):
        for j in graph.out[i]:
            m[i][j] = 1.0 / (1 + max(degree[i], degree[j]))
        m[i][i] = 1.0 - sum(m[i])
    return m


def is_doubly_stochastic(m: list[list[float]], tol: float = 1e-12) -> bool:
    """Rows and columns sum to 1 (then push-sum weights stay 1 and can be left out)."""
    n = len(m)
    rows = all(abs(sum(m[i]) - 1.0) <= tol for i in range(n))
    cols = all(abs(sum(m[i][j] for i in range(n)) - 1.0) <= tol for j in range(n))
    return rows and cols


def round_plan(m: list[list[float]], node: int) -> RoundPlan:
    """Node ``node``'s part of one mixing round under ``M``."""
    n = len(m)
    send = tuple((i, m[i][node]) for i in range(n) if i != node and m[i][node] > 0)
    recv = tuple(j for j in range(n) if j != node and m[node][j] > 0)
    return RoundPlan(keep=m[node][node], send=send, recv=recv)
