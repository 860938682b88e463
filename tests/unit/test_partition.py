"""Pipeline partitioning: the DP search against brute force, the memory model, bad input, profiles."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch

from polytrain.data.datasets import DataSpec
from polytrain.errors import PartitionError
from polytrain.models.mlp import build_mlp
from polytrain.pipeline.partition import (
    BlockProfile,
    all_partitions,
    block_ranges,
    brute_force_partition,
    check_counts,
    evaluate_partition,
    in_flight_microbatches,
    nearby_partitions,
    optimizer_state_factor,
    search_partition,
    uniform_counts,
)
from polytrain.pipeline.profile import choose_partition, profile_blocks
from tests.conftest import small_job
from tests.helpers.models import timed_blocks

SCHEDULES = ("gpipe", "1f1b", "pipedream")


def block(
    time_s: float = 1.0,
    params: int = 10,
    activation: int = 100,
    output: int = 10,
    input_bytes: int = 10,
    update_s: float = 0.0,
) -> BlockProfile:
    return BlockProfile(
        forward_s=time_s / 3,
        backward_s=2 * time_s / 3,
        param_count=params,
        param_bytes=4 * params,
        grad_bytes=4 * params,
        optimizer_bytes=8 * params,
        activation_bytes=activation,
        input_bytes=input_bytes,
        output_bytes=output,
        update_s=update_s,
    )


def random_profiles(rng: random.Random, n: int) -> list[BlockProfile]:
    return [
        block(
            time_s=rng.uniform(0.1, 5.0),
            params=rng.randint(0, 500),
            activation=rng.randint(0, 2000),
            output=rng.randint(1, 300),
            input_bytes=rng.randint(1, 300),
            update_s=rng.choice([0.0, rng.uniform(0.0, 3.0)]),
        )
        for _ in range(n)
    ]


# -- the search ------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(40))
def test_dp_matches_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(1, 9)
    p = rng.randint(1, min(n, 5))
    m = rng.randint(1, 6)
    schedule = rng.choice(SCHEDULES)
    recompute = rng.random() < 0.3
    link = rng.choice([None, 1000.0])
    update_every = rng.randint(1, 4)
    profiles = random_profiles(rng, n)
    unlimited = brute_force_partition(
        profiles,
        p,
        schedule=schedule,
        num_microbatches=m,
        memory_limit_bytes=None,
        recompute=recompute,
        link_bytes_per_s=link,
        update_every=update_every,
    )
    assert unlimited is not None
    # a limit between the leanest and the largest stage memory makes some partitions infeasible
    limit = rng.uniform(0.6, 1.1) * max(unlimited.stage_memory_bytes)
    kwargs = {
        "schedule": schedule,
        "num_microbatches": m,
        "memory_limit_bytes": limit,
        "recompute": recompute,
        "link_bytes_per_s": link,
        "update_every": update_every,
    }
    best = brute_force_partition(profiles, p, **kwargs)  # type: ignore[arg-type]
    if best is None:
        with pytest.raises(PartitionError, match="no .*-stage partition fits"):
            search_partition(profiles, p, **kwargs)  # type: ignore[arg-type]
        return
    found = search_partition(profiles, p, **kwargs)  # type: ignore[arg-type]
    assert found.bottleneck_s == pytest.approx(best.bottleneck_s, rel=1e-12)
    assert max(found.stage_memory_bytes) <= limit
    assert sum(found.counts) == n and len(found.counts) == p and min(found.counts) >= 1
    # the result's numbers are those of evaluating its counts
    again = evaluate_partition(profiles, found.counts, **kwargs)  # type: ignore[arg-type]
    assert again.stage_time_s == found.stage_time_s
    assert again.stage_memory_bytes == found.stage_memory_bytes


def test_balances_an_unbalanced_model() -> None:
    profiles = [block(t) for t in (1, 1, 1, 1, 8, 1, 1, 1)]
    result = search_partition(
        profiles, 3, schedule="1f1b", num_microbatches=4, memory_limit_bytes=None
    )
    assert result.counts == [4, 1, 3]
    assert result.bottleneck_s == pytest.approx(8.0)
    uniform = evaluate_partition(
        profiles, uniform_counts(8, 3), schedule="1f1b", num_microbatches=4
    )
    assert uniform.bottleneck_s > result.bottleneck_s


def test_ties_prefer_the_most_even_partition() -> None:
    # block 0 alone sets the bottleneck (9); every split of the other 8 ties on it, and the
    # even one leaves the most slack for profile error
    profiles = [block(9.0)] + [block(1.0) for _ in range(8)]
    result = search_partition(
        profiles, 3, schedule="1f1b", num_microbatches=4, memory_limit_bytes=None
    )
    assert result.counts == [1, 4, 4]
    assert result.stage_time_s == pytest.approx([9.0, 4.0, 4.0])


def test_memory_limit_moves_blocks_off_the_first_stage() -> None:
    # equal times; with gpipe and 8 micro-batches activations dominate, and stage 0 of 1f1b
    # holds 2 micro-batches against stage 1's 1, so a tight limit shrinks stage 0
    profiles = [block(1.0, params=0, activation=1000, output=0) for _ in range(6)]
    free = search_partition(
        profiles, 2, schedule="1f1b", num_microbatches=8, memory_limit_bytes=None
    )
    assert free.counts == [3, 3]
    assert free.stage_memory_bytes == [6000, 3000]
    tight = search_partition(
        profiles, 2, schedule="1f1b", num_microbatches=8, memory_limit_bytes=4000
    )
    assert tight.counts == [2, 4]
    assert max(tight.stage_memory_bytes) <= 4000


def test_update_is_spread_over_the_microbatches() -> None:
    # the optimizer update runs once per step: with 4 micro-batches each carries a quarter
    profiles = [block(1.0, update_s=4.0), block(1.0), block(1.0)]
    one = evaluate_partition(profiles, [1, 2], schedule="1f1b", num_microbatches=4)
    assert one.stage_time_s == pytest.approx([2.0, 2.0])
    best = search_partition(
        [block(1.0, update_s=8.0), block(1.0), block(1.0), block(1.0)],
        2,
        schedule="gpipe",
        num_microbatches=2,
        memory_limit_bytes=None,
    )
    assert best.counts == [1, 3]  # 1 + 8 / 2 = 5 against 3, not [2, 2]'s 6 against 2


def test_in_flight_per_schedule() -> None:
    assert in_flight_microbatches("gpipe", 4, 8) == [8, 8, 8, 8]
    assert in_flight_microbatches("1f1b", 4, 8) == [4, 3, 2, 1]
    assert in_flight_microbatches("1f1b", 4, 2) == [2, 2, 2, 1]
    assert in_flight_microbatches("pipedream", 4, 2) == [4, 3, 2, 1]


def test_memory_model_counts_state_activations_and_stash() -> None:
    profiles = [block(1.0, params=10, activation=100, output=7) for _ in range(4)]
    one = evaluate_partition(profiles, [2, 2], schedule="gpipe", num_microbatches=3)
    # params 40 + grads 40 + adam 80 per block; 3 in flight x (200 saved + 7 output)
    assert one.stage_memory_bytes[0] == 2 * 160 + 3 * (200 + 7)
    assert one.stage_memory_bytes[1] == 2 * 160 + 3 * 200  # the last stage sends no output
    # pipedream, an update per micro-batch: p - s in flight and p - s stashed copies (live too)
    stash = evaluate_partition(profiles, [2, 2], schedule="pipedream", num_microbatches=1)
    assert stash.stage_memory_bytes[0] == 2 * 160 + 2 * 207 + 2 * 80
    assert stash.stage_memory_bytes[1] == 2 * 160 + 1 * 200 + 1 * 80
    # an update per step of 4 micro-batches: stage 0 of 4 stashes ceil(3 / 4) + 1 = 2 copies
    four = evaluate_partition(
        profiles, [1, 1, 1, 1], schedule="pipedream", num_microbatches=4, update_every=4
    )
    assert four.stage_memory_bytes[0] == 160 + 4 * (100 + 7) + 2 * 40
    recompute = evaluate_partition(
        profiles, [2, 2], schedule="gpipe", num_microbatches=3, recompute=True
    )
    # inputs (10 each) + output kept per micro-batch, one block's activations rebuilt at a time
    assert recompute.stage_memory_bytes[0] == 2 * 160 + 3 * (20 + 7) + 100
    assert recompute.stage_time_s[0] == pytest.approx(2 * (2 / 3 + 2 / 3))
    # recompute = "every:2": blocks 0 and 2 keep their inputs, blocks 1 and 3 their activations
    every2 = evaluate_partition(
        profiles, [2, 2], schedule="gpipe", num_microbatches=3, recompute=True, recompute_every=2
    )
    assert every2.stage_memory_bytes[0] == 2 * 160 + 3 * (10 + 100 + 7) + 100
    assert every2.stage_time_s[0] == pytest.approx((2 / 3 + 2 / 3) + (1 / 3 + 2 / 3))


def test_infeasible_names_the_stage_and_the_fix() -> None:
    profiles = [block(1.0, params=1000, activation=10) for _ in range(3)]
    with pytest.raises(PartitionError) as err:
        search_partition(
            profiles, 3, schedule="gpipe", num_microbatches=2, memory_limit_bytes=1024.0
        )
    message = str(err.value)
    assert "stage 0 (blocks 0-0)" in message
    assert "memory_limit_mb = 0.000976562 (1.0 KiB)" in message
    assert "needs 15.7 KiB on stage 0" in message  # 16000 B of state + 2 x (10 + 10) B
    for fix in ("--pp", "--recompute", "--microbatches", "memory_limit_mb"):
        assert fix in message
    assert "\n" not in message


def test_table_lists_every_stage() -> None:
    profiles = [block(0.001 * (i + 1), params=1000 * (i + 1)) for i in range(5)]
    result = search_partition(
        profiles, 2, schedule="1f1b", num_microbatches=4, memory_limit_bytes=None
    )
    table = result.table()
    lines = table.splitlines()
    assert len(lines) == 2 + 2
    assert "peak mem (MiB)" in lines[1]
    first, stop = result.block_ranges()[1]  # half-open, as everywhere
    assert f"{first}-{stop - 1}" in lines[3]
    assert block_ranges([2, 1, 3]) == [(0, 2), (2, 3), (3, 6)]
    assert f"{result.stage_params[0]:,}" in lines[2]


# -- uniform and explicit counts -------------------------------------------------------------


def test_uniform_counts() -> None:
    assert uniform_counts(6, 2) == [3, 3]
    assert uniform_counts(7, 3) == [3, 2, 2]
    assert uniform_counts(5, 5) == [1] * 5
    assert uniform_counts(10, 4) == [3, 3, 2, 2]
    with pytest.raises(PartitionError, match="only 3 blocks"):
        uniform_counts(3, 4)


def test_all_partitions_counts() -> None:
    found = list(all_partitions(6, 3))
    assert len(found) == 10  # C(5, 2)
    assert all(sum(c) == 6 and min(c) >= 1 for c in found)


def test_check_counts_errors() -> None:
    assert check_counts([2, 4], 6, 2) == [2, 4]
    with pytest.raises(
        PartitionError,
        match=r"pipeline.partition = \[3, 4\] sums to 7 but the model has 6 blocks: "
        r"give counts that sum to 6",
    ):
        check_counts([3, 4], 6, 2)
    with pytest.raises(PartitionError, match="has 3 stage.* parallel.pp = 2"):
        check_counts([2, 2, 2], 6, 2)
    with pytest.raises(PartitionError, match="at most 2 stages"):
        check_counts([1, 1, 1], 2, 3)
    with pytest.raises(PartitionError, match="at least one block"):
        check_counts([0, 6], 6, 2)


def test_optimizer_state_factor() -> None:
    assert optimizer_state_factor("adamw") == 2
    assert optimizer_state_factor("sgd", 0.9) == 1
    assert optimizer_state_factor("sgd", 0.0) == 0


# -- profiling (torch, in-process) -----------------------------------------------------------


def tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_mlp(DataSpec(kind="tokens", vocab_size=32), n_layer=3, width=64, block_size=8)


def sample(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randint(0, 32, (rows, 8), generator=gen), torch.randint(
        0, 32, (rows, 8), generator=gen
    )


def test_profile_blocks() -> None:
    model = tiny_model()
    rng = torch.get_rng_state()
    small = profile_blocks(model, sample(4), warmup=1, repeats=3)
    big = profile_blocks(model, sample(16), warmup=1, repeats=3)
    assert len(small) == model.num_blocks == 5
    for p in small:
        assert p.forward_s > 0 and p.backward_s > 0
    dense = small[1]  # Linear(128 -> 64) + GELU
    assert dense.param_count == 128 * 64 + 64
    assert dense.param_bytes == 4 * dense.param_count == dense.grad_bytes
    assert dense.optimizer_bytes == 2 * dense.param_bytes
    # Linear saves its input (4 x 128 fp32), GELU its input (4 x 64 fp32); weights excluded
    assert dense.activation_bytes == 4 * 4 * (128 + 64)
    assert dense.output_bytes == 4 * 4 * 64
    for s, b in zip(small[1:-1], big[1:-1], strict=True):  # float activations scale with rows
        assert b.activation_bytes == 4 * s.activation_bytes
        assert b.output_bytes == 4 * s.output_bytes
    # the last block includes the loss, which also saves a few row-independent bytes
    assert 3.9 * small[-1].activation_bytes < big[-1].activation_bytes
    # profiling leaves no trace: no .grad, same RNG stream
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(rng, torch.get_rng_state())
    # the meta device (pre-launch) measures the same bytes without computing anything
    with torch.device("meta"):
        meta_model = tiny_model()
    x, y = sample(4)
    meta = profile_blocks(meta_model, (x.to("meta"), y.to("meta")), warmup=0, repeats=1)
    for m, s in zip(meta, small, strict=True):
        assert (m.activation_bytes, m.output_bytes) == (s.activation_bytes, s.output_bytes)


def test_choose_partition_single_process() -> None:
    model = tiny_model()
    job = small_job(pipeline={"partition": "auto", "microbatches": 2})
    counts = choose_partition(job, model, sample(8), 2)
    assert sum(counts) == 5 and len(counts) == 2
    assert choose_partition(small_job(pipeline={"partition": [1, 4]}), model, sample(8), 2) == [
        1,
        4,
    ]
    assert choose_partition(small_job(), model, sample(8), 2) == [3, 2]
    with pytest.raises(PartitionError, match="sums to 4 but the model has 5 blocks"):
        choose_partition(small_job(pipeline={"partition": [1, 3]}), model, sample(8), 2)
    limited = small_job(pipeline={"partition": "auto", "memory_limit_mb": 0.01})
    with pytest.raises(PartitionError, match="no 2-stage partition fits"):
        choose_partition(limited, model, sample(8), 2)


def test_nearby_partitions_shift_one_boundary_fastest_first() -> None:
    profiles = [block(1.0, params=0, activation=1000, output=0) for _ in range(6)]
    kw = {"schedule": "1f1b", "num_microbatches": 8}
    # the optimum first, then one boundary moved by 1, then by 2 (slower); within the limit
    assert nearby_partitions(profiles, [3, 3], 5, **kw) == [[3, 3], [2, 4], [4, 2], [1, 5], [5, 1]]
    assert nearby_partitions(profiles, [3, 3], 2, **kw) == [[3, 3], [2, 4]]
    assert nearby_partitions(profiles, [3, 3], 1, **kw) == [[3, 3]]
    # stage 0 holds 2 micro-batches of 1000 bytes per block under 1f1b: [4, 2] and [5, 1] do not fit
    tight = nearby_partitions(profiles, [3, 3], 9, memory_limit_bytes=6000, **kw)
    assert tight == [[3, 3], [2, 4], [1, 5]]
    three = nearby_partitions(profiles, [2, 2, 2], 20, radius=1, **kw)
    assert three[0] == [2, 2, 2] and sorted(three[1:]) == [
        [1, 3, 2],
        [2, 1, 3],
        [2, 3, 1],
        [3, 1, 2],
    ]


def test_choose_partition_keeps_the_fastest_trial(one_thread: None) -> None:
    # The profile must pick the same optimum every time it runs, under any load: two 20 ms
    # blocks in the middle make [3, 3] twice as fast as any other split (22 ms per stage, not
    # 42), far above scheduler noise; a tiny real model's sub-millisecond blocks flipped. One
    # intra-op thread, as in a worker: the profile then reads CPU time ([Note: profile clock]);
    # with pytest's default threads it read the wall clock, and two CPU hogs flipped it.
    model = timed_blocks(
        DataSpec(kind="tokens", vocab_size=32), [0.001, 0.001, 0.02, 0.02, 0.001, 0.001]
    )
    job = small_job(pipeline={"partition": "auto", "microbatches": 2, "partition_trials": 3})
    seen: list[list[list[int]]] = []

    def measure(times: list[float]) -> Callable[[list[list[int]]], list[float]]:
        def run(candidates: list[list[int]]) -> list[float]:
            seen.append(candidates)
            return times[: len(candidates)]

        return run

    optimum = choose_partition(job, model, sample(8), 2)  # no measure: the profile's choice
    assert optimum == [3, 3]
    assert (
        choose_partition(job, model, sample(8), 2, measure=measure([3.0, 1.0, 2.0])) == seen[-1][1]
    )
    assert seen[-1][0] == optimum and len(seen[-1]) == 3
    # a tie keeps the profile's optimum
    assert choose_partition(job, model, sample(8), 2, measure=measure([1.0, 1.0, 1.0])) == optimum
    no_trials = small_job(pipeline={"partition": "auto", "microbatches": 2, "partition_trials": 0})
    assert choose_partition(no_trials, model, sample(8), 2, measure=measure([1.0])) == optimum
    assert len(seen) == 2  # trials = 0 never measures


# -- pre-launch checks -----------------------------------------------------------------------


def test_preflight_checks_explicit_and_auto_partitions() -> None:
    from polytrain.trainer.preflight import preflight

    two = {"parallel": {"pp": 2}, "launch": {"nproc": 2}}
    preflight(small_job(**two, pipeline={"partition": [1, 3]}))  # mlp tiny: 4 blocks
    with pytest.raises(PartitionError, match="sums to 5 but the model has 4 blocks"):
        preflight(small_job(**two, pipeline={"partition": [2, 3]}))
    with pytest.raises(PartitionError, match="has 3 stage"):
        preflight(small_job(**two, pipeline={"partition": [1, 1, 2]}))
    with pytest.raises(PartitionError, match=r"\[1, 3\] with parallel.pp = 1: the one stage"):
        preflight(small_job(pipeline={"partition": [1, 3]}))
    preflight(small_job(pipeline={"partition": [4]}))
    preflight(small_job(**two, pipeline={"partition": "auto", "memory_limit_mb": 64}))
    # memory does not depend on timing: the meta-device profile finds that nothing fits
    with pytest.raises(PartitionError, match="no 2-stage partition fits"):
        preflight(small_job(**two, pipeline={"partition": "auto", "memory_limit_mb": 0.05}))
