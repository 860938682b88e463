"""``--grad-compression topk|sign`` from the command line: bad input is one line and exit 2."""

from __future__ import annotations

import pytest
import tomllib

from tests.helpers.cli import assert_usage_error, run_main

CASES = {
    "ratio 0": (
        ["--grad-compression", "topk", "--set", "parallel.grad_topk_ratio=0"],
        "parallel.grad_topk_ratio = 0",
    ),
    "ratio above 1": (
        ["--grad-compression", "topk", "--set", "parallel.grad_topk_ratio=1.5"],
        "parallel.grad_topk_ratio = 1.5",
    ),
    "top-k under ZeRO": (
        ["--grad-compression", "topk", "--zero", "2"],
        "ZeRO 2 (FSDP2) reduce-scatters without DDP",
    ),
    "sign under ZeRO 3": (["--grad-compression", "sign", "--zero", "3"], "'sign' is a DDP hook"),
    "sign with gossip": (
        ["--grad-compression", "sign", "--sync", "gossip"],
        "parallel.grad_compression = 'sign'",
    ),
    "unknown kind": (["--grad-compression", "topq"], "topq"),
}


def _run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    return run_main(["train", "--dry-run", "--model", "mlp", *args], capsys)


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_gradient_compression(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    args, expected = CASES[name]
    code, _, err = _run(args, capsys)
    assert_usage_error(code, err, expected)


def test_topk_ratio_lands_in_the_job(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--grad-compression", "topk", "--set", "parallel.grad_topk_ratio=0.05"]
    code, out, err = _run(args, capsys)
    assert code == 0, err
    parallel = tomllib.loads(out)["parallel"]
    assert (parallel["grad_compression"], parallel["grad_topk_ratio"]) == ("topk", 0.05)
