"""Pipelines reproduce the single-process run parameter by parameter (contract 1).

GPipe and 1F1B at pp 2 and 4 with 1, 4 and 8 micro-batches, dp 2 x pp 2, a GPT case,
recomputation, accumulation and global-norm clipping; PipeDream's weight stashing is checked
against a sequential emulation of its semantics. Jobs of one world size share one set of
processes (spawning dominates the cost of these tiny jobs).
"""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest
import torch

from polytrain.config import JobConfig
from polytrain.data.datasets import build_datasets
from polytrain.models.registry import block_size_of, build_model
from polytrain.testing import assert_state_close, run_distributed
from tests.conftest import small_job

pytestmark = pytest.mark.slow

# mlp n_layer 4: [TokenEmbedding, Dense x 4, Output] = 6 blocks, enough for 4 stages.
MLP: dict[str, Any] = {"name": "mlp", "n_layer": 4}
GPT: dict[str, Any] = {"name": "gpt", "n_layer": 2, "n_embd": 32, "n_head": 2, "block_size": 16}
CLIP: dict[str, Any] = {"grad_clip": 0.05}  # below the gradient norm: clipping is active
ADAM: dict[str, Any] = {"name": "adamw", "lr": 0.01}


def _train_jobs(rank: int, world_size: int, jobs: list[JobConfig]) -> list[dict[str, Any]] | None:
    from polytrain.trainer.loop import train

    results = []
    for job in jobs:
        result = train(job)
        results.append(
            {
                "state": result.state_dict,
                "losses": [r["loss"] for r in result.history],
                "history": result.history,
                "steps": [r["step"] for r in result.history],
                "val_loss": result.val_loss,
                "strategy": result.strategy,
            }
        )
    return results if rank == 0 else None


def run_jobs(jobs: list[JobConfig], timeout_s: float = 240.0) -> list[dict[str, Any]]:
    world = jobs[0].world_size
    assert all(job.world_size == world for job in jobs)
    out = run_distributed(_train_jobs, world, jobs, timeout_s=timeout_s)[0]
    assert out is not None
    return out


def pipe(model: dict[str, Any], schedule: str, pp: int, m: int, **sections: Any) -> JobConfig:
    parallel = {"pp": pp, **sections.pop("parallel", {})}
    pipeline = {"schedule": schedule, "microbatches": m, **sections.pop("pipeline", {})}
    nproc = pp * parallel.get("dp", 1)
    return small_job(
        model=model, parallel=parallel, pipeline=pipeline, launch={"nproc": nproc}, **sections
    )


REFERENCES = {
    "mlp": small_job(model=MLP),
    "gpt": small_job(model=GPT),
    "mlp-clip": small_job(model=MLP, optim=CLIP),
    "mlp-adam": small_job(model=MLP, optim=ADAM),
}
CASES: dict[str, tuple[str, JobConfig]] = {
    "gpipe-pp2-m1": ("mlp", pipe(MLP, "gpipe", 2, 1)),
    "gpipe-pp2-m4": ("mlp", pipe(MLP, "gpipe", 2, 4)),
    "1f1b-pp2-m8": ("mlp", pipe(MLP, "1f1b", 2, 8)),
    "1f1b-pp2-m4-recompute": ("mlp", pipe(MLP, "1f1b", 2, 4, parallel={"recompute": True})),
    "1f1b-pp2-m2-accum2": ("mlp", pipe(MLP, "1f1b", 2, 2, train={"grad_accum": 2})),
    "1f1b-pp2-partition-1-5": ("mlp", pipe(MLP, "1f1b", 2, 4, pipeline={"partition": [1, 5]})),
    "gpt-1f1b-pp2-m4": ("gpt", pipe(GPT, "1f1b", 2, 4)),
    "clip-1f1b-pp2-m4": ("mlp-clip", pipe(MLP, "1f1b", 2, 4, optim=CLIP)),
    "adam-1f1b-pp2-m4": ("mlp-adam", pipe(MLP, "1f1b", 2, 4, optim=ADAM)),
    "gpipe-pp4-m8": ("mlp", pipe(MLP, "gpipe", 4, 8)),
    "1f1b-pp4-m1": ("mlp", pipe(MLP, "1f1b", 4, 1)),
    "1f1b-pp4-m4": ("mlp", pipe(MLP, "1f1b", 4, 4)),
    "gpt-gpipe-pp4-m4": ("gpt", pipe(GPT, "gpipe", 4, 4)),
    "1f1b-dp2-pp2-m4": ("mlp", pipe(MLP, "1f1b", 2, 4, parallel={"dp": 2})),
    "gpipe-dp2-pp2-m2": ("mlp", pipe(MLP, "gpipe", 2, 2, parallel={"dp": 2})),
}


@cache
def references() -> dict[str, dict[str, Any]]:
    return dict(zip(REFERENCES, run_jobs(list(REFERENCES.values())), strict=True))


