"""Bytes autograd saves for backward: what a stage's activations cost, measured one way.

The profile (bytes per block, for the partition search) and the runtime (live activation bytes
per micro-batch in flight) count the same thing, so they share one counter: the distinct
storages that autograd's ``saved_tensors_hooks`` see, each counted once at its full size,
leaving out storages the caller names (parameters, buffers, stashed weight versions: they exist
whether or not a forward runs). Storages are told apart by `storage_key`, which also works on
the meta device, where every ``data_ptr`` is 0.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator

import torch

from polytrain._torch_private import storage_key

__all__ = ["SavedBytes", "count_saved_bytes", "storage_keys"]


class SavedBytes:
    """Running total of one `count_saved_bytes` block."""

    def __init__(
        self,
        exclude: set[int] | None = None,
        split: Callable[[torch.Tensor], bool] | None = None,
        keep: bool = False,
    ) -> None:
        self.bytes = 0
        self.split_bytes = 0  # of ``bytes``, the storages ``split`` said a tp plan splits
        self._exclude = exclude or set()
        self._split = split
        self._seen: set[int] = set()
        # with ``keep``, the counted storages themselves, so none is freed while counting and its
        # identity reused by a new storage that would then read as seen (a saved tensor of a
        # graph branch that does not reach the output is freed with it: on meta, where
        # nothing is allocated, such reuse is immediate)
        self._kept: list[torch.UntypedStorage] | None = [] if keep else None

    def add(self, tensor: torch.Tensor, split: bool | None = None) -> None:
        """Count ``tensor``'s storage once unless excluded (``split``: whether a tp plan splits
        it, when the caller knows better than the block's ``split`` test)."""
        key = storage_key(tensor)
        if key in self._exclude or key in self._seen:
            return
        self._seen.add(key)
        if self._kept is not None:
            self._kept.append(tensor.untyped_storage())
        nbytes = tensor.untyped_storage().nbytes()
        self.bytes += nbytes
        if split is None:
            split = self._split is not None and self._split(tensor)
        if split:
            self.split_bytes += nbytes

    def release(self) -> None:
        """Let go of the storages ``keep`` held."""
        if self._kept is not None:
            self._kept.clear()

    def is_split(self, tensor: torch.Tensor) -> bool:
        """Whether the block's ``split`` test says a tp plan splits ``tensor``."""
        return self._split is not None and self._split(tensor)


def storage_keys(tensors: Iterable[torch.Tensor]) -> set[int]:
    """Identities of the storages behind ``tensors`` (for `count_saved_bytes`'s ``exclude``)."""
    return {storage_key(t) for t in tensors}


@contextlib.contextmanager
def count_saved_bytes(
    exclude: set[int], split: Callable[[torch.Tensor], bool] | None = None, keep: bool = False
) -> Iterator[SavedBytes]:
    """Count the bytes of the distinct storages autograd saves while the block runs (and, with
    ``split``, those of them it says a tensor-parallel plan splits: `measure.stats`); ``keep``
    holds each counted storage until the block ends (`SavedBytes`)."""
    total = SavedBytes(exclude, split, keep)

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        total.add(tensor)
        return tensor

    def unpack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield total
    finally:
        total.release()
