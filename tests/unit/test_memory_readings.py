"""The memory readings that the feature tests rely on (polytrain.testing.memory)."""

from __future__ import annotations

import torch

from polytrain.testing.memory import heap_bytes_in_use, resident_parameter_bytes


def test_heap_bytes_follow_a_tensor_that_lives_and_dies() -> None:
    size = 4 * 2**20
    before = heap_bytes_in_use()
    t = torch.empty(size // 4)
    during = heap_bytes_in_use()
    del t
    after = heap_bytes_in_use()
    assert 0.95 * size <= during - before <= 1.5 * size
    assert during - after >= 0.95 * size


def test_resident_bytes_count_each_storage_once_and_skip_freed_ones() -> None:
    weight = torch.zeros(10, 10)
    assert resident_parameter_bytes([weight, weight[0], weight.t()]) == 400
    freed = torch.zeros(5)
    freed.untyped_storage().resize_(0)  # as FSDP frees a gathered parameter
    assert resident_parameter_bytes([weight, freed, torch.zeros(2)]) == 408
