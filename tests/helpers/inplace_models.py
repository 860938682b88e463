from typing import Any

from torch import nn


def make(spec: Any) -> nn.Module:
    w = spec.input_shape[0]
    return nn.Sequential(
        nn.Linear(w, 16),
        nn.ReLU(inplace=True),
        nn.ReLU(inplace=True),
        nn.Linear(16, 16),
        nn.ReLU(inplace=True),
        nn.Linear(16, spec.num_outputs),
    )
