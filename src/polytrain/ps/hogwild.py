"""Hogwild!: lock-free SGD by several processes on one host's shared-memory parameters.

Recht, Re, Wright and Niu, "Hogwild!: A Lock-Free Approach to Parallelizing Stochastic Gradient
Descent", NIPS 2011. When each update touches only a few coordinates of a large parameter
vector (sparse problems: a sparse linear model, a large embedding), processes rarely write the
same coordinate at once, so running them without any lock loses almost nothing and scales
with the number of cores. Here: sparse logistic regression on synthetic data; every process
samples examples and applies ``w[idx] -= lr * g * x[idx]`` with ``index_add_`` directly on the
shared weights (``share_memory_()``), without locks, barriers or messages.

Shapes: F features, N examples, K non-zeros per example.

Limits: one host only (the parameters live in that host's shared memory); ``nnodes > 1`` is a
`ConfigError`. Races are real: two processes updating one coordinate at the same time may lose
one of the two updates, which is exactly the trade Hogwild makes.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

from polytrain.config.base import option, positive
from polytrain.errors import ConfigError

__all__ = ["HogwildConfig", "HogwildResult", "SparseProblem", "make_problem", "run_hogwild"]


@dataclass
class HogwildConfig:
    workers: int = option(2, "processes updating the shared weights (one host)")
    nnodes: int = option(1, "hosts; Hogwild needs shared memory, so exactly 1")
    features: int = option(100_000, "F: dimension of the sparse linear model")
    nonzeros: int = option(16, "K: non-zero features per example")
    examples: int = option(20_000, "N: training examples (synthetic)")
    steps: int = option(20_000, "SGD updates per worker")
    lr: float = option(0.5, "learning rate")
    seed: int = option(0, "seed of the data and of each worker's sampling")

    def __post_init__(self) -> None:
        if self.nnodes != 1:
            raise ConfigError(
                f"hogwild.nnodes = {self.nnodes}: Hogwild updates parameters in one host's "
                f"shared memory, so it runs on exactly 1 node; across hosts use "
                f"parallel.sync = 'ps' with ps.mode = 'async'"
            )
        for name in ("workers", "features", "nonzeros", "examples", "steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"hogwild.{name} = {value!r}: expected a positive integer")
        if self.nonzeros > self.features:
            raise ConfigError(
                f"hogwild.nonzeros = {self.nonzeros} exceeds hogwild.features = "
                f"{self.features}: use fewer non-zeros per example"
            )
        positive("hogwild", "lr", self.lr)


@dataclass
class SparseProblem:
    """N examples of K (index, value) pairs and a label in {0, 1}."""

    index: torch.Tensor  # (N, K) int64
    value: torch.Tensor  # (N, K) float32
    label: torch.Tensor  # (N,) float32

    def share_memory_(self) -> SparseProblem:
        for t in (self.index, self.value, self.label):
            t.share_memory_()
        return self

    def loss(self, w: torch.Tensor) -> float:
        """Mean logistic loss of weights ``w`` (F,) over every example."""
        margin = (w[self.index] * self.value).sum(1)
        return float(F.binary_cross_entropy_with_logits(margin, self.label))


def make_problem(cfg: HogwildConfig) -> SparseProblem:
    """Labels from a hidden sparse-ish linear model, 5% of them flipped."""
    g = torch.Generator().manual_seed(cfg.seed)
    truth = torch.randn(cfg.features, generator=g)
    index = torch.randint(0, cfg.features, (cfg.examples, cfg.nonzeros), generator=g)
    value = torch.randn(cfg.examples, cfg.nonzeros, generator=g) / math.sqrt(cfg.nonzeros)
    margin = (truth[index] * value).sum(1)
    label = (margin > 0).float()
    flip = torch.rand(cfg.examples, generator=g) < 0.05
    label[flip] = 1 - label[flip]
    return SparseProblem(index, value, label)


def _worker(rank: int, cfg: HogwildConfig, w: torch.Tensor, data: SparseProblem) -> None:
    """Run ``cfg.steps`` lock-free sparse SGD updates on the shared ``w``."""
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(cfg.seed * 7919 + rank + 1)
    order = torch.randint(0, cfg.examples, (cfg.steps,), generator=g)
    for i in order.tolist():
        idx, val = data.index[i], data.value[i]
        margin = float((w[idx] * val).sum())
        grad = 1.0 / (1.0 + math.exp(-margin)) - float(data.label[i])  # d loss / d margin
        w.index_add_(0, idx, val, alpha=-cfg.lr * grad)  # no lock: Hogwild


@dataclass
class HogwildResult:
    loss: float
    initial_loss: float
    wall_s: float
    updates: int

    @property
    def updates_per_s(self) -> float:
        return self.updates / self.wall_s


def run_hogwild(cfg: HogwildConfig, data: SparseProblem | None = None) -> HogwildResult:
    """Train the sparse model with ``cfg.workers`` lock-free processes; return the final loss.

    ``workers = 1`` runs in this process (the serial SGD baseline).
    """
    data = (data or make_problem(cfg)).share_memory_()
    w = torch.zeros(cfg.features).share_memory_()
    initial = data.loss(w)
    t0 = time.perf_counter()
    if cfg.workers == 1:
        _worker(0, cfg, w, data)
    else:
        mp.start_processes(
            _worker, args=(cfg, w, data), nprocs=cfg.workers, join=True, start_method="spawn"
        )
    wall = time.perf_counter() - t0
    return HogwildResult(data.loss(w), initial, wall, cfg.workers * cfg.steps)
