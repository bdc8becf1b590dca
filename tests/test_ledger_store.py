"""The embedded ledger on a real SQLite file: reservations, commits, releases, tenants, history."""

import json
import math
import os
import pickle
import random
import re
import sqlite3
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from accounting.accountants import get_accountant
from accounting.events import Composition, SampledGaussian, group_events
from accounting.ledger import caches, store
from accounting.ledger.admission import AdmissionRule, RdpTally, canonical, split_steps
from accounting.ledger.callers import ADMIN
from accounting.ledger.errors import (
    AlreadyExists,
    BudgetExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    RateLimited,
    Unauthenticated,
)
from accounting.ledger.limits import TokenBuckets
from accounting.ledger.store import (
    SCHEMA_VERSION,
    Ledger,
    default_ledger_path,
    load_history_key,
    open_embedded_ledger,
    rekey_ledger,
)
from accounting.ledger.tokens import hash_token, token_digest
from accounting.ledger.verification import history_hash
from query_plans import listing_statements, reads_growing_table, recording_statements, sqlite_plan_problems

DELTA = 1e-5
FIRST = SampledGaussian(0.004, 1.1, 1)
SECOND = SampledGaussian(0.008, 0.9, 1)
TABLES = ("tenants", "datasets", "reservations", "commits", "history")
VERSION_2_DUMP = Path(__file__).resolve().parent / "ledger_v2.sql"


@pytest.fixture
def ledger(tmp_path):
    with open_embedded_ledger(tmp_path / "ledger.db") as opened:
        yield opened


def row_counts(ledger):
    with sqlite3.connect(ledger.path) as connection:
        return {table: connection.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0] for table in TABLES}


def rdp_epsilon(events):
    return RdpTally.of(events).epsilon(DELTA)


def filter_epsilon(events, budget):
    """The epsilon a dataset of this budget's filter counts for `events`."""
    return AdmissionRule.for_budget(budget, DELTA).epsilon(RdpTally.of(events))


def test_embedded_ledger_lives_under_dpfleet_home(tmp_path, monkeypatch):
    monkeypatch.setenv("DPFLEET_HOME", str(tmp_path / "home"))
    assert default_ledger_path() == tmp_path / "home" / "ledger.db"
    with open_embedded_ledger() as opened:
        opened.create_dataset("mnist", 1.0, DELTA)
    assert (tmp_path / "home" / "ledger.db").exists()
    monkeypatch.delenv("DPFLEET_HOME")
    assert str(default_ledger_path()).endswith(".local/share/dpfleet/ledger.db")


def test_file_is_wal_with_a_schema_version_and_refuses_other_versions(ledger, tmp_path):
    with sqlite3.connect(ledger.path) as connection:
        assert connection.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert connection.execute("SELECT version FROM schema_version").fetchall() == [(SCHEMA_VERSION,)]
        connection.execute("UPDATE schema_version SET version = 99")
    with pytest.raises(FailedPrecondition, match=f"schema version 99; this dpfleet reads versions up to {SCHEMA_VERSION}"):
        Ledger(ledger.path)


def version_2_file(path, version=2):
    """A ledger file as schema version 2 wrote it (tests/ledger_v2.sql); version 1 also lacks released_jobs."""
    with sqlite3.connect(path) as connection:
        connection.executescript(VERSION_2_DUMP.read_text())
        if version == 1:
            connection.execute("ALTER TABLE datasets DROP COLUMN released_jobs")
            connection.execute("UPDATE schema_version SET version = 1")
    return path


# The tables each schema version created, newest first (accounting/ledger/store/schema.py).
LATER_TABLES = {13: "plans plan_jobs", 11: "verified_state", 10: "composed_pld", 8: "admin_tokens token_generation", 6: "queued_jobs",
                5: "tenant_use"}


def as_unkeyed_version(path, version):
    """The file as schema `version` (before 9) left it, as far as the ledger can tell: without the tables of
    later versions and the entries that record a creation or migration, its history chained without the key."""
    assert version < 9
    with without_history_triggers(path) as connection:
        for since, tables in LATER_TABLES.items():
            for table in tables.split() if since > version else ():
                connection.execute(f"DROP TABLE {table}")
        connection.execute("DELETE FROM history WHERE action IN ('create_ledger', 'migrate_schema')")
        rechain_without_the_key(connection)
        connection.execute("UPDATE schema_version SET version = ?", (version,))
    return path


def test_a_file_of_a_version_before_the_key_is_not_keyed_by_opening_it_but_by_rekey(tmp_path):
    path = version_2_file(tmp_path / "ledger.db")
    with pytest.raises(FailedPrecondition, match="schema version 2, whose history is chained without the history "
                                                 "key .* key and migrate it on purpose with dpfleet ledger rekey"):
        open_embedded_ledger(path)
    with sqlite3.connect(path) as connection:  # refused before anything was written
        assert connection.execute("SELECT version FROM schema_version").fetchall() == [(2,)]
    assert rekey_ledger(path) == []
    with open_embedded_ledger(path) as migrated:
        assert migrated.verify().findings == ()


def test_a_version_1_file_is_migrated_with_its_released_jobs_counted_and_the_migration_recorded(tmp_path):
    rekey_ledger(version_2_file(tmp_path / "ledger.db", version=1))
    with open_embedded_ledger(tmp_path / "ledger.db") as migrated:
        after = migrated.get_budget("mnist")
        assert after.released_jobs == 2 and [job.job_id for job in after.jobs] == ["running"]
        (entry,) = [entry for entry in migrated.history() if entry.action == "migrate_schema"]
        assert entry.details == {"from": 1, "to": SCHEMA_VERSION}
        assert migrated.verify().findings == ()
    with sqlite3.connect(tmp_path / "ledger.db") as connection:
        assert connection.execute("SELECT version FROM schema_version").fetchall() == [(SCHEMA_VERSION,)]


