"""The driver's Poisson sampling of logical batches and their split across workers (pure functions)."""

from __future__ import annotations

import numpy as np

# One implementation, shared with the workers, which sample locally in shard mode.
from workers.sampling import (  # noqa: F401 - re-exported for the driver
    cyclic_poisson_batch, fixed_order_batch, make_generator, poisson_sample, shuffled_order, step_generator,
)


def partition(indices: np.ndarray, parts: int) -> list[np.ndarray]:
    """Split a batch's indices into `parts` near-equal contiguous shards (sizes differ by <= 1)."""
    return np.array_split(indices, parts)


def microbatch_count(expected_batch_size: float, microbatch_size: int) -> int:
    """G, the fixed number of microbatches a step's examples are spread over: about batch / k."""
    return max(1, round(expected_batch_size / microbatch_size))


def assign_microbatches(generator: np.random.Generator, example_count: int, microbatches: int) -> np.ndarray:
    """Each sampled example's microbatch, drawn independently and uniformly.

    Independent assignment means adding or removing one example changes
    exactly one microbatch, which is what the sensitivity factor 2 assumes.
    """
    return generator.integers(0, microbatches, size=example_count)


def partition_microbatches(
    indices: np.ndarray, group_ids: np.ndarray, parts: int
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Split a batch across `parts` workers keeping each microbatch whole (microbatch g goes to worker g mod parts)."""
    owners = group_ids % parts
    return ([indices[owners == part] for part in range(parts)], [group_ids[owners == part] for part in range(parts)])


def worker_shares(
    indices: np.ndarray, group_ids: np.ndarray | None, parts: int
) -> tuple[list[np.ndarray], list[np.ndarray] | None]:
    """Each of `parts` workers' share of a step's sample, and with microbatches (`group_ids`) their microbatch ids."""
    if group_ids is None:
        return partition(indices, parts), None
    return partition_microbatches(indices, group_ids, parts)


def step_sample(run_key, step: int, dataset_size: int, sampling_rate: float,
                microbatches: int | None) -> tuple[np.ndarray, np.ndarray | None]:
    """Step `step`'s Poisson sample and, with microbatches, each sampled example's microbatch.

    Both come from PRF(run key, "sample", step): drawn again, the step gets the same sample.
    """
    generator = step_generator(run_key, step)
    indices = poisson_sample(generator, dataset_size, sampling_rate)
    return indices, assign_microbatches(generator, len(indices), microbatches) if microbatches else None


def correlated_step_sample(run_key, order: np.ndarray, step: int, correlation, batch_size: int) -> np.ndarray:
    """Step `step`'s batch for a correlated mechanism's sampler (`correlation`, a CorrelatedNoisePlan): fixed order,
    or cyclic Poisson over its band_width groups of the run's shuffled `order`."""
    if correlation.sampler == "fixed-order":
        return fixed_order_batch(order, step, batch_size)
    return cyclic_poisson_batch(run_key, order, step, correlation.band_width, correlation.participation_rate)
