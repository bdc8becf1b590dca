"""Central Gaussian noise and the noisy mean gradient (pure functions over arrays)."""

from __future__ import annotations

import numpy as np

from orchestrator.sampling import make_generator

NOISE_STREAM = 1


# Secure mode: four N(0, std^2 / 4) draws add up to one N(0, std^2) whose low-order bits no longer follow the
# pattern of a single floating-point Gaussian sample (Mironov 2012; the
# mitigation Opacus uses, after Holohan and Braghin 2021).
SECURE_DRAWS = 4


class GaussianNoise:
    """Draws N(0, std^2) noise vectors, once per step, on the driver.

    Seeded from OS entropy unless a seed is given (tests only: the trainer
    prints `seeded: not for production use`). With `secure`, each value is the
    sum of SECURE_DRAWS float64 Gaussians of std / sqrt(SECURE_DRAWS), which
    hardens the released float32 values against the floating-point attack on
    Gaussian sampling.
    """

    def __init__(self, seed: int | None = None, secure: bool = True):
        self.seeded = seed is not None
        self.secure = secure
        self._generator = make_generator(seed, NOISE_STREAM)

    @property
    def state(self) -> dict:
        """The generator's state, for checkpoints."""
        return self._generator.bit_generator.state

    @state.setter
    def state(self, value: dict) -> None:
        self._generator.bit_generator.state = value

    def draw(self, size: int, std: float) -> np.ndarray:
        """`size` independent N(0, std^2) values as float64."""
        if not self.secure:
            return self._generator.normal(0.0, std, size)
        # The secure draws accumulate in place: for an 11M-parameter model, a
        # [SECURE_DRAWS, size] array would be 356 MB written and read again.
        total = self._generator.standard_normal(size)
        part = np.empty_like(total)
        for _ in range(SECURE_DRAWS - 1):
            total += self._generator.standard_normal(out=part)
        total *= std / np.sqrt(SECURE_DRAWS)
        return total


def average_noisy_sum(noisy_sum: np.ndarray, expected_batch_size: float) -> np.ndarray:
    """The noisy sum of clipped gradients divided by q * N, as float32.

    Dividing by the expected batch size, not the realised one, keeps the
    realised count (a raw, un-noised statistic) out of what is released.
    """
    return (np.asarray(noisy_sum, dtype=np.float64) / expected_batch_size).astype(np.float32)
