"""Correlated-noise mechanisms: strategies, sensitivity, the noise recursion and their accounting (pure math)."""

from __future__ import annotations

import itertools
import math

import dp_accounting
import numpy as np
import pytest

from accounting.accountants import PldAccountant, RdpAccountant, rdp_vector
from accounting.events import Composition, CorrelatedGaussian, EventError, SampledGaussian
from accounting.matrix_mechanisms import (
    CorrelatedNoisePlan, StrategyError, band_coefficients, banded_inverse_noise, banded_prefix_rmse,
    banded_sensitivity, column_norms, fixed_order_patterns, fixed_order_tree_sensitivities, inverse_coefficients,
    pattern_sensitivity, prefix_workload, sampler_refusal, toeplitz_matrix, tree_nodes, tree_prefix_noise,
    tree_prefix_rmse, tree_sensitivity, tree_strategy,
)


@pytest.fixture(autouse=True)
def strategy_cache(tmp_path, monkeypatch):
    """Each test optimises into a cache of its own, so no test reads another's files."""
    monkeypatch.setenv("DPFLEET_CACHE_DIR", str(tmp_path))
    band_coefficients.cache_clear()


def test_band_strategy_has_unit_column_norm_and_beats_its_start_and_dp_sgd():
    coefficients = np.array(band_coefficients(64, 1, 4))
    assert len(coefficients) == 4
    assert np.linalg.norm(coefficients) == pytest.approx(1.0, abs=1e-12)
    assert column_norms(toeplitz_matrix(coefficients, 64)).max() == pytest.approx(1.0, abs=1e-12)
    square_root = np.array([1.0, 0.5, 0.375, 0.3125])
    square_root /= np.linalg.norm(square_root)
    optimised = banded_prefix_rmse(coefficients, 64, 1.0, 1.0)
    assert optimised <= banded_prefix_rmse(square_root, 64, 1.0, 1.0) + 1e-12
    # DP-SGD's prefix error grows like sqrt(n): four bands cut it by over 40% at n = 64 (3.24 against 5.70).
    assert optimised < 0.6 * banded_prefix_rmse([1.0], 64, 1.0, 1.0)


def test_prefix_rmse_matches_the_explicit_matrices():
    coefficients = np.array(band_coefficients(20, 2, 3))
    strategy = toeplitz_matrix(coefficients, 20)
    explicit = np.linalg.norm(prefix_workload(20) @ np.linalg.inv(strategy)) / math.sqrt(20)
    assert banded_prefix_rmse(coefficients, 20, 1.0, 1.0) == pytest.approx(explicit, rel=1e-10)
    assert np.allclose(np.linalg.inv(strategy)[:, 0], inverse_coefficients(coefficients, 20))


def test_band_strategy_is_cached_on_disk_by_steps_epochs_and_band(tmp_path):
    first = band_coefficients(30, 2, 3)
    assert (tmp_path / "strategies" / "band-v2-30-2-3.json").exists()
    band_coefficients.cache_clear()
    assert band_coefficients(30, 2, 3) == first
    with pytest.raises(StrategyError, match="band_width must be at most the run's steps, 5"):
        band_coefficients(5, 1, 6)


def test_banded_inverse_recursion_matches_the_explicit_inverse():
    coefficients = np.array(band_coefficients(12, 1, 3))
    unit_noise = np.random.default_rng(0).standard_normal((12, 5))
    explicit = np.linalg.inv(toeplitz_matrix(coefficients, 12)) @ unit_noise
    assert np.allclose(banded_inverse_noise(coefficients, unit_noise), explicit, atol=1e-12)


def _patterns_with_separation(steps: int, participations: int, separation: int):
    """Every set of at most `participations` steps of 0..steps-1 whose members are >= `separation` apart."""
    for size in range(1, participations + 1):
        for pattern in itertools.combinations(range(steps), size):
            if all(b - a >= separation for a, b in zip(pattern, pattern[1:])):
                yield np.array(pattern)


