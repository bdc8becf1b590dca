"""Each budget's composed PLD, extended by new commits and kept in the database: it equals a full replay."""

import hashlib
import hmac
import sqlite3
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from accounting import accountants
from accounting.accountants import get_accountant
from accounting.events import Composition, SampledGaussian
from accounting.ledger.admission import RdpTally, canonical, forget_figures, rdp_figures
from accounting.ledger.caches import forget_pld_figures
from accounting.ledger import caches, composed
from accounting.ledger.composed import COMPOSED, ComposedPld, ComposedStates, new_steps
from accounting.ledger.store import composed as store_composed
from accounting.ledger.store import load_history_key, open_embedded_ledger

DELTA = 1e-5
MECHANISMS = (SampledGaussian(0.01, 0.9, 1), SampledGaussian(0.01, 1.1, 1), SampledGaussian(0.02, 1.4, 1, 2.0))
KEY = b"k" * 32


def replayed_epsilon(committed):
    return get_accountant("pld").epsilon(committed, DELTA)


@settings(max_examples=6, deadline=None)
@given(st.lists(st.tuples(st.integers(0, len(MECHANISMS) - 1), st.integers(1, 40)), min_size=1, max_size=4))
def test_a_distribution_extended_commit_by_commit_bounds_the_replay_from_above_within_one_percent(commits):
    state, committed = ComposedPld.empty(), Composition()
    for mechanism, steps in commits:
        committed = canonical(committed.then(MECHANISMS[mechanism].with_steps(steps)))
        state = state.extended_to(committed)
        incremental, replayed = state.epsilon(DELTA), replayed_epsilon(committed)
        assert replayed - 1e-9 <= incremental <= replayed * 1.01


def test_only_the_new_steps_are_composed_and_a_state_of_other_events_is_not_extended():
    first, second = MECHANISMS[0].with_steps(5), MECHANISMS[1].with_steps(3)
    assert new_steps(Composition((first,)), Composition((first.with_steps(7), second))) == Composition(
        (first.with_steps(2), second)
    )
    assert new_steps(Composition((first.with_steps(9),)), Composition((first,))) is None
    later = ComposedPld.empty().extended_to(Composition((first.with_steps(9),)))
    # A state with more steps than asked for is not a start: the events are composed afresh.
    assert later.extended_to(Composition((first,))).epsilon(DELTA) == replayed_epsilon(Composition((first,)))


def test_a_kept_state_reads_back_only_under_its_key_and_an_older_state_does_not_replace_a_newer():
    committed = Composition((MECHANISMS[0].with_steps(20),))
    state = ComposedPld.empty().extended_to(committed)
    stored = state.to_bytes(KEY)
    assert ComposedPld.from_bytes(stored, KEY).epsilon(DELTA) == state.epsilon(DELTA)
    assert ComposedPld.from_bytes(stored, b"o" * 32) is None
    edited = bytearray(stored)
    edited[-1] ^= 1
    assert ComposedPld.from_bytes(bytes(edited), KEY) is None
    states = ComposedStates(size=2)
    states.keep("budget", state)
    states.keep("budget", ComposedPld.empty())
    assert states.get("budget") is state


def test_a_status_extends_the_kept_state_and_a_restart_recalls_it_from_the_database(tmp_path, monkeypatch):
    path = tmp_path / "ledger.db"
    with open_embedded_ledger(path) as ledger:
        ledger.create_dataset("mnist", 5.0, DELTA)
        reservation = ledger.reserve("mnist", "job", MECHANISMS[1].with_steps(60))
        ledger.commit(reservation.reservation_id, 20, 0)
        first = ledger.get_budget("mnist")
        ledger.commit(reservation.reservation_id, 30, 1)
        second = ledger.get_budget("mnist")
    committed = Composition((MECHANISMS[1].with_steps(50),))
    assert first.spent_epsilon_accountant == second.spent_epsilon_accountant == "pld"
    assert abs(second.spent_epsilon - replayed_epsilon(committed)) <= 1e-9
    with sqlite3.connect(path) as connection:
        ((kept,),) = connection.execute("SELECT state FROM composed_pld").fetchall()
    # Kept at the first status, and the second's (within KEEP_EVERY_SECONDS of it) when the ledger closed.
    assert ComposedPld.from_bytes(kept, load_history_key()).events == committed
    forget_pld_figures()  # as a restart does
    with open_embedded_ledger(path) as reopened:
        reopened.commit(reservation.reservation_id, 10, 2)
        with monkeypatch.context() as patched:
            patched.setattr(ComposedPld, "empty", lambda: pytest.fail("the kept state was composed again"))
            status = reopened.get_budget("mnist")
        (state,) = COMPOSED.states()
    assert state.events == Composition((MECHANISMS[1].with_steps(60),))
    assert abs(status.spent_epsilon - replayed_epsilon(state.events)) <= 1e-9


