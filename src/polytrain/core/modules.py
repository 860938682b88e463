"""A module view of parameters held outside any model module."""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

__all__ = ["module_of"]


def module_of(params: Mapping[str, nn.Parameter]) -> nn.Module:
    """A module whose ``state_dict`` keys are the given dotted names (``blocks.3.fc.weight``).

    For a strategy whose rank holds parameters outside any model module (a parameter server's
    shard): exposing this as ``modules`` makes the shard checkpointable; loading writes into the
    given parameters in place (they may be views of one flat buffer).
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
        node.register_parameter(leaf, param)
    return root
