"""Poisson sampling, partitioning and central noise: statistical tests with fixed seeds."""

import math
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from scipy import stats

import workers.sampling as sampling_module

from orchestrator.aggregation import group_by_node, split_counts
from orchestrator.noise import CHUNK_VALUES, GRADIENT_NOISE, GaussianNoise, noisy_mean_gradient, noisy_sum_at
from orchestrator.sampling import make_generator, partition, poisson_sample, step_generator
from workers.keys import SecretKey


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


@pytest.mark.parametrize("chunk", [None, 1], ids=["one chunk", "a chunk per gap"])
def test_poisson_sample_draws_every_inclusion_pattern_with_its_product_probability(monkeypatch, chunk):
    """The geometric gaps give exactly independent Bernoulli(q) inclusion: on 5 examples, each of the 32 patterns
    of who joins turns up as often as q^k (1-q)^(5-k) says (chi-square), drawn under the run key's PRF; also when
    every gap is a chunk of its own (the path of a batch past the first chunk)."""
    if chunk is not None:
        monkeypatch.setattr(sampling_module, "_gap_chunk", lambda *_: chunk)
    key, dataset_size, rate, steps = SecretKey.from_seed(13), 5, 0.3, 20_000
    patterns = np.zeros(2**dataset_size)
    for step in range(steps):
        patterns[(1 << poisson_sample(step_generator(key, step), dataset_size, rate)).sum()] += 1
    joined = np.array([bin(pattern).count("1") for pattern in range(2**dataset_size)])
    expected = steps * rate**joined * (1 - rate) ** (dataset_size - joined)
    assert stats.chisquare(patterns, expected).pvalue > 1e-3


def test_poisson_batch_sizes_follow_the_binomial_and_samples_are_sorted_and_distinct():
    """Batch sizes over 4,000 steps of N = 20,000 at q = 0.01 against Binomial(N, q) (chi-square on its central
    bins), and every sample a sorted set inside 0..N-1."""
    key, dataset_size, rate, steps = SecretKey.from_seed(17), 20_000, 0.01, 4000
    samples = [poisson_sample(step_generator(key, step), dataset_size, rate) for step in range(steps)]
    assert all(np.all(np.diff(sample) > 0) and (not len(sample) or 0 <= sample[0] <= sample[-1] < dataset_size)
               for sample in samples)
    sizes = np.array([len(sample) for sample in samples])
    edges = np.arange(160, 241, 8)
    observed = np.bincount(np.searchsorted(edges, sizes, side="right"), minlength=len(edges) + 1)
    binomial = stats.binom(dataset_size, rate)
    cells = np.diff([0.0, *binomial.cdf(edges - 1), 1.0])
    assert stats.chisquare(observed, steps * cells).pvalue > 1e-3


def test_a_step_sample_is_a_pure_function_of_the_key_and_the_step():
    key = SecretKey.from_seed(19)
    first = poisson_sample(step_generator(key, 4), 20_000_000, 250 / 20_000_000)
    assert np.array_equal(first, poisson_sample(step_generator(key, 4), 20_000_000, 250 / 20_000_000))
    assert not np.array_equal(first, poisson_sample(step_generator(key, 5), 20_000_000, 250 / 20_000_000))
    assert not np.array_equal(first, poisson_sample(step_generator(SecretKey.from_seed(20), 4), 20_000_000,
                                                    250 / 20_000_000))


def test_poisson_sample_at_rates_zero_and_one():
    generator = make_generator(5, 0)
    assert len(poisson_sample(generator, 100, 0.0)) == 0
    assert np.array_equal(poisson_sample(generator, 100, 1.0), np.arange(100))
    assert len(poisson_sample(generator, 0, 0.5)) == 0


@given(st.lists(st.integers(0, 10**6), unique=True, max_size=200), st.integers(1, 9))
def test_partition_is_near_equal_and_keeps_every_index(indices, parts):
    shards = partition(np.array(sorted(indices), dtype=np.int64), parts)
    assert len(shards) == parts
    sizes = [len(shard) for shard in shards]
    assert max(sizes) - min(sizes) <= 1
    assert sorted(np.concatenate(shards).tolist()) == sorted(indices)


def test_noise_std_is_sigma_times_clip_norm():
    noise = GaussianNoise(SecretKey.from_seed(5))
    sigma, clip_norm, size = 1.3, 1.5, 200_000
    draws = noise.draw(size, sigma * clip_norm, (GRADIENT_NOISE, 0))
    assert draws.std() == pytest.approx(sigma * clip_norm, rel=0.03)
    assert abs(draws.mean()) < 4 * sigma * clip_norm / math.sqrt(size)


def test_unseeded_noise_differs_between_sources():
    assert not np.array_equal(GaussianNoise().draw(8, 1.0, (0, 0)), GaussianNoise().draw(8, 1.0, (0, 0)))
    assert not GaussianNoise().seeded and GaussianNoise(SecretKey.from_seed(1)).seeded


def test_noisy_mean_adds_the_parts_then_the_noise_and_divides_by_the_expected_batch_size():
    parts = [np.array([3.0, -6.0], dtype=np.float32), np.array([1.0, 0.5])]
    out = np.empty(2, dtype=np.float32)
    noisy_mean_gradient(parts, np.array([0.5, 1.0]), 2.0, 4.0, out)
    np.testing.assert_array_equal(out, [1.25, -0.875])
    assert noisy_sum_at(parts, np.array([0.5, 1.0]), 2.0, np.array([1])) == pytest.approx([-3.5])


@pytest.mark.parametrize("threads", [None, 3])
def test_the_noisy_mean_of_a_large_vector_is_computed_in_float64_chunk_by_chunk(threads):
    generator = np.random.default_rng(3)
    size = 3 * CHUNK_VALUES + 17
    parts = [generator.standard_normal(size).astype(np.float32) for _ in range(3)] + [generator.standard_normal(size)]
    unit_noise = generator.standard_normal(size)
    out = np.empty(size, dtype=np.float32)
    pool = ThreadPoolExecutor(threads) if threads else None
    noisy_mean_gradient(parts, unit_noise, 1.7, 64.0, out, pool)
    expected = ((np.add.reduce(parts, dtype=np.float64) + 1.7 * unit_noise) / 64.0).astype(np.float32)
    np.testing.assert_array_equal(out, expected)
    # An empty list of parts (every shard lost under "skip") releases the noise alone.
    noisy_mean_gradient([], unit_noise, 1.7, 64.0, out, pool)
    np.testing.assert_array_equal(out, (1.7 * unit_noise / 64.0).astype(np.float32))


def test_nodes_group_their_workers_and_counts_are_split_off_the_sums():
    assert group_by_node({0: "a", 1: "b", 2: "a", 3: "c"}, [3, 2, 1, 0]) == {"c": [3], "a": [2, 0], "b": [1]}
    parts = [np.array([1.0, 2.0, 5.0, 1.0], dtype=np.float32), np.array([0.5, 0.5, 2.0, 0.0])]
    sums, counts = split_counts(parts, 2, 2)
    assert [part.tolist() for part in sums] == [[1.0, 2.0], [0.5, 0.5]] and counts.tolist() == [7.0, 1.0]
    assert all(np.shares_memory(part, whole) for part, whole in zip(sums, parts))
