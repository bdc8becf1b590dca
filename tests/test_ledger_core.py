"""The ledger's pure core: splitting plans, exact RDP tallies, safe admission, validation, tokens."""

import hashlib
import math
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dp_accounting.rdp.rdp_privacy_accountant import compute_epsilon

from accounting.accountants import RDP_ORDERS, epsilon_from_rdp, get_accountant, rdp_vector
from accounting.events import Composition, SampledGaussian
from accounting.ledger.admission import (
    ADMISSION_MARGIN,
    AdmissionRule,
    RdpTally,
    canonical,
    check_admission,
    check_new_budget,
    check_plan,
    committed_json_with,
    fits_budget,
    parse_plan,
    remember_stored_tally,
    split_steps,
    stored_tally,
    uncached_mechanisms,
)
from accounting.ledger.caches import CurveNotCached, rdp_curves_cached_only, shared_cache
from accounting.ledger.callers import ADMIN, Caller, DatasetRef, resolve_dataset, tenant_caller
from accounting.ledger.errors import (
    BudgetExceeded,
    FailedPrecondition,
    InvalidArgument,
    PermissionDenied,
    RateLimited,
    Unauthenticated,
)
from accounting.ledger.limits import TokenBuckets
from accounting.ledger.store import open_embedded_ledger
from accounting.ledger.tokens import admin_key_id, hash_token, new_token, token_digest, token_key_id, token_matches
from accounting.ledger.validation import check_budget_epsilon, check_delta, check_name, delta_warning

DELTA = 1e-5
RULE = AdmissionRule.for_budget(2.0, DELTA)
# Few distinct mechanisms: each costs one dp-accounting RDP evaluation (~0.1 s), then is cached.
MECHANISMS = [
    SampledGaussian(0.004, 1.1, 1),
    SampledGaussian(0.008, 0.9, 1),
    SampledGaussian(0.01, 1.3, 1, sensitivity_factor=2.0),
]

compositions = st.lists(
    st.tuples(st.sampled_from(MECHANISMS), st.integers(1, 60)), min_size=1, max_size=5
).map(lambda records: Composition(tuple(mechanism.with_steps(steps) for mechanism, steps in records)))


def test_split_steps_consumes_a_heterogeneous_plan_in_order():
    first_kind, second_kind = MECHANISMS[0], MECHANISMS[1]
    plan = Composition((first_kind.with_steps(5), second_kind.with_steps(3)))
    first, rest = split_steps(plan, 6)
    assert first == Composition((first_kind.with_steps(5), second_kind.with_steps(1)))
    assert rest == Composition((second_kind.with_steps(2),))
    assert split_steps(plan, 0) == (Composition(), plan)
    assert split_steps(plan, 8) == (plan, Composition())


@settings(max_examples=200, deadline=None)
@given(plan=compositions, data=st.data())
def test_split_steps_then_rejoin_is_the_plan(plan, data):
    steps = data.draw(st.integers(0, plan.steps))
    first, rest = split_steps(plan, steps)
    assert first.steps == steps
    assert rest.steps == plan.steps - steps
    assert first.then(rest) == plan


@pytest.mark.parametrize("steps", [-1, 9, 2.0, True, None])
def test_split_steps_refuses_a_split_outside_the_plan(steps):
    plan = Composition((MECHANISMS[0].with_steps(5), MECHANISMS[1].with_steps(3)))
    with pytest.raises(InvalidArgument, match=r"at 0\.\.8"):
        split_steps(plan, steps)


@settings(max_examples=100, deadline=None)
@given(plan=compositions, data=st.data())
def test_tally_is_exactly_additive_over_a_split(plan, data):
    first, rest = split_steps(plan, data.draw(st.integers(0, plan.steps)))
    assert RdpTally.of(first) + RdpTally.of(rest) == RdpTally.of(plan)
    assert RdpTally.of(plan) - RdpTally.of(rest) == RdpTally.of(first)


