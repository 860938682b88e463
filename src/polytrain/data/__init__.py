"""Datasets, the default corpus and the layout-invariant global-batch sampler (contract 1)."""

from polytrain.data.corpus import default_corpus
from polytrain.data.datasets import DataSpec, PairDataset, TokenDataset, build_datasets
from polytrain.data.sampler import Batches, GlobalBatchSampler

__all__ = [
    "Batches",
    "DataSpec",
    "GlobalBatchSampler",
    "PairDataset",
    "TokenDataset",
    "build_datasets",
    "default_corpus",
]
