"""Poisson sampling of logical batches and their split across workers (pure functions)."""

from __future__ import annotations

import numpy as np


def make_generator(seed: int | None, stream: int) -> np.random.Generator:
    """A numpy Generator: from OS entropy when `seed` is None, else reproducible for tests.

    `stream` separates the sampler's and the noise's streams under one seed.
    """
    if seed is None:
        return np.random.default_rng()
    return np.random.default_rng([seed, stream])


def poisson_sample(generator: np.random.Generator, dataset_size: int, sampling_rate: float) -> np.ndarray:
    """Indices of one logical batch: every example joins independently with probability q.

    The batch size varies from step to step and may be zero.
    """
    return np.flatnonzero(generator.random(dataset_size) < sampling_rate)


def partition(indices: np.ndarray, parts: int) -> list[np.ndarray]:
    """Split a batch's indices into `parts` near-equal contiguous shards (sizes differ by <= 1)."""
    return np.array_split(indices, parts)
