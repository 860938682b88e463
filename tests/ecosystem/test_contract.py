"""The model contract (docs/models.md): outputs, losses, factory arguments, named inputs, and the
one-line errors for what does not fit. No processes: pre-flight and in-process models only."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from polytrain.cli.app import main
from polytrain.config.job import DataConfig, ModelConfig
from polytrain.data.datasets import build_datasets
from polytrain.errors import ConfigError
from polytrain.models.contract import ContractLoss, predictions, resolve_loss
from polytrain.models.registry import build_model
from polytrain.trainer.export import load_weights, save_weights

HELPERS = "tests.helpers.contract_models"


@pytest.fixture
def pairs(tmp_path: Path) -> Path:
    g = torch.Generator().manual_seed(0)
    path = tmp_path / "pairs.safetensors"
    save_file(
        {
            "inputs": torch.randn(32, 6, generator=g),
            "targets": torch.randint(0, 3, (32,), generator=g),
        },
        str(path),
    )
    return path


@pytest.fixture
def regression(tmp_path: Path) -> Path:
    g = torch.Generator().manual_seed(0)
    path = tmp_path / "regression.safetensors"
    save_file(
        {"inputs": torch.randn(32, 6, generator=g), "targets": torch.randn(32, generator=g)},
        str(path),
    )
    return path


@pytest.fixture
def named(tmp_path: Path) -> Path:
    g = torch.Generator().manual_seed(0)
    path = tmp_path / "named.safetensors"
    save_file(
        {
            "input_ids": torch.randint(0, 50, (32, 8), generator=g),
            "attention_mask": torch.ones(32, 8, dtype=torch.int64),
            "targets": torch.randint(0, 3, (32,), generator=g),
        },
        str(path),
    )
    return path


def dry_run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(["train", "--dry-run", *args])
    captured = capsys.readouterr()
    return int(exc.value.code or 0), captured.out, captured.err


def test_outputs_tensor_dict_and_model_output() -> None:
    from collections import OrderedDict

    logits = torch.randn(4, 3)
    assert predictions(logits)[0] is logits
    assert predictions({"logits": logits, "hidden_states": None})[0] is logits
    own = torch.tensor(0.5)
    assert predictions(OrderedDict(loss=own, logits=logits)) == (None, own)  # the model's loss
    assert predictions((logits, None))[0] is logits  # return_dict=False
    with pytest.raises(ConfigError, match=r"keys \['hidden'\]: it needs 'logits'"):
        predictions({"hidden": logits})


def test_loss_follows_the_target_dtype() -> None:
    preds = torch.randn(5, 1)
    assert resolve_loss("auto", classification=False).name == "mse"
    assert resolve_loss("auto", classification=True).name == "cross_entropy"
    mse = resolve_loss("auto", classification=False)(preds, torch.zeros(5))
    torch.testing.assert_close(mse, preds.squeeze(-1).square().mean())
    ce = resolve_loss("auto", classification=True)(
        torch.zeros(5, 4), torch.zeros(5, dtype=torch.long)
    )
    torch.testing.assert_close(ce, torch.log(torch.tensor(4.0)))
    custom = resolve_loss(f"{HELPERS}:per_row_loss", classification=True)
    with pytest.raises(ConfigError, match=r"returned \(5,\), not a scalar"):
        custom(preds.expand(5, 2), torch.zeros(5))
    with pytest.raises(ConfigError, match="model.loss = 'hinge'"):
        resolve_loss("hinge", classification=True)


def test_factory_arguments_and_built_in_fields(pairs: Path) -> None:
    _, _, spec = build_datasets(DataConfig(source=str(pairs)), 8)
    model = build_model(ModelConfig(name=f"{HELPERS}:linear", args={"bias": False}), spec, 0)
    inner = model.blocks[0]
    assert inner.factory_args == {"bias": False} and inner.bias is None
    with pytest.raises(ConfigError, match="model.n_layer = 3 applies to the built-in models only"):
        build_model(ModelConfig(name=f"{HELPERS}:linear", n_layer=3), spec, 0)
    with pytest.raises(ConfigError, match="model.args = .* is for factories"):
        build_model(ModelConfig(name="mlp", args={"n_layer": 3}), spec, 0)
    with pytest.raises(ConfigError, match="raised TypeError"):
        build_model(ModelConfig(name=f"{HELPERS}:dict_logits", args={"depth": 3}), spec, 0)


def test_named_inputs_keep_their_dtypes(named: Path) -> None:
    train, _, spec = build_datasets(DataConfig(source=str(named)), 8)
    x, y = train.get(torch.arange(4))
    assert isinstance(x, dict) and spec.input_names == ("attention_mask", "input_ids")
    assert x["input_ids"].dtype == torch.int64 and x["input_ids"].shape == (4, 8)
    assert y.dtype == torch.int64


def test_single_integer_input_stays_integer(tmp_path: Path) -> None:
    path = tmp_path / "ids.safetensors"
    save_file({"inputs": torch.arange(40).view(5, 8), "targets": torch.arange(5)}, str(path))
    train, _, _ = build_datasets(DataConfig(source=str(path), val_fraction=0.2), 8)
    assert train.get(torch.arange(2))[0].dtype == torch.int64


def test_export_keeps_user_names_and_ties(tmp_path: Path) -> None:
    from polytrain.data.datasets import DataSpec

    spec = DataSpec(kind="tokens", vocab_size=11, input_shape=(4,))
    model = build_model(ModelConfig(name=f"{HELPERS}:tied_sequential"), spec, 0)
    state = model.state_dict()
    assert state["blocks.0.weight"].data_ptr() == state["blocks.2.weight"].data_ptr()
    path = save_weights(model.export_state(state), tmp_path / "w.safetensors")
    loaded = load_weights(path)
    assert set(loaded) == {"0.weight", "1.weight", "1.bias", "2.weight"}
    from tests.helpers.contract_models import tied_sequential

    fresh = tied_sequential(spec)
    fresh.load_state_dict(loaded)  # the original class, no key changes
    torch.testing.assert_close(fresh[2].weight, state["blocks.0.weight"])
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        assert f.metadata()["tied"] == "2.weight=0.weight"


@pytest.mark.parametrize(
    ("model", "extra", "message"),
    [
        ("dict_hidden", [], "with keys ['hidden']: it needs 'logits'"),
        ("reads_values", [], "raised RuntimeError"),
        ("linear", ["--set", f"model.loss='{HELPERS}:per_row_loss'"], "not a scalar"),
        ("linear", ["--set", "model.n_layer=2"], "applies to the built-in models only"),
    ],
    ids=["no logits no loss", "meta factory", "non-scalar loss", "n_layer for factory"],
)
def test_bad_models_fail_in_one_line(
    model: str, extra: list[str], message: str, pairs: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = dry_run(["--model", f"{HELPERS}:{model}", "--data", str(pairs), *extra], capsys)
    assert code == 2
    assert message in err and len(err.strip().splitlines()) == 1


def test_meta_device_error_says_why(pairs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, _, err = dry_run(["--model", f"{HELPERS}:reads_values", "--data", str(pairs)], capsys)
    assert "meta device" in err and ".item()" in err


def test_batchnorm_with_micro_batched_pipeline(
    pairs: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [
        "--model",
        f"{HELPERS}:batchnorm_mlp",
        "--data",
        str(pairs),
        "--nproc",
        "2",
        "--pp",
        "2",
    ]
    args += ["--microbatches", "2", "--batch-size", "8"]
    code, _, err = dry_run(args, capsys)
    assert (
        code == 2 and "BatchNorm with parallel.pp = 2" in err and "model.batchnorm = 'local'" in err
    )
    code, _, err = dry_run([*args, "--set", "model.batchnorm='local'"], capsys)
    assert code == 0
    warnings = [
        line for line in err.splitlines() if line.startswith("polytrain: warning: BatchNorm")
    ]
    assert len(warnings) == 1
    # One micro-batch: the stages' BatchNorms are synchronised over dp, so dp x pp is accepted.
    one = [*args[:5], "4", "--dp", "2", "--pp", "2", "--microbatches", "1", "--batch-size", "8"]
    code, _, err = dry_run(one, capsys)
    assert code == 0 and "warning" not in err, err


def test_named_inputs_pass_as_keyword_arguments(named: Path) -> None:
    """A dict of inputs reaches the model as keyword arguments."""
    from polytrain.models.base import BlockModel

    seen: dict[str, torch.Tensor] = {}

    class Probe(torch.nn.Module):
        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            seen.update(input_ids=input_ids, attention_mask=attention_mask)
            return torch.zeros(len(input_ids), 3)

    train, _, _ = build_datasets(DataConfig(source=str(named)), 8)
    x, y = train.get(torch.arange(4))
    model = BlockModel([Probe()], ContractLoss(lambda p, t: p.sum(), "sum"))
    model.loss(model(x), y)
    assert set(seen) == {"input_ids", "attention_mask"}


def test_byte_and_tokenizer_file_tokenization(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    text = "naïve café " * 40
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(text, encoding="utf-8")
    train, _, spec = build_datasets(DataConfig(source=str(corpus), tokenizer="byte"), 8)
    assert spec.vocab_size == 256
    x, _ = train.get(torch.tensor([0]))
    assert isinstance(x, torch.Tensor) and x.dtype == torch.int64
    assert spec.decode(x[0].tolist()) == "naïve c"  # 8 bytes: ï is two of them

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train([str(corpus)], trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    train, _, spec = build_datasets(
        DataConfig(source=str(corpus), tokenizer=str(path), val_fraction=0.25), 4
    )
    assert spec.vocab_size == tok.get_vocab_size() == 3  # [UNK], naïve, café
    x, _ = train.get(torch.tensor([0]))
    assert spec.decode(x[0].tolist()) == "naïve café naïve café"
    with pytest.raises(ConfigError, match="data.tokenizer = 'nope.json'"):
        build_datasets(DataConfig(source=str(corpus), tokenizer="nope.json"), 4)


@pytest.fixture
def tokens(tmp_path: Path) -> Path:
    path = tmp_path / "tokens.safetensors"
    stream = torch.randint(0, 48, (32, 9), generator=torch.Generator().manual_seed(0))
    save_file(
        {"input_ids": stream[:, :-1].contiguous(), "targets": stream[:, 1:].contiguous()}, str(path)
    )
    return path


GPT2 = "tests.helpers.hf_models:make_gpt2"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ["--set", "pipeline.split_points=['transformer.h.9']"],
            "'transformer.h.9' names no module of the model: use layer paths such as "
            "'transformer.h.1'",
        ),
        (
            ["--set", "pipeline.split_points=['transformer.ln_f']"],
            "'transformer.ln_f' is not one of the repeated layers",
        ),
        (["--schedule", "pipedream"], "pipeline.schedule = 'pipedream' with a pipeline over"),
        (
            ["--tp", "2", "--pp", "1", "--set", "parallel.tp_plan=['blocks.0.lm_head=colwise']"],
            "splits a tied weight two ways: blocks.0.transformer.wte (replicated: whole), "
            "blocks.0.lm_head (colwise: dim 0)",
        ),
        (
            ["--tp", "4", "--pp", "1", "--nproc", "4"],
            "parallel.tp = 4 does not divide the 2 attention heads of the model (GPT2LMHeadModel)",
        ),
    ],
    ids=[
        "split point names no module",
        "split point not a layer",
        "pipedream",
        "tied split apart",
        "heads not divisible by tp",
    ],
)
def test_layer_pipeline_bad_input(
    extra: list[str], message: str, tokens: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [
        "--model",
        GPT2,
        "--data",
        str(tokens),
        "--nproc",
        "2",
        "--pp",
        "2",
        "--batch-size",
        "8",
    ]
    code, _, err = dry_run([*args, *extra], capsys)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_layer_pipeline_split_points_accepted(
    tokens: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [
        "--model",
        GPT2,
        "--data",
        str(tokens),
        "--nproc",
        "2",
        "--pp",
        "2",
        "--batch-size",
        "8",
    ]
    code, _, err = dry_run([*args, "--set", "pipeline.split_points=['transformer.h.1']"], capsys)
    assert code == 0, err


def test_tied_sequential_pipeline_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """A tie across the blocks of an nn.Sequential would drift apart between stages: refused."""
    args = [
        "--model",
        f"{HELPERS}:tied_sequential",
        "--nproc",
        "2",
        "--pp",
        "2",
        "--batch-size",
        "8",
    ]
    code, _, err = dry_run(args, capsys)
    assert code == 2 and "ties 0.weight and 2.weight" in err


@pytest.mark.slow
def test_console_script_sees_the_current_directory(tmp_path: Path, pairs: Path) -> None:
    """``polytrain train --model my_model:make`` finds my_model.py beside the job, as
    ``python -m polytrain`` does ([Note: the current directory])."""
    import os
    import shutil
    import subprocess

    script = shutil.which("polytrain")
    if script is None:
        pytest.skip("the polytrain console script is not installed")
    (tmp_path / "my_model.py").write_text(
        "from torch import nn\n\ndef make(spec):\n"
        "    return nn.Linear(spec.input_shape[0], spec.num_outputs)\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.dirname(__file__))) + "/src",
    }
    done = subprocess.run(
        [script, "train", "--dry-run", "--model", "my_model:make", "--data", str(pairs)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr


def test_python_api_takes_a_factory_and_tensors(tmp_path: Path) -> None:
    """``polytrain.run(job, model=fn, data=...)``: the factory travels as its import path, the
    tensors as a safetensors file in the run directory ([Note: objects to workers])."""
    from polytrain.api import _write_data, factory_name
    from tests.helpers.contract_models import linear

    assert factory_name(linear) == f"{HELPERS}:linear"
    with pytest.raises(ConfigError, match="not a lambda or nested function"):
        factory_name(lambda spec: torch.nn.Linear(2, 2))
    ids = torch.randint(0, 9, (8, 4))
    source = _write_data({"input_ids": ids, "targets": torch.arange(8)}, tmp_path)
    train, _, spec = build_datasets(DataConfig(source=source, val_fraction=0.25), 4)
    x, _ = train.get(torch.arange(6))
    assert spec.input_names == ("input_ids",) and isinstance(x, dict)
    assert torch.equal(x["input_ids"], ids[:6])