@pytest.mark.parametrize(
    "plan",
    [
        Composition((MECHANISMS[0].with_steps(1),)),
        Composition((MECHANISMS[0].with_steps(3600), MECHANISMS[1].with_steps(7))),
        Composition((MECHANISMS[2].with_steps(12), MECHANISMS[0].with_steps(5), MECHANISMS[2].with_steps(100_000))),
    ],
)
def test_tally_rounds_up_and_only_by_float_noise(plan):
    exact = rdp_vector(plan)
    tallied = RdpTally.of(plan).divergences()
    assert np.all(tallied >= exact)
    np.testing.assert_allclose(tallied, exact, rtol=1e-12, atol=0)
    assert RdpTally.of(plan).epsilon(DELTA) >= epsilon_from_rdp(exact, DELTA, warn=False)


def test_tally_of_canonical_form_equals_tally_of_interleaved_events():
    a, b = MECHANISMS[0], MECHANISMS[1]
    interleaved = Composition((a.with_steps(3), b.with_steps(4), a.with_steps(5)))
    assert canonical(interleaved) == Composition((a.with_steps(8), b.with_steps(4)))
    assert RdpTally.of(canonical(interleaved)) == RdpTally.of(interleaved)


def test_tally_keeps_orders_where_the_divergence_is_unbounded():
    # dp-accounting gives up on the smallest orders for this mechanism and reports them unbounded.
    wild = SampledGaussian(0.5, 0.3, 7)
    tally = RdpTally.of(wild)
    unbounded = np.isinf(rdp_vector(wild))
    assert unbounded.any()
    assert [count == 7 for count in tally.unbounded_steps] == list(unbounded)
    assert np.isinf(tally.divergences()[unbounded]).all()
    assert math.isfinite(tally.epsilon(DELTA))
    assert tally - tally == RdpTally.zero()
    assert RdpTally.from_json(tally.to_json()) == tally


def test_tally_refuses_to_go_negative():
    with pytest.raises(ValueError, match="inconsistent"):
        RdpTally.zero() - RdpTally.of(MECHANISMS[0].with_steps(1))


def test_a_total_equal_to_the_budget_is_refused_and_one_just_below_is_admitted():
    assert not fits_budget(1.0, 1.0)
    assert not fits_budget(1.0, 1.0 + ADMISSION_MARGIN / 2)
    assert fits_budget(1.0, 1.0 + 2 * ADMISSION_MARGIN)


def test_admission_at_the_exact_edge_is_refused():
    job = RdpTally.of(MECHANISMS[0].with_steps(500))
    epsilon = RULE.epsilon(job)
    with pytest.raises(BudgetExceeded):
        check_admission("mnist", RULE, epsilon, RdpTally.zero(), job)
    assert check_admission("mnist", RULE, epsilon * (1 + 1e-6), RdpTally.zero(), job) == epsilon


def test_budget_refusal_reports_remaining_and_needed_epsilon():
    held = RdpTally.of(MECHANISMS[0].with_steps(500))
    job = RdpTally.of(MECHANISMS[1].with_steps(2000))
    budget = 2.0
    with pytest.raises(BudgetExceeded) as refusal:
        check_admission("mnist", RULE, budget, held, job)
    error = refusal.value
    assert error.remaining_epsilon == pytest.approx(budget - RULE.epsilon(held), rel=1e-12)
    assert error.needed_epsilon == pytest.approx(RULE.epsilon(held + job) - RULE.epsilon(held), rel=1e-12)
    assert error.needed_epsilon > error.remaining_epsilon
    remaining = math.floor(error.remaining_epsilon * 100) / 100
    needed = math.ceil(error.needed_epsilon * 100) / 100
    assert str(error).startswith(
        f"dataset 'mnist' has ε {remaining:.2f} left at δ=1e-05; this job needs ε {needed:.2f}."
    )


