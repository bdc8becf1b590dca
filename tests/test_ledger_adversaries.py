"""Tenants that try to stall, lock out or count each other on a real ledger server on loopback (issue #49).

Each test plays the attacker and fails when the protection it names is taken out: bounded composition work,
failed authentications counted per token key id, ranges on every number, opaque history ids, and one path for
"not yours" and "does not exist".
"""

import json
import threading
import time

import grpc
import pytest

from accounting.events import Composition, SampledGaussian
from accounting.ledger import caches
from accounting.ledger import ledger_pb2 as pb
from accounting.ledger import ledger_pb2_grpc
from accounting.ledger.client import RemoteLedger
from accounting.ledger.composed import ComposedPld
from accounting.ledger.errors import FailedPrecondition, PermissionDenied, RateLimited, Unauthenticated
from accounting.ledger.service import start_server
from accounting.ledger.store import admission as store_admission
from accounting.ledger.store import authorisation, open_embedded_ledger

ADMIN_TOKEN = "admin-token-for-tests-0123456789"
DELTA = 1e-5
STEP = SampledGaussian(0.004, 1.1, 1)
# A victim's call must answer within this while another tenant attacks.
VICTIM_SECONDS = 2.0


def bearer(token):
    return (("authorization", f"Bearer {token}"),)


def plan_json(*records):
    return json.dumps({"schema": "dpfleet.events", "version": 1, "events": [
        {"kind": "sampled_gaussian", "sampling_rate": rate, "noise_multiplier": sigma, "steps": steps}
        for rate, sigma, steps in records
    ]})


@pytest.fixture
def server(tmp_path):
    running = start_server(tmp_path / "ledger.db", "127.0.0.1", 0, ADMIN_TOKEN, auth_failure_burst=3,
                           auth_failure_rate_per_second=0.01, allow_key_beside_database=True)
    yield running
    running.stop(grace_seconds=1.0)


@pytest.fixture
def tokens(server):
    with RemoteLedger(server.address, ADMIN_TOKEN) as admin:
        return {name: admin.create_tenant(name).token for name in ("mallory", "victim")}


@pytest.fixture
def composition_process(monkeypatch):
    """PLDs composed in a process of their own, as `dpfleet ledger serve` does, for this test only."""
    process = caches.CompositionProcess(caches.PLD_DEADLINE_SECONDS)
    monkeypatch.setattr(caches, "_COMPOSITION_PROCESS", [process])
    yield process
    process.close()


def test_a_long_composition_does_not_stall_another_tenant_and_is_reported_by_its_rdp_bound(
    server, tokens, composition_process
):
    with RemoteLedger(server.address, tokens["victim"]) as victim, \
            RemoteLedger(server.address, tokens["mallory"]) as mallory:
        victim.create_dataset("mnist", 5.0, DELTA)
        victim.get_budget("mnist")
        mallory.create_dataset("own", 1e4, DELTA)
        with grpc.insecure_channel(server.address) as channel:
            with pytest.raises(grpc.RpcError) as refused:  # the finding's 1e8 steps: past the plan's total
                ledger_pb2_grpc.LedgerStub(channel).Reserve(pb.ReserveRequest(
                    dataset="own", job_id="huge", planned_events_json=plan_json((1e-6, 100.0, 10**8))),
                    metadata=bearer(tokens["mallory"]), timeout=10)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "at most 10000000 steps in total" in refused.value.details()
        # At the cap, a mechanism whose PLD would take minutes of one core to compose (RDP ε in the thousands).
        heavy = Composition((SampledGaussian(0.01, 0.8, caches.PLD_MAX_STEPS * 10),))
        reservation = mallory.reserve("own", "heavy", heavy)
        mallory.commit(reservation.reservation_id, heavy.steps, 0)
        answered = []

        def attack():
            started = time.monotonic()
            answered.append((mallory.get_budget("own"), time.monotonic() - started))

        attacker = threading.Thread(target=attack)
        attacker.start()
        for _ in range(5):
            started = time.monotonic()
            assert victim.get_budget("mnist").spent_epsilon == 0.0
            assert time.monotonic() - started < VICTIM_SECONDS
        attacker.join(timeout=60)
        ((status, seconds),) = answered
        assert seconds < VICTIM_SECONDS
        assert status.spent_epsilon_accountant == "rdp" and status.spent_epsilon > 100