@cache
def outcomes(world: int) -> dict[str, dict[str, Any]]:
    names = [n for n, (_, job) in CASES.items() if job.world_size == world]
    return dict(zip(names, run_jobs([CASES[n][1] for n in names]), strict=True))


@pytest.mark.parametrize("case", list(CASES))
def test_matches_single_process(case: str) -> None:
    ref_name, job = CASES[case]
    out = outcomes(job.world_size)[case]
    ref = references()[ref_name]
    assert out["strategy"].startswith(f"{job.pipeline.schedule}-pp{job.parallel.pp}")
    # Adam divides by the root of tiny second moments, which magnifies reassociation noise:
    # plain gradient accumulation (grad_accum 4, one process) moves this job by 5.1e-5 too.
    atol = 1e-4 if ref_name == "mlp-adam" else 1e-5
    assert_state_close(out["state"], ref["state"], atol=atol)
    assert out["losses"] == pytest.approx(ref["losses"], abs=1e-5)
    assert out["val_loss"] == pytest.approx(ref["val_loss"], abs=1e-5)  # forward-only pipeline


def test_parity_is_not_vacuous() -> None:
    """Training moved the weights, and clipping changed the result."""
    job = REFERENCES["mlp"]
    _, _, spec = build_datasets(job.data, block_size_of(job.model))
    init = build_model(job.model, spec, job.train.seed).state_dict()
    ref = references()["mlp"]
    assert max(float((ref["state"][k] - init[k]).abs().max()) for k in init) > 1e-3
    assert torch.isfinite(torch.tensor(ref["losses"])).all()
    with pytest.raises(AssertionError):
        assert_state_close(references()["mlp-clip"]["state"], ref["state"], atol=1e-4)


# -- PipeDream: weight stashing -----------------------------------------------------------------


def _pipedream_rank(rank: int, world_size: int, jobs: list[JobConfig]) -> list[dict[str, Any]]:
    """Train each job through the strategy directly, to read the stage's stash record."""
    from polytrain.comm.init import init_distributed
    from polytrain.core.optim import lr_at
    from polytrain.core.strategy import step_result
    from polytrain.pipeline.pipedream import PipeDreamStrategy
    from tests.helpers.strategies import job_strategy

    ctx = init_distributed()
    outs = []
    for job in jobs:
        strategy = job_strategy(job, ctx)
        assert isinstance(strategy, PipeDreamStrategy)
        losses, val_losses = [], []
        for step in range(job.train.steps):
            strategy.set_lr(lr_at(step, job.optim, job.train.steps))
            losses.append(step_result(strategy.train_step(step)).loss)
            # Evaluate mid-stream: micro-batches are in flight between steps, on another group.
            val_losses.append(strategy.evaluate(1))
        stash = strategy.stash
        outs.append(
            {
                "state": strategy.full_state_dict(),
                "losses": losses,
                "val_losses": val_losses,
                "stage": strategy.stage_index,
                "log": stash.log,
                "max_stashed": stash.max_stashed,
                "bound": stash.bound,
                "left": len(stash.snapshots),
            }
        )
    return outs


