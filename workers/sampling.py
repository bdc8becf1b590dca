"""Poisson sampling, for the driver over one dataset and for each worker over its own examples (pure functions)."""

from __future__ import annotations

import numpy as np

# Separates a worker's local sampling stream from the driver's sampler (0) and noise (1) under one seed.
LOCAL_SAMPLER_STREAM = 2


def make_generator(seed: int | None, *stream: int) -> np.random.Generator:
    """A numpy Generator: from OS entropy when `seed` is None, else reproducible for tests.

    `stream` (one or more non-negative integers) separates independent
    streams under one seed: the driver's sampler and noise, and each worker's
    local sampling at each step.
    """
    if seed is None:
        return np.random.default_rng()
    return np.random.default_rng([seed, *stream])


def poisson_sample(generator: np.random.Generator, dataset_size: int, sampling_rate: float) -> np.ndarray:
    """Indices of one logical batch: every example joins independently with probability q.

    The batch size varies from step to step and may be zero.
    """
    return np.flatnonzero(generator.random(dataset_size) < sampling_rate)


def part_bounds(size: int, part: int, parts: int) -> tuple[int, int]:
    """[start, stop) of contiguous part `part` of `parts` over `size` examples (lengths differ by <= 1).

    Every example lies in exactly one part: the parts of 0..parts-1 tile 0..size-1.
    """
    if not 0 <= part < parts:
        raise ValueError(f"part must be in 0..{parts - 1} for parts = {parts} (got {part})")
    return part * size // parts, (part + 1) * size // parts


def local_sampling_generator(seed: int | None, shard_index: int, worker_index: int, step: int) -> np.random.Generator:
    """The generator a worker samples its step `step` (0-based) from.

    From OS entropy when `seed` is None. With a seed (tests only) the stream is
    derived from (seed, shard, worker within the shard, step), so a resumed or
    retried step draws exactly the same examples, and no two workers or steps
    share a stream.
    """
    return make_generator(seed, LOCAL_SAMPLER_STREAM, shard_index, worker_index, step)


def local_poisson_sample(
    seed: int | None, shard_index: int, worker_index: int, step: int, example_count: int, sampling_rate: float
) -> np.ndarray:
    """One worker's share of step `step`'s Poisson sample: positions among its own `example_count` examples.

    Each worker holds a disjoint range of the union dataset and includes each of
    its examples independently with probability q from a stream of its own, so
    the union of all workers' draws is exactly a Poisson(q) sample of the union.
    """
    return poisson_sample(local_sampling_generator(seed, shard_index, worker_index, step), example_count,
                          sampling_rate)