def test_commits_are_composed_in_the_background_and_neither_a_status_nor_a_restart_composes_them_again(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(store_composed, "SETTLE_SECONDS", 0.0)
    path = tmp_path / "ledger.db"
    committed = Composition(tuple(mechanism.with_steps(4) for mechanism in MECHANISMS))
    with open_embedded_ledger(path) as ledger:
        ledger.create_dataset("mnist", 5.0, DELTA)
        for sequence, mechanism in enumerate(MECHANISMS):
            reservation = ledger.reserve("mnist", f"job-{sequence}", mechanism.with_steps(4))
            ledger.commit(reservation.reservation_id, 4, 0)
        # No status asked: the thread the commits woke composes them.
        waited = 0.0
        while not any(canonical(state.events) == canonical(committed) for state in COMPOSED.states()):
            assert waited < 120, "the commits were not composed in the background"
            time.sleep(0.1)
            waited += 0.1
        with monkeypatch.context() as patched:
            patched.setattr(composed, "composed_pld", lambda *_, **__: pytest.fail("a status composed again"))
            status = ledger.get_budget("mnist")
    replayed = replayed_epsilon(committed)
    assert replayed - 1e-9 <= status.spent_epsilon <= replayed * 1.01
    forget_pld_figures()  # as a restart does
    with open_embedded_ledger(path) as reopened:
        with monkeypatch.context() as patched:
            patched.setattr(composed, "composed_pld", lambda *_, **__: pytest.fail("a restart composed again"))
            assert reopened.get_budget("mnist").spent_epsilon == status.spent_epsilon


def test_the_first_status_after_a_restart_reads_the_kept_state_and_builds_no_curve_or_distribution_again(
    tmp_path, monkeypatch
):
    path = tmp_path / "ledger.db"
    new_mechanism = SampledGaussian(0.01, 1.25, 1)
    with open_embedded_ledger(path) as ledger:
        ledger.create_dataset("mnist", 50.0, DELTA)
        for sequence, mechanism in enumerate(MECHANISMS):
            reservation = ledger.reserve("mnist", f"job-{sequence}", mechanism.with_steps(4))
            ledger.commit(reservation.reservation_id, 4, 0)
        before = ledger.get_budget("mnist")
        # Committed just before the ledger closes, before its background composition ran: composed at close.
        reservation = ledger.reserve("mnist", "job-last", MECHANISMS[0].with_steps(2))
        ledger.commit(reservation.reservation_id, 2, 0)
    committed = Composition(tuple(mechanism.with_steps(6 if mechanism is MECHANISMS[0] else 4)
                                  for mechanism in MECHANISMS))
    built = []

    def counted(name, function):
        def wrapped(*args, **kwargs):
            built.append((name, args))
            return function(*args, **kwargs)
        wrapped.cache_clear = getattr(function, "cache_clear", None)
        return wrapped

    forget_figures()  # as a restart does: every curve, tally, figure and distribution of this process
    monkeypatch.setattr(caches, "_curve_anywhere", counted("curve", caches._curve_anywhere))
    monkeypatch.setattr(caches, "_step_curve", caches.shared_cache(4096)(caches._curve_anywhere))
    monkeypatch.setattr(accountants, "one_step_pld", counted("one-step pld", accountants.one_step_pld))
    with open_embedded_ledger(path) as reopened:
        after = reopened.get_budget("mnist")
        assert built == []  # one read of the kept state: nothing rebuilt per mechanism
        assert after.spent_epsilon_filter > before.spent_epsilon_filter
        assert after.spent_epsilon_filter == rdp_figures(
            after.budget_epsilon, after.admission, RdpTally.of(committed), RdpTally.of(committed)
        ).spent_epsilon_filter
        assert replayed_epsilon(committed) - 1e-9 <= after.spent_epsilon <= replayed_epsilon(committed) * 1.01
        # A step of a mechanism committed since: its curve and one-step distribution are the only ones built.
        reservation = reopened.reserve("mnist", "job-new", new_mechanism.with_steps(1))
        reopened.commit(reservation.reservation_id, 1, 0)
        built.clear()
        reopened.get_budget("mnist")
        assert {name for name, _ in built} <= {"one-step pld"}
        assert all(args[:2] == (0.01, 1.25) for _, args in built)
    forget_figures()
    with open_embedded_ledger(path) as reopened:
        built.clear()
        assert reopened.get_budget("mnist").spent_epsilon_filter > after.spent_epsilon_filter
        assert built == []


def test_a_state_kept_without_its_tally_still_reads_back_and_the_tally_is_computed(tmp_path):
    path = tmp_path / "ledger.db"
    with open_embedded_ledger(path) as ledger:
        ledger.create_dataset("mnist", 50.0, DELTA)
        reservation = ledger.reserve("mnist", "job", MECHANISMS[0].with_steps(10))
        ledger.commit(reservation.reservation_id, 10, 0)
        before = ledger.get_budget("mnist")
    with sqlite3.connect(path) as connection:
        ((kept,),) = connection.execute("SELECT state FROM composed_pld").fetchall()
        state = ComposedPld.from_bytes(kept, load_history_key())
        assert state.rdp_tally == RdpTally.of(state.events).to_json()
        # The layout of states kept before the tally was: the same bytes without the tally's section.
        older = ComposedPld(state.events, state.distribution).to_bytes(load_history_key())[:-8]
        key = load_history_key()
        older = hmac.new(key, older[32:], hashlib.sha256).digest() + older[32:]
        connection.execute("UPDATE composed_pld SET state = ?", (older,))
    assert ComposedPld.from_bytes(older, key).rdp_tally == ""
    forget_figures()
    with open_embedded_ledger(path) as reopened:
        assert reopened.get_budget("mnist") == before


def test_an_edited_kept_state_is_ignored_and_the_figure_is_composed_again(tmp_path):
    path = tmp_path / "ledger.db"
    with open_embedded_ledger(path) as ledger:
        ledger.create_dataset("mnist", 5.0, DELTA)
        reservation = ledger.reserve("mnist", "job", MECHANISMS[0].with_steps(30))
        ledger.commit(reservation.reservation_id, 30, 0)
        honest = ledger.get_budget("mnist").spent_epsilon
    # Someone with the database but not the key puts in the distribution of fewer steps.
    understated = ComposedPld.empty().extended_to(Composition((MECHANISMS[0].with_steps(30),)))
    forged = ComposedPld(understated.events, ComposedPld.empty().extended_to(
        Composition((MECHANISMS[0].with_steps(1),))).distribution)
    with sqlite3.connect(path) as connection:
        connection.execute("UPDATE composed_pld SET state = ?", (forged.to_bytes(b"o" * 32),))
    forget_pld_figures()
    with open_embedded_ledger(path) as reopened:
        assert reopened.get_budget("mnist").spent_epsilon == honest



def test_where_pld_is_impractical_the_status_reports_the_rdp_bound_without_composing(tmp_path, monkeypatch):
    heavy = SampledGaussian(1.0, 0.25, 10)  # ε about 139: past where PLD's grid is practical
    with open_embedded_ledger(tmp_path / "ledger.db") as ledger:
        ledger.create_dataset("mnist", 1e4, DELTA)
        reservation = ledger.reserve("mnist", "job", heavy)
        ledger.commit(reservation.reservation_id, 10, 0)
        monkeypatch.setattr(COMPOSED, "extended", lambda *_: pytest.fail("an impractical PLD was composed"))
        status = ledger.get_budget("mnist")
    # The filter's tallies round each order up to 2**-60 nats: the same bound to the last bits.
    assert status.spent_epsilon == pytest.approx(get_accountant("rdp").epsilon(Composition((heavy,)), DELTA), rel=1e-12)
    assert status.spent_epsilon > 100
    assert status.spent_epsilon_accountant == "rdp"