def test_a_version_2_file_keeps_its_events_and_its_reservations_commit_only_what_fits_the_filter(tmp_path):
    path = version_2_file(tmp_path / "ledger.db")
    with sqlite3.connect(path) as connection:
        before = connection.execute("SELECT held_rdp, committed_events FROM datasets").fetchone()
        history_before = connection.execute("SELECT id, at, actor, action, details FROM history").fetchall()
    rekey_ledger(path)
    with open_embedded_ledger(path) as migrated:
        with sqlite3.connect(path) as connection:
            assert connection.execute("SELECT held_rdp, committed_events FROM datasets").fetchone() == before
            assert connection.execute(
                "SELECT id, at, actor, action, details FROM history WHERE id <= ?", (len(history_before),)
            ).fetchall() == history_before
        status = migrated.get_budget("mnist")
        rule = AdmissionRule.for_budget(2.0, DELTA)
        assert status.admission == rule
        assert status.privacy_unit == "example"  # what every dataset protected before units were recorded
        assert status.spent_epsilon_filter == filter_epsilon(FIRST.with_steps(1800), 2.0)
        adopted = [entry.details for entry in migrated.history() if entry.action == "adopt_admission_rule"]
        held_epsilon = rule.epsilon(RdpTally.from_json(before[0]))
        assert adopted == [
            {"admission": rule.to_dict(), "held_epsilon_filter": held_epsilon, "held_fits_budget": False}
        ]
        assert held_epsilon > 2.0 > RdpTally.from_json(before[0]).epsilon(DELTA)  # admitted by the old rule only
        assert migrated.verify().findings == ()

        with pytest.raises(BudgetExceeded):
            migrated.reserve("mnist", "new", FIRST.with_steps(10))
        (running,) = status.jobs
        assert migrated.commit(running.reservation_id, 100, 1).committed_steps == 600
        with pytest.raises(BudgetExceeded):
            migrated.commit(running.reservation_id, 400, 2)
        migrated.release(running.reservation_id)
        migrated.reserve("mnist", "new", FIRST.with_steps(10))
        assert migrated.verify().findings == ()


def test_history_is_append_only(ledger):
    ledger.create_dataset("mnist", 1.0, DELTA)
    with sqlite3.connect(ledger.path) as connection:
        with pytest.raises(sqlite3.IntegrityError, match="append-only"):
            connection.execute("UPDATE history SET actor = 'someone else'")
        with pytest.raises(sqlite3.IntegrityError, match="append-only"):
            connection.execute("DELETE FROM history")


def test_commits_consume_a_heterogeneous_plan_in_order(ledger):
    ledger.create_dataset("mnist", 10.0, DELTA)
    plan = Composition((FIRST.with_steps(5), SECOND.with_steps(3)))
    reservation = ledger.reserve("mnist", "job-1", plan)
    assert ledger.commit(reservation.reservation_id, 4, 0).committed_steps == 4
    result = ledger.commit(reservation.reservation_id, 2, 1)
    assert (result.committed_steps, result.unrun_steps) == (6, 2)
    charges = [entry.details["events"] for entry in ledger.history("mnist") if entry.action == "commit"]
    assert [Composition.from_dict(charge) for charge in charges] == [
        Composition((FIRST.with_steps(4),)),
        Composition((FIRST.with_steps(1), SECOND.with_steps(1))),
    ]
    status = ledger.get_budget("mnist")
    spent = Composition((FIRST.with_steps(5), SECOND.with_steps(1)))
    assert status.spent_epsilon_rdp == rdp_epsilon(spent)
    assert status.spent_epsilon == get_accountant("pld").epsilon(spent, DELTA)
    assert status.spent_epsilon_filter == filter_epsilon(spent, 10.0)
    assert status.remaining_epsilon == pytest.approx(10.0 - filter_epsilon(plan, 10.0), rel=1e-12)


def test_a_status_that_may_not_wait_reports_the_rdp_bound_until_the_pld_figure_is_ready(ledger, held_back_pld):
    uncommon = SampledGaussian(0.0037, 1.07, 1)  # a composition no other test has had the PLD of
    ledger.create_dataset("mnist", 10.0, DELTA)
    reservation = ledger.reserve("mnist", "job-1", uncommon.with_steps(100))
    ledger.commit(reservation.reservation_id, 37, 0)
    quick = ledger.get_budget("mnist", pld_may_be_pending=True)
    assert quick.spent_epsilon_accountant == "rdp"
    assert quick.spent_epsilon == quick.spent_epsilon_rdp == rdp_epsilon(uncommon.with_steps(37))
    assert [status.spent_epsilon_accountant for status in ledger.list_datasets(pld_may_be_pending=True)] == ["rdp"]
    held_back_pld.set()
    exact = ledger.get_budget("mnist")
    assert exact.spent_epsilon_accountant == "pld"
    assert exact.spent_epsilon == get_accountant("pld").epsilon(uncommon.with_steps(37), DELTA) < quick.spent_epsilon
    assert (exact.reserved_epsilon, exact.remaining_epsilon) == (quick.reserved_epsilon, quick.remaining_epsilon)
    assert ledger.get_budget("mnist", pld_may_be_pending=True) == exact


def test_closing_lets_a_read_in_progress_finish_and_refuses_reads_after(ledger):
    ledger.create_dataset("mnist", 1.0, DELTA)
    ledger.get_budget("mnist")  # leaves an idle reader in the pool
    with ledger._transactions.read() as connection:  # a read another thread might be in the middle of
        ledger.close()
        assert connection.execute("SELECT COUNT(*) FROM datasets").fetchone() == (1,)
    with pytest.raises(sqlite3.ProgrammingError):
        connection.execute("SELECT 1")  # closed once the read was done
    with pytest.raises(FailedPrecondition, match="is closed"):
        ledger.get_budget("mnist")


def test_a_commit_with_the_same_sequence_charges_once(ledger):
    ledger.create_dataset("mnist", 10.0, DELTA)
    reservation = ledger.reserve("mnist", "job-1", FIRST.with_steps(100))
    first = ledger.commit(reservation.reservation_id, 10, 7)
    before = row_counts(ledger)
    assert ledger.commit(reservation.reservation_id, 10, 7) == first
    assert row_counts(ledger) == before
    assert ledger.list_jobs("mnist")[0].committed_steps == 10
    with pytest.raises(InvalidArgument, match="sequence 7 .* was committed with 10 steps \\(got 11\\)"):
        ledger.commit(reservation.reservation_id, 11, 7)


def test_commit_refuses_more_steps_than_planned_and_after_release(ledger):
    ledger.create_dataset("mnist", 10.0, DELTA)
    reservation = ledger.reserve("mnist", "job-1", FIRST.with_steps(10))
    first = ledger.commit(reservation.reservation_id, 8, 0)
    with pytest.raises(InvalidArgument, match="has 2 unrun steps of 10 \\(got 3\\)"):
        ledger.commit(reservation.reservation_id, 3, 1)
    ledger.release(reservation.reservation_id)
    with pytest.raises(FailedPrecondition, match="was released"):
        ledger.commit(reservation.reservation_id, 1, 1)
    # The reservation is checked before the sequence: a late retry is refused, and its charge stands.
    with pytest.raises(FailedPrecondition, match="was released"):
        ledger.commit(reservation.reservation_id, 8, 0)
    assert first.committed_steps == ledger.list_jobs("mnist")[0].committed_steps == 8


