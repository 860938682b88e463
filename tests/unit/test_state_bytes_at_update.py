"""`observe.metrics.StateBytesAtUpdate`: model states read just before the optimizer step."""

from __future__ import annotations

import torch

from polytrain.observe.metrics import StateBytesAtUpdate, model_state_bytes


def test_reading_keeps_the_gradients_a_step_frees_afterwards() -> None:
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters())
    probe = StateBytesAtUpdate([model], opt)
    params = sum(p.numel() * 4 for p in model.parameters())

    def step() -> None:
        model(torch.ones(2, 8)).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)  # what PipeDream's update does after it

    step()  # not armed: nothing read
    assert probe.reading == {}
    probe.arm()
    step()
    probe.close()
    assert probe.reading == {"params": params, "grads": params, "optimizer": 2 * params}
    assert model_state_bytes([model], opt)["grads"] == 0  # the after-step reading misses them
    step()  # closed: the hook is gone
    assert probe.reading["grads"] == params