def test_a_composition_past_its_deadline_is_killed_and_the_process_serves_the_next():
    process = caches.CompositionProcess(deadline_seconds=0.5)
    try:
        slow = Composition((SampledGaussian(0.01, 0.8, 10**6),))  # some 5 s of one core
        started = time.monotonic()
        with pytest.raises(caches.CompositionTimedOut, match="took over 0.5 s"):
            process.extended(ComposedPld.empty(), slow)
        assert time.monotonic() - started < 3.0
        quick = Composition((SampledGaussian(0.01, 2.0, 10),))
        process.deadline_seconds = 60.0
        assert process.extended(ComposedPld.empty(), quick).epsilon(DELTA) == pytest.approx(
            ComposedPld.empty().extended_to(quick).epsilon(DELTA))
    finally:
        process.close()


def test_a_commit_is_charged_for_the_steps_it_makes_the_server_compose(tmp_path):
    running = start_server(tmp_path / "ledger.db", "127.0.0.1", 0, ADMIN_TOKEN, curve_burst=101,
                           curve_rate_per_second=0.01, allow_key_beside_database=True)
    try:
        with RemoteLedger(running.address, ADMIN_TOKEN) as admin:
            token = admin.create_tenant("mallory").token
        with RemoteLedger(running.address, token) as mallory:
            mallory.create_dataset("own", 1e4, DELTA)
            plan = Composition((SampledGaussian(1e-6, 100.0, 10**7),))
            first = mallory.reserve("own", "a", plan)
            second = mallory.reserve("own", "b", plan)
            mallory.commit(first.reservation_id, 10**7, 0)  # 100 units of the bucket's 101
            with pytest.raises(RateLimited, match="this request counts 100") as refused:
                mallory.commit(second.reservation_id, 10**7, 0)
            assert refused.value.retry_after_seconds > 1000
            (job,) = [job for job in mallory.list_jobs("own") if job.reservation_id == second.reservation_id]
            assert job.committed_steps == 0
    finally:
        running.stop(grace_seconds=1.0)


def test_a_budget_composes_at_most_its_cap_of_steps_in_all_whatever_the_plans(tmp_path, monkeypatch):
    """Steps were bounded per plan only: plans of the most steps, one after another, took a budget's sums of steps
    without end. Reserves and commits past the budget's cap are refused, and what is committed stays under it."""
    monkeypatch.setattr(store_admission, "MAX_BUDGET_STEPS", 25)
    step = SampledGaussian(1e-6, 100.0, 10)
    with open_embedded_ledger(tmp_path / "ledger.db") as ledger:
        ledger.create_dataset("own", 1e4, DELTA)
        jobs = [ledger.reserve("own", job, Composition((step,))).reservation_id for job in ("a", "b", "c")]
        ledger.commit(jobs[0], 10, 0)
        ledger.commit(jobs[1], 10, 0)
        with pytest.raises(FailedPrecondition, match="has composed 20 steps; 10 more would pass the 25"):
            ledger.commit(jobs[2], 10, 0)  # admitted while nothing was composed
        with pytest.raises(FailedPrecondition, match="has composed 20 steps; 10 more"):
            ledger.reserve("own", "d", Composition((step,)))
        ledger.commit(jobs[2], 5, 0)
        assert sum(job.committed_steps for job in ledger.list_jobs("own")) == 25