def test_release_frees_only_what_never_ran(ledger):
    ledger.create_dataset("mnist", 10.0, DELTA)
    reservation = ledger.reserve("mnist", "job-1", FIRST.with_steps(1000))
    ledger.commit(reservation.reservation_id, 400, 0)
    released = ledger.release(reservation.reservation_id)
    assert (released.state, released.committed_steps, released.unrun_steps) == ("released", 400, 0)
    status = ledger.get_budget("mnist")
    assert status.reserved_epsilon == 0.0
    assert status.remaining_epsilon == 10.0 - filter_epsilon(FIRST.with_steps(400), 10.0)
    assert status.released_jobs == 1 and status.jobs == ()
    before = row_counts(ledger)
    assert ledger.release(reservation.reservation_id) == released
    assert row_counts(ledger) == before and ledger.get_budget("mnist").released_jobs == 1


def test_a_reservation_stays_held_until_released(ledger):
    ledger.create_dataset("mnist", 10.0, DELTA)
    reservation = ledger.reserve("mnist", "job-that-died", FIRST.with_steps(1000))
    remaining = ledger.get_budget("mnist").remaining_epsilon
    ledger.close()
    with open_embedded_ledger(ledger.path) as reopened:
        status = reopened.get_budget("mnist")
        assert [job.reservation_id for job in status.jobs] == [reservation.reservation_id]
        assert status.remaining_epsilon == remaining


def test_a_job_that_does_not_fit_is_refused_and_nothing_is_written(ledger):
    ledger.create_dataset("mnist", 2.5, DELTA)
    ledger.reserve("mnist", "job-1", FIRST.with_steps(2000))
    before = row_counts(ledger)
    status = ledger.get_budget("mnist")
    big = SECOND.with_steps(3000)
    with pytest.raises(BudgetExceeded) as refusal:
        ledger.reserve("mnist", "job-2", big)
    assert refusal.value.remaining_epsilon == status.remaining_epsilon
    held = FIRST.with_steps(2000)
    needed = filter_epsilon(Composition((held, big)), 2.5) - filter_epsilon(held, 2.5)
    assert refusal.value.needed_epsilon == needed
    shown_remaining = math.floor(status.remaining_epsilon * 100) / 100
    shown_needed = math.ceil(refusal.value.needed_epsilon * 100) / 100
    assert f"has ε {shown_remaining:.2f} left at δ=1e-05; this job needs ε {shown_needed:.2f}" in str(refusal.value)
    assert row_counts(ledger) == before


def test_two_jobs_that_fit_together_are_both_admitted_though_their_epsilons_add_up_to_more(ledger):
    job = FIRST.with_steps(3000)
    budget = 2.0
    alone = filter_epsilon(job, budget)
    together = filter_epsilon(Composition((job, job)), budget)
    assert together < budget < 2 * alone
    ledger.create_dataset("mnist", budget, DELTA)
    for job_id in ("job-1", "job-2"):
        reservation = ledger.reserve("mnist", job_id, job)
        ledger.commit(reservation.reservation_id, job.steps, 0)
    status = ledger.get_budget("mnist")
    assert status.spent_epsilon_filter == together
    assert status.spent_epsilon_rdp == rdp_epsilon(Composition((job, job)))
    assert status.spent_epsilon < 2 * get_accountant("pld").epsilon(job, DELTA)
    with pytest.raises(BudgetExceeded):
        ledger.reserve("mnist", "job-3", job)


def test_reserving_again_for_the_same_job_holds_budget_once(ledger):
    ledger.create_dataset("mnist", 10.0, DELTA)
    first = ledger.reserve("mnist", "job-1", FIRST.with_steps(100))
    before = row_counts(ledger)
    assert ledger.reserve("mnist", "job-1", FIRST.with_steps(100)) == first
    assert row_counts(ledger) == before
    with pytest.raises(FailedPrecondition, match="already holds reservation"):
        ledger.reserve("mnist", "job-1", FIRST.with_steps(200))


def test_budgets_are_raised_by_admins_only_never_below_what_is_held_and_recorded(ledger):
    tenant = ledger.create_tenant("acme")
    acme = ledger.authenticate(tenant.token)
    ledger.create_dataset("mnist", 2.0, DELTA, caller=acme)
    ledger.reserve("mnist", "job-1", FIRST.with_steps(2000), caller=acme)
    with pytest.raises(PermissionDenied, match="needs the admin token"):
        ledger.raise_budget("mnist", 5.0, caller=acme)
    held = filter_epsilon(FIRST.with_steps(2000), 2.0)  # the orders stay those chosen at creation
    with pytest.raises(FailedPrecondition, match="would not cover it"):
        ledger.raise_budget("acme/mnist", held * 0.9)
    assert ledger.raise_budget("acme/mnist", 5.0).budget_epsilon == 5.0
    assert ledger.raise_budget("acme/mnist", held * 1.1).budget_epsilon == held * 1.1
    changes = [entry.details for entry in ledger.history("acme/mnist") if entry.action == "raise_budget"]
    # The embedded ledger's local admin acts with no token; a tenant's change names its token's key id.
    assert changes == [{"from": 2.0, "to": 5.0, "actor_key_id": None},
                       {"from": 5.0, "to": held * 1.1, "actor_key_id": None}]
    (created,) = [entry for entry in ledger.history("acme/mnist") if entry.action == "create_dataset"]
    assert created.details["actor_key_id"] == acme.key_id is not None


def test_tenants_see_and_charge_only_their_own_datasets(ledger):
    acme = ledger.authenticate(ledger.create_tenant("acme").token)
    globex = ledger.authenticate(ledger.create_tenant("globex").token)
    ledger.create_dataset("secret", 5.0, DELTA, caller=acme)
    reservation = ledger.reserve("secret", "job-1", FIRST.with_steps(10), caller=acme)
    before = row_counts(ledger)

    def refusal(call):
        with pytest.raises(PermissionDenied) as raised:
            call()
        return str(raised.value)

    existing_status = refusal(lambda: ledger.get_budget("acme/secret", caller=globex))
    missing_status = refusal(lambda: ledger.get_budget("acme/nosuch", caller=globex))
    assert existing_status.replace("secret", "X") == missing_status.replace("nosuch", "X")
    existing = refusal(lambda: ledger.reserve("acme/secret", "job-2", FIRST.with_steps(1), caller=globex))
    missing = refusal(lambda: ledger.reserve("acme/nosuch", "job-2", FIRST.with_steps(1), caller=globex))
    assert existing.replace("secret", "X") == missing.replace("nosuch", "X")
    assert refusal(lambda: ledger.get_budget("secret", caller=globex)) == refusal(
        lambda: ledger.get_budget("secret", caller=ledger.authenticate(ledger.create_tenant("initech").token))
    )
    other = refusal(lambda: ledger.commit(reservation.reservation_id, 1, 0, caller=globex))
    bogus = refusal(lambda: ledger.commit("r-0000000000000000", 1, 0, caller=globex))
    assert other.replace(reservation.reservation_id, "X") == bogus.replace("r-0000000000000000", "X")
    refusal(lambda: ledger.release(reservation.reservation_id, caller=globex))
    assert ledger.list_datasets(caller=globex) == []
    assert ledger.list_jobs(caller=globex) == []
    assert [entry.action for entry in ledger.history(caller=globex)] == ["create_tenant"]
    assert [status.name for status in ledger.list_datasets(caller=acme)] == ["secret"]
    assert row_counts(ledger)["commits"] == before["commits"]
    with pytest.raises(NotFound):
        ledger.get_budget("acme/nosuch", caller=ADMIN)


