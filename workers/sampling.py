"""Poisson sampling, for the driver over one dataset and for each worker over its own examples, and the fixed-order
and cyclic Poisson samplers of the correlated-noise mechanisms (pure functions)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from workers.keys import LOCAL_SAMPLE, ORDER, SAMPLE, SecretKey, process_key


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
    """Indices of one logical batch, sorted: every example joins independently with probability q.

    The batch size varies from step to step and may be zero. The joined
    examples are drawn as the gaps between them, each Geometric(q) (the
    trials up to the next success of independent Bernoulli(q) trials), so
    the sample is exactly independent Bernoulli(q) inclusion at a cost of
    O(q·N), not O(N): a step of 250 among 20M rows draws about 250 numbers.
    """
    if dataset_size <= 0 or sampling_rate <= 0:
        return np.zeros(0, dtype=np.int64)
    if sampling_rate >= 1:
        return np.arange(dataset_size, dtype=np.int64)
    chunk = _gap_chunk(dataset_size, sampling_rate)
    joined, last = [], -1
    while True:
        positions = last + np.cumsum(generator.geometric(sampling_rate, size=chunk))
        if positions[-1] >= dataset_size:
            joined.append(positions[:np.searchsorted(positions, dataset_size)])
            return np.concatenate(joined)
        joined.append(positions)
        last = int(positions[-1])


def _gap_chunk(dataset_size: int, sampling_rate: float) -> int:
    """How many gaps `poisson_sample` draws at a time: the expected batch plus six standard deviations (and 16).

    It fixes how the generator's stream is consumed (so a step's sample is
    a pure function of its key); a batch past it draws another chunk.
    """
    expected = dataset_size * sampling_rate
    return int(expected + 6 * np.sqrt(expected) + 16)


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


def shuffled_order(key: SecretKey, dataset_size: int) -> np.ndarray:
    """The run's one shuffle of 0..N-1, from PRF(key, "order"): the order fixed-order epochs cycle through and the
    groups cyclic Poisson sampling takes in turn."""
    return key.numpy_generator(ORDER).permutation(dataset_size)


def fixed_order_batch(order: np.ndarray, step: int, batch_size: int) -> np.ndarray:
    """Step `step`'s batch in fixed order: the next `batch_size` examples of `order`, from the start every epoch.

    An epoch is len(order) // batch_size steps; the len(order) mod batch_size
    examples at its end never take part. Each example takes part once per
    epoch, at the same position, so its participations are one epoch apart.
    """
    position = step % (len(order) // batch_size)
    return np.sort(order[position * batch_size:(position + 1) * batch_size])


@dataclass(frozen=True)
class SiloFixedOrder:
    """Fixed-order participation in one silo worker: its examples shuffled once, one slice a step, every epoch.

    `order_key` is the 32-byte PRF output the driver derives for this
    (shard, worker) from its run key, so that a replacement worker takes the
    same examples at the same steps; the accounting (no amplification) does
    not rest on it being secret, but it is kept out of every `repr` and log.
    `steps_per_epoch` is the run's s = N // batch_size over all silos.
    """

    order_key: bytes = field(repr=False)
    steps_per_epoch: int

    def __post_init__(self) -> None:
        if self.steps_per_epoch < 1:
            raise ValueError(f"steps_per_epoch must be >= 1 (got {self.steps_per_epoch})")

    def order(self, example_count: int) -> np.ndarray:
        """This worker's one shuffle of its `example_count` examples."""
        return shuffled_order(SecretKey(self.order_key), example_count)


def silo_fixed_order_batch(order: np.ndarray, step: int, steps_per_epoch: int) -> np.ndarray:
    """Step `step`'s batch among a silo worker's examples in fixed order: slice step mod s of its `order`.

    The s slices (`part_bounds`) tile the worker's examples, so each takes
    part exactly once an epoch, always at the same step of it: its
    participations are s steps apart, the separation the driver's
    fixed-order accounting assumes for all N examples. Every silo's slices
    add up to about N / s ≥ batch_size examples a step.
    """
    start, stop = part_bounds(len(order), step % steps_per_epoch, steps_per_epoch)
    return np.sort(order[start:stop])


def cyclic_poisson_batch(key: SecretKey, order: np.ndarray, step: int, groups: int, rate: float) -> np.ndarray:
    """Step `step`'s batch under cyclic Poisson sampling: group step mod `groups` of `order`, each of its
    N // groups examples joining independently with probability `rate` (PRF(key, "sample", step))."""
    group_size = len(order) // groups
    group = step % groups
    members = order[group * group_size:(group + 1) * group_size]
    return np.sort(members[poisson_sample(step_generator(key, step), group_size, rate)])


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