@pytest.mark.parametrize(
    "remaining, needed, shown",
    [
        (0.31, 0.85, "ε 0.31 left at δ=1e-05; this job needs ε 0.85."),
        (0.3149, 0.3141, "ε 0.31 left at δ=1e-05; this job needs ε 0.32."),
        (0.0, 0.0123, "ε 0.000 left at δ=1e-05; this job needs ε 0.013."),
        (0.00129, 2.5, "ε 0.0012 left at δ=1e-05; this job needs ε 2.5000."),
    ],
)
def test_budget_message_shows_remaining_rounded_down_and_needed_rounded_up(remaining, needed, shown):
    assert str(BudgetExceeded("mnist", remaining, needed, 1e-5)).startswith(f"dataset 'mnist' has {shown}")


def test_two_jobs_compose_to_less_than_the_sum_of_their_epsilons():
    first = MECHANISMS[0].with_steps(3000)
    second = MECHANISMS[1].with_steps(1000)
    pld = get_accountant("pld")
    both = Composition((first, second))
    assert pld.epsilon(both, DELTA) < pld.epsilon(first, DELTA) + pld.epsilon(second, DELTA)
    first_tally, second_tally = RdpTally.of(first), RdpTally.of(second)
    assert (first_tally + second_tally).epsilon(DELTA) < first_tally.epsilon(DELTA) + second_tally.epsilon(DELTA)


def test_a_budget_cannot_drop_below_what_is_held():
    held = RdpTally.of(MECHANISMS[0].with_steps(500))
    held_epsilon = RULE.epsilon(held)
    assert check_new_budget("mnist", RULE, held_epsilon * 1.01, held) == held_epsilon * 1.01
    with pytest.raises(FailedPrecondition, match="would not cover it"):
        check_new_budget("mnist", RULE, held_epsilon * 0.99, held)
    with pytest.raises(InvalidArgument, match="finite"):
        check_new_budget("mnist", RULE, math.inf, held)


@pytest.mark.parametrize("name", ["", "x" * 129, "x" * 10_000, "a/b", "-lead", "spa ce", "naïve", "a\x00b", None, 7])
def test_bad_names_are_refused_with_the_rule(name):
    with pytest.raises(InvalidArgument, match="1 to 128 characters of letters, digits"):
        check_name("dataset name", name)


def test_good_names_pass():
    for name in ("mnist", "a", "x" * 128, "cifar-10_v2.1"):
        assert check_name("dataset name", name) == name


def test_a_long_bad_name_is_not_echoed_whole():
    with pytest.raises(InvalidArgument) as refusal:
        check_name("dataset name", "x" * 10_000)
    assert "(10000 characters)" in str(refusal.value)
    assert len(str(refusal.value)) < 400


def test_dataset_names_resolve_within_the_callers_tenant():
    acme = tenant_caller("acme")
    assert resolve_dataset(acme, "mnist") == DatasetRef("acme", "mnist")
    assert resolve_dataset(acme, "acme/mnist") == DatasetRef("acme", "mnist")
    assert resolve_dataset(ADMIN, "globex/mnist") == DatasetRef("globex", "mnist")
    with pytest.raises(PermissionDenied, match="no dataset 'globex/mnist' that this token may use"):
        resolve_dataset(acme, "globex/mnist")
    with pytest.raises(InvalidArgument, match="TENANT/NAME"):
        resolve_dataset(ADMIN, "mnist")
    embedded = Caller(actor="me", tenant="local", admin=True)
    assert resolve_dataset(embedded, "mnist") == DatasetRef("local", "mnist")


