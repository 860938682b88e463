"""One block view of any model: the units ZeRO-3 shards and recomputation re-runs one at a time.

A `BlockModel`'s blocks are its ``nn.Sequential`` children. A user's model that is one module
(a transformers model, a torchvision-style ResNet) has its repeated layers found here: the
``nn.ModuleList`` with the most parameters whose children are all of one class (GPT-2's
``transformer.h``, Llama's ``model.layers``, BERT's ``encoder.layer``, ViT's layers, a ResNet's
``encoder.stages``).

[Note: block view] Per-block ``fully_shard`` (ZeRO-3) gathers one layer's weights at a time
instead of the whole model, and per-block ``checkpoint_wrapper`` keeps one layer's input instead
of recomputing the whole forward. What runs between the layers (embeddings, final norm, head)
stays in the root module: FSDP's root unit and the un-recomputed part.
"""

from __future__ import annotations

from torch import nn

__all__ = ["disable_inplace", "find_repeated_layers", "layer_paths"]


def disable_inplace(module: nn.Module) -> list[str]:
    """Set ``inplace = False`` on every module that has it (``ReLU(inplace=True)``...).

    [Note: in-place ops at boundaries] A pipeline stage's input is a received tensor that
    requires grad, and a block profiled alone gets one too: an in-place op on it fails at run
    time ("a leaf Variable that requires grad is being used in an in-place operation"), and
    DTensor shards reject some in-place ops. The out-of-place version computes the same values
    (it only keeps one more activation), so pipelines and tensor parallel turn them off.
    Returns the paths changed.
    """
    changed = []
    for name, child in module.named_modules():
        if getattr(child, "inplace", False) is True:
            child.inplace = False
            changed.append(name)
    return changed


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def find_repeated_layers(module: nn.Module) -> str | None:
    """Path of the largest ``ModuleList`` of same-class children (>= 2), or None."""
    best: tuple[int, str] | None = None
    for name, child in module.named_modules():
        if not isinstance(child, nn.ModuleList) or len(child) < 2:
            continue
        if len({type(c) for c in child}) != 1:
            continue
        size = _numel(child)
        if size and (best is None or size > best[0]):
            best = (size, name)
    return best[1] if best else None


def layer_paths(module: nn.Module) -> list[str]:
    """Module paths of the model's repeated layers ([Note: block view]); [] when it has none."""
    found = find_repeated_layers(module)
    if found is None:
        return []
    layers = module.get_submodule(found)
    assert isinstance(layers, nn.ModuleList)
    return [f"{found}.{i}" if found else str(i) for i in range(len(layers))]
