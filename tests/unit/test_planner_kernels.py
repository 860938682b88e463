"""[Note: attention kernels] and [Note: cold operands]: attention counted per call on every
device and priced at its own calibrated rate on a CPU host; Linears at the cold-operand rates;
an accelerator and old profiles priced as before."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from polytrain.config.job import JobConfig, ModelConfig
from polytrain.measure.kernels import AttentionCounter, attention_rates, gemm_rates
from polytrain.measure.stats import model_stats
from polytrain.planner.cluster import parse_cluster
from polytrain.planner.cost.common import Env
from polytrain.planner.cost.rates import grid_rate
from polytrain.planner.types import BlockStats
from tests.helpers.planner import cpu_profile

# (T, D) -> (forward, backward) FLOP/s: 1 and 0.5 GFLOP/s at (64, 32), faster elsewhere
GRID = {
    (64, 32): (1e9, 0.5e9),
    (64, 128): (4e9, 2e9),
    (256, 32): (4e9, 2e9),
    (256, 128): (8e9, 8e9),
}


def _block(
    attention: tuple[tuple[int, int, int, float], ...] = (), counted: float = 0.0
) -> BlockStats:
    # 1 GFLOP of 128-wide Linears per sample, plus whatever attention was counted in fwd_flops
    return BlockStats(
        "b",
        0,
        0,
        1e9 + counted,
        0.0,
        0.0,
        linears=((128, 128),),
        attention=attention,
        attention_counted=counted,
    )


def test_the_counter_records_each_attention_call_and_what_the_flop_counter_saw() -> None:
    from torch.utils.flop_counter import FlopCounterMode

    q = torch.randn(2, 4, 16, 8)
    with FlopCounterMode(display=False) as flops, AttentionCounter(flops) as counter:
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
        torch.ones(3) + 1  # not attention
    assert counter.calls == [(16, 16, 8, 4.0 * 8 * 16 * 16 * 8)]
    assert counter.counted == flops.get_total_flops()  # all of it was the attention


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_an_attention_call_counts_as_one_operator_moving_nothing_on_any_device(device: str) -> None:
    from polytrain.measure.stats import OpCounter

    q = torch.randn(2, 4, 16, 8, device=device)
    ops = OpCounter()
    with ops, AttentionCounter(None, ops):
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert (ops.ops, ops.moved, ops.elementwise) == (1, 0.0, {})
    with ops, AttentionCounter(None, ops):
        torch.softmax(q, -1)  # not attention: counted as it runs
    assert ops.ops == 2 and ops.moved > 0 and "aten._softmax" in ops.elementwise


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_model_stats_count_gpt_attention_alike_on_meta_and_cpu(device: str) -> None:
    job = JobConfig(model=ModelConfig(name="gpt", n_layer=1, n_embd=32, n_head=2, block_size=16))
    stats = model_stats(job, device=device)
    (block,) = [b for b in stats.blocks if b.attention]
    assert block.attention == ((16, 16, 16, 4.0 * 2 * 16 * 16 * 16),)
    # meta decomposes attention into bmm's the FLOP counter sees; CPU's fused kernel it does not
    assert block.attention_counted == (
        pytest.approx(4.0 * 2 * 16 * 16 * 16) if device == "meta" else 0.0
    )


def test_grid_rate_interpolates_in_log_log_and_clamps() -> None:
    fwd = {key: pair[0] for key, pair in GRID.items()}
    assert grid_rate(fwd, 64, 32) == pytest.approx(1e9)
    assert grid_rate(fwd, 128, 32) == pytest.approx(2e9)  # halfway in log T: sqrt(1 * 4)
    assert grid_rate(fwd, 128, 64) == pytest.approx((1e9 * 4e9 * 4e9 * 8e9) ** 0.25)
    assert grid_rate(fwd, 16, 8) == pytest.approx(1e9)  # clamped below
    assert grid_rate(fwd, 4096, 4096) == pytest.approx(8e9)
    assert grid_rate({(64, 32): 3e9}, 100, 100) == pytest.approx(3e9)  # one point


def test_cpu_attention_is_priced_at_its_calibrated_rate_forward_and_backward() -> None:
    prof = cpu_profile(attention_rates=GRID)
    env = Env(parse_cluster("1x1xcpu"), profile=prof)
    plain = Env(parse_cluster("1x1xcpu"), profile=cpu_profile())
    att = ((64, 64, 32, 1e8),)  # 0.1 GFLOP per sample at (64, 32)
    base_f, base_b = env.fwd_s(_block(), 2), env.bwd_s(_block(), 2)
    assert env.fwd_s(_block(att), 2) - base_f == pytest.approx(2 * 1e8 / 1e9)
    assert env.bwd_s(_block(att), 2) - base_b == pytest.approx(2 * 2e8 / 0.5e9)
    # counted inside fwd_flops (meta): the same price, not twice
    assert env.fwd_s(_block(att, counted=1e8), 2) == pytest.approx(env.fwd_s(_block(att), 2))
    # no rates calibrated: at the matmul rate (10 GFLOP/s), which the fused kernel never had
    assert plain.fwd_s(_block(att), 2) - plain.fwd_s(_block(), 2) == pytest.approx(2e8 / 10e9)
    # tensor parallel splits the heads
    assert env.fwd_s(_block(att), 2, tp=2) - env.fwd_s(_block(), 2, tp=2) == pytest.approx(
        1e8 / 1e9
    )


def test_shared_cores_slow_attention_like_the_matmuls() -> None:
    prof = cpu_profile(attention_rates=GRID)
    alone = Env(parse_cluster("1x1xcpu"), profile=prof)
    four = Env(parse_cluster("1x4xcpu"), profile=prof)
    att = ((64, 64, 32, 1e8),)
    extra = four.fwd_s(_block(att), 1) - four.fwd_s(_block(), 1)
    assert extra == pytest.approx((alone.fwd_s(_block(att), 1) - alone.fwd_s(_block(), 1)) * 5)


def test_an_accelerator_keeps_its_flop_count() -> None:
    from polytrain.planner.types import HostProfile

    gpu = HostProfile(
        "g", "H100", {"fp32": 50e12}, 3e12, attention_rates=GRID, gemm_by_size={128: 1e9}
    )
    env = Env(parse_cluster("1x1xh100"), profile=gpu)
    att = ((64, 64, 32, 1e8),)
    assert env.fwd_s(_block(att, counted=1e8), 4) == env.fwd_s(_block(counted=1e8), 4)


def test_cold_operand_rates_price_the_cpu_linears_in_fp32() -> None:
    by_size = {"fp32": {128: 9e9, 1024: 10e9}, "bf16": {128: 20e9, 1024: 20e9}}
    cube = Env(parse_cluster("1x1xcpu"), profile=cpu_profile(matmul_by_size=by_size))
    cold = Env(
        parse_cluster("1x1xcpu"),
        profile=cpu_profile(matmul_by_size=by_size, gemm_by_size={128: 6e9, 1024: 8e9}),
    )
    assert cube.matmul_rate(_block()) == pytest.approx(9e9)
    assert cold.matmul_rate(_block()) == pytest.approx(6e9)
    # read at the block's size whatever the curve's shape (a loaded large size: slower)
    dipped = Env(
        parse_cluster("1x1xcpu"),
        profile=cpu_profile(matmul_by_size=by_size, gemm_by_size={128: 6e9, 1024: 3e9}),
    )
    assert dipped.matmul_rate(_block()) == pytest.approx(6e9)
    assert cold.fwd_s(_block(), 1) == pytest.approx(1e9 / 6e9)
    shared = Env(
        parse_cluster("1x4xcpu"),
        profile=cpu_profile(matmul_by_size=by_size, gemm_by_size={128: 6e9, 1024: 8e9}),
    )
    assert shared.matmul_rate(_block()) == pytest.approx(6e9 / 5)  # 10 -> 2 GFLOP/s at 4
    bf16 = Env(
        parse_cluster("1x1xcpu"),
        "bf16",
        cpu_profile(
            matmul_flops={"fp32": 10e9, "bf16": 20e9},
            matmul_by_size=by_size,
            gemm_by_size={128: 6e9},
        ),
    )
    assert bf16.matmul_rate(_block()) == pytest.approx(20e9)  # fp32-only figure: not used


def test_the_probes_answer_positive_rates_for_every_shape() -> None:
    gemm = gemm_rates((16, 32), 0.01, rows=64, pool_bytes=2**20)
    assert set(gemm) == {16, 32} and all(rate > 0 for rate, _ in gemm.values())
    att = attention_rates((8, 16), (8,), 0.01)
    assert set(att) == {(8, 8), (16, 8)}
    assert all(f > 0 and b > 0 for f, b, _ in att.values())


def test_the_op_counter_records_heavy_elementwise_operators_forward_and_backward() -> None:
    from polytrain.measure.stats import OpCounter

    x = torch.randn(4, 8, requires_grad=True)
    fwd, bwd = OpCounter(), OpCounter()
    with fwd:
        y = F.gelu(x) * 2.0
    with bwd:
        y.sum().backward()
    assert fwd.per_sample(2) == (("aten.gelu", 16.0, 2 * 32 * 4 / 2),)  # in + out bytes
    assert dict((op, n) for op, n, _ in bwd.per_sample(1)) == {"aten.gelu_backward": 32.0}
    assert "aten.mul" not in fwd.elementwise  # light: priced by its bytes


def test_cpu_elementwise_operators_cost_their_elements_instead_of_their_bytes() -> None:
    heavy = (("aten.gelu", 1e6, 8e6),)  # 1 M elements, 8 MB per sample
    block = BlockStats(
        "b",
        0,
        0,
        0.0,
        0.0,
        0.0,
        fwd_moved_bytes=10e6,
        bwd_moved_bytes=10e6,
        fwd_elementwise=heavy,
        bwd_elementwise=(("aten.gelu_backward", 1e6, 12e6),),
    )
    prof = cpu_profile(op_s=1e-6, elementwise_s={"aten.gelu": 1e-9})  # mem_bw 10 GB/s
    env = Env(parse_cluster("1x1xcpu"), profile=prof)
    plain = Env(parse_cluster("1x1xcpu"), profile=cpu_profile(op_s=1e-6))
    dispatch = block.fwd_ops * 1e-6
    assert plain.fwd_s(block, 2) == pytest.approx(dispatch + 20e6 / 1e10)
    assert env.fwd_s(block, 2) == pytest.approx(dispatch + 4e6 / 1e10 + 2e6 * 1e-9)
    # an operator the profile did not time keeps its bytes
    assert env.bwd_s(block, 2) == pytest.approx(plain.bwd_s(block, 2))
    # an accelerator: as before
    gpu = Env(parse_cluster("1x1xh100"), profile=replace(prof, device="H100"))
    gpu_plain = Env(parse_cluster("1x1xh100"), profile=replace(plain.profile, device="H100"))
    assert gpu.fwd_s(block, 2) == gpu_plain.fwd_s(block, 2)


def test_the_elementwise_probe_times_every_named_operator() -> None:
    from polytrain.measure.kernels import ELEMENTWISE, elementwise_seconds

    seconds = elementwise_seconds(0.005, side=64)
    assert set(seconds) == ELEMENTWISE and all(s > 0 for s, _ in seconds.values())


def test_each_elementwise_probe_runs_the_operator_it_is_named_for() -> None:
    """The names `OpCounter` matches are the operators the probes time (the softmax family
    reached through its public functions)."""
    from polytrain.measure.kernels import _elementwise_probes
    from polytrain.measure.stats import OpCounter

    for name, probe in _elementwise_probes(torch.randn(8, 8)).items():
        counter = OpCounter()
        with counter:
            probe()
        assert name in counter.elementwise, name