def test_names_and_tokens_are_checked(ledger):
    with pytest.raises(AlreadyExists):
        ledger.create_tenant("local")
    with pytest.raises(InvalidArgument):
        ledger.create_tenant("")
    with pytest.raises(NotFound, match="tenant 'ghost' does not exist"):
        ledger.create_dataset("ghost/mnist", 1.0, DELTA)
    ledger.create_dataset("mnist", 1.0, DELTA)
    with pytest.raises(AlreadyExists):
        ledger.create_dataset("mnist", 1.0, DELTA)
    with pytest.raises(Unauthenticated):
        ledger.authenticate("dpf_0123456789abcdef_guessed")


def test_running_tallies_equal_a_recomputation_from_stored_events_after_random_work(ledger):
    """Adding plans and subtracting their unrun parts leaves no drift in the running RDP tallies."""
    generator = random.Random(4)
    ledger.create_dataset("mnist", 1e4, DELTA)
    mechanisms = [FIRST, SECOND, SampledGaussian(0.02, 2.0, 1)]
    active, sequence = [], 0
    for round_number in range(150):
        action = generator.random()
        if action < 0.35 or not active:
            plan = Composition(
                tuple(generator.choice(mechanisms).with_steps(generator.randint(1, 50)) for _ in range(3))
            )
            active.append(ledger.reserve("mnist", f"job-{round_number}", plan))
        elif action < 0.8:
            reservation = generator.choice(active)
            jobs = {job.reservation_id: job for job in ledger.list_jobs("mnist", "active")}
            unrun = jobs[reservation.reservation_id].unrun_steps
            if unrun:
                sequence += 1
                ledger.commit(reservation.reservation_id, generator.randint(1, unrun), sequence)
        else:
            ledger.release(active.pop(generator.randrange(len(active))).reservation_id)
    held, committed, committed_events = RdpTally.zero(), RdpTally.zero(), Composition()
    for job in ledger.list_jobs("mnist"):
        ran, _ = split_steps(job.planned, job.committed_steps)
        committed = committed + RdpTally.of(ran)
        committed_events = committed_events.then(ran)
        held = held + (RdpTally.of(job.planned) if job.state == "active" else RdpTally.of(ran))
    with sqlite3.connect(ledger.path) as connection:
        stored_held, stored_committed = connection.execute("SELECT held_rdp, committed_events FROM datasets").fetchone()
    assert RdpTally.from_json(stored_held) == held
    assert Composition.from_json(stored_committed) == canonical(committed_events)
    assert RdpTally.of(canonical(committed_events)) == committed
    history = ledger.history("mnist", limit=100_000)
    assert sum(1 for entry in history if entry.action == "commit") == row_counts(ledger)["commits"]
    assert json.loads(json.dumps([entry.to_dict() for entry in history]))  # history is plain JSON


def test_concurrent_changes_are_each_applied_once_or_not_at_all(ledger):
    """Threads share transactions (group commit); a refused change must not disturb the others."""
    ledger.create_dataset("mnist", 1e4, DELTA)
    reservations = [ledger.reserve("mnist", f"job-{index}", FIRST.with_steps(10_000)) for index in range(4)]
    refusals = []

    def work(reservation):
        for sequence in range(60):
            ledger.commit(reservation.reservation_id, 2, sequence)
            try:
                ledger.commit(reservation.reservation_id, 10**6, 1000 + sequence)  # more than planned
            except InvalidArgument:
                refusals.append(sequence)

    threads = [threading.Thread(target=work, args=(reservation,)) for reservation in reservations]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(refusals) == 4 * 60
    assert [job.committed_steps for job in ledger.list_jobs("mnist")] == [120] * 4
    assert row_counts(ledger)["commits"] == 240
    with sqlite3.connect(ledger.path) as connection:
        (stored,) = connection.execute("SELECT committed_events FROM datasets").fetchone()
    assert Composition.from_json(stored) == Composition((FIRST.with_steps(480),))


def edit_history(path, entry_id, details, rechain=False):
    """Edit one history row by hand, as someone with the file could; with `rechain`, rewrite every hash after it
    (as someone who also holds the history key could)."""
    with sqlite3.connect(path) as connection:
        connection.execute("DROP TRIGGER IF EXISTS history_is_append_only_update")
        connection.execute(
            "UPDATE history SET details = ? WHERE id = ?", (json.dumps(details, sort_keys=True), entry_id)
        )
        if rechain:
            previous = ""
            for row in connection.execute(
                "SELECT id, at, actor, action, tenant, dataset_id, details FROM history ORDER BY id"
            ).fetchall():
                entry_hash = history_hash(previous, *row, load_history_key())
                connection.execute(
                    "UPDATE history SET previous_hash = ?, hash = ? WHERE id = ?", (previous, entry_hash, row[0])
                )
                previous = entry_hash


def findings(ledger):
    return [str(finding) for finding in ledger.verify().findings]


