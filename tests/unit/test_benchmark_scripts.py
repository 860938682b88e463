"""The one-GPU benchmark and its CPU twin (issue 36) without a GPU: the one-line refusal, the
cases' job fields, the CLI command they build, the window medians and the plain loop."""

from __future__ import annotations

import pytest
import torch
from benchmarks.gpu import main as gpu
from benchmarks.step_overhead import main as overhead

from polytrain.config.io import job_from_fields, parse_override
from tests.helpers.devices import see_gpus


def test_gpu_script_without_cuda_exits_2_with_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu.main([]) == 2
    out = capsys.readouterr()
    assert len(out.out.splitlines()) == 1 and "no CUDA device" in out.out
    assert out.err == ""


@pytest.mark.parametrize("smoke", [False, True])
def test_gpu_cases_are_valid_jobs(smoke: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    see_gpus(monkeypatch, 1)  # the cases name train.device = "cuda"
    cases = {c.name: c for c in gpu.cases(smoke)}
    assert list(cases) == ["small", "medium", "medium-1024", "hf"]
    assert not cases["medium-1024"].eager and cases["hf"].hf
    for case in cases.values():
        job = job_from_fields(case.fields)  # every key exists and every value is valid
        assert job.train.global_batch_size == case.batch
        assert job.model.block_size == case.block
    if not smoke:
        small, medium = cases["small"], cases["medium-1024"]
        assert (small.batch, small.block, small.fields["model.n_embd"]) == (16, 512, 768)
        assert (medium.batch, medium.block, medium.fields["model.n_layer"]) == (32, 1024, 24)
        assert cases["hf"].fields["train.dtype"] == "bf16"


def test_the_cli_command_carries_every_field_as_toml() -> None:
    fields = gpu.cases()[3].fields
    cmd = overhead.polytrain_command(fields, overhead.HERE / "x", steps=40, log_every=10)
    assert cmd[1:4] == ["-m", "polytrain", "train"] and cmd[cmd.index("--nproc") + 1] == "1"
    sets = dict(
        (".".join(k), v)
        for k, v in (parse_override(cmd[i + 1]) for i, a in enumerate(cmd) if a == "--set")
    )
    assert {k: sets[k] for k in fields} == fields
    assert sets["train.eval_every"] == 0 and sets["train.sample_tokens"] == 0
    two = overhead.polytrain_command(
        {}, overhead.HERE, steps=4, log_every=1, extra=["--nproc", "2"]
    )
    assert two.count("--nproc") == 1


def test_window_median_leaves_out_the_first_two_windows() -> None:
    records = [{"step_time_s": t, "mfu": m} for t, m in [(9.0, 0.1), (5.0, 0.2), (1.0, 0.3)]]
    records += [{"step_time_s": 3.0}, {"step_time_s": 2.0}]
    assert overhead.window_median(records, "step_time_s") == 2.0
    assert overhead.window_median(records, "mfu") == 0.3  # the records that carry it
    assert overhead.window_median(records[:1], "step_time_s") == 9.0
    assert overhead.window_median([], "mfu") is None


@pytest.mark.parametrize("optimizer", overhead.OPTIMIZERS)
def test_the_plain_loop_trains_the_model_polytrain_builds(optimizer: str) -> None:
    fields = {**gpu.TINY, "model.block_size": 8, "train.global_batch_size": 2}
    model, spec = overhead.build_same_model(fields, "cpu")
    again, _ = overhead.build_same_model(fields, "cpu")
    assert all(
        torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters(), strict=True)
    )
    batches = overhead.random_batches(spec.vocab_size, 2, 8, "cpu", n=2)
    before = [p.detach().clone() for p in model.parameters()]
    times = overhead.plain_windows(
        model,
        overhead.block_loss,
        batches,
        optimizer=optimizer,
        dtype="fp32",
        windows=3,
        window_steps=2,
    )
    assert len(times) == 3 and all(t > 0 for t in times)
    assert not torch.equal(before[0], next(model.parameters()))
    assert gpu.mfu(model, 8, 2, 0.01, torch.device("cpu")) is None  # no peak known on a CPU


def test_our_gpt_is_counted_as_the_textbook_mfu(monkeypatch: pytest.MonkeyPatch) -> None:
    """`reference_mfu` (6NT + 12LdT^2) is the check of polytrain's count: for our gpt they
    agree, so a factory model's ratio to it shows whether that one is counted right."""
    import polytrain.measure.mfu

    monkeypatch.setattr(polytrain.measure.mfu, "peak_flops", lambda device, dtype: 1e12)
    case = gpu.Case("t", "t", {**gpu.TINY, "model.block_size": 8, "train.global_batch_size": 2})
    model, _ = overhead.build_same_model(case.fields, "cpu")
    params = sum(p.numel() for p in model.parameters())
    ours = gpu.mfu(model, case.block, case.batch, 0.01, torch.device("cpu"))
    # The textbook's 6N counts the embedding table as a matmul; the planner counts its lookup
    # as none: on this tiny model (a large share of its weights) that is the 8% between them.
    assert ours == pytest.approx(
        gpu.reference_mfu(case, params, 0.01, torch.device("cpu")), rel=0.1
    )
    hf = gpu.cases()[3]
    assert (hf.dim("n_layer"), hf.dim("n_embd")) == (12, 768)


def test_the_leaf_server_benchmark_runs_three_valid_layouts() -> None:
    """benchmarks/parameter_server/leaves.py: flat, per-host all-reduce + push, leaves."""
    from benchmarks.parameter_server import leaves

    spec = {"hosts": 4, "per_host": 2, "per_worker": 2, "steps": 8, "lr": 1e-3, "mode": "sync"}
    jobs = {kind: leaves._job(kind, spec, "") for kind in leaves.KINDS}
    assert all((j.world_size, j.num_trainers) == (9, 8) for j in jobs.values())
    assert (jobs["flat"].ps.hierarchical, jobs["flat"].ps.leaves) == (False, 0)
    assert jobs["allreduce-push"].ps.hierarchical and jobs["leaves"].ps.leaves == "host"
    assert leaves.time_to([(5, 1.0, 3.0), (10, 2.0, 2.5)], 2.6) == 2.0
    assert leaves.time_to([(5, 1.0, 3.0)], 2.6) is None
