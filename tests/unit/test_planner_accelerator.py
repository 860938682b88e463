"""A calibrated GPU host: its matmul rate read at the matmul's size, asynchronous dispatch, and
which clusters its profile describes (pure, milliseconds)."""

from __future__ import annotations

import math

import pytest

from polytrain.measure.host import describes
from polytrain.planner.catalog import device_key_of
from polytrain.planner.cluster import parse_cluster
from polytrain.planner.cost import Env
from polytrain.planner.types import BlockStats, HostProfile

# An H100-like profile: bf16 rate rises with the matmul's size; 16 us per operator dispatch.
GPU = HostProfile(
    fingerprint="test",
    device="NVIDIA H100 80GB HBM3",
    matmul_flops={"bf16": 700e12},
    matmul_by_size={"bf16": {512: 10e12, 4096: 700e12}},
    mem_bw=3e12,
    op_s=16e-6,
)
BLOCK = BlockStats(
    name="blocks.0",
    params=512 * 512,
    param_bytes=4 * 512 * 512,
    fwd_flops=2.0 * 512 * 512 * 64,  # one 512x512 Linear over 64 rows per sample
    saved_bytes=0.0,
    output_bytes=0.0,
    linears=((512, 512),),
    rows_per_sample=64,
    fwd_ops=5,
    bwd_ops=10,
)


def test_gpu_matmul_rate_is_read_at_the_equal_flops_cube() -> None:
    """[Note: matmul size] on an accelerator: (rows x fan_in x fan_out)^(1/3), so more rows
    run faster; 8 samples x 64 rows x 512 x 512 is a 512-cube, 512 samples a 2048-cube."""
    env = Env(parse_cluster("1x1xH100"), "bf16", GPU)
    assert env.matmul_rate(BLOCK, 8 * 64) == pytest.approx(10e12)
    big = env.matmul_rate(BLOCK, 512 * 64)
    # log-log halfway-and-more between 512 (10 T) and 4096 (700 T): 2048 is 2/3 of the way
    assert big == pytest.approx(math.exp(math.log(10e12) / 3 + 2 * math.log(700e12) / 3))
    assert env.matmul_rate(BLOCK) == 700e12  # rows unknown: the largest calibrated size


def test_gpu_block_takes_the_longer_of_dispatch_and_device_work() -> None:
    """[Note: asynchronous devices]: few samples are dispatch-bound (ops x op_s), many samples
    device-bound (matmuls + bytes), never the sum as on a CPU."""
    env = Env(parse_cluster("1x1xH100"), "bf16", GPU)
    assert env.fwd_s(BLOCK, 1) == pytest.approx(5 * 16e-6)  # 80 us of dispatch
    samples = 4096
    device = BLOCK.fwd_flops * samples / env.matmul_rate(BLOCK, samples * 64)
    assert device > 5 * 16e-6
    assert env.fwd_s(BLOCK, samples) == pytest.approx(device)
    cpu = HostProfile(
        fingerprint="t", device="cpu", matmul_flops={"fp32": 1e11}, mem_bw=1e10, op_s=4e-6
    )
    on_cpu = Env(parse_cluster("1x1xcpu"), "fp32", cpu)
    matmul = BLOCK.fwd_flops / 1e11
    assert on_cpu.fwd_s(BLOCK, 1) == pytest.approx(matmul + 5 * 4e-6)  # the sum


def test_a_profile_describes_its_own_device_only() -> None:
    assert describes(GPU, "H100")
    assert not describes(GPU, "H200") and not describes(GPU, "cpu")
    cpu = HostProfile(fingerprint="t", device="cpu", matmul_flops={}, mem_bw=0.0)
    assert describes(cpu, "cpu") and not describes(cpu, "H100")


def test_the_catalog_key_of_a_gpu_name() -> None:
    """What `--strategy auto`, `profile_for` and the GPU benchmark read off torch's name."""
    assert device_key_of("NVIDIA H100 80GB HBM3") == "H100"
    assert device_key_of("NVIDIA H200") == "H200"
    assert device_key_of("NVIDIA GeForce RTX 4090") is None
