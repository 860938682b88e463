"""Push from backward hooks and pull into forward hooks ([Note: prioritised overlap]), no processes.

The pusher and fetcher are driven with recording callbacks in place of the wire: these tests
fail if a chunk is posted before every parameter in it has its final gradient, if a chunk's
payload is not exactly that slice of the flat gradient, if a chunk is posted twice or never,
or if forward uses a parameter before its chunks were waited for.
"""

from __future__ import annotations

import torch
from torch import nn

from polytrain.core.step import all_finite, norm_and_finite
from polytrain.ps.layout import ShardLayout, build_layout
from polytrain.ps.overlap import GradPusher, ParamFetcher, chunk_members, param_chunks


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(24, 32), nn.Tanh(), nn.Linear(32, 16), nn.Tanh())
        self.body.append(nn.Linear(16, 4))
        self.spare = nn.Linear(20, 15)  # not used in forward: never gets a gradient

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _model() -> _Net:
    torch.manual_seed(0)
    return _Net()


def _layout(model: _Net, servers: int) -> ShardLayout:
    return build_layout(model, servers, chunk_kb=1)  # 256 floats per chunk: params straddle


def test_chunk_map_covers_every_element_once() -> None:
    model = _model()
    for servers in (1, 2):
        layout = _layout(model, servers)
        where = param_chunks(layout)
        for s in range(servers):
            covered = torch.zeros(layout.numel(s), dtype=torch.int64)
            for name in layout.names[s]:
                srv, start, stop, keys = where[name]
                assert srv == s
                covered[start:stop] += 1
                for _, k in keys:  # every chunk listed overlaps the parameter
                    c0, c1 = layout.spans(s)[k]
                    assert c0 < stop and start < c1
            assert bool((covered == 1).all())
        members = chunk_members(layout)
        assert sum(len(layout.spans(s)) for s in range(servers)) == len(members)
        assert all(members.values())


def _backward(model: _Net) -> None:
    x = torch.randn(5, 24)
    model(x).square().sum().backward()


def test_pusher_posts_each_complete_chunk_once_last_layers_first() -> None:
    model = _model()
    layout = _layout(model, 2)
    pusher = GradPusher(model, layout)
    members = chunk_members(layout)
    posted: dict[tuple[int, int], torch.Tensor] = {}
    order: list[tuple[int, int]] = []

    def post(s: int, k: int, payload: torch.Tensor) -> None:
        assert (s, k) not in posted, f"chunk {(s, k)} posted twice"
        assert set(members[(s, k)]) <= pusher.done, "chunk posted before all its gradients"
        posted[(s, k)] = payload.clone()
        order.append((s, k))

    _backward(model)  # not armed: posts nothing
    assert not posted
    model.zero_grad(set_to_none=True)
    pusher.arm(post)
    _backward(model)
    early = len(order)
    pusher.flush()
    assert 0 < early < len(members)  # the unused parameter's chunks wait for the flush
    assert set(posted) == set(members)
    grads = {
        n: (p.grad if p.grad is not None else torch.zeros_like(p))
        for n, p in model.named_parameters()
    }
    for s in range(2):
        got = torch.cat([posted[(s, k)] for k in range(len(layout.spans(s)))])
        assert torch.equal(got, layout.flatten(grads, s))
    # Backward reaches the last layer first: its chunks go before the first layer's.
    where = param_chunks(layout)
    first_of = {n: order.index(where[n][3][0]) for n in ("body.0.weight", "body.4.weight")}
    assert first_of["body.4.weight"] < first_of["body.0.weight"]
    # A NaN repost sends every chunk again.
    again: list[tuple[int, int]] = []
    pusher.repost(
        lambda s, k, c: again.append((s, k)) if bool(c.isnan().all()) else None, 0.0 * float("nan")
    )
    assert sorted(again) == sorted(members)


def test_fetcher_waits_only_for_a_modules_own_chunks_first_layers_first() -> None:
    model = _model()
    layout = _layout(model, 1)
    fetcher = ParamFetcher(model, layout)
    where = param_chunks(layout)
    flat = torch.arange(layout.numel(0), dtype=torch.float32)
    waited: list[tuple[int, int]] = []

    def wait(s: int, k: int) -> torch.Tensor:
        waited.append((s, k))
        return flat

    seen: dict[str, list[tuple[int, int]]] = {}

    def record(i: int) -> None:
        seen[str(i)] = list(waited)

    for i in (0, 2, 4):  # what had been waited for when each Linear ran (after its fetch)
        model.body[i].register_forward_pre_hook(lambda m, a, i=i: record(i))
    fetcher.start(wait)
    model(torch.randn(2, 24))
    # The first Linear ran after only its own chunks had been waited for.
    own0 = {key for n in ("body.0.weight", "body.0.bias") for key in where[n][3]}
    assert set(seen["0"]) == own0
    own2 = {key for n in ("body.2.weight", "body.2.bias") for key in where[n][3]}
    assert set(seen["2"]) == own0 | own2
    spare = {key for n in ("spare.weight", "spare.bias") for key in where[n][3]}
    assert not spare <= set(waited)  # forward never waited for the unused module
    fetcher.finish()  # the unused parameter
    assert not fetcher.pending
    for name, param in model.named_parameters():
        _, start, stop, _ = where[name]
        assert torch.equal(param.detach().reshape(-1), flat[start:stop])


def test_pusher_finite_sees_a_non_finite_loss_or_gradient_anywhere() -> None:
    """[Note: pull with the clock]: a worker poisons its push from `GradPusher.finite`, so it
    must see a NaN/Inf in the loss or in any element of any server's pushed gradient, and must
    not mistake finite values whose float32 sum overflows for a non-finite gradient."""
    model = _model()
    pusher = GradPusher(model, _layout(model, 2))
    pusher.arm(lambda s, k, payload: None)
    _backward(model)
    pusher.flush()
    loss = torch.tensor(1.5)
    assert pusher.finite(loss)
    assert not pusher.finite(torch.tensor(float("nan")))
    assert not pusher.finite(torch.tensor(float("inf")))
    for s in range(2):
        for value in (float("nan"), float("inf"), float("-inf")):
            saved = pusher.flats[s][-1].clone()
            pusher.flats[s][-1] = value
            assert not pusher.finite(loss), (s, value)
            pusher.flats[s][-1] = saved
    pusher.flats[0][:4] = 3e38  # finite, but their float32 sum overflows
    assert pusher.finite(loss)
    assert not all_finite(torch.tensor([3e38, float("nan"), -3e38]))
    assert all_finite(torch.tensor([3e38, 3e38, -3e38]))


def test_the_servers_clip_norm_tells_overflow_from_nan() -> None:
    """[Note: the server's clip norm]: one float32 pass when finite; squares that overflow
    float32 fall back to float64 (finite, the true norm); a NaN or Inf element says so."""
    norm, finite = norm_and_finite(torch.tensor([3.0, 4.0]))
    assert finite and float(norm) == 5.0 and norm.dtype == torch.float32
    norm, finite = norm_and_finite(torch.tensor([3e30, 4e30]))
    assert finite and norm.dtype == torch.float64 and abs(float(norm) / 5e30 - 1) < 1e-6
    for bad in (float("nan"), float("inf")):
        assert not norm_and_finite(torch.tensor([1.0, bad]))[1]