def test_a_wrong_token_flood_and_a_rotation_do_not_lock_out_another_tenant(server, tokens):
    with RemoteLedger(server.address, tokens["victim"]) as victim, \
            RemoteLedger(server.address, tokens["mallory"]) as mallory:
        victim.list_datasets()  # verified before the attack
        mallory.list_datasets()
        with RemoteLedger(server.address, ADMIN_TOKEN) as admin:
            late_token = admin.create_tenant("late").token  # never verified before the attack
        mallory_key_id = tokens["mallory"].split("_")[1]
        for guess in range(10):  # from the victims' address, with mallory's key id and with others
            key_id = mallory_key_id if guess % 2 else f"{guess:016x}"
            with RemoteLedger(server.address, f"dpf_{key_id}_wrongsecret{guess}") as guesser:
                with pytest.raises((Unauthenticated, RateLimited)):
                    guesser.list_datasets()
        with pytest.raises(RateLimited, match=f"key id {mallory_key_id}"):
            RemoteLedger(server.address, f"dpf_{mallory_key_id}_oneMore").list_datasets()
        rotated = mallory.rotate_token("mallory")  # any tenant may; every server looks at its tokens again
        time.sleep(authorisation.TOKEN_RECHECK_SECONDS)
        for _ in range(20):
            assert victim.list_datasets() == []
        assert RemoteLedger(server.address, late_token).list_datasets() == []
        assert RemoteLedger(server.address, rotated.token).list_datasets() == []
        with pytest.raises((Unauthenticated, RateLimited)):  # its key id spent its failures
            mallory.list_datasets()


BAD_VALUES = [
    ("unlock_seconds", 1e300), ("unlock_seconds", 1e-300), ("unlock_seconds", 5e-324),
    ("unlock_seconds", float(2**70)), ("unlock_jobs", 2**63 - 1),
    ("lease_seconds", 1e-300), ("lease_seconds", 5e-324),
    ("max_wait_seconds", 1e-300), ("max_wait_seconds", 5e-324),
    ("enqueue lease_seconds", 5e-324), ("two records of 2**63 - 1 steps", None),
]


@pytest.mark.parametrize(("name", "value"), BAD_VALUES, ids=[f"{name}={value!r}" for name, value in BAD_VALUES])
def test_each_bad_value_is_invalid_argument_naming_the_range_and_changes_nothing(server, tokens, name, value):
    token = tokens["mallory"]
    with RemoteLedger(server.address, token) as mallory:
        mallory.create_dataset("own", 5.0, DELTA)
        history = len(mallory.history())
    valid = plan_json((0.01, 1.0, 10))
    if name.startswith("unlock"):
        scheduling = pb.Scheduling(policy="dpf", **{name: value})
        call, request = "CreateDataset", pb.CreateDatasetRequest(
            dataset="scheduled", epsilon=1.0, delta=DELTA, privacy_unit="example", scheduling=scheduling)
    elif name == "lease_seconds":
        call, request = "Reserve", pb.ReserveRequest(
            dataset="own", job_id="j", planned_events_json=valid, lease_seconds=value)
    elif name == "max_wait_seconds":
        call, request = "Enqueue", pb.EnqueueRequest(
            dataset="own", job_id="j", planned_events_json=valid, max_wait_seconds=value)
    elif name == "enqueue lease_seconds":
        call, request = "Enqueue", pb.EnqueueRequest(
            dataset="own", job_id="j", planned_events_json=valid, lease_seconds=value)
    else:
        huge = plan_json((0.01, 1.0, 2**63 - 1), (0.02, 1.0, 2**63 - 1))
        call, request = "Reserve", pb.ReserveRequest(dataset="own", job_id="j", planned_events_json=huge)
    with grpc.insecure_channel(server.address) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            getattr(ledger_pb2_grpc.LedgerStub(channel), call)(request, metadata=bearer(token), timeout=10)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
    assert "[" in refused.value.details() or "at most" in refused.value.details()
    with RemoteLedger(server.address, token) as mallory:
        assert len(mallory.history()) == history
        assert [status.name for status in mallory.list_datasets()] == ["own"]


