"""The silos' noise accountant (the Skellam RDP bound): its RDP at hand-computed values, the subsampled bound
against dp-accounting's sampled Gaussian, its event records through every accountant and the ledger's filter;
and the silos' integer noise, the exact discrete Gaussian, against its distribution."""

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
from workers.secure_aggregation import (
    RandomWords,
    discrete_gaussian,
    noise_scale_for,
    noise_share,
    noise_tail_bound,
    silo_noise_scale,
)
from workers.secure_aggregation.noise import bernoulli_exp

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


def chi_square_p_value(counts, expected):
    """The chi-square goodness-of-fit p-value of observed `counts` against `expected` counts."""
    from scipy import stats
    counts, expected = np.asarray(counts, dtype=float), np.asarray(expected, dtype=float)
    return stats.chi2.sf(((counts - expected) ** 2 / expected).sum(), len(counts) - 1)


def test_the_exact_bernoulli_exp_trial_succeeds_at_rate_exp_minus_n_over_d():
    words = RandomWords(bytes(range(32)))  # a fixed key, tests only: the tolerance is stated below
    size = 200_000
    for numerator, denominator in ((5, 3), (1, 7), (0, 4), (9, 2)):
        rate = bernoulli_exp(words, np.full(size, numerator), denominator).mean()
        assert abs(rate - math.exp(-numerator / denominator)) < 5 * math.sqrt(0.25 / size)


def test_the_discrete_gaussian_at_a_small_scale_fits_its_exact_distribution():
    words = RandomWords(bytes(32))  # a fixed key, tests only
    scale, size = 3, 200_000
    draws = discrete_gaussian(words, scale, size)
    assert draws.dtype == np.int64
    support = np.arange(-60, 61)
    weights = np.exp(-support.astype(float) ** 2 / (2 * scale**2))
    probabilities = weights / weights.sum()
    inner = np.abs(support) <= 9
    counts = [np.count_nonzero(draws == value) for value in support[inner]]
    counts.append(np.count_nonzero(np.abs(draws) > 9))
    expected = list(size * probabilities[inner]) + [size * probabilities[~inner].sum()]
    # A p-value below 0.001 would reject the exact law; a fixed key makes the test repeatable.
    assert chi_square_p_value(counts, expected) > 1e-3
    assert abs(draws.mean()) < 5 * scale / math.sqrt(size)
    assert abs(draws.var() / (probabilities * support**2).sum() - 1) < 0.02


def test_the_discrete_gaussian_at_a_large_scale_fits_the_gaussian_it_equals_to_within_float_precision():
    """At t ≈ 5.1e5 (variance 2.6e11, a silo share's size) N_Z(0, t²)'s CDF differs from N(0, t²)'s at the
    half-integers by far less than a double's precision, so twenty equiprobable bins of the normal are exact."""
    from scipy import stats
    words = RandomWords(b"\x07" * 32)  # a fixed key, tests only
    scale, size = noise_scale_for(2.6e11), 200_000
    draws = discrete_gaussian(words, scale, size)
    edges = np.floor(stats.norm.ppf(np.arange(1, 20) / 20, scale=scale)) + 0.5
    counts = np.bincount(np.searchsorted(edges, draws), minlength=20)
    expected = [size * probability for probability in np.diff(stats.norm.cdf(np.r_[-np.inf, edges, np.inf],
                                                                             scale=scale))]
    assert chi_square_p_value(counts, expected) > 1e-3
    assert abs(draws.mean()) < 5 * scale / math.sqrt(size)
    # The sample variance's relative std is √(2/n) ≈ 0.3%.
    assert abs(draws.var() / scale**2 - 1) < 0.015
    assert np.abs(draws).max() < noise_tail_bound(float(scale) ** 2, size)


def test_a_share_has_at_least_the_variance_asked_and_fresh_streams_differ():
    for variance in (1.0, 2.0, 2.6e11, 1e16):
        scale = noise_scale_for(variance)
        assert scale**2 >= variance > (scale - 1) ** 2
    with pytest.raises(ValueError, match="lower noise_multiplier"):
        noise_scale_for(1e18)
    assert not np.array_equal(noise_share(RandomWords(), 100.0, 50), noise_share(RandomWords(), 100.0, 50))
    with pytest.raises(TypeError, match="never pickled"):
        import pickle
        pickle.dumps(RandomWords())


def test_the_silo_noise_scale_keeps_rounding_a_small_fraction_of_one_examples_effect():
    scale = silo_noise_scale(1.5, 10**6, 2.0**-12)
    assert math.sqrt(10**6) <= 2.0**-12 * scale * 1.5 < 2 * math.sqrt(10**6)
    assert math.log2(scale).is_integer()
