"""The Skellam accountant: its RDP at hand-computed values, the subsampled bound against dp-accounting's sampled
Gaussian, its event records through every accountant and the ledger's filter, and the silos' integer noise."""

import math

import dp_accounting
import numpy as np
import pytest

from accounting.accountants import RDP_ORDERS, SKELLAM_LABEL, get_accountant, labelled_epsilon, rdp_vector
from accounting.events import (
    Composition,
    SampledGaussian,
    SampledSkellam,
    event_of,
    group_events,
    noise_placement,
    skellam_events,
)
from accounting.ledger.admission import AdmissionRule, RdpTally, canonical, committed_json_with
from accounting.skellam import poisson_subsampled_rdp, sampled_skellam_rdp, skellam_rdp
from workers.secure_aggregation import noise_tail_bound, skellam_scale, skellam_share

ORDERS = np.array([2, 3, 4, 8, 16, 32, 64])


def sampled_gaussian_rdp(sampling_rate, noise_multiplier, orders=ORDERS):
    accountant = dp_accounting.rdp.RdpAccountant(orders=[float(order) for order in orders])
    accountant.compose(dp_accounting.PoissonSampledDpEvent(sampling_rate,
                                                           dp_accounting.GaussianDpEvent(noise_multiplier)))
    return np.array(accountant.rdp)


def test_skellam_rdp_at_hand_computed_values():
    # α Δ2²/(2μ) + min(((2α−1)Δ2² + 6Δ1)/(4μ²), 3Δ1/(2μ)), μ the variance (Agarwal et al. 2021, Theorem 3.5).
    assert skellam_rdp(2, 1.0, 1.0, 1.0) == pytest.approx(1.0 + 1.5)  # the second branch: 9/4 > 3/2
    assert skellam_rdp(10, 2.0, 3.0, 100.0) == pytest.approx(0.2 + 94 / 40_000)  # the first: 0.00235 < 0.045
    # With no L1 sensitivity it is the Gaussian mechanism's α Δ²/(2μ) exactly.
    assert skellam_rdp(7, 3.0, 0.0, 5.0) == pytest.approx(7 * 9 / 10)


@pytest.mark.parametrize("scale", [1.0, 64.0, 2.0**20])
def test_skellam_rdp_agrees_with_its_statement_in_unscaled_units(scale):
    # The same theorem as TensorFlow Federated states it for a sum scaled by s before rounding: sensitivities and
    # variance in the data's units, so that Δ2 → s·l2, Δ1 → s·l1, μ → s²·var.
    l2, l1, variance = 1.3, 40.0, 2.5

    def unscaled(order):
        return order / (2 * variance) * l2**2 + min(
            ((2 * order - 1) * scale * l2**2 + 6 * l1) / (4 * scale**3 * variance**2), 3 * l1 / (2 * scale * variance))
    for order in (2, 5, 33, 256):
        assert skellam_rdp(order, scale * l2, scale * l1, scale**2 * variance) == pytest.approx(unscaled(order))


@pytest.mark.parametrize("sampling_rate, noise_multiplier", [(0.01, 1.0), (0.002, 0.8), (0.1, 2.0)])
def test_zhu_wang_bound_is_dp_accountings_sampled_gaussian_at_order_2_and_above_it_elsewhere(sampling_rate,
                                                                                         noise_multiplier):
    exact = sampled_gaussian_rdp(sampling_rate, noise_multiplier)
    bound = np.array([poisson_subsampled_rdp(order, sampling_rate, lambda ells: ells / (2 * noise_multiplier**2))
                      for order in ORDERS])
    assert bound[0] == pytest.approx(exact[0], rel=1e-9)  # at α = 2 Theorem 6 is tight
    assert np.all(bound >= exact * (1 - 1e-12))
    # Without sampling there is nothing to amplify: the mechanism's own RDP.
    assert poisson_subsampled_rdp(5, 1.0, lambda ells: ells * 0.3) == pytest.approx(1.5)


def test_sampled_skellam_approaches_the_sampled_gaussian_from_above_as_its_variance_grows():
    sampling_rate, noise_multiplier, coordinates = 0.01, 1.0, 10**6
    exact = sampled_gaussian_rdp(sampling_rate, noise_multiplier)
    limit = np.array([poisson_subsampled_rdp(order, sampling_rate, lambda ells: ells / (2 * noise_multiplier**2))
                      for order in ORDERS])
    previous = None
    for scaled_clip in (1e4, 1e5, 1e6, 1e9):  # s·C: the noise's std is σ·s·C, rounding adds √d to Δ2
        l2 = scaled_clip + math.sqrt(coordinates)
        curve = np.array([poisson_subsampled_rdp(order, sampling_rate, lambda ells: skellam_rdp(
            ells, l2, math.sqrt(coordinates) * l2, (noise_multiplier * scaled_clip) ** 2)) for order in ORDERS])
        assert np.all(curve >= exact * (1 - 1e-12))
        if previous is not None:
            assert np.all(curve <= previous)
        previous = curve
    assert previous == pytest.approx(limit, rel=1e-5)


