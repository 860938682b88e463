"""Start a job from pretrained weights (``model.init_from``; ``--init-from``).

A safetensors file, or a directory as transformers' ``save_pretrained`` writes it
(``model.safetensors``, or ``model.safetensors.index.json`` and its shards). The names in the
file are the user's own (a transformers model's, or what ``--save-final`` exports); the
model's are those plus its block prefix (`BlockModel.user_prefix`). Every rank loads the
weights into its whole model before any strategy shards, splits or wraps it, so each
strategy starts from the same weights (contract 1). This is not a resume: no optimizer state,
step 0, the job's own schedule.

[Note: tied weights in pretrained files] transformers writes a tied weight once (GPT-2's
``lm_head.weight`` is ``transformer.wte.weight``) and polytrain's export records ties in the
metadata (`trainer.export`); a name the file lacks is fine when the model ties it to a name
the file has (the same parameter), and is an error otherwise.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from polytrain.errors import ConfigError
from polytrain.models.base import BlockModel

__all__ = ["check_pretrained", "load_pretrained", "pretrained_files"]

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


def pretrained_files(path: str | Path) -> list[Path]:
    """The safetensors files ``path`` names, or a one-line error saying what was expected."""
    p = Path(path).expanduser()
    where = f"model.init_from = {str(path)!r}"
    if p.is_file():
        if p.suffix != ".safetensors":
            raise ConfigError(
                f"{where}: expected a .safetensors file or a save_pretrained directory"
            )
        return [p]
    if p.is_dir():
        if (p / _SINGLE).is_file():
            return [p / _SINGLE]
        if (p / _INDEX).is_file():
            try:
                weight_map = json.loads((p / _INDEX).read_text())["weight_map"]
            except (ValueError, KeyError, TypeError):
                raise ConfigError(f"{where}: {_INDEX} has no 'weight_map'") from None
            files = [p / name for name in sorted(set(weight_map.values()))]
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise ConfigError(f"{where}: {_INDEX} names missing shards {missing[:3]}")
            return files
        raise ConfigError(
            f"{where}: the directory holds neither {_SINGLE} nor {_INDEX} (a .bin checkpoint? "
            "save it again with save_pretrained(..., safe_serialization=True))"
        )
    raise ConfigError(f"{where}: no such file or directory")


def _model_names(model: BlockModel) -> dict[str, str]:
    """The file's name (the user's) -> the model's state_dict name, for every entry."""
    prefix = model.user_prefix
    out = {}
    for name in model.state_dict():
        out[name[len(prefix) :] if prefix and name.startswith(prefix) else name] = name
    return out


def _tied(model: BlockModel) -> dict[str, str]:
    """state_dict name -> the first name of the same tensor, for names that repeat one."""
    first: dict[int, str] = {}
    out = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        key = id(tensor)
        if key in first:
            out[name] = first[key]
        else:
            first[key] = name
    return out


def check_pretrained(model: BlockModel, path: str | Path) -> None:
    """Names and shapes of ``path`` against ``model`` (built on any device, meta included),
    reading only the files' headers; one line for the first mismatch."""
    files = pretrained_files(path)
    names = _model_names(model)
    state = model.state_dict()
    tied = _tied(model)
    where = f"model.init_from = {str(path)!r}"
    seen: set[str] = set()
    with ExitStack() as stack:
        readers = [stack.enter_context(safe_open(str(f), framework="pt")) for f in files]
        for reader, key in ((r, k) for r in readers for k in r.keys()):
            if key not in names:
                raise ConfigError(
                    f"{where}: {key!r} is not a weight of the model (is it the same "
                    f"architecture? the model's names look like {next(iter(names))!r})"
                )
            shape = tuple(reader.get_slice(key).get_shape())
            want = tuple(state[names[key]].shape)
            if shape != want:
                raise ConfigError(f"{where}: {key!r} has shape {shape}, the model's {want}")
            seen.add(names[key])
    # A buffer the file lacks keeps its initial value (transformers leaves some out, e.g.
    # position ids); a parameter it lacks is an error unless tied to one it has.
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    missing = [
        user
        for user, name in names.items()
        if name in params and name not in seen and not (name in tied and tied[name] in seen)
    ]
    if missing:
        raise ConfigError(
            f"{where}: the file has no {missing[:3]}{' ...' if len(missing) > 3 else ''} "
            f"({len(missing)} of the model's weights)"
        )


@torch.no_grad()
def load_pretrained(model: BlockModel, path: str | Path) -> None:
    """Copy the weights of ``path`` into ``model`` in place (checked as `check_pretrained`)."""
    check_pretrained(model, path)
    names = _model_names(model)
    state = model.state_dict(keep_vars=True)
    for f in pretrained_files(path):
        with safe_open(str(f), framework="pt") as reader:
            for key in reader.keys():
                target = state[names[key]]
                target.copy_(reader.get_tensor(key).to(dtype=target.dtype))
