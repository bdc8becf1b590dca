"""The queue of jobs waiting for budget: a ledger server on loopback (fcfs, dpf), the CLI, migration, training."""

import json
import sqlite3
import threading
import time

import pytest

from accounting.events import SampledGaussian, group_events
from accounting.ledger.admission import AdmissionRule, RdpTally
from accounting.ledger.callers import ADMIN
from accounting.ledger.client import RemoteLedger
from accounting.ledger.errors import BudgetExceeded, FailedPrecondition
from accounting.ledger.scheduling import SchedulingPolicy
from accounting.ledger.store import SCHEMA_VERSION, open_embedded_ledger, rekey_ledger
from orchestrator.cli import main
from orchestrator.errors import BudgetRefusedError
from orchestrator.ledger_session import JobLedger
from tests.test_ledger_service import ADMIN_TOKEN, acme_token, admin, server  # noqa: F401 - fixtures
from tests.test_ledger_store import FIRST, version_2_file

BUDGET, DELTA = 10.0, 1e-5
# At budget 10 and delta 1e-5 the filter watches orders 2.5, 4 and 6.9; at order 4, where these plans use the
# budget best, BIG holds 27.7% of it and SMALL 5.5%.
BIG = SampledGaussian(0.01, 1.0, 5000)
SMALL = SampledGaussian(0.01, 1.0, 1000)


def share(plan):
    rule = AdmissionRule.for_budget(BUDGET, DELTA)
    return min(d / c for d, c in zip(rule.order_divergences(RdpTally.of(plan)), rule.capacities(BUDGET)))


