"""Predictions for published GPU training setups, beside the published numbers.

docs/planner.md "Published setups" prints the same table; this test reads that table and
recomputes every prediction, so the doc cannot drift (run ``python
tests/unit/test_planner_published.py`` to print the table). The target is within 15%; the
error column shows which rows miss it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from polytrain.planner.catalog import device, link
from polytrain.planner.cluster import Cluster
from polytrain.planner.cost import Env, predict
from polytrain.planner.stats_pure import transformer_stats
from polytrain.planner.types import Layout


@dataclass(frozen=True)
class Setup:
    name: str
    source: str
    cluster: Cluster
    n_layer: int
    n_embd: int
    n_head: int
    seq_len: int
    vocab: int
    batch: int
    layout: Layout
    published_tflops: float  # per GPU, as the paper counts it (with recomputation)


def _a100_selene(nodes: int) -> Cluster:
    # Selene DGX A100 80GB nodes: 8 GPUs on NVSwitch (NVLink 3), one HDR 200 Gb/s NIC per GPU
    return Cluster(nodes, 8, device("A100-80GB"), link("nvlink3"), link("ib200"), None)


def _v100_dgx2h(nodes: int) -> Cluster:
    # DGX-2H: 16 V100 on NVSwitch (NVLink 2, 150 GB/s per direction), 8 EDR 100 Gb/s NICs for
    # 16 GPUs: half an EDR link per GPU [Note: one NIC per device] in planner/cluster.py
    ib = link("ib100")
    return Cluster(
        nodes, 16, device("V100"), link("nvlink2"), replace(ib, bandwidth=ib.bandwidth / 2), None
    )


SC21 = "Narayanan et al. SC21, arXiv:2104.04473, Table 1"
SETUPS = [
    Setup("Megatron GPT 1.7B, 32 A100", SC21, _a100_selene(4), 24, 2304, 24, 2048, 51200, 512,
          Layout(dp=32, recompute=True), 137.0),
    Setup("Megatron GPT 18.4B, 256 A100 (tp 8)", SC21, _a100_selene(32), 40, 6144, 48, 2048, 51200, 1024,
          Layout(dp=32, tp=8, recompute=True), 135.0),
    Setup("Megatron GPT 39.1B, 512 A100 (tp 8, pp 2)", SC21, _a100_selene(64), 48, 8192, 64, 2048, 51200, 1536,
          Layout(dp=32, tp=8, pp=2, microbatches=48, recompute=True), 138.0),
    Setup("Megatron GPT 145.6B, 1536 A100 (tp 8, pp 8)", SC21, _a100_selene(192), 80, 12288, 96, 2048, 51200, 2304,
          Layout(dp=24, tp=8, pp=8, microbatches=96, recompute=True), 148.0),
    Setup("Megatron GPT 1T, 3072 A100 (tp 8, pp 64)", SC21, _a100_selene(384), 128, 25600, 160, 2048, 51200, 3072,
          Layout(dp=6, tp=8, pp=64, microbatches=512, recompute=True), 163.0),
    Setup("Megatron-LM 8.3B, 512 V100 (tp 8, dp 64)", "Shoeybi et al. 2019, arXiv:1909.08053, sec. 5.1: 15.1 PFLOP/s on 512 GPUs",
          _v100_dgx2h(32), 72, 3072, 32, 1024, 51200, 512, Layout(dp=64, tp=8, recompute=True), 15.1e3 / 512),
]  # fmt: skip

DOC = Path(__file__).resolve().parents[2] / "docs" / "planner.md"


def doc_rows() -> dict[str, tuple[float, float]]:
    """docs/planner.md "Published setups": setup -> (published, predicted TFLOP/s per GPU), as
    the document prints them (the test reads the document, so the two cannot drift)."""
    text = DOC.read_text()
    section = text[text.index("## Published setups") :]
    section = section[: section.index("\n## ", 1)]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0] not in ("setup", "---"):
            rows[cells[0]] = (float(cells[2]), float(cells[3]))
    return rows


def megatron_flops(s: Setup) -> float:
    """FLOPs per iteration as the papers count them (Narayanan et al. SC21, eq. 3: with
    activation recomputation): 96 B s l h^2 (1 + s / 6h + V / 16 l h)."""
    b, t, n, h, v = s.batch, s.seq_len, s.n_layer, s.n_embd, s.vocab
    return 96.0 * b * t * n * h * h * (1 + t / (6 * h) + v / (16 * n * h))


def predicted_tflops(s: Setup) -> float:
    stats = transformer_stats(
        n_layer=s.n_layer, n_embd=s.n_embd, n_head=s.n_head, seq_len=s.seq_len,
        vocab_size=s.vocab, act_bytes=2, param_bytes=2,
    )  # fmt: skip
    pred = predict(s.layout, stats, Env(s.cluster, "fp16"), s.batch)
    return megatron_flops(s) / (pred.step_s * s.layout.devices) / 1e12


def _param(s: Setup) -> object:
    # 64 stages x 512 micro-batches: a second or more of simulation, several under load
    slow = s.layout.pp * s.layout.microbatches > 10_000
    return pytest.param(s, id=s.name, marks=[pytest.mark.slow] if slow else [])


@pytest.mark.parametrize("setup", [_param(s) for s in SETUPS])
def test_prediction_matches_the_doc(setup: Setup) -> None:
    assert setup.layout.devices == setup.cluster.size
    published, predicted = doc_rows()[setup.name]
    assert published == pytest.approx(setup.published_tflops, abs=0.05)
    value = predicted_tflops(setup)
    assert value == pytest.approx(predicted, abs=0.05), "docs/planner.md is stale: rerun this file"


def test_the_doc_lists_every_setup_once() -> None:
    assert sorted(doc_rows()) == sorted(s.name for s in SETUPS)


if __name__ == "__main__":
    print("| setup | source | published TFLOP/s/GPU | predicted | error |")
    print("| --- | --- | ---: | ---: | ---: |")
    for s in SETUPS:
        v = predicted_tflops(s)
        print(
            f"| {s.name} | {s.source} | {s.published_tflops:.1f} | {v:.1f} | {v / s.published_tflops - 1:+.0%} |"
        )