@pytest.mark.parametrize("steps,bands,participations", [(8, 2, 2), (9, 3, 3), (10, 1, 4)])
def test_banded_sensitivity_equals_brute_force_over_patterns_and_signs(steps, bands, participations):
    coefficients = np.array(band_coefficients(steps, participations, bands))
    strategy = toeplitz_matrix(coefficients, steps)
    brute = 0.0
    for pattern in _patterns_with_separation(steps, participations, bands):
        for signs in itertools.product((-1.0, 1.0), repeat=len(pattern)):
            contribution = np.zeros(steps)
            contribution[pattern] = signs
            brute = max(brute, float(np.linalg.norm(strategy @ contribution)))
    assert brute == pytest.approx(banded_sensitivity(coefficients, participations), rel=1e-12)
    steps_per_epoch = math.ceil(steps / participations)
    if steps_per_epoch >= bands:
        assert pattern_sensitivity(strategy, fixed_order_patterns(steps, steps_per_epoch)) <= brute + 1e-12


def test_tree_sensitivity_brute_force_and_node_counting_agree():
    for steps, steps_per_epoch in [(8, 8), (12, 4), (16, 5), (7, 3)]:
        strategy = tree_strategy(steps)
        by_count = fixed_order_tree_sensitivities(steps, steps_per_epoch)
        assert by_count[-1] == pytest.approx(
            pattern_sensitivity(strategy, fixed_order_patterns(steps, steps_per_epoch)), rel=1e-12)
    assert tree_sensitivity(8) == pytest.approx(2.0)  # 8 leaves: levels 0..3
    assert column_norms(tree_strategy(8)).max() == pytest.approx(2.0)


def test_tree_prefix_noise_sums_the_covering_nodes():
    leaves = 11
    strategy = tree_strategy(leaves)
    levels = {}
    row = 0
    for level in range(5):
        for index in range(math.ceil(leaves / (1 << level))):
            levels[(level, index)] = row
            row += 1
    for position in range(leaves):
        covering = np.zeros(leaves)
        for node in tree_nodes(position, leaves):
            covering += strategy[levels[node]]
        assert np.array_equal(covering, np.r_[np.ones(position + 1), np.zeros(leaves - position - 1)])
    assert tree_nodes(7, 8, complete=True) == [(3, 0)]
    unit_nodes = {node: np.full(2, float(i)) for i, node in enumerate(levels)}
    assert np.array_equal(tree_prefix_noise(unit_nodes, 2, leaves), unit_nodes[(1, 0)] + unit_nodes[(0, 2)])
    # 7 leaves: the last prefix is three nodes, or the completed root alone.
    assert tree_nodes(6, 7, complete=True) == [(3, 0)] and len(tree_nodes(6, 7)) == 3
    assert tree_prefix_rmse(7, 1.0, 1.0, complete=True) < tree_prefix_rmse(7, 1.0, 1.0)


def test_one_band_amplified_is_dp_sgd_exactly():
    plan = CorrelatedNoisePlan("band-mf", "cyclic-poisson", 100, 25, band_width=1, participation_rate=0.04)
    assert plan.coefficients == (1.0,)
    events = plan.events(1.1)
    dp_sgd = Composition((SampledGaussian(0.04, 1.1, 100),))
    for accountant in (PldAccountant(), RdpAccountant()):
        assert accountant.epsilon(events, 1e-5) == accountant.epsilon(dp_sgd, 1e-5)
    # Step by step the charges add up to the whole run's.
    by_step = Composition()
    for step in range(100):
        by_step = by_step.then(plan.events_between(1.1, step, step + 1))
    assert by_step == events


