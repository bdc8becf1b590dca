"""Accountants against published reference values, inverse calibration, and properties."""

import math
import warnings
from fractions import Fraction

import dp_accounting
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from accounting.accountants import (
    PLD_FALLBACK_LABEL,
    RDP_ORDERS,
    PldFallbackWarning,
    RdpOrderWarning,
    epsilon_from_rdp,
    get_accountant,
    labelled_epsilon,
    one_step_pld,
    rdp_vector,
    sampled_gaussian_rdp,
)
from accounting.calibration import max_steps_for, noise_multiplier_for
from accounting.events import Composition, EventError, SampledGaussian, steps_for_epochs

MNIST_Q = 250 / 60000
DELTA = 1e-5


def epsilon(name, events, delta=DELTA):
    return get_accountant(name).epsilon(events, delta)


def test_steps_for_epochs_is_exact():
    assert steps_for_epochs(15, 60000, 250) == 3600
    assert steps_for_epochs(3, 60000, 250) == 720
    assert steps_for_epochs(60, 60000, 256) == 14063
    assert steps_for_epochs(0.5, 10, 3) == 2


@pytest.mark.parametrize(
    "name, steps, expected, tolerance",
    [
        ("rdp", 3600, 0.9422, 5e-5),
        ("gdp", 3600, 0.8237, 5e-5),
        ("pld", 3600, 0.853, 0.002),
        ("rdp", 720, 0.5632, 5e-5),
    ],
)
def test_seed_configuration_reference_values(name, steps, expected, tolerance):
    assert epsilon(name, SampledGaussian(MNIST_Q, 1.3, steps)) == pytest.approx(expected, abs=tolerance)


def test_sixty_epochs_at_sigma_1_1():
    event = SampledGaussian(256 / 60000, 1.1, steps_for_epochs(60, 60000, 256))
    assert epsilon("rdp", event) == pytest.approx(2.5967, abs=5e-5)
    assert epsilon("pld", event) == pytest.approx(2.3818, abs=0.002)


def test_heterogeneous_composition():
    events = Composition((SampledGaussian(0.004, 1.1, 1000), SampledGaussian(0.008, 0.9, 1000)))
    assert epsilon("rdp", events) == pytest.approx(2.2937, abs=5e-5)
    assert epsilon("pld", events) == pytest.approx(1.914, abs=0.002)


def test_pld_equals_dp_accountings_own_accountant():
    # The PLD accountant composes cached one-step distributions itself; the figures must be dp-accounting's, exactly.
    events = Composition(
        (SampledGaussian(0.01, 1.1, 100), SampledGaussian(0.02, 2.0, 50, 2.0), SampledGaussian(0.01, 1.1, 30))
    )
    reference = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    reference.compose(events.to_dp_event())
    assert get_accountant("pld").epsilon(events, 1e-5) == reference.get_epsilon(1e-5)
    assert get_accountant("pld").delta(events, 1.0) == reference.get_delta(1.0)


@pytest.mark.parametrize("rate, sigma", [(0.004, 0.9), (0.02, 1.4), (0.3, 0.7), (1.0, 1.1)])
def test_the_vectorised_one_step_pld_is_dp_accountings(rate, sigma):
    # Built with the hockey-stick deltas over the whole grid at once (dp-accounting takes them one by one): the same
    # distribution, to the last bit.
    ours = one_step_pld(rate, sigma, 1e-4)
    reference = dp_accounting.pld.privacy_loss_distribution.from_gaussian_mechanism(
        standard_deviation=sigma, value_discretization_interval=1e-4, sampling_prob=rate
    )
    pairs = [(ours._pmf_remove, reference._pmf_remove)] + ([] if rate == 1.0 else [(ours._pmf_add, reference._pmf_add)])
    for mine, theirs in pairs:
        mine, theirs = mine.to_dense_pmf(), theirs.to_dense_pmf()
        assert (mine._lower_loss, mine.size, mine._infinity_mass) == (theirs._lower_loss, theirs.size,
                                                                     theirs._infinity_mass)
        np.testing.assert_array_equal(mine._probs, theirs._probs)


