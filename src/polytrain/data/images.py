"""The built-in image data set: scikit-learn's handwritten digits (``load_digits``).

1,797 grey-scale images of 8 x 8 pixels (values 0-16, scaled here to [0, 1]) with labels 0-9,
from the UCI "Optical Recognition of Handwritten Digits" set. They ship inside scikit-learn
(a CSV read with numpy, no pickle, no download), so ``--data digits`` works offline.

[Note: fixed image split] The rows are shuffled once with a fixed generator (seed 0, not the
job's seed) before the last ``val_fraction`` is held out: the file lists the digits in writer
order, so an unshuffled tail would hold other writers' hands than the training set, and a split
that moved with ``train.seed`` would make runs with different seeds incomparable.

Shapes: N images, 1 channel, H = W = 8.
"""

from __future__ import annotations

import numpy as np
import torch

from polytrain.errors import ConfigError

__all__ = ["SPLIT_SEED", "load_digits_pairs"]

SPLIT_SEED = 0


def load_digits_pairs() -> tuple[torch.Tensor, torch.Tensor]:
    """``(images (N, 1, 8, 8) float32 in [0, 1], labels (N,) int64)`` in the fixed order."""
    try:
        # Optional dependency (the "images" extra): imported only when the digits are asked for.
        from sklearn.datasets import load_digits  # type: ignore[import-untyped]
    except ImportError:
        raise ConfigError(
            "data.source = 'digits' needs scikit-learn (it ships the images): "
            "pip install scikit-learn, or pip install 'polytrain[images]'"
        ) from None
    digits = load_digits()
    order = np.random.default_rng(SPLIT_SEED).permutation(len(digits.target))
    images = torch.from_numpy(digits.images[order].astype(np.float32) / 16.0).unsqueeze(1)
    labels = torch.from_numpy(digits.target[order].astype(np.int64))
    return images, labels
