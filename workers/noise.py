"""Gaussian noise vectors keyed by the PRF of a secret key: the same values on any number of threads or processes.

Every noise vector is a pure function of a secret key (``workers.keys``, in
memory only) and a noise key (which vector it is, and the step): fixed-size
chunks of it come from independent streams, each seeded by PRF(key, "noise",
kind, step, chunk). The driver draws its whole vector here
(``orchestrator.noise``); on the collective path each rank draws the vector of
its own slice of the coordinates (``workers.collective``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from workers.keys import NOISE, SLICE_NOISE, SecretKey

# Secure mode: four N(0, std^2 / 4) draws add up to one N(0, std^2) whose low-order bits no longer follow the
# pattern of a single floating-point Gaussian sample (Mironov 2012; the
# mitigation Opacus uses, after Holohan and Braghin 2021).
SECURE_DRAWS = 4

# The first element of a noise key: the gradient's noise, and adaptive clipping's count noise, of a step.
GRADIENT_NOISE = 0
COUNT_NOISE = 1
# DP-FTRL's tree nodes: the noise of node (level, index) of tree `tree` is keyed (TREE_NOISE, tree, level, index).
TREE_NOISE = 2

# Values per independent stream: 2 MB of float64, small enough that a chunk's four draws stay in cache.
CHUNK_VALUES = 2**18


def driver_threads() -> int:
    """The cores this process may run on (its CPU affinity), for the driver's parallel noise and arithmetic."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def chunk_bounds(size: int, chunk_values: int = CHUNK_VALUES) -> list[tuple[int, int]]:
    """[start, stop) of each chunk of a `size`-value vector: fixed length, the last one shorter."""
    return [(start, min(size, start + chunk_values)) for start in range(0, size, chunk_values)]


def fill_unit_normal(generator: np.random.Generator, out: np.ndarray, draws: int) -> None:
    """Fill `out` (float64) with the sum of `draws` independent N(0, 1) arrays, scaled to N(0, 1) again."""
    generator.standard_normal(out=out)
    if draws == 1:
        return
    part = np.empty_like(out)
    for _ in range(draws - 1):
        out += generator.standard_normal(out=part)
    out *= 1.0 / np.sqrt(draws)


class GaussianNoise:
    """N(0, std^2) noise vectors for the driver, each keyed by (kind, step): one key, one vector.

    They derive from `key`, the driver's secret key: fresh from the OS when
    not given, or derived from a seed in tests (the trainer then prints
    `seeded: not for production use`). With `secure`,
    each value is the sum of SECURE_DRAWS float64 Gaussians, which hardens
    the released float32 values against the floating-point attack on Gaussian
    sampling. `threads` draw the chunks in parallel (default: the driver's
    cores); they do not change the values.
    """

    def __init__(self, key: SecretKey | None = None, secure: bool = True, threads: int | None = None):
        self._key = key or SecretKey.fresh()
        self.secure = secure
        self.threads = threads or driver_threads()
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="noise") if self.threads > 1 else None

    @property
    def draws_per_value(self) -> int:
        """How many float64 Gaussians make one value: SECURE_DRAWS in secure mode, else 1."""
        return SECURE_DRAWS if self.secure else 1

    @property
    def seeded(self) -> bool:
        """Whether the noise derives from a test seed (reproducible, so not private)."""
        return self._key.seeded

    def close(self) -> None:
        """Stop the drawing threads (a generator made for one vector, as a collective rank's, is closed after it)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def slice_key(self, step: int, slice_index: int) -> bytes:
        """PRF(key, "slice noise", step, slice): what the noise of slice `slice_index` of step `step` derives from.

        The collective path sends it to the rank that owns that slice, in
        memory only (`workers.collective`); the rank draws its slice's vector
        from it and never sees the key or any other slice's noise.
        """
        return self._key.derive(SLICE_NOISE, GRADIENT_NOISE, step, slice_index)

    def chunk_generator(self, key: Sequence[int], chunk: int) -> np.random.Generator:
        """The independent stream of chunk `chunk` of the vector `key`."""
        return self._key.numpy_generator(NOISE, *key, chunk)

    def draw(self, size: int, std: float, key: Sequence[int], out: np.ndarray | None = None) -> np.ndarray:
        """The `size` independent N(0, std^2) float64 values of vector `key` (written into `out` if given)."""
        if out is None:
            out = np.empty(size, dtype=np.float64)
        draws = self.draws_per_value

        def fill(chunk: int, bounds: tuple[int, int]) -> None:
            values = out[bounds[0]:bounds[1]]
            fill_unit_normal(self.chunk_generator(key, chunk), values, draws)
            if std != 1.0:
                values *= std

        bounds = chunk_bounds(size)
        if self._pool is None or len(bounds) == 1:
            for chunk, chunk_bound in enumerate(bounds):
                fill(chunk, chunk_bound)
        else:
            # numpy's generators and ufuncs release the GIL, so the chunks fill in parallel.
            list(self._pool.map(fill, range(len(bounds)), bounds))
        return out