@settings(max_examples=8, deadline=None)
@given(st.floats(1e-4, 0.5), st.floats(0.5, 8.0), st.integers(1, 1000))
def test_the_closed_form_rdp_is_dp_accountings_to_the_last_bit(rate, sigma, steps):
    # The ledger adds and subtracts these curves in exact units and verify compares them with what was stored.
    reference = dp_accounting.rdp.RdpAccountant(orders=RDP_ORDERS)
    reference.compose(SampledGaussian(rate, sigma, steps).to_dp_event())
    np.testing.assert_array_equal(rdp_vector(SampledGaussian(rate, sigma, steps)), np.array(reference._rdp))
    assert not sampled_gaussian_rdp(rate, sigma).flags.writeable


@settings(max_examples=12, deadline=None)
@given(st.floats(1e-6, 0.999), st.floats(0.05, 200.0))
def test_one_step_rdp_curve_is_dp_accountings_at_every_order_to_the_last_bit(rate, sigma):
    # Every order's series summed as dp-accounting sums it (terms in numpy, restarts and underflows skipped):
    # the tallies the ledger stored with earlier curves stay exact.
    reference = dp_accounting.rdp.rdp_privacy_accountant._compute_rdp_poisson_subsampled_gaussian(
        rate, sigma, RDP_ORDERS
    )
    np.testing.assert_array_equal(sampled_gaussian_rdp.__wrapped__(rate, sigma), reference)


@pytest.mark.parametrize("rate, sigma", [(0.004, 0.9), (0.004, 1.4999), (0.01, 0.3), (0.5, 0.5), (1e-9, 50.0),
                                         (0.999, 1.0), (0.004, 1e-3), (1.0, 1.3)])
def test_one_step_rdp_curve_at_the_edges_is_dp_accountings(rate, sigma):
    reference = dp_accounting.rdp.rdp_privacy_accountant._compute_rdp_poisson_subsampled_gaussian(
        rate, sigma, RDP_ORDERS
    )
    np.testing.assert_array_equal(sampled_gaussian_rdp.__wrapped__(rate, sigma), reference)


def test_pld_is_tighter_than_rdp_and_gdp_is_flagged_approximate():
    event = SampledGaussian(MNIST_Q, 1.3, 3600)
    assert epsilon("pld", event) < epsilon("rdp", event)
    assert get_accountant("pld").rigorous and get_accountant("rdp").rigorous
    assert not get_accountant("gdp").rigorous


@pytest.mark.parametrize("name", ["pld", "rdp", "gdp"])
def test_delta_inverts_epsilon(name):
    event = SampledGaussian(MNIST_Q, 1.3, 3600)
    eps = epsilon(name, event)
    assert get_accountant(name).delta(event, eps) == pytest.approx(DELTA, rel=0.02)


def test_sensitivity_factor_acts_as_smaller_noise():
    doubled = SampledGaussian(MNIST_Q, 2.6, 720, sensitivity_factor=2.0)
    plain = SampledGaussian(MNIST_Q, 1.3, 720)
    for name in ("pld", "rdp", "gdp"):
        assert epsilon(name, doubled) == pytest.approx(epsilon(name, plain), rel=1e-9)


def test_empty_composition_costs_nothing():
    for name in ("pld", "rdp", "gdp"):
        assert epsilon(name, Composition()) == 0.0


def test_rdp_vector_adds_up_across_jobs():
    first, second = SampledGaussian(0.004, 1.1, 1000), SampledGaussian(0.008, 0.9, 1000)
    together = rdp_vector(Composition((first, second)))
    np.testing.assert_allclose(rdp_vector(first) + rdp_vector(second), together, rtol=1e-12)
    assert epsilon_from_rdp(together, DELTA) == pytest.approx(2.2937, abs=5e-5)


