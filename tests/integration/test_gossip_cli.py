"""Decentralized modes from the command line: bad input is one line and exit 2 (in-process)."""

from __future__ import annotations

import pytest
import tomllib

from tests.helpers.cli import assert_usage_error, run_main

GOSSIP = ["--sync", "gossip", "--nproc", "4", "--batch-size", "32"]

CASES = {
    "peers >= world": ([*GOSSIP, "--topology", "random", "--peers", "4"], "gossip.peers = 4"),
    "zero peers": ([*GOSSIP, "--topology", "random", "--peers", "0"], "gossip.peers = 0"),
    "period < 1": (["--sync", "localsgd", "--period", "0"], "localsgd.period = 0"),
    "torus on a prime world": (
        ["--sync", "gossip", "--nproc", "5", "--batch-size", "20", "--topology", "torus"],
        "gossip.topology = 'torus' needs a world of r x c",
    ),
    "torus on two ranks": (
        ["--sync", "gossip", "--topology", "torus"],
        "not 2: use --nproc 4",
    ),
    "compress with all-reduce": (["--compress", "fp16"], "--grad-compression"),
    "compress with parameter servers": (
        ["--sync", "ps", "--nproc", "3", "--batch-size", "32", "--compress", "sign"],
        "parallel.sync = 'ps' sends none",
    ),
    "compress with hierarchical localsgd": (
        [
            *("--sync", "localsgd", "--nproc", "4", "--batch-size", "32", "--compress", "bf16"),
            *("--set", "localsgd.hierarchical=true", "--set", "localsgd.ranks_per_host=2"),
        ],
        "with localsgd.hierarchical",
    ),
    "top-k with random peers": (
        [*GOSSIP, "--topology", "random", "--compress", "topk"],
        "not topology 'random'",
    ),
    "sign with async gossip": (
        [*GOSSIP, "--compress", "sign", "--set", "gossip.mode=async"],
        "which asynchronous gossip has not",
    ),
    "top-k ratio above 1": ([*GOSSIP, "--set", "gossip.topk_ratio=2"], "gossip.topk_ratio = 2"),
    "grad compression with gossip": (
        [*GOSSIP, "--grad-compression", "powersgd"],
        "which parallel.sync = 'gossip' does not run",
    ),
    "unknown topology": ([*GOSSIP, "--topology", "star"], "gossip.topology = 'star'"),
    "gossip with tensor parallel": (
        ["--sync", "gossip", "--nproc", "4", "--tp", "2"],
        "mixes whole-model replicas",
    ),
    "checkpoints with async gossip": (
        [*GOSSIP, "--set", "gossip.mode=async", "--checkpoint-dir", "ck"],
        "with gossip.mode = 'async'",
    ),
    "negative straggler delay": (
        [*GOSSIP, "--set", "gossip.straggler_delay_s=-1"],
        "gossip.straggler_delay_s = -1",
    ),
    "overlap with local SGD": (
        ["--sync", "localsgd", "--overlap"],
        "not parallel.sync = 'localsgd'",
    ),
    "overlap with async gossip": (
        [*GOSSIP, "--overlap", "--set", "gossip.mode=async"],
        "gossip.mode = 'async'",
    ),
    "overlap with sign gossip": (
        [*GOSSIP, "--overlap", "--compress", "sign"],
        "gossip.overlap = true with gossip.compress = 'sign'",
    ),
    "hierarchical on one host": (
        ["--sync", "localsgd", "--set", "localsgd.hierarchical=true"],
        "into at least 2 hosts",
    ),
}


def _run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    return run_main(["train", "--dry-run", *args], capsys)


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_decentralized_invocation(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    args, expected = CASES[name]
    code, _, err = _run(args, capsys)
    assert_usage_error(code, err, expected)


def test_flags_land_in_the_job(capsys: pytest.CaptureFixture[str]) -> None:
    args = [*GOSSIP, "--topology", "random", "--peers", "2", "--compress", "bf16", "--overlap"]
    code, out, err = _run(args, capsys)
    assert code == 0, err
    job = tomllib.loads(out)
    assert job["parallel"]["sync"] == "gossip"
    assert job["gossip"] == {
        "topology": "random",
        "peers": 2,
        "compress": "bf16",
        "topk_ratio": 0.01,
        "consensus_lr": 0.5,
        "seed": 0,
        "mode": "sync",
        "overlap": True,
        "straggler_delay_s": 0.0,
    }
    code, out, err = _run(["--sync", "localsgd", "--period", "4"], capsys)
    assert code == 0, err
    assert tomllib.loads(out)["localsgd"]["period"] == 4