def test_a_tenant_cannot_count_other_tenants_changes_between_its_own_history_entries(server, tokens):
    with RemoteLedger(server.address, tokens["victim"]) as victim, \
            RemoteLedger(server.address, tokens["mallory"]) as mallory:
        mallory.create_dataset("first", 1.0, DELTA)
        for name in ("a", "b", "c", "d", "e"):
            victim.create_dataset(name, 1.0, DELTA)
        mallory.create_dataset("second", 1.0, DELTA)
        ids = [entry.entry_id for entry in mallory.history()][-2:]
        assert [entry.action for entry in mallory.history()][-2:] == ["create_dataset"] * 2
        assert ids == [entry.entry_id for entry in mallory.history()][-2:]  # stable
        assert abs(ids[1] - ids[0]) > 10**6  # opaque: no count of the five in between
        with RemoteLedger(server.address, ADMIN_TOKEN) as admin:
            assert [entry.entry_id for entry in admin.history()][-7:] == list(range(
                admin.history()[-7].entry_id, admin.history()[-7].entry_id + 7))


class RecordedReads:
    """A connection that records the SQL each lookup runs and whether each read found a row."""

    def __init__(self, connection):
        self._connection = connection
        self.statements = []

    def execute(self, sql, parameters=()):
        cursor = self._connection.execute(sql, parameters)
        statements = self.statements

        class Recorded:
            def fetchone(self):
                row = cursor.fetchone()
                statements.append((sql, row is not None))
                return row

            def fetchall(self):
                rows = cursor.fetchall()
                statements.append((sql, len(rows)))
                return rows

        return Recorded()


def test_not_found_and_not_yours_take_the_same_reads_to_the_same_refusal(tmp_path):
    from accounting.ledger.callers import ADMIN, tenant_caller
    from accounting.ledger.store import Ledger

    with Ledger(tmp_path / "ledger.db", caller=ADMIN, history_key_file=tmp_path / "key") as ledger:
        owner, other = tenant_caller("owner"), tenant_caller("other")
        ledger.create_tenant("owner")
        ledger.create_tenant("other")
        ledger.create_dataset("mnist", 5.0, DELTA, caller=owner)
        reservation = ledger.reserve("mnist", "job", Composition((STEP.with_steps(10),)), caller=owner)
        queued = ledger.enqueue("mnist", "queued", Composition((STEP.with_steps(10),)), caller=owner)
        lookups = [
            (authorisation.visible_reservation, reservation.reservation_id, "r-does-not-exist"),
            (authorisation.visible_queued_job, queued.queue_id, "q-does-not-exist"),
            (authorisation.visible_dataset, "owner/mnist", "owner/none"),
        ]
        for lookup, theirs, missing in lookups:
            answers = []
            for reference in (theirs, missing):
                with ledger._transactions.read() as connection:
                    counting = RecordedReads(connection)
                    with pytest.raises(PermissionDenied) as refused:
                        if lookup is authorisation.visible_dataset:
                            lookup(ledger._tables, counting, other, reference, shared=True)
                        else:
                            lookup(ledger._tables, counting, other, reference)
                answers.append((counting.statements, str(refused.value).replace(reference, "<id>")))
            assert answers[0] == answers[1], lookup.__name__


def test_one_tenants_rotation_keeps_every_other_token_verified_and_ends_its_own(tmp_path):
    from accounting.ledger.callers import ADMIN, tenant_caller
    from accounting.ledger.store import Ledger

    with Ledger(tmp_path / "ledger.db", caller=ADMIN, history_key_file=tmp_path / "key") as ledger:
        victim = ledger.create_tenant("victim").token
        mallory = ledger.create_tenant("mallory").token
        assert ledger.authenticate(victim).tenant == "victim" and ledger.authenticate(mallory).tenant == "mallory"
        ledger.rotate_token("mallory", caller=tenant_caller("mallory"))
        # Still verified: never sent back through authenticate, where a failed-authentication limit applies.
        assert ledger.verified_caller(victim).tenant == "victim"
        assert ledger.verified_caller(mallory) is None
        with pytest.raises(Unauthenticated):
            ledger.authenticate(mallory)