def test_verify_reports_a_hand_edited_history_row_with_its_dataset_and_entry(ledger):
    ledger.create_dataset("mnist", 10.0, DELTA)
    reservation = ledger.reserve("mnist", "job-1", FIRST.with_steps(100))
    ledger.commit(reservation.reservation_id, 60, 0)
    ledger.release(reservation.reservation_id)
    clean = ledger.verify()
    assert clean.findings == () and clean.entries == len(ledger.history()) and clean.datasets == 1
    (commit,) = [entry for entry in ledger.history() if entry.action == "commit"]
    smaller = dict(commit.details, events=Composition((FIRST.with_steps(6),)).to_dict())
    edit_history(ledger.path, commit.entry_id, smaller)
    release = f"entry {commit.entry_id + 1} of dataset local/mnist: records 60 committed and 40 freed steps of "
    assert findings(ledger) == [
        f"entry {commit.entry_id} of dataset local/mnist: its fields do not match its hash (the row was edited)",
        f"{release}{reservation.reservation_id}; its commits give 6 and 94",
        "dataset row of dataset local/mnist: the row's RDP tally of committed and reserved steps is not what its "
        "history replays to",
        "dataset row of dataset local/mnist: the row's set of committed events is not what its history replays to",
        f"reservation: {reservation.reservation_id}: its row differs from what its history replays to in "
        "committed_steps",
        f"commit: sequence 0 of {reservation.reservation_id} (6 steps) is in the history but has no row",
        f"commit: sequence 0 of {reservation.reservation_id} (60 steps) has a row but no history entry",
    ]
    edit_history(ledger.path, commit.entry_id, smaller, rechain=True)  # hashes made whole again: the replay still tells
    anchor, replayed, *_ = findings(ledger)
    # The last clean verify kept the hash of its last entry, the release: rewritten, so the replays start over.
    assert anchor == f"entry {commit.entry_id + 1}: its hash is not the one the last verify checked there: the " \
        "history was rewritten"
    assert replayed.startswith(release)


def test_verify_replays_each_admission_against_the_rule(ledger):
    ledger.create_dataset("mnist", 2.0, DELTA)
    ledger.reserve("mnist", "job-1", FIRST.with_steps(100))
    (reserve,) = [entry for entry in ledger.history() if entry.action == "reserve"]
    assert reserve.details["held_epsilon_filter"] == filter_epsilon(FIRST.with_steps(100), 2.0)
    oversized = Composition((FIRST.with_steps(10**5),)).to_dict()
    edit_history(ledger.path, reserve.entry_id, dict(reserve.details, planned_events=oversized))
    admitted, recorded = findings(ledger)[1:3]
    assert admitted.startswith(f"entry {reserve.entry_id} of dataset local/mnist: admitted a job to ε ")
    assert admitted.endswith("over the budget ε 2")
    assert recorded.startswith(f"entry {reserve.entry_id} of dataset local/mnist: records ε ")


def test_a_lease_expires_frees_its_unrun_steps_and_fences_off_later_commits(ledger):
    job = FIRST.with_steps(3000)
    ledger.create_dataset("mnist", 2.0, DELTA)
    renewed = ledger.reserve("mnist", "renewed", job, lease_seconds=0.4)
    zombie = ledger.reserve("mnist", "zombie", job, lease_seconds=0.4)
    assert zombie.lease_seconds == 0.4 and zombie.expires_at > zombie.created_at
    with pytest.raises(BudgetExceeded):
        ledger.reserve("mnist", "waiting", job)
    ledger.commit(zombie.reservation_id, 100, 0)
    for sequence in range(4):  # a trainer that commits every 0.2 s keeps its lease
        time.sleep(0.2)
        ledger.commit(renewed.reservation_id, 10, sequence)
    assert ledger.reserve("mnist", "waiting", job).state == "active"  # the zombie's 2900 unrun steps were freed
    with pytest.raises(FailedPrecondition, match="lease of reservation .* expired .* takes no more commits"):
        ledger.commit(zombie.reservation_id, 100, 1)
    with pytest.raises(FailedPrecondition, match="lease of reservation .* expired"):  # checked before the sequence
        ledger.commit(zombie.reservation_id, 100, 0)
    (expired,) = [job for job in ledger.list_jobs("mnist") if job.reservation_id == zombie.reservation_id]
    assert (expired.state, expired.lease_expired, expired.committed_steps) == ("released", True, 100)
    (entry,) = [entry for entry in ledger.history("mnist") if entry.action == "expire"]
    assert entry.actor == "ledger (lease expired)" and entry.details["freed_steps"] == 2900
    assert ledger.commit(renewed.reservation_id, 10, 4).committed_steps == 50
    assert ledger.verify().findings == ()
    with pytest.raises(InvalidArgument, match="lease_seconds must be in"):
        ledger.reserve("mnist", "bad", job, lease_seconds=-1.0)


def test_a_user_level_dataset_refuses_jobs_of_mixed_units_and_charges_a_row_bound_by_group_privacy(ledger):
    ledger.create_dataset("people", 8.0, DELTA, "user")
    ledger.create_dataset("rows", 8.0, DELTA)
    assert [(status.name, status.privacy_unit) for status in ledger.list_datasets()] == [
        ("people", "user"), ("rows", "example")]
    plan = Composition((SampledGaussian(0.004, 5.0, 200),))
    before = row_counts(ledger)
    with pytest.raises(FailedPrecondition, match="user-level budget .* does not bound how many rows one person has"):
        ledger.reserve("people", "rows-unbounded", plan)
    with pytest.raises(FailedPrecondition, match="example-level budget .* bound one person, not one row"):
        ledger.reserve("rows", "per-person", plan, privacy_unit="user")
    assert row_counts(ledger) == before
    # A user-level job charges its own events; an example-level one with at most 5 rows a person its group bound.
    ledger.reserve("people", "per-person", plan, privacy_unit="user")
    bounded = ledger.reserve("people", "rows-bounded", plan, privacy_unit="example", rows_per_person=5)
    assert bounded.planned == group_events(plan, 5)
    ledger.commit(bounded.reservation_id, 200, 0)
    status = ledger.get_budget("people")
    assert status.spent_epsilon == get_accountant("pld").epsilon(group_events(plan, 5), DELTA)
    assert status.spent_epsilon > get_accountant("pld").epsilon(plan, DELTA)
    (reserve,) = [entry for entry in ledger.history("people")
                  if entry.action == "reserve" and entry.details["job_id"] == "rows-bounded"]
    assert (reserve.details["job_events"], reserve.details["rows_per_person"]) == (plan.to_dict(), 5)
    assert ledger.verify().findings == ()
    # A history that claims a smaller person than the charge was made for is caught by the replay.
    edit_history(ledger.path, reserve.entry_id, dict(reserve.details, rows_per_person=2), rechain=True)
    assert findings(ledger) == [
        # The last verify's state was kept at the commit after it, whose hash the rewrite changed.
        f"entry {reserve.entry_id + 1}: its hash is not the one the last verify checked there: the history was "
        "rewritten",
        f"entry {reserve.entry_id} of dataset local/people: charges events that are not the group-privacy bound "
        "of its job's events for 2 rows per person"]


# ------------------------------------------------------------ a keyed, anchored history: the attacker's moves