@pytest.mark.parametrize(
    "text, complaint",
    [
        ('{"schema": "dpfleet.events", "version": 1, "events": [{"kind": "sampled_gaussian", '
         '"sampling_rate": 0.01, "noise_multiplier": NaN, "steps": 10}]}', "finite"),
        ('{"schema": "dpfleet.events", "version": 1, "events": [{"kind": "sampled_gaussian", '
         '"sampling_rate": Infinity, "noise_multiplier": 1.0, "steps": 10}]}', "finite"),
        (
            '{"schema": "dpfleet.events", "version": 1, "events": [{"kind": "laplace", "steps": 1}]}',
            "unknown event kind",
        ),
        ('{"schema": "dpfleet.events", "version": 99, "events": []}', "version 99"),
        ('{"schema": "dpfleet.events", "version": 1, "events": []}', "at least one step"),
        ('{"schema": "dpfleet.events", "version": 1, "events": 5}', "planned events"),
        ("[1, 2]", "object"),
        ("not json", "not valid JSON"),
    ],
)
def test_bad_plans_are_invalid_arguments(text, complaint):
    with pytest.raises(InvalidArgument, match=complaint):
        parse_plan(text)


def test_a_plan_with_too_many_records_is_refused():
    alternating = tuple(MECHANISMS[i % 2].with_steps(1) for i in range(1001))
    with pytest.raises(InvalidArgument, match="at most 1000 records"):
        parse_plan(Composition(alternating).to_json())


def test_a_plan_with_more_distinct_mechanisms_than_the_cap_is_refused_naming_the_cap():
    at_cap = Composition(tuple(SampledGaussian(0.01, 1.0 + i / 1000, 1) for i in range(100)))
    assert parse_plan(at_cap.to_json()) == at_cap
    over = Composition((*at_cap.events, SampledGaussian(0.01, 5.0, 1)))
    with pytest.raises(InvalidArgument, match="at most 100 distinct mechanisms .*got 101"):
        parse_plan(over.to_json())


def test_under_cached_only_a_missing_curve_raises_and_a_cached_one_is_used():
    mechanism = SampledGaussian(0.0123, 1.234567, 3)
    assert uncached_mechanisms(mechanism) == 1
    with rdp_curves_cached_only():
        with pytest.raises(CurveNotCached) as missing:
            RdpTally.of(mechanism)
    assert missing.value.mechanism == (0.0123, 1.234567, 1.0)
    outside = RdpTally.of(mechanism)
    assert uncached_mechanisms(mechanism) == 0
    with rdp_curves_cached_only():
        assert RdpTally.of(mechanism) == outside


def test_token_buckets_refill_at_their_rate_and_say_when_to_retry():
    now = [0.0]
    buckets = TokenBuckets(2.0, 10, "costly requests", clock=lambda: now[0])
    buckets.take("a", 10)
    with pytest.raises(RateLimited, match="retry in 0.5 s") as refused:
        buckets.take("a", 1)
    assert refused.value.retry_after_seconds == pytest.approx(0.5)
    buckets.take("b", 4)  # another key has its own bucket
    assert buckets.owes("a") == pytest.approx(0.5)
    now[0] = 0.5
    assert buckets.owes("a") == 0.0
    buckets.take("a", 1)
    now[0] = 100.0
    buckets.take("a", 50)  # a cost above the burst takes a full bucket
    with pytest.raises(RateLimited):
        buckets.take("a", 1)


def test_tokens_are_stored_by_sha256_and_admin_tokens_get_a_key_id():
    key_id, token = new_token()
    assert len(token.split("_", 2)[2]) == 43  # 32 random bytes, base64 without padding
    assert token_digest(token) == hashlib.sha256(token.encode()).digest()
    assert admin_key_id(token) == key_id
    assert admin_key_id("a-configured-admin-token-0123") == "adm" + token_digest("a-configured-admin-token-0123").hex()[:13]


def test_tokens_verify_against_their_salted_hash_only():
    key_id, token = new_token()
    _, other = new_token()
    salt = b"0123456789abcdef"
    stored = hash_token(token, salt)
    assert token_key_id(token) == key_id
    assert token_matches(token, salt, stored)
    assert not token_matches(other, salt, stored)
    assert hash_token(token, b"fedcba9876543210") != stored
    with pytest.raises(Unauthenticated):
        token_key_id("Bearer nonsense")