def test_rdp_warns_when_best_order_is_at_grid_edge():
    with pytest.warns(RdpOrderWarning):
        epsilon("rdp", SampledGaussian(1.0, 5000.0, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        epsilon("rdp", SampledGaussian(MNIST_Q, 1.3, 3600))
    assert RDP_ORDERS[0] < 1.1 and RDP_ORDERS[-1] >= 4096


def test_the_rdp_grid_holds_dp_accountings_default_grid():
    assert set(dp_accounting.rdp.rdp_privacy_accountant.DEFAULT_RDP_ORDERS) <= set(RDP_ORDERS.tolist())
    assert len(RDP_ORDERS) == len(set(RDP_ORDERS.tolist())) == 173


@pytest.mark.parametrize("name", ["pld", "rdp", "gdp"])
def test_noise_multiplier_round_trip(name):
    sigma = noise_multiplier_for(1.0, DELTA, MNIST_Q, 3600, name)
    assert epsilon(name, SampledGaussian(MNIST_Q, sigma, 3600)) <= 1.0
    assert epsilon(name, SampledGaussian(MNIST_Q, 0.999 * sigma, 3600)) > 1.0


@pytest.mark.parametrize("name", ["pld", "rdp", "gdp"])
def test_a_search_that_passes_through_tiny_noise_multipliers_still_round_trips(name):
    # The GDP ε that starts every search is asked about sigma near 0.13 here, where mu is about 2.5e12.
    sigma = noise_multiplier_for(2.0, DELTA, 0.01, 10, name)
    assert epsilon(name, SampledGaussian(0.01, sigma, 10)) <= 2.0
    assert epsilon(name, SampledGaussian(0.01, 0.999 * sigma, 10)) > 2.0


def test_max_steps_fits_and_one_more_does_not():
    steps = max_steps_for(0.5, DELTA, MNIST_Q, 1.3, "rdp")
    assert epsilon("rdp", SampledGaussian(MNIST_Q, 1.3, steps)) <= 0.5
    assert epsilon("rdp", SampledGaussian(MNIST_Q, 1.3, steps + 1)) > 0.5
    assert 200 < steps < 720  # 720 steps cost 0.5632
    assert max_steps_for(0.01, DELTA, 1.0, 0.5, "rdp") == 0


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(sampling_rate=0.0, noise_multiplier=1.0, steps=1),
        dict(sampling_rate=1.5, noise_multiplier=1.0, steps=1),
        dict(sampling_rate=0.1, noise_multiplier=0.0, steps=1),
        dict(sampling_rate=0.1, noise_multiplier=math.nan, steps=1),
        dict(sampling_rate=0.1, noise_multiplier=1.0, steps=-1),
        dict(sampling_rate=0.1, noise_multiplier=1.0, steps=1.5),
        dict(sampling_rate=0.1, noise_multiplier=1.0, steps=1, sensitivity_factor=math.inf),
    ],
)
def test_event_refuses_values_out_of_range(kwargs):
    with pytest.raises(EventError):
        SampledGaussian(**kwargs)


def test_json_refuses_other_versions():
    data = Composition((SampledGaussian(0.1, 1.0, 3),)).to_dict()
    data["version"] = 99
    with pytest.raises(EventError, match="version 99"):
        Composition.from_dict(data)


events_strategy = st.lists(
    st.builds(
        SampledGaussian,
        sampling_rate=st.floats(min_value=1e-6, max_value=1.0, exclude_min=True),
        noise_multiplier=st.floats(min_value=1e-3, max_value=1e3),
        steps=st.integers(min_value=0, max_value=10**6),
        sensitivity_factor=st.sampled_from([1.0, 2.0, 1.4142135623730951]),
    ),
    max_size=8,
)


@given(events_strategy)
def test_json_round_trip_is_exact(events):
    composition = Composition(tuple(events))
    assert Composition.from_json(composition.to_json()) == composition
    assert composition.steps == sum(event.steps for event in events)


@settings(max_examples=25, deadline=None)
@given(
    sigma=st.floats(min_value=0.5, max_value=5.0),
    factor=st.floats(min_value=1.01, max_value=2.0),
    steps=st.integers(min_value=1, max_value=2000),
    rate=st.floats(min_value=1e-3, max_value=0.1),
)
def test_epsilon_falls_with_noise_and_rises_with_steps(sigma, factor, steps, rate):
    for name in ("rdp", "gdp"):
        base = epsilon(name, SampledGaussian(rate, sigma, steps))
        assert epsilon(name, SampledGaussian(rate, sigma * factor, steps)) <= base + 1e-12
        assert epsilon(name, SampledGaussian(rate, sigma, steps * 2)) >= base - 1e-12


@settings(max_examples=6, deadline=None)
@given(sigma=st.floats(min_value=0.6, max_value=3.0), steps=st.integers(min_value=10, max_value=500))
def test_pld_epsilon_falls_with_noise_and_rises_with_steps(sigma, steps):
    base = epsilon("pld", SampledGaussian(0.01, sigma, steps))
    assert epsilon("pld", SampledGaussian(0.01, sigma * 1.2, steps)) <= base
    assert epsilon("pld", SampledGaussian(0.01, sigma, steps * 2)) >= base