def without_history_triggers(path):
    """A connection to the file with the history's append-only triggers dropped, as whoever holds the file can."""
    connection = sqlite3.connect(path)
    connection.execute("DROP TRIGGER IF EXISTS history_is_append_only_update")
    connection.execute("DROP TRIGGER IF EXISTS history_is_append_only_delete")
    return connection


def rechain_without_the_key(connection):
    """Recompute every history entry's hash as the unkeyed SHA-256 chain, as anyone holding the file can."""
    previous = ""
    for row in connection.execute(
        "SELECT id, at, actor, action, tenant, dataset_id, details FROM history ORDER BY id"
    ).fetchall():
        entry_hash = history_hash(previous, *row)
        connection.execute("UPDATE history SET previous_hash = ?, hash = ? WHERE id = ?",
                           (previous, entry_hash, row[0]))
        previous = entry_hash


def spent_some(ledger):
    """A dataset with a committed and a released job; returns the reservation still active."""
    ledger.create_dataset("mnist", 10.0, DELTA)
    finished = ledger.reserve("mnist", "finished", FIRST.with_steps(100))
    ledger.commit(finished.reservation_id, 100, 0)
    ledger.release(finished.reservation_id)
    running = ledger.reserve("mnist", "running", FIRST.with_steps(100))
    ledger.commit(running.reservation_id, 40, 0)
    return running


def test_the_history_key_is_a_file_of_the_owner_only_outside_the_database(ledger, tmp_path):
    key_file = Path(os.environ["DPFLEET_HOME"]) / "ledger-history.key"
    assert key_file.stat().st_mode & 0o777 == 0o600 and len(load_history_key()) == 32
    key = key_file.read_text().strip().encode()
    for stored in ledger.path.parent.glob(f"{ledger.path.name}*"):  # the file, its WAL and shared memory
        assert key not in stored.read_bytes() and bytes.fromhex(key.decode()) not in stored.read_bytes()
    key_file.chmod(0o604)
    with pytest.raises(FailedPrecondition, match="chmod 600"):
        load_history_key()


def test_a_ledger_opened_with_another_key_refuses_to_chain_to_its_history(ledger, tmp_path):
    spent_some(ledger)
    with Ledger(ledger.path, caller=ADMIN, history_key_file=tmp_path / "another.key") as other:
        with pytest.raises(FailedPrecondition, match="not chained with the history key"):
            other.create_tenant("acme")
        # No entry is keyed with this key, nor is the state kept at the ledger's creation.
        assert len(other.verify().findings) == len(ledger.history()) + 1
    assert ledger.verify().findings == ()


def test_verify_finds_the_last_history_row_deleted(ledger):
    running = spent_some(ledger)
    head = ledger.head()
    with without_history_triggers(ledger.path) as connection:
        connection.execute("DELETE FROM history WHERE id = (SELECT MAX(id) FROM history)")  # the last commit
    shown = findings(ledger)
    assert (f"reservation: {running.reservation_id}: its row differs from what its history replays to in "
            "committed_steps") in shown
    assert f"commit: sequence 0 of {running.reservation_id} (40 steps) has a row but no history entry" in shown
    assert any("entries were cut from its tail" in str(finding) for finding in ledger.verify(head).findings)


def test_verify_with_a_signed_head_finds_a_tail_cut_with_every_table_rolled_back(ledger, tmp_path):
    spent_some(ledger)
    earlier = tmp_path / "earlier.db"
    with sqlite3.connect(ledger.path) as source, sqlite3.connect(earlier) as copy:
        source.backup(copy)  # the whole file as it was: every table agrees with the shorter history
    more = ledger.reserve("mnist", "more", FIRST.with_steps(50))
    ledger.commit(more.reservation_id, 50, 0)
    head = ledger.head()
    assert ledger.verify(head).findings == ()
    with sqlite3.connect(earlier) as copy, sqlite3.connect(ledger.path) as target:
        copy.backup(target)
    assert ledger.verify().findings == ()  # the cut cannot be seen from the file alone
    (cut,) = ledger.verify(head).findings
    assert str(cut) == (f"signed head: the history has {head.entries - 2} entries; at {head.at} it had {head.entries}: "
                        "entries were cut from its tail")


def test_verify_finds_a_history_rewritten_without_the_key_and_a_forged_head(ledger):
    spent_some(ledger)
    head = ledger.head()
    # Someone with the file but not the key rewrites the chain whole, as the unkeyed chain once allowed.
    with without_history_triggers(ledger.path) as connection:
        connection.execute("UPDATE history SET details = replace(details, '\"steps\": 40', '\"steps\": 4')")
        connection.execute("UPDATE commits SET steps = 4, committed_steps = 4 WHERE steps = 40")
        rechain_without_the_key(connection)
    chain = [finding for finding in ledger.verify().findings if "do not match its hash" in finding.problem]
    assert len(chain) == len(ledger.history())
    forged = replace(head, entries=head.entries - 1)
    (finding,) = [finding for finding in ledger.verify(forged).findings if finding.row == "head file"]
    assert str(finding).startswith("head file: its signature does not match the history key")


def test_verify_finds_an_edited_reservation_and_a_swapped_token(ledger):
    running = spent_some(ledger)
    ledger.create_tenant("acme")
    with sqlite3.connect(ledger.path) as connection:
        connection.execute("UPDATE reservations SET committed_steps = 10, state = 'released' WHERE id = ?",
                           (running.reservation_id,))
        connection.execute("UPDATE tenants SET token_hash = ? WHERE name = 'acme'", (b"\0" * 32,))
    assert findings(ledger)[-2:] == [
        f"reservation: {running.reservation_id}: its row differs from what its history replays to in "
        "committed_steps, state",
        "tenant: acme: its token is not the one its history records (a token was swapped in the table)",
    ]


def verified_twice(ledger):
    """A verified history (its state kept at the first commit) and two entries recorded after: the running job's
    commit of 40 steps and its release."""
    running = spent_some(ledger)
    first = ledger.verify()
    assert first.findings == () and first.replayed == first.entries
    ledger.commit(running.reservation_id, 20, 1)
    ledger.release(running.reservation_id)
    return running, first.entries


def test_verify_replays_only_the_entries_after_the_last_verified_one_and_full_replays_all(ledger):
    _, verified = verified_twice(ledger)
    incremental = ledger.verify()
    assert incremental.findings == () and (incremental.entries, incremental.replayed) == (verified + 2, 2)
    assert ledger.verify().replayed == 0  # the state moved on to the last entry
    full = ledger.verify(full=True)
    assert full.findings == () and full.replayed == full.entries == verified + 2