def call_at_once(threads, function):
    """Start `threads` threads that each call `function` at the same moment; wait for all of them."""
    start = threading.Barrier(threads)

    def call():
        start.wait()
        function()

    running = [threading.Thread(target=call) for _ in range(threads)]
    for thread in running:
        thread.start()
    for thread in running:
        thread.join()


def test_a_shared_cache_computes_once_for_callers_asking_at_the_same_time_and_forgets_the_least_recent():
    calls = []

    @shared_cache(maxsize=2)
    def slow_square(value):
        calls.append(value)
        time.sleep(0.2)
        return value * value

    results = []
    call_at_once(8, lambda: results.append(slow_square(3)))
    assert results == [9] * 8 and calls == [3]
    assert [slow_square(4), slow_square(3), slow_square(5)] == [16, 9, 25] and calls == [3, 4, 5]
    assert slow_square(4) == 16 and calls == [3, 4, 5, 4]  # 4 was the least recently used of three, so forgotten


def test_a_shared_cache_hands_an_error_to_every_waiting_caller_and_tries_again_after():
    attempts = []

    @shared_cache(maxsize=4)
    def flaky(value):
        attempts.append(value)
        time.sleep(0.1)
        if len(attempts) == 1:
            raise RuntimeError("first attempt fails")
        return value

    errors = []

    def ask():
        try:
            flaky(1)
        except RuntimeError as error:
            errors.append(error)

    call_at_once(4, ask)
    assert len(errors) == 4 and attempts == [1]
    assert flaky(1) == 1 and attempts == [1, 1]


def test_a_shared_cache_starts_one_background_computation_at_a_time():
    may_finish = threading.Event()
    calls = []

    @shared_cache(maxsize=4)
    def gated_tenfold(value):
        calls.append(value)
        may_finish.wait(30)
        return 10 * value

    first = gated_tenfold.start(1)
    assert not first.done()
    assert gated_tenfold.start(1) is first  # the same computation
    assert gated_tenfold.start(2) is None  # one background computation at a time: nothing starts
    waiting = []
    waiter = threading.Thread(target=lambda: waiting.append(gated_tenfold(1)))
    waiter.start()
    may_finish.set()
    waiter.join()
    assert first.result(timeout=30) == 10 and waiting == [10]
    assert gated_tenfold.start(1).result(timeout=0) == 10  # cached: a future already done
    assert gated_tenfold.start(2).result(timeout=30) == 20
    assert calls == [1, 2]


def test_the_filter_converts_each_order_at_delta_over_k_and_takes_the_least():
    rule = AdmissionRule((2.0, 8.0), DELTA)
    nats = 2**60  # RdpTally's units per nat
    divergences = {2.0: 0.5, 8.0: 1.0}
    units = [int(divergences.get(float(order), 0.0) * nats) for order in RDP_ORDERS]
    tally = RdpTally(tuple(units), (0,) * len(RDP_ORDERS))
    # By hand: epsilon = r + log(1 - 1/a) - log(a * delta / K) / (a - 1), with delta / K = 5e-6.
    at_2 = 0.5 + math.log(1 - 1 / 2) - math.log(2 * 5e-6) / 1  # 11.3197781...
    at_8 = 1.0 + math.log(1 - 1 / 8) - math.log(8 * 5e-6) / 7  # 2.3131302...
    assert rule.delta_per_order == 5e-6
    assert rule.order_epsilons(tally) == pytest.approx((11.319778, 2.313130), abs=1e-6)
    assert rule.order_epsilons(tally) == pytest.approx((at_2, at_8), rel=1e-12)
    assert rule.epsilon(tally) == pytest.approx(at_8, rel=1e-12)
    # The union bound's price at order 8: log(K) / (a - 1) over the same order's conversion at delta.
    assert rule.epsilon(tally) - AdmissionRule((8.0,), DELTA).epsilon(tally) == pytest.approx(math.log(2) / 7, rel=1e-9)


