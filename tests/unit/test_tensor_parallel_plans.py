"""Tensor-parallel plans as data, and the sufficient-factor byte chooser: no processes."""

from __future__ import annotations

import pytest
import torch

from polytrain.config import job_from_dict
from polytrain.core.tensor_parallel import resolve_tp_plan
from polytrain.core.tp_plans import (
    ModuleInfo,
    PlanEntry,
    check_plan,
    gpt_plan,
    match_plan,
    mlp_plan,
    parse_plan,
)
from polytrain.data.datasets import DataSpec
from polytrain.errors import ConfigError, MeshError
from polytrain.models.gpt import GPTConfig, build_gpt
from polytrain.models.mlp import build_mlp
from polytrain.parallel.sufficient_factor import choose_layers, layer_cost, plain_linears


def _gpt(vocab: int = 64, n_head: int = 4) -> torch.nn.Module:
    with torch.device("meta"):
        return build_gpt(GPTConfig(vocab, n_layer=2, n_embd=32, n_head=n_head, block_size=16))


def _mlp(n_layer: int, vocab: int = 64) -> torch.nn.Module:
    spec = DataSpec(kind="tokens", vocab_size=vocab, input_shape=(16,))
    with torch.device("meta"):
        return build_mlp(spec, n_layer, 32, 16)


def test_parse_plan_rows() -> None:
    plan = parse_plan(["blocks.*.attn.q=colwise", " blocks.*.out = colwise_gather "])
    assert plan == [
        PlanEntry("blocks.*.attn.q", "colwise"),
        PlanEntry("blocks.*.out", "colwise_gather"),
    ]
    assert str(plan[0]) == "blocks.*.attn.q=colwise"


