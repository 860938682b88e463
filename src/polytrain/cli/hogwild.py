"""``polytrain hogwild``: lock-free sparse SGD by several processes on one host (Recht et al. 2011)."""

from __future__ import annotations

import json
from typing import Annotated

import typer

__all__ = ["hogwild_command"]


def hogwild_command(
    workers: Annotated[int, typer.Option(help="processes updating the shared weights")] = 2,
    nnodes: Annotated[int, typer.Option(help="hosts (Hogwild needs exactly 1)")] = 1,
    features: Annotated[int, typer.Option(help="dimension of the sparse linear model")] = 100_000,
    nonzeros: Annotated[int, typer.Option(help="non-zero features per example")] = 16,
    examples: Annotated[int, typer.Option(help="synthetic training examples")] = 20_000,
    steps: Annotated[int, typer.Option(help="SGD updates per worker")] = 20_000,
    lr: Annotated[float, typer.Option(help="learning rate")] = 0.5,
    seed: Annotated[int, typer.Option(help="seed of data and sampling")] = 0,
) -> None:
    """Train a sparse logistic-regression model with lock-free Hogwild workers; print JSON."""
    from polytrain.ps.hogwild import HogwildConfig, run_hogwild

    cfg = HogwildConfig(
        workers=workers,
        nnodes=nnodes,
        features=features,
        nonzeros=nonzeros,
        examples=examples,
        steps=steps,
        lr=lr,
        seed=seed,
    )
    result = run_hogwild(cfg)
    summary = {
        "workers": workers,
        "initial_loss": result.initial_loss,
        "loss": result.loss,
        "updates": result.updates,
        "wall_s": result.wall_s,
        "updates_per_s": result.updates_per_s,
    }
    print(json.dumps(summary))