def both_verifies(ledger):
    """The findings of an incremental and of a full verify, as text; neither keeps a state when it finds anything."""
    return [str(finding) for finding in ledger.verify().findings], \
        [str(finding) for finding in ledger.verify(full=True).findings]


def entry_of(ledger, action, nth=0):
    return [entry for entry in ledger.history() if entry.action == action][nth]


@pytest.mark.parametrize("rechain", [False, True], ids=["edited", "edited-and-rechained-with-the-key"])
@pytest.mark.parametrize("which", ["old", "new"])
def test_an_edited_entry_before_or_after_the_verified_one_is_found_by_verify_and_by_verify_full(
    ledger, which, rechain
):
    running, verified = verified_twice(ledger)
    # The running job's first commit (40 steps) was verified; its second (20) was not yet.
    commit = entry_of(ledger, "commit", 1 if which == "old" else 2)
    assert (commit.entry_id <= verified) == (which == "old")
    smaller = dict(commit.details, events=Composition((FIRST.with_steps(4),)).to_dict())
    edit_history(ledger.path, commit.entry_id, smaller, rechain=rechain)
    incremental, full = both_verifies(ledger)
    edited = f"entry {commit.entry_id} of dataset local/mnist: its fields do not match its hash (the row was edited)"
    row = "dataset row of dataset local/mnist: the row's set of committed events is not what its history replays to"
    assert (edited in full) == (not rechain) and row in full
    rewritten = f"entry {verified}: its hash is not the one the last verify checked there: the history was rewritten"
    # Both check the kept state's anchor, and the incremental one replays from the start once it does not hold.
    assert incremental == full
    assert (rewritten in full) == (rechain and which == "old")


def test_a_forged_verified_state_is_found_and_the_replays_start_from_the_first_entry(ledger):
    running, _ = verified_twice(ledger)
    # Whoever holds the file lowers the dataset's committed steps in its row and in the kept state alike, so that
    # a replay from that state would agree with the row; without the history key the state's HMAC cannot follow.
    with sqlite3.connect(ledger.path) as connection:
        (blob,) = connection.execute("SELECT state FROM verified_state").fetchone()
        tag, body = blob[:32], blob[32:]
        prefix = body[:body.index(b"\n") + 1]
        state = pickle.loads(body[len(prefix):])
        (budget,) = state.replay.budgets.values()
        budget.committed_steps_by_mechanism = {mechanism: 1 for mechanism in budget.committed_steps_by_mechanism}
        connection.execute("UPDATE verified_state SET state = ?", (tag + prefix + pickle.dumps(state),))
    incremental, full = both_verifies(ledger)
    forged = ("verified state: its HMAC does not match the history key: it was edited, or written with another key; "
              "the replays started from the first entry")
    assert forged in incremental and forged in full
    assert incremental == full and len(incremental) == 1  # replayed from the start, the history matches the rows
    with sqlite3.connect(ledger.path) as connection:
        connection.execute("DELETE FROM verified_state")
    (deleted,) = findings(ledger)
    assert deleted == ("verified state: there is none, though every ledger of schema version 12 or later keeps one: "
                       "it was deleted")
    assert rekey_ledger(ledger.path) == []  # the admin's explicit, recorded way to seal it again
    assert ledger.history()[-1].action == "rekey_history"
    assert ledger.verify().findings == () and ledger.verify().replayed == 0  # a clean verify keeps a new state


def test_a_version_8_file_with_an_edited_unkeyed_chain_is_refused_and_keyed_only_by_rekey_which_keeps_it(ledger):
    spent_some(ledger)
    # The file as schema version 8 left it: an unkeyed chain, with one row edited before the key existed.
    as_unkeyed_version(ledger.path, 8)
    with without_history_triggers(ledger.path) as connection:
        connection.execute("UPDATE history SET actor = 'someone else' WHERE id = 2")
    entries = len(ledger.history())
    edited = "entry 2: its fields do not match its hash (the row was edited)"
    with pytest.raises(FailedPrecondition, match=r"says schema version 8, but its history's chain, checked as schema "
                                                 rf"version 8 chained it, has 1 finding\(s\): {re.escape(edited)}"):
        Ledger(ledger.path)
    (accepted,) = rekey_ledger(ledger.path, accept_findings=True)
    assert edited in accepted
    with open_embedded_ledger(ledger.path) as migrated:
        anchor, migration = migrated.history()[-2:]
        assert (anchor.action, migration.action) == ("anchor_history", "migrate_schema")
        assert migration.details["accepted_findings"] == [accepted]
        assert anchor.details["entries"] == entries and len(anchor.details["unkeyed_chain_findings"]) == 1
        # Reported from then on: at the entry that keyed the chain, and at the migration the admin accepted it in.
        unkeyed, admitted = migrated.verify().findings
        assert (unkeyed.entry_id, unkeyed.problem) == (
            anchor.entry_id, "before the history was keyed, its unkeyed chain had: entry 2: its fields do not match "
            "its hash (the row was edited)")
        assert (admitted.entry_id, admitted.problem) == (
            migration.entry_id, f"an admin accepted, when it was migrated or re-keyed as it was: {accepted}")


def test_a_rotated_or_revoked_token_is_refused_by_every_ledger_on_the_file_after_the_recheck(ledger, monkeypatch):
    other_server = Ledger(ledger.path)  # a second server of the same file, with its own cache of verified tokens
    created = ledger.create_tenant("acme")
    assert other_server.authenticate(created.token).tenant == "acme"
    with pytest.raises(PermissionDenied, match="rotates only its own"):
        ledger.rotate_token("globex", caller=ledger.authenticate(created.token))
    rotated = ledger.rotate_token("acme", caller=ledger.authenticate(created.token))
    with pytest.raises(Unauthenticated, match="revoked or rotated"):
        ledger.authenticate(created.token)  # the ledger that rotated it forgets it at once
    time.sleep(store.TOKEN_RECHECK_SECONDS)
    with pytest.raises(Unauthenticated):
        other_server.authenticate(created.token)
    assert other_server.authenticate(rotated.token).tenant == "acme"
    assert ledger.revoke_token("acme") == rotated.token.split("_")[1]
    time.sleep(store.TOKEN_RECHECK_SECONDS)
    with pytest.raises(Unauthenticated):
        other_server.authenticate(rotated.token)
    actions = [(entry.action, entry.details.get("key_id")) for entry in ledger.history() if "token" in entry.action]
    assert actions == [("rotate_token", rotated.token.split("_")[1]), ("revoke_token", rotated.token.split("_")[1])]
    assert created.token not in json.dumps([entry.details for entry in ledger.history()])
    assert ledger.verify().findings == ()
    other_server.close()