def emulate_pipedream(
    job: JobConfig, update_every: int, *, stale: bool = True
) -> dict[str, torch.Tensor]:
    """PipeDream's semantics, run sequentially in one process.

    Micro-batch ``g`` runs forward and backward through stage ``s`` on the weights stage ``s``
    had after ``weight_version(s, g, p, u)`` updates; every ``u`` micro-batches each stage
    applies the mean of their gradients. No pipeline, no stash: the bookkeeping is an explicit
    list of every version of every stage. ``stale=False`` uses the newest version instead
    (what a pipeline without stashing and staleness, a synchronous one, would compute).
    """
    from polytrain.core.optim import build_optimizer, lr_at
    from polytrain.data.sampler import Batches
    from polytrain.pipeline.partition import block_ranges, uniform_counts
    from polytrain.pipeline.schedule import weight_version
    from polytrain.pipeline.stage import build_stage

    train_set, val_set, spec = build_datasets(job.data, block_size_of(job.model))
    batches = Batches(train_set, val_set, job.train.global_batch_size, job.train.seed)
    model = build_model(job.model, spec, job.train.seed)
    p, m, steps = job.parallel.pp, job.pipeline.microbatches, job.train.steps
    ranges = block_ranges(uniform_counts(model.num_blocks, p))
    stages = [build_stage(model, a, b) for a, b in ranges]
    optimizers = [build_optimizer(stage.parameters(), job.optim) for stage in stages]
    history = [[{n: t.detach().clone() for n, t in st.named_parameters()}] for st in stages]
    for g in range(steps * m):
        step, j = divmod(g, m)
        x, y = batches.train(step, 0, 1, j, m)
        versions = [
            weight_version(s, g, p, update_every) if stale else g // update_every for s in range(p)
        ]
        weights = [
            {n: t.clone().requires_grad_() for n, t in history[s][v].items()}
            for s, v in enumerate(versions)
        ]
        h = x
        for stage, w in zip(stages, weights, strict=True):
            h = stage(h, w)
        leaves = [t for w in weights for t in w.values()]
        grads = iter(torch.autograd.grad(model.loss(h, y) / update_every, leaves))
        for s, (stage, opt) in enumerate(zip(stages, optimizers, strict=True)):
            for param in stage.parameters():
                grad = next(grads)
                param.grad = grad if param.grad is None else param.grad + grad
            if (g + 1) % update_every:
                continue
            for group in opt.param_groups:
                group["lr"] = lr_at(step, job.optim, steps)
            opt.step()
            opt.zero_grad(set_to_none=True)
            history[s].append({n: t.detach().clone() for n, t in stage.named_parameters()})
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_pipedream_weight_stashing() -> None:
    """Every backward used its forward's stashed version; the stash stayed within its bound;
    the weights equal the sequential emulation (a backward on the live weights would not).
    Both update rules: after every micro-batch (PipeDream) and once per step (PipeDream-2BW)."""
    from polytrain.pipeline.schedule import stash_bound, weight_version

    p, m, steps = 3, 4, 4
    modes = {"microbatch": 1, "step": m}
    # A large step, so that one version of staleness moves the weights by >= 2e-4 (1e-5 tol).
    sections: dict[str, Any] = {"train": {"steps": steps}, "optim": {"lr": 0.5}}
    jobs = [
        pipe(MLP, "pipedream", p, m, pipeline={"pipedream_update": mode}, **sections)
        for mode in modes
    ]
    results = run_distributed(_pipedream_rank, p, jobs, timeout_s=180.0)
    # Per-micro-batch updates: each version in flight is copied, p - s on stage s (the bound)
    # except the last stage; once per step: one copy, for the step's first p - 1 - s.
    copies = {1: [3, 2, 0], m: [1, 1, 0]}
    for n, u in enumerate(modes.values()):
        for rank_results in results:
            out = rank_results[n]
            s = out["stage"]
            assert [i for i, _, _ in out["log"]] == list(range(steps * m))  # backward order
            for i, forward_version, backward_version in out["log"]:
                assert forward_version == backward_version == weight_version(s, i, p, u)
            assert out["bound"] == stash_bound(s, p, u) <= p - s
            # Copies only for micro-batches that cross an update ([Note: live forwards]): none
            # on the last stage, never more than the bound.
            assert out["max_stashed"] == copies[u][s] <= out["bound"]
            assert out["left"] == 0  # the stream drained: nothing stashed at the end
            assert out["val_losses"] == results[0][n]["val_losses"]  # on every rank
        expected = emulate_pipedream(jobs[n], u)
        assert_state_close(results[0][n]["state"], expected, atol=1e-5)
        fresh = emulate_pipedream(jobs[n], u, stale=False)  # the stash and staleness matter
        with pytest.raises(AssertionError):
            assert_state_close(results[0][n]["state"], fresh, atol=1e-4)


def test_pipedream_dp2_pp2_with_recompute_and_evaluation() -> None:
    """dp x pp PipeDream (dp all-reduce after every update), evaluating between steps while
    micro-batches are in flight; recomputation on stashed weights changes nothing."""
    common: dict[str, Any] = {"train": {"steps": 6, "eval_every": 2}}
    plain, recomputed = run_jobs(
        [
            pipe(MLP, "pipedream", 2, 4, parallel={"dp": 2}, **common),
            pipe(MLP, "pipedream", 2, 4, parallel={"dp": 2, "recompute": True}, **common),
        ]
    )
    assert plain["strategy"] == "pipedream-pp2-m4-dp2"
    assert_state_close(recomputed["state"], plain["state"], atol=1e-6)
    assert recomputed["losses"] == pytest.approx(plain["losses"], abs=1e-6)
    assert torch.isfinite(torch.tensor(plain["losses"])).all()
    assert plain["losses"][-1] < plain["losses"][0]


def test_pipedream_loop_reads_each_step_after_the_next_has_started() -> None:
    """The loop finishes a PipeDream step (its loss all-reduce) only after starting the next one
    ([Note: deferred step results]); every step's record still gets that step's own loss."""
    job = pipe(MLP, "pipedream", 2, 4, train={"steps": 5})
    (looped,) = run_jobs([job])
    direct = run_distributed(_pipedream_rank, 2, [job], timeout_s=180.0)[0][0]["losses"]
    assert looped["steps"] == [1, 2, 3, 4, 5]
    assert looped["losses"] == pytest.approx(direct, abs=1e-6)
    assert len(set(direct)) == 5  # distinct per step: a shifted record could not pass