def test_amplified_band_mf_matches_the_published_reduction():
    # Choquette-Choo et al. 2023 (as jax_privacy accounts it): DP-SGD at rate B / (N // b), ceil(n / b) times.
    dataset_size, batch_size, bands, steps, sigma = 1000, 10, 4, 60, 0.9
    rate = batch_size / (dataset_size // bands)
    plan = CorrelatedNoisePlan("band-mf", "cyclic-poisson", steps, dataset_size // batch_size, bands, rate)
    reference = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    reference.compose(dp_accounting.PoissonSampledDpEvent(rate, dp_accounting.GaussianDpEvent(sigma)),
                      math.ceil(steps / bands))
    assert PldAccountant().epsilon(plan.events(sigma), 1e-5) == pytest.approx(
        reference.get_epsilon(1e-5), rel=1e-9)


def test_unamplified_mechanisms_are_one_gaussian_of_the_matrix_sensitivity():
    plan = CorrelatedNoisePlan("band-mf", "fixed-order", 40, 10, band_width=3)
    assert plan.sensitivity == pytest.approx(2.0)  # sqrt(4 epochs) at unit column norm
    sigma = 3.0
    gaussian = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    gaussian.compose(dp_accounting.GaussianDpEvent(sigma / plan.sensitivity))
    assert PldAccountant().epsilon(plan.events(sigma), 1e-5) == pytest.approx(gaussian.get_epsilon(1e-5), rel=1e-3)
    rdp = dp_accounting.rdp.RdpAccountant()
    rdp.compose(dp_accounting.GaussianDpEvent(sigma / plan.sensitivity))
    assert RdpAccountant().epsilon(plan.events(sigma), 1e-5) == pytest.approx(rdp.get_epsilon(1e-5), rel=1e-6)
    tree = CorrelatedNoisePlan("dp-ftrl", "fixed-order", 40, 10, tree_restart=False)
    assert tree.sensitivity == pytest.approx(pattern_sensitivity(tree_strategy(40), fixed_order_patterns(40, 10)))
    restarted = CorrelatedNoisePlan("dp-ftrl", "fixed-order", 40, 10)
    assert restarted.sensitivity == pytest.approx(math.sqrt(4 * 5))  # 10 leaves: 5 levels, 4 trees


def test_every_prefix_is_charged_at_least_its_sensitivity():
    plan = CorrelatedNoisePlan("dp-ftrl", "fixed-order", 24, 6, tree_restart=False)
    strategy = tree_strategy(24)
    for end in range(1, 25):
        charged = plan.events_between(1.0, 0, end)
        charged_square = sum(event.sensitivity_factor**2 * event.steps for event in charged.events)
        prefix = strategy[:, :end]
        true = pattern_sensitivity(prefix, [pattern[pattern < end] for pattern in fixed_order_patterns(24, 6)])
        assert charged_square >= true**2 - 1e-9


def test_correlated_events_round_trip_and_stay_apart_from_dp_sgd():
    event = CorrelatedGaussian(1.0, 2.0, 3, 1.0, "band-mf", 4, 25)
    composition = Composition((SampledGaussian(1.0, 2.0, 3), event))
    assert len(composition.events) == 2  # never merged into a DP-SGD record
    assert Composition.from_json(composition.to_json()) == composition
    assert np.array_equal(rdp_vector(composition), 2 * rdp_vector(Composition((event,))))
    with pytest.raises(EventError, match="mechanism must be one of"):
        CorrelatedGaussian(1.0, 2.0, 3, 1.0, "blt", 4, 25)
    with pytest.raises(EventError, match="unknown event kind"):
        Composition.from_dict({"schema": "dpfleet.events", "version": 1, "events": [{"kind": "matrix"}]})


def test_samplers_that_do_not_match_the_mechanism_are_refused():
    assert sampler_refusal("dp-sgd", "poisson") is None
    assert "needs sampler = \"poisson\"" in sampler_refusal("dp-sgd", "fixed-order")
    assert "needs sampler = \"fixed-order\"" in sampler_refusal("dp-ftrl", "cyclic-poisson")
    assert "cyclic-poisson" in sampler_refusal("band-mf", "poisson")
    with pytest.raises(StrategyError, match="at most the steps of one epoch, 5"):
        CorrelatedNoisePlan("band-mf", "fixed-order", 20, 5, band_width=6)