@pytest.mark.parametrize(
    ("row", "match"),
    [("blocks.1.fc", "expected 'pattern=style'"), ("=colwise", "expected"), ("a=diag", "diag")],
)
def test_parse_plan_rejects(row: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        parse_plan([row])


def test_match_first_row_wins_and_star_crosses_dots() -> None:
    names = ["blocks.1.attn.q", "blocks.2.attn.q", "blocks.2.mlp.fc"]
    plan = [PlanEntry("blocks.2.*", "rowwise"), PlanEntry("blocks.*", "colwise")]
    assert match_plan(plan, names) == {
        "blocks.2.attn.q": "rowwise",
        "blocks.2.mlp.fc": "rowwise",
        "blocks.1.attn.q": "colwise",
    }


def test_pattern_matching_nothing_names_it_and_lists_paths() -> None:
    with pytest.raises(ConfigError, match=r"'blocks\.\*\.nope' matches no module.*blocks\.1\.q"):
        match_plan([PlanEntry("blocks.*.nope", "colwise")], ["", "blocks.1.q", "blocks.2.q"])


def test_check_plan_kind_and_divisibility() -> None:
    infos = {"a": ModuleInfo("linear", 8, 6), "e": ModuleInfo("embedding", 4, 10)}
    check_plan({"a": "rowwise"}, infos, 4)  # in 8 / 4
    with pytest.raises(MeshError, match=r"does not divide out_features = 6 of 'a'"):
        check_plan({"a": "colwise"}, infos, 4)
    with pytest.raises(MeshError, match="vocabulary"):
        check_plan({"e": "vocab"}, infos, 4)
    with pytest.raises(ConfigError, match="not an nn.Embedding"):
        check_plan({"a": "vocab"}, infos, 2)
    with pytest.raises(ConfigError, match="not an nn.Linear"):
        check_plan({"e": "colwise"}, infos, 2)


def test_gpt_plan_vocab_parallel_only_when_divisible() -> None:
    styles = {e.pattern: e.style for e in gpt_plan(64, 4)}
    assert styles["blocks.0.tok"] == "vocab" and styles["blocks.*.out"] == "colwise_gather"
    assert "blocks.0.tok" not in {e.pattern for e in gpt_plan(103, 2)}


def test_builtin_gpt_plan_on_the_model() -> None:
    assignment = resolve_tp_plan("gpt", _gpt(), 2, [])
    assert assignment["blocks.1.attn.q"] == "colwise"
    assert assignment["blocks.2.attn.proj"] == "rowwise"
    assert assignment["blocks.2.mlp.proj"] == "rowwise"
    assert assignment["blocks.0.tok"] == "vocab"
    assert assignment["blocks.3.out"] == "colwise_gather"
    assert "blocks.0.pos" not in assignment and "blocks.1.ln1" not in assignment


def test_gpt_heads_must_divide() -> None:
    with pytest.raises(MeshError, match="does not divide the 2 attention heads"):
        resolve_tp_plan("gpt", _gpt(n_head=2), 4, [])


@pytest.mark.parametrize(("n_layer", "output"), [(1, "rowwise"), (2, "colwise_gather")])
def test_mlp_plan_alternates_and_handles_the_output(n_layer: int, output: str) -> None:
    assignment = resolve_tp_plan("mlp", _mlp(n_layer), 2, [])
    hidden = [assignment[f"blocks.{i + 1}.fc"] for i in range(n_layer)]
    assert hidden == ["colwise", "rowwise"][:n_layer]
    assert assignment[f"blocks.{n_layer + 1}.fc"] == output


def test_mlp_output_stays_replicated_when_width_not_divisible() -> None:
    plan = mlp_plan(["h1", "h2", "out"], {"h1": 8, "h2": 8, "out": 103}, 2)
    assert plan == [PlanEntry("h1", "colwise"), PlanEntry("h2", "rowwise")]


def test_user_plan_replaces_builtin_and_unknown_model_needs_one() -> None:
    assignment = resolve_tp_plan("pkg.mod:make", _mlp(2), 2, ["blocks.1.fc=colwise"])
    assert assignment == {"blocks.1.fc": "colwise"}
    with pytest.raises(MeshError, match="no built-in tensor-parallel plan"):
        resolve_tp_plan("pkg.mod:make", _mlp(2), 2, [])


def test_tp_plan_config_field_round_trips() -> None:
    job = job_from_dict(
        {"parallel": {"tp": 2, "tp_plan": ["blocks.*.mlp.fc=colwise"]}, "launch": {"nproc": 2}}
    )
    assert job.parallel.tp_plan == ["blocks.*.mlp.fc=colwise"] and job.parallel.dp == 1
    with pytest.raises(ConfigError, match="list of str"):
        job_from_dict({"parallel": {"tp_plan": "blocks.1.fc=colwise"}})


@pytest.mark.parametrize(
    ("parallel", "key"),
    [
        ({"tp": 2}, "parallel.tp = 2"),
        ({"zero": 2}, "parallel.zero = 2"),
        ({"grad_compression": "bf16"}, "grad_compression"),
    ],
)
def test_sufficient_factor_needs_plain_data_parallel(parallel: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        job_from_dict(
            {"parallel": {"sufficient_factor": "auto", **parallel}, "launch": {"nproc": 2}}
        )


def test_layer_cost_bytes() -> None:
    # 4096 x 4096 with bias, 8 rows, 2 ranks, fp32
    cost = layer_cost("fc", rows=8, in_features=4096, out_features=4096, bias=True, world=2)
    assert cost.allreduce_bytes == pytest.approx(2 * 1 / 2 * (4096 * 4096 + 4096) * 4)
    assert cost.factor_bytes == 1 * 8 * (4096 + 4096) * 4
    assert cost.factors_cheaper
    assert cost.allreduce_bytes / cost.factor_bytes > 200


def test_chooser_picks_by_bytes() -> None:
    wide = layer_cost("wide", rows=8, in_features=1024, out_features=1024, bias=True, world=4)
    # many rows on a narrow layer: the factors outweigh the gradient
    narrow = layer_cost("narrow", rows=4096, in_features=16, out_features=16, bias=True, world=4)
    assert not narrow.factors_cheaper
    assert choose_layers([wide, narrow], "auto") == ["wide"]
    assert choose_layers([wide, narrow], "on") == ["wide", "narrow"]
    assert choose_layers([wide, narrow], "off") == []
    with pytest.raises(ConfigError, match="no nn.Linear"):
        choose_layers([], "on")


def test_chooser_boundary_follows_world_size() -> None:
    """Factors win iff (w-1) N (m+n) < 2 (w-1)/w (m n + m): the break-even N shrinks with w."""
    m = n = 256
    for world in (2, 4, 8):
        break_even = 2 * (m * n + m) / world / (m + n)
        below = layer_cost("l", int(break_even) - 1, n, m, True, world)
        above = layer_cost("l", int(break_even) + 1, n, m, True, world)
        assert below.factors_cheaper and not above.factors_cheaper


def test_plain_linears_skips_subclasses_with_their_own_forward() -> None:
    class Scaled(torch.nn.Linear):
        def forward(self, input: torch.Tensor) -> torch.Tensor:
            return 2 * super().forward(input)

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), Scaled(2, 2))
    assert list(plain_linears(model)) == ["0"]