def test_pld_reports_the_rdp_bound_when_the_loss_is_too_large_to_grid():
    event = SampledGaussian(0.05, 0.1, 500)
    with pytest.warns(PldFallbackWarning, match="exceeds 100"):
        reported = epsilon("pld", event)
    assert reported == epsilon("rdp", event) > 100


def test_the_label_says_when_pld_fell_back_to_the_rdp_bound():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the label replaces the warning
        value, shown = labelled_epsilon(get_accountant("pld"), SampledGaussian(0.05, 0.1, 500), 1e-5)
    assert shown == PLD_FALLBACK_LABEL and value > 100
    assert labelled_epsilon(get_accountant("pld"), SampledGaussian(0.004, 1.3, 100), 1e-5)[1] == "pld"
    assert labelled_epsilon(get_accountant("gdp"), SampledGaussian(0.004, 1.3, 100), 1e-5)[1] == "gdp (approximate)"



def hockey_stick_deltas(first, second, epsilons, step):
    """delta(eps) of `first` against `second` and back, for densities on one grid of spacing `step`."""
    return [(np.maximum(first - math.exp(eps) * second, 0).sum() * step,
             np.maximum(second - math.exp(eps) * first, 0).sum() * step) for eps in epsilons]


@pytest.mark.parametrize(("rate", "sigma", "rows"), [(0.05, 1.0, 3), (0.2, 2.0, 5), (0.01, 0.8, 10)])
def test_group_events_bound_a_persons_rows_in_both_directions(rate, sigma, rows):
    from scipy import stats

    from accounting.events import group_events

    (bound,) = group_events(SampledGaussian(rate, sigma, 1), rows).events
    touched = 1 - (1 - Fraction(rate)) ** rows  # exactly, from the float rate
    assert Fraction(bound.sampling_rate) >= touched > Fraction(bound.sampling_rate) - Fraction(1, 10**15)
    assert (bound.noise_multiplier, bound.sensitivity_factor) == (sigma, rows)
    # The person's rows, each sampled at `rate`, with clipped gradients all pointing the same way (the worst
    # case for their sum): N(0, sigma^2) against the mixture over j ~ Binomial(rows, rate) of N(j, sigma^2).
    grid = np.linspace(-12 * sigma, rows + 12 * sigma, 60_001)
    step = grid[1] - grid[0]
    without = stats.norm.pdf(grid, scale=sigma)
    weights = stats.binom.pmf(np.arange(rows + 1), rows, rate)
    with_person = sum(weight * stats.norm.pdf(grid, loc=j, scale=sigma) for j, weight in enumerate(weights))
    # The bound's pair: one sampled Gaussian at rate q' and shift `rows`.
    bounding = (1 - bound.sampling_rate) * without + bound.sampling_rate * stats.norm.pdf(grid, loc=rows, scale=sigma)
    epsilons = [0.1, 0.5, 1.0, 2.0, 4.0]
    exact = hockey_stick_deltas(with_person, without, epsilons, step)
    bounded = hockey_stick_deltas(bounding, without, epsilons, step)
    for (add, remove), (add_bound, remove_bound) in zip(exact, bounded):
        assert add_bound >= add - 1e-12 and remove_bound >= remove - 1e-12
    assert any(add_bound > 1.01 * add for (add, _), (add_bound, _) in zip(exact, bounded) if add > 1e-6)


def test_group_events_keep_one_row_and_scale_every_record():
    from accounting.events import group_events

    plan = Composition((SampledGaussian(0.01, 1.0, 30), SampledGaussian(0.02, 2.0, 10, sensitivity_factor=2.0)))
    assert group_events(plan, 1) == plan
    grouped = group_events(plan, 4)
    assert [event.steps for event in grouped.events] == [30, 10]
    assert [event.sensitivity_factor for event in grouped.events] == [4.0, 8.0]
    assert epsilon("rdp", grouped) > epsilon("rdp", plan)
    with pytest.raises(EventError, match="rows_per_person must be an integer >= 1"):
        group_events(plan, 0)
