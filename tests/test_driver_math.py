"""Poisson sampling, partitioning and central noise: statistical tests with fixed seeds."""

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from orchestrator.noise import GaussianNoise, average_noisy_sum
from orchestrator.sampling import make_generator, partition, poisson_sample


def test_poisson_batch_size_mean_within_four_standard_errors():
    generator = make_generator(7, 0)
    dataset_size, rate, steps = 60000, 250 / 60000, 2000
    sizes = np.array([len(poisson_sample(generator, dataset_size, rate)) for _ in range(steps)])
    expected = rate * dataset_size
    standard_error = math.sqrt(dataset_size * rate * (1 - rate) / steps)
    assert abs(sizes.mean() - expected) < 4 * standard_error
    # Sizes vary like a binomial, not a fixed batch.
    assert sizes.std() == pytest.approx(math.sqrt(dataset_size * rate * (1 - rate)), rel=0.1)


def test_poisson_sampling_includes_each_example_independently():
    generator = make_generator(11, 0)
    dataset_size, rate, steps = 50, 0.3, 20000
    counts = np.zeros(dataset_size)
    for _ in range(steps):
        counts[poisson_sample(generator, dataset_size, rate)] += 1
    standard_error = math.sqrt(rate * (1 - rate) / steps)
    assert np.all(np.abs(counts / steps - rate) < 5 * standard_error)


def test_poisson_batches_can_be_empty():
    generator = make_generator(3, 0)
    sizes = [len(poisson_sample(generator, 20, 0.02)) for _ in range(500)]
    # P(empty) = 0.98^20 = 0.667
    assert sizes.count(0) / 500 == pytest.approx(0.98**20, abs=0.07)


@given(st.lists(st.integers(0, 10**6), unique=True, max_size=200), st.integers(1, 9))
def test_partition_is_near_equal_and_keeps_every_index(indices, parts):
    shards = partition(np.array(sorted(indices), dtype=np.int64), parts)
    assert len(shards) == parts
    sizes = [len(shard) for shard in shards]
    assert max(sizes) - min(sizes) <= 1
    assert sorted(np.concatenate(shards).tolist()) == sorted(indices)


def test_noise_std_is_sigma_times_clip_norm():
    noise = GaussianNoise(seed=5)
    sigma, clip_norm, size = 1.3, 1.5, 200_000
    draws = noise.draw(size, sigma * clip_norm)
    assert draws.std() == pytest.approx(sigma * clip_norm, rel=0.03)
    assert abs(draws.mean()) < 4 * sigma * clip_norm / math.sqrt(size)


def test_unseeded_noise_differs_between_sources():
    assert not np.array_equal(GaussianNoise().draw(8, 1.0), GaussianNoise().draw(8, 1.0))
    assert not GaussianNoise().seeded and GaussianNoise(1).seeded


def test_noisy_mean_divides_by_the_expected_batch_size():
    noisy_sum = np.array([3.0, -6.0], dtype=np.float32) + np.array([1.0, 2.0])
    result = average_noisy_sum(noisy_sum, expected_batch_size=4.0)
    assert result.dtype == np.float32
    np.testing.assert_allclose(result, [1.0, -1.0])