def test_a_new_datasets_orders_depend_on_its_budget_alone_and_sit_on_the_grid():
    rule = AdmissionRule.for_budget(10.0, DELTA)
    assert rule == AdmissionRule.for_budget(10.0, DELTA) and rule.delta_per_order == DELTA / len(rule.orders)
    assert rule.orders == (2.5, 4.0, 6.9)  # (alpha* - 1) * 1/2, 1, 2 on the grid, alpha* = 4.0 for epsilon 10
    assert AdmissionRule.for_budget(1.0, DELTA).orders == (14.0, 27.0, 52.0)
    assert AdmissionRule.for_budget(1e6, DELTA).orders == (1.02,)  # the lowest order dp-accounting converts
    assert AdmissionRule.from_dict(rule.to_dict()) == rule
    with pytest.raises(ValueError, match="not an order of the RDP grid"):
        AdmissionRule((2.55,), DELTA)
    with pytest.raises(ValueError, match="unknown admission rule"):
        AdmissionRule((2.5,), DELTA, "rdp-grid")


def independent_order_epsilons(rule, events):
    """Per order of the rule, epsilon at delta / K straight from dp-accounting, not through RdpTally's units."""
    divergences = dict(zip(RDP_ORDERS, rdp_vector(events)))
    return [
        compute_epsilon([order], [divergences[order]], rule.delta / len(rule.orders))[0] for order in rule.orders
    ]


