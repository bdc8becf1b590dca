"""Central Gaussian noise and the noisy mean gradient (pure functions over arrays)."""

from __future__ import annotations

import numpy as np

from orchestrator.sampling import make_generator

NOISE_STREAM = 1


class GaussianNoise:
    """Draws N(0, std^2) noise vectors, once per step, on the driver.

    Seeded from OS entropy unless a seed is given (tests only: the trainer
    prints `seeded: not for production use`).
    """

    def __init__(self, seed: int | None = None):
        self.seeded = seed is not None
        self._generator = make_generator(seed, NOISE_STREAM)

    def draw(self, size: int, std: float) -> np.ndarray:
        """`size` independent N(0, std^2) values as float64."""
        return self._generator.normal(0.0, std, size)


def noisy_mean_gradient(clipped_sum: np.ndarray, noise: np.ndarray, expected_batch_size: float) -> np.ndarray:
    """(sum of clipped per-example gradients + noise) / (q * N), as float32.

    Dividing by the expected batch size, not the realised one, keeps the
    realised count (a raw, un-noised statistic) out of what is released.
    """
    return ((clipped_sum.astype(np.float64) + noise) / expected_batch_size).astype(np.float32)