def test_a_skellam_step_costs_a_little_more_epsilon_than_the_gaussian_at_the_same_sigma():
    gaussian = SampledGaussian(0.004, 1.1, 2400)
    skellam = skellam_events(gaussian, 2.0**-12)
    gaussian_rdp, skellam_rdp_epsilon = (get_accountant("rdp").epsilon(events, 1e-5) for events in (gaussian, skellam))
    assert gaussian_rdp < skellam_rdp_epsilon < 1.1 * gaussian_rdp
    assert np.all(rdp_vector(skellam) >= rdp_vector(gaussian))
    # The per-step curve is the module's function, times the steps.
    assert rdp_vector(skellam) == pytest.approx(2400 * sampled_skellam_rdp(RDP_ORDERS, 0.004, 1.1, 1.0, 2.0**-12))


def test_every_rigorous_accountant_reports_the_skellam_rdp_bound_and_says_so():
    events = Composition((SampledSkellam(0.01, 1.2, 500, 1.0, 2.0**-12),))
    rdp_epsilon = get_accountant("rdp").epsilon(events, 1e-5)
    for name in ("pld", "rdp"):
        assert labelled_epsilon(get_accountant(name), events, 1e-5) == (rdp_epsilon, SKELLAM_LABEL)
    assert get_accountant("pld").delta(events, rdp_epsilon) == get_accountant("rdp").delta(events, rdp_epsilon)
    assert labelled_epsilon(get_accountant("gdp"), events, 1e-5)[1] == "gdp (approximate)"


def test_skellam_records_round_trip_name_their_placement_and_keep_their_kind():
    step = SampledSkellam(0.01, 1.2, 7, 1.0, 2.0**-12)
    record = step.to_dict()
    assert record["kind"] == "sampled_skellam" and record["noise_placement"] == "silos"
    composition = Composition((step, SampledGaussian(0.01, 1.2, 3)))
    assert Composition.from_json(composition.to_json()) == composition
    assert noise_placement(Composition((step,))) == "silos" and noise_placement(composition) == "driver"
    assert event_of(step.mechanism_key, 2) == step.with_steps(2)
    (grouped,) = group_events(step, 3).events
    assert isinstance(grouped, SampledSkellam) and grouped.sensitivity_factor == 3.0
    # A Skellam step and a Gaussian one of the same (q, σ, k) are different mechanisms: never merged.
    assert len(canonical(composition).events) == 2


def test_the_ledgers_filter_tallies_and_admits_skellam_steps_at_their_rdp():
    steps = Composition((SampledSkellam(0.01, 1.2, 500, 1.0, 2.0**-12),))
    tally = RdpTally.of(steps)
    assert np.all(tally.divergences() >= rdp_vector(steps))
    assert np.all(tally.divergences() <= rdp_vector(steps) * (1 + 1e-12) + 1e-15)
    rule = AdmissionRule((8.0, 16.0, 32.0), 1e-5)
    epsilon = rule.epsilon(tally)
    assert get_accountant("rdp").epsilon(steps, 1e-5) <= epsilon  # the filter's orders and δ/K: never below
    assert rule.epsilon(RdpTally.of(SampledGaussian(0.01, 1.2, 500))) < epsilon
    # A commit of more Skellam steps rewrites the stored record's count in place.
    stored = canonical(steps).to_json()
    assert committed_json_with(stored, steps.split(5)[0]) == canonical(steps.then(steps.split(5)[0])).to_json()


def test_skellam_shares_sum_to_the_target_variance():
    generator = np.random.default_rng(11)  # a fixed seed: the test's tolerance is stated below
    variance, size = 4.0e6, 200_000
    shares = [skellam_share(generator, variance / 3, size) for _ in range(3)]
    total = np.sum(shares, axis=0)
    assert total.dtype == np.int64
    # The sample variance of 200k draws is within ±1% of the true one (its relative std is √(2/n) ≈ 0.3%).
    assert abs(total.var() / variance - 1) < 0.01
    assert abs(total.mean()) < 5 * math.sqrt(variance / size)
    assert np.abs(total).max() < noise_tail_bound(variance, size)


def test_the_skellam_scale_keeps_rounding_a_small_fraction_of_one_examples_effect():
    scale = skellam_scale(1.5, 10**6, 2.0**-12)
    assert math.sqrt(10**6) <= 2.0**-12 * scale * 1.5 < 2 * math.sqrt(10**6)
    assert math.log2(scale).is_integer()
