"""A module view of parameters (and other state tensors) held outside any model module."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

__all__ = ["module_of", "train_mode"]


def module_of(params: Mapping[str, torch.Tensor]) -> nn.Module:
    """A module whose ``state_dict`` keys are the given dotted names (``blocks.3.fc.weight``).

    For a strategy whose rank holds parameters outside any model module (a parameter server's
    shard) or state tensors of its own (DiLoCo's anchor and outer momentum): exposing this as
    ``modules`` makes them checkpointable; loading writes into the given tensors in place (they
    may be views of one flat buffer). A ``nn.Parameter`` is registered as a parameter, any
    other tensor as a (persistent) buffer.
    """
    root = nn.Module()
    for name, param in params.items():
        *path, leaf = name.split(".")
        node = root
        for part in path:
            child = dict(node.named_children()).get(part)
            if child is None:
                child = nn.Module()
                node.add_module(part, child)
            node = child
        if isinstance(param, nn.Parameter):
            node.register_parameter(leaf, param)
        else:
            node.register_buffer(leaf, param)
    return root


def train_mode(module: nn.Module) -> None:
    """Put ``module`` in training mode unless it already is (after an evaluation it is not).

    ``nn.Module.train`` walks every submodule: about 0.3 ms of host time per step for a
    24-layer GPT, paid by every step that called it unconditionally."""
    if not module.training:
        module.train()