def until(condition, seconds=20.0):
    """Poll `condition()` until it is true (the server's sweep runs every second); fail after `seconds`."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "the ledger did not get there in time"
        time.sleep(0.1)


@pytest.fixture
def acme(server, acme_token):
    with RemoteLedger(server.address, acme_token) as client:
        yield client


def actions(ledger, dataset):
    """(who, what, which job) of each change to `dataset` after its creation."""
    return [(entry.actor, entry.action, entry.details.get("job_id")) for entry in ledger.history(dataset)][1:]


def test_plan_shares_are_what_the_comments_say():
    assert share(BIG) == pytest.approx(0.277, abs=0.001) and share(SMALL) == pytest.approx(0.055, abs=0.001)


def test_fcfs_queue_on_a_server_admits_when_budget_is_released_higher_priority_first(server, acme):
    acme.create_dataset("mnist", BUDGET, DELTA)  # the server's default: fcfs
    holders = [acme.reserve("mnist", f"holder-{index}", BIG) for index in range(3)]  # 83% held, 17% free
    low = acme.enqueue("mnist", "low", BIG)
    high = acme.enqueue("mnist", "high", BIG, priority=5)
    assert (low.state, high.state) == ("queued", "queued")
    waiting = acme.list_queued("mnist")
    assert [(job.job_id, job.position) for job in waiting] == [("high", 1), ("low", 2)]
    assert waiting[0].reason.startswith("needs 27.7% of the budget; 16.")
    assert acme.enqueue("mnist", "low", BIG) == acme.queued_job(low.queue_id)  # a retry queues once
    with pytest.raises(FailedPrecondition, match="another plan"):
        acme.enqueue("mnist", "low", SMALL)

    acme.release(holders[0].reservation_id)  # room for one BIG: the higher priority goes first
    assert [job.job_id for job in acme.list_queued("mnist", "admitted")] == ["high"]  # the release served it
    admitted = acme.queued_job(high.queue_id)
    assert admitted.state == "admitted" and admitted.reservation_id
    assert [job.job_id for job in acme.get_budget("mnist").jobs] == ["holder-1", "holder-2", "high"]
    assert (acme.queued_job(low.queue_id).state, acme.queued_job(low.queue_id).position) == ("queued", 1)

    cancelled = acme.cancel_queued(low.queue_id)
    assert cancelled.state == "cancelled" and acme.cancel_queued(low.queue_id).state == "cancelled"
    with pytest.raises(FailedPrecondition, match="release that instead"):
        acme.cancel_queued(high.queue_id)
    assert acme.list_queued("mnist") == []
    assert [job.state for job in acme.list_queued("mnist", None)] == ["cancelled", "admitted"]
    with pytest.raises(BudgetExceeded):  # more than the whole budget never fits: refused, not queued
        acme.enqueue("mnist", "huge", SampledGaussian(0.01, 1.0, 20000))
    assert actions(acme, "mnist")[3:] == [
        ("acme", "enqueue", "low"), ("acme", "enqueue", "high"), ("acme", "release", "holder-0"),
        ("ledger (queue)", "reserve", "high"), ("acme", "cancel_queued", "low"),
    ]
    assert server.ledger.verify(caller=ADMIN).findings == ()


def test_dpf_on_a_server_unlocks_per_arriving_job_and_serves_the_smallest_share_first(server, acme):
    acme.create_dataset("fair", BUDGET, DELTA, scheduling=SchedulingPolicy("dpf", unlock_jobs=5))
    big = acme.enqueue("fair", "big", BIG)  # one arrival of five: 20% unlocked, BIG needs 27.7%
    assert (big.state, big.position, big.reason) == (
        "queued", 1, "needs 27.7% of the budget; 20.0% is unlocked and not held"
    )
    status = acme.get_budget("fair")
    assert (status.scheduling, status.queued_jobs) == (SchedulingPolicy("dpf", unlock_jobs=5), 1)
    small = acme.enqueue("fair", "small", SMALL)  # 40% unlocked: the small share goes first, then the big one fits
    assert small.state == "admitted" and acme.queued_job(big.queue_id).state == "admitted"
    assert actions(acme, "fair") == [
        ("acme", "enqueue", "big"), ("acme", "enqueue", "small"), ("ledger (queue)", "reserve", "small"),
        ("ledger (queue)", "reserve", "big"),
    ]
    # Under fcfs the same big job is admitted the moment it arrives.
    acme.create_dataset("first-come", BUDGET, DELTA, scheduling=SchedulingPolicy("fcfs"))
    assert acme.enqueue("first-come", "big", BIG).state == "admitted"

    acme.create_dataset("timed", BUDGET, DELTA, scheduling=SchedulingPolicy("dpf", unlock_seconds=3.0))
    timed = acme.enqueue("timed", "big", BIG)
    assert timed.state == "queued"  # the server's sweep admits it once 27.7% of 3 s have passed
    until(lambda: acme.queued_job(timed.queue_id).state == "admitted")
    assert server.ledger.verify(caller=ADMIN).findings == ()


def test_a_job_gives_up_at_its_deadline_and_the_history_says_so(server, acme):
    acme.create_dataset("full", BUDGET, DELTA)
    for index in range(3):
        acme.reserve("full", f"holder-{index}", BIG)
    waiting = acme.enqueue("full", "patient", BIG, max_wait_seconds=0.5)
    assert waiting.deadline is not None
    until(lambda: acme.queued_job(waiting.queue_id).state == "timed_out")
    assert actions(acme, "full")[-1] == ("ledger (queue deadline)", "queue_timeout", "patient")
    assert server.ledger.verify(caller=ADMIN).findings == ()


def test_ledger_jobs_queued_and_cancel_on_the_command_line(server, capsys):
    with RemoteLedger(server.address, ADMIN_TOKEN) as admin:
        admin.create_tenant("lab")
        admin.create_dataset("lab/mnist", BUDGET, DELTA)
        for index in range(4):
            admin.reserve("lab/mnist", f"holder-{index}", SampledGaussian(0.01, 1.0, 4200))
        queued = admin.enqueue("lab/mnist", "waiting", BIG, priority=3)
    client = ["--ledger", server.address, "--token", ADMIN_TOKEN]
    assert main(["ledger", "jobs", "--queued", *client]) == 0
    table = capsys.readouterr().out
    assert queued.queue_id in table and "needs 27.7% of the budget" in table
    assert main(["ledger", "jobs", "--queued", "--json", *client]) == 0
    (shown,) = json.loads(capsys.readouterr().out)["queued"]
    assert (shown["job_id"], shown["position"], shown["priority"], shown["state"]) == ("waiting", 1, 3, "queued")
    assert main(["ledger", "cancel", queued.queue_id, *client]) == 0
    assert capsys.readouterr().out.strip().endswith(": cancelled")
    assert main(["ledger", "jobs", "--queued", "--json", *client]) == 0
    assert json.loads(capsys.readouterr().out)["queued"] == []


def test_a_version_2_file_migrates_to_the_queue_and_keeps_verifying(tmp_path):
    path = version_2_file(tmp_path / "ledger.db")
    rekey_ledger(path)
    with open_embedded_ledger(path) as migrated:
        with sqlite3.connect(path) as connection:
            assert connection.execute("SELECT version FROM schema_version").fetchone() == (SCHEMA_VERSION,)
            assert connection.execute("SELECT DISTINCT scheduling FROM datasets").fetchall() == [
                (json.dumps(SchedulingPolicy().to_dict()),)
            ]
        (running,) = migrated.get_budget("mnist").jobs
        queued = migrated.enqueue("mnist", "next", FIRST.with_steps(10))
        assert queued.state == "queued"  # what the file holds does not fit the filter it adopted
        migrated.release(running.reservation_id)
        assert migrated.queued_job(queued.queue_id).state == "admitted"
        assert migrated.verify().findings == ()


def test_training_waits_for_budget_with_a_progress_line_then_runs_or_gives_up(tmp_path):
    lines = []
    with open_embedded_ledger(tmp_path / "ledger.db") as ledger:
        ledger.create_dataset("mnist", BUDGET, DELTA)
        holders = [ledger.reserve("mnist", f"holder-{index}", BIG) for index in range(3)]
        releaser = threading.Timer(1.5, ledger.release, args=(holders[0].reservation_id,))
        releaser.start()
        big_job = lambda dataset_unit: (BIG, "example", None)  # noqa: E731 - the plan RunPlan.ledger_plan gives
        job = JobLedger.wait_for_budget(ledger, "mnist", "train-1", big_job, 30.0, lines.append)
        releaser.join()
        assert [reservation.job_id for reservation in ledger.get_budget("mnist").jobs][-1] == "train-1"
        assert job.reservation_id == ledger.get_budget("mnist").jobs[-1].reservation_id
        assert lines[0].startswith("ledger: waiting for budget on 'mnist' (q-")
        assert "position 1, needs 27.7%" in lines[0]
        assert lines[-1].startswith("ledger: admitted after ")

        with pytest.raises(BudgetRefusedError, match="without budget \\(timed_out"):
            JobLedger.wait_for_budget(ledger, "mnist", "train-2", big_job, 30.0, lines.append, max_wait_seconds=0.5)
        assert ledger.verify().findings == ()


def test_a_job_id_that_reserved_directly_while_waiting_is_not_admitted_twice(tmp_path):
    with open_embedded_ledger(tmp_path / "ledger.db") as ledger:
        ledger.create_dataset("mnist", BUDGET, DELTA, scheduling=SchedulingPolicy("dpf", unlock_jobs=5))
        waiting = ledger.enqueue("mnist", "job", BIG)  # 20% unlocked: waits
        held = ledger.reserve("mnist", "job", SMALL)  # a direct reserve is admitted by the filter alone
        ledger.enqueue("mnist", "other", SMALL)  # 60% unlocked now: BIG would fit beside both SMALL
        shown = ledger.queued_job(waiting.queue_id)
        assert (shown.state, shown.reason) == (
            "queued", f"job id already holds reservation {held.reservation_id}; cancel this or release that"
        )
        assert ledger.verify().findings == ()


def test_train_takes_max_wait_and_priority_only_with_wait_for_budget(capsys):
    assert main(["train", "--config", "examples/mnist.toml", "--max-wait", "60"]) == 2
    assert "add --wait-for-budget" in capsys.readouterr().err


def test_a_queued_example_level_job_on_a_user_level_dataset_is_charged_its_group_bound(tmp_path):
    job = SampledGaussian(0.01, 2.0, 1000)  # for people of at most 2 rows: q 0.0199 at sigma 1, 23% of the budget
    with open_embedded_ledger(tmp_path / "ledger.db") as ledger:
        ledger.create_dataset("people", BUDGET, DELTA, "user")
        holders = [ledger.reserve("people", f"holder-{index}", BIG, privacy_unit="user") for index in range(3)]
        queued = ledger.enqueue("people", "job", job, privacy_unit="example", rows_per_person=2)
        assert queued.state == "queued" and queued.planned == group_events(job, 2)
        ledger.release(holders[0].reservation_id)
        admitted = ledger.queued_job(queued.queue_id)
        assert admitted.state == "admitted"
        assert ledger.get_budget("people").jobs[-1].planned == group_events(job, 2)
        assert ledger.history("people")[-1].details["rows_per_person"] == 2
        assert ledger.verify().findings == ()


def test_a_job_on_blocks_waits_for_each_block_to_unlock_under_dpf(tmp_path):
    with open_embedded_ledger(tmp_path / "ledger.db") as ledger:
        ledger.create_dataset("days", BUDGET, DELTA, scheduling=SchedulingPolicy("dpf", unlock_jobs=5))
        for block in ("d1", "d2"):
            ledger.add_block("days", block, BUDGET, data={"partition": {"column": "day", "value": block}})
        big = ledger.enqueue("days", "big", BIG, blocks=["d1", "d2"])  # one arrival on each block: 20% unlocked
        assert (big.state, big.reason) == (
            "queued", "block 'd1': needs 27.7% of the budget; 20.0% is unlocked and not held"
        )
        assert ledger.enqueue("days", "small", SMALL, blocks=["d1"]).state == "admitted"  # d1 at 40%, d2 at 20%
        assert ledger.queued_job(big.queue_id).reason == (
            "block 'd2': needs 27.7% of the budget; 20.0% is unlocked and not held"
        )
        assert ledger.enqueue("days", "small-2", SMALL, blocks=["d2"]).state == "admitted"  # d2 at 40%: big fits
        admitted = ledger.queued_job(big.queue_id)
        assert admitted.state == "admitted"
        (reservation,) = [job for job in ledger.get_budget("days").jobs if job.job_id == "big"]
        assert reservation.blocks == ("d1", "d2") and reservation.reservation_id == admitted.reservation_id
        assert ledger.verify().findings == ()