def test_admin_tokens_rotate_and_revoke_and_the_last_one_stays(ledger):
    ledger.register_admin_token("configured-admin-token-0123456789")
    configured = ledger.authenticate("configured-admin-token-0123456789")
    assert configured.admin
    with pytest.raises(FailedPrecondition, match="last one"):
        ledger.revoke_token(key_id=configured.key_id)
    rotated = ledger.rotate_token(caller=configured)
    assert rotated.tenant is None
    with pytest.raises(Unauthenticated):
        ledger.authenticate("configured-admin-token-0123456789")
    ledger.register_admin_token("configured-admin-token-0123456789")  # a server started again with it
    with pytest.raises(Unauthenticated):
        ledger.authenticate("configured-admin-token-0123456789")
    new_admin = ledger.authenticate(rotated.token)
    assert new_admin.admin
    with pytest.raises(PermissionDenied, match="needs the admin token"):
        ledger.revoke_token("acme", caller=ledger.authenticate(ledger.create_tenant("acme").token))
    with pytest.raises(NotFound, match="no admin token with key id"):
        ledger.revoke_token(key_id="0123456789abcdef", caller=new_admin)


def test_a_token_hashed_with_scrypt_before_version_7_is_checked_once_then_stored_by_digest(ledger):
    created = ledger.create_tenant("acme")
    key_id = created.token.split("_")[1]
    salt = b"0123456789abcdef"
    with sqlite3.connect(ledger.path) as connection:
        connection.execute(
            "UPDATE tenants SET token_salt = ?, token_hash = ? WHERE key_id = ?",
            (salt, hash_token(created.token, salt), key_id),
        )
    fresh = Ledger(ledger.path)
    with pytest.raises(Unauthenticated):
        fresh.authenticate(created.token[:-1] + ("A" if created.token[-1] != "A" else "B"))
    assert fresh.authenticate(created.token).tenant == "acme"
    with sqlite3.connect(ledger.path) as connection:
        assert connection.execute("SELECT token_salt, token_hash FROM tenants WHERE key_id = ?", (key_id,)).fetchone() \
            == (None, token_digest(created.token))
    fresh.close()
    again = Ledger(ledger.path)
    assert again.authenticate(created.token).tenant == "acme"
    again.close()


class _CurvesSeenUnderTheLock:
    """Stands in for the cache of RDP curves: forgets chosen mechanisms once (as if evicted, or reserved on another
    server), and notes every curve computed while the ledger's write lock is held."""

    def __init__(self, ledger, real, forget):
        self.ledger, self.real, self.forget = ledger, real, set(forget)
        self.computed_under_lock = []

    def peek(self, *mechanism):
        if mechanism in self.forget:
            self.forget.discard(mechanism)
            return None
        return self.real.peek(*mechanism)

    def __call__(self, *mechanism):
        if self.ledger._transactions.write_lock.locked():
            self.computed_under_lock.append(mechanism)
        return self.real(*mechanism)


def test_curves_missing_under_the_write_lock_are_computed_outside_it_and_the_change_runs_once(ledger, monkeypatch):
    ledger.create_dataset("mnist", 1.0, DELTA)
    plan = Composition((SampledGaussian(0.0031, 1.37, 1000), SampledGaussian(0.0047, 1.53, 1000)))
    reservation = ledger.reserve("mnist", "job-1", plan)
    queued_plan = SampledGaussian(0.0059, 1.71, 3000)  # waits until job-1 is released
    curves = _CurvesSeenUnderTheLock(
        ledger, caches._step_curve, [(0.0031, 1.37, 1.0), (0.0047, 1.53, 1.0), (0.0059, 1.71, 1.0)]
    )
    assert ledger.enqueue("mnist", "job-2", queued_plan).state == "queued"
    monkeypatch.setattr(caches, "_step_curve", curves)
    result = ledger.commit(reservation.reservation_id, 7, 0)
    ledger.release(reservation.reservation_id)
    assert curves.forget == set()  # each was asked for under the lock, found missing, and computed outside it
    assert curves.computed_under_lock == []
    assert result.committed_steps == 7
    assert [entry.action for entry in ledger.history("mnist")].count("commit") == 1
    assert ledger.get_budget("mnist").spent_epsilon_filter == pytest.approx(
        filter_epsilon(split_steps(plan, 7)[0], 1.0)
    )


def test_a_tenants_new_curves_and_fits_take_from_its_bucket(ledger):
    ledger.curve_limits = TokenBuckets(0.001, 4, "costly requests (new RDP curves, Fits)")
    acme = ledger.authenticate(ledger.create_tenant("acme").token)
    globex = ledger.authenticate(ledger.create_tenant("globex").token)
    ledger.create_dataset("mnist", 50.0, DELTA, caller=acme)
    ledger.create_dataset("mnist", 50.0, DELTA, caller=globex)
    new = [SampledGaussian(0.0013, 2.0 + i / 100, 1) for i in range(3)]
    ledger.reserve("mnist", "job-1", Composition(tuple(new[:2])), caller=acme)  # 2 new curves
    ledger.reserve("mnist", "job-2", new[0].with_steps(3), caller=acme)  # none new: free
    assert ledger.fits("mnist", new[2], caller=acme).fits  # the last two tokens: the Fits and one new curve
    before = row_counts(ledger)
    with pytest.raises(RateLimited, match="tenant 'acme'.*retry in"):
        ledger.fits("mnist", new[2], caller=acme)  # a Fits costs one even when nothing in it is new
    with pytest.raises(RateLimited):
        ledger.reserve("mnist", "job-3", SampledGaussian(0.0013, 4.5, 1), caller=acme)
    assert row_counts(ledger) == before
    assert ledger.fits("mnist", new[2], caller=globex).fits  # another tenant's bucket is its own
    ledger.reserve("acme/mnist", "job-3", SampledGaussian(0.0013, 3.5, 1))  # the admin is not limited


def test_every_listing_reads_the_growing_tables_by_index_in_order(tmp_path, monkeypatch):
    statements = recording_statements(monkeypatch)
    with open_embedded_ledger(tmp_path / "ledger.db") as opened:
        listings = listing_statements(opened, statements)
    assert any(statement.startswith("SELECT h.id") for statement, _ in listings)
    with sqlite3.connect(tmp_path / "ledger.db") as connection:
        problems = {
            statement: sqlite_plan_problems(connection, statement, parameters)
            for statement, parameters in listings if reads_growing_table(statement)
        }
    assert {statement: found for statement, found in problems.items() if found} == {}
    assert len(problems) >= 6