def test_an_adaptive_adversary_never_takes_the_committed_steps_past_the_filters_bound(tmp_path):
    """Each job is chosen from what the ledger admitted so far, to push one order of the filter and then another.

    The adversary alternates between a mechanism that is cheap at low orders
    and dear at high ones and the reverse, sizes each job by bisecting on
    the ledger's refusals, and commits only part of some jobs. After every
    commit the committed steps must fit the budget at one order of the
    filter at least, by dp-accounting's own RDP of the composition.
    """
    budget = 3.0
    low_noise, high_noise = SampledGaussian(0.02, 0.7, 1), SampledGaussian(0.2, 4.0, 1)
    ledger = open_embedded_ledger(tmp_path / "ledger.db")
    rule = ledger.create_dataset("adaptive", budget, DELTA).admission
    committed = Composition()
    passed_alone = set()
    for round_number in range(12):
        mechanism = low_noise if round_number % 2 == 0 else high_noise

        def admitted(steps):
            try:
                probe = ledger.reserve("adaptive", f"probe-{round_number}-{steps}", mechanism.with_steps(steps))
            except BudgetExceeded:
                return False
            ledger.release(probe.reservation_id)
            return True

        fits, refused = 0, 1
        while admitted(refused):  # the most steps the ledger still admits, found from its own answers
            fits, refused = refused, refused * 2
        while refused - fits > 1:
            middle = (fits + refused) // 2
            fits, refused = (middle, refused) if admitted(middle) else (fits, middle)
        if fits == 0:
            continue
        reservation = ledger.reserve("adaptive", f"job-{round_number}", mechanism.with_steps(fits))
        run = fits if round_number % 3 else max(1, fits // 2)  # some jobs stop early and release the rest
        ledger.commit(reservation.reservation_id, run, 0)
        ledger.release(reservation.reservation_id)
        committed = canonical(committed.then(mechanism.with_steps(run)))
        per_order = independent_order_epsilons(rule, committed)
        assert min(per_order) <= budget, (round_number, per_order)
        passed_alone |= {order for order, epsilon in zip(rule.orders, per_order) if epsilon > budget}
    assert committed.steps > 0 and ledger.get_budget("adaptive").spent_epsilon_filter <= budget
    assert passed_alone  # the adversary did push some order past the budget: the union over orders is what held
    assert ledger.verify().findings == ()
    ledger.close()


# ---------------------------------------------------------------- input ranges

EXTREMES = [0.0, 5e-324, 1e-300, 1e-20, 1e-6, 0.1, 0.999999, 1.0, 1e4, 1e300, math.inf, math.nan]


@settings(max_examples=60, deadline=None)
@given(epsilon=st.one_of(st.sampled_from(EXTREMES), st.floats()), delta=st.one_of(st.sampled_from(EXTREMES),
                                                                                  st.floats()))
def test_every_budget_the_checks_accept_gives_a_rule_and_the_rest_is_refused_by_name(epsilon, delta):
    try:
        accepted = check_budget_epsilon(epsilon), check_delta(delta)
    except InvalidArgument as refusal:
        assert str(refusal).startswith(("budget epsilon must be", "delta must be"))
        return
    rule = AdmissionRule.for_budget(*accepted)  # no overflow, no division by zero
    assert math.isfinite(rule.epsilon(RdpTally.of(SampledGaussian(0.01, 1.0, 100))))


@settings(max_examples=40, deadline=None)
@given(sigma=st.one_of(st.sampled_from(EXTREMES), st.floats(min_value=0.0, exclude_min=True)),
       factor=st.sampled_from([1e-300, 0.5, 1.0, 2.0, 1e300]))
def test_a_plan_is_refused_by_name_when_its_noise_leaves_the_range_the_accountants_compute(sigma, factor):
    try:
        event = SampledGaussian(0.01, sigma, 10, factor)
    except ValueError:
        return  # not finite or not > 0: the event record itself refuses it
    try:
        check_plan(event)
    except InvalidArgument as refusal:
        assert "noise_multiplier" in str(refusal) and "[0.001, 10000]" in str(refusal)
        assert not 1e-3 <= min(sigma, sigma / factor) <= max(sigma, sigma / factor) <= 1e4
        return
    assert math.isfinite(RdpTally.of(event).epsilon(DELTA))


def test_a_number_sent_as_text_is_refused_and_delta_above_one_over_n_is_warned_about():
    with pytest.raises(InvalidArgument, match="noise_multiplier must be a number \\(got '1.0'\\)"):
        parse_plan('{"schema": "dpfleet.events", "version": 1, "events": [{"kind": "sampled_gaussian", '
                   '"sampling_rate": 0.01, "noise_multiplier": "1.0", "steps": 10}]}')
    assert delta_warning(1e-5, None) is None and delta_warning(1e-5, 100_000) is None
    assert delta_warning(1e-4, 60_000).startswith("delta 0.0001 is above 1/N = 1.67e-05 for a dataset of 60000 rows")


_MECHANISM_RECORDS = st.builds(
    SampledGaussian, st.sampled_from([0.001, 0.004, 0.01]), st.sampled_from([0.8, 1.1, 1.3]),
    st.integers(1, 50), st.sampled_from([1.0, 2.0]),
)


@settings(max_examples=60, deadline=None)
@given(st.lists(_MECHANISM_RECORDS, max_size=8), st.lists(_MECHANISM_RECORDS, min_size=1, max_size=3))
def test_a_commit_adds_its_block_to_the_stored_events_as_a_canonical_rebuild_would(stored, block):
    stored_json = canonical(Composition(tuple(stored))).to_json()
    block = Composition(tuple(block))
    assert committed_json_with(stored_json, block) == canonical(Composition.from_json(stored_json).then(block)).to_json()
    # A stored list that is not canonical (never written so) takes the general way to the same answer.
    uncanonical = Composition(tuple(stored) + tuple(stored)).to_json()
    assert committed_json_with(uncanonical, block) == canonical(Composition.from_json(uncanonical).then(block)).to_json()


def test_a_stored_tally_is_remembered_and_is_the_tally_of_the_stored_events():
    committed = canonical(Composition((SampledGaussian(0.004, 1.1, 30), SampledGaussian(0.01, 0.9, 5))))
    assert stored_tally(committed.to_json()) == RdpTally.of(committed)
    block = Composition((SampledGaussian(0.004, 1.1, 3),))
    after = committed_json_with(committed.to_json(), block)
    remember_stored_tally(after, stored_tally(committed.to_json()) + RdpTally.of(block))
    assert stored_tally(after) == RdpTally.of(Composition.from_json(after))
