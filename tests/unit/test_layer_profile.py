"""`auto` partitioning of a pipeline over a user model's layers ([Note: layer profile]).

A one-module model whose layers are cheap and whose head is expensive: the profile charges the
head (and the loss) to the last layer, so the search gives the last stage fewer layers; and
profiling writes no ``.grad`` and changes no weight or buffer.
"""

from __future__ import annotations

import torch
from torch import nn

from polytrain.models.base import BlockModel
from polytrain.models.blocks import layer_paths
from polytrain.models.split import trace_sides
from polytrain.pipeline.layer_profile import profile_layers
from polytrain.pipeline.profile import choose_counts
from tests.conftest import small_job

# (B, T, C): batch, positions, channels; V: the head's (large) vocabulary
B, T, C, V = 4, 8, 16, 1024


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(C, C)

    def forward(self, hidden_states: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor]:
        return (hidden_states + torch.tanh(self.fc(hidden_states)) * scale,)  # a tuple, as HF's


class HeavyHead(nn.Module):
    """Embedding, four cheap layers taking a tensor computed before them, an expensive head."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(32, C)
        self.h = nn.ModuleList(Layer() for _ in range(4))
        self.norm = nn.LayerNorm(C)
        self.head = nn.Sequential(nn.Linear(C, V), nn.Linear(V, V))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(input_ids)
        scale = torch.ones(())  # like a mask: made by the model, passed to every layer
        for layer in self.h:
            x = layer(x, scale)[0]
        return self.head(self.norm(x))  # (B, T, V)


def _model() -> BlockModel:
    torch.manual_seed(0)
    user = HeavyHead()
    return BlockModel([user], user_prefix="blocks.0.", layers=layer_paths(user))


def test_expensive_head_leaves_the_last_stage_fewer_layers() -> None:
    model = _model()
    user = model.blocks[0]
    ids = torch.randint(0, 32, (B, T))
    targets = torch.randint(0, V, (B, T))
    split = trace_sides(user, "h", lambda: user(ids))
    before = {k: v.clone() for k, v in model.state_dict().items()}

    # one intra-op thread, as on every pipeline rank: the profile then reads the process's CPU
    # time, which other processes on a loaded machine do not inflate ([Note: profile clock])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        profiles = profile_layers(model, split, (ids, targets), warmup=1, repeats=3)
    finally:
        torch.set_num_threads(threads)

    assert len(profiles) == 4
    # the head's parameters and time are the last layer's; the embedding's the first's
    layer_params = C * C + C
    assert profiles[1].param_count == profiles[2].param_count == layer_params
    assert profiles[0].param_count == layer_params + 32 * C
    assert profiles[3].param_count == layer_params + 2 * C + C * V + V + V * V + V
    cost = [p.forward_s + p.backward_s for p in profiles]
    assert cost[3] > 5 * max(cost[1], cost[2]), cost
    assert profiles[1].input_bytes == profiles[1].output_bytes == B * T * C * 4
    assert profiles[3].activation_bytes > profiles[1].activation_bytes  # the head's
    # profiling leaves no trace: no .grad, weights and buffers unchanged
    assert all(p.grad is None for p in model.parameters())
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, before[key], atol=0, rtol=0)

    job = small_job(pipeline={"partition": "auto", "microbatches": 2})
    counts = choose_counts(job, 4, 2, lambda: profiles)
    assert counts == [3, 1]  # the uniform partition would be [2, 2]
