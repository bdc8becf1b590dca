"""Poisson sampling, for the driver over one dataset and for each worker over its own examples (pure functions)."""

from __future__ import annotations

import numpy as np

from workers.keys import LOCAL_SAMPLE, SAMPLE, SecretKey, process_key


def make_generator(seed: int | None, *stream: int) -> np.random.Generator:
    """A numpy Generator: from OS entropy when `seed` is None, else reproducible for tests.

    `stream` (one or more non-negative integers) separates independent
    streams under one seed. Sampling that the run's ε rests on (each step's
    Poisson sample) comes from a `SecretKey` instead (`step_generator`).
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


def step_generator(key: SecretKey, step: int) -> np.random.Generator:
    """The generator step `step` (0-based) is sampled from: PRF(key, "sample", step), so it replays only under `key`."""
    return key.numpy_generator(SAMPLE, step)


def local_sampling_key(seed: int | None, shard_index: int, worker_index: int) -> SecretKey:
    """A shard worker's own key for its local sampling, held in its memory only.

    Fresh from the OS when `seed` is None. With a seed (tests only) it is
    derived from (seed, shard, worker within the shard), so a seeded run's
    workers, and their replacements, draw exactly the same examples.
    """
    return process_key(seed, LOCAL_SAMPLE, shard_index, worker_index)


def local_poisson_sample(key: SecretKey, step: int, example_count: int, sampling_rate: float) -> np.ndarray:
    """One worker's share of step `step`'s Poisson sample: positions among its own `example_count` examples.

    Each worker holds a disjoint range of the union dataset and includes each of
    its examples independently with probability q from a stream of its own
    (PRF of its `key` and the step), so the union of all workers' draws is
    exactly a Poisson(q) sample of the union, and a retried step draws the same.
    """
    return poisson_sample(step_generator(key, step), example_count, sampling_rate)
