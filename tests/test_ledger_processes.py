"""The ledger across processes: `ledger serve` as a process, kill -9 mid-burst, 8 racing clients."""

import os
import signal
import sqlite3
import sys
import threading
import time

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from accounting.events import Composition, SampledGaussian
from accounting.ledger.admission import AdmissionRule, RdpTally, fits_budget, split_steps
from accounting.ledger.client import RemoteLedger
from accounting.ledger.errors import LedgerUnavailable
from accounting.ledger.service import start_server
from servers import start_racers, start_serve_process

ADMIN_TOKEN = "admin-token-for-tests-0123456789"
DELTA = 1e-5


@pytest.fixture
def token_file(tmp_path):
    path = tmp_path / "admin-token"
    path.write_text(ADMIN_TOKEN + "\n")
    return path


def test_serve_announces_its_address_answers_health_and_stops_on_sigterm(tmp_path, token_file):
    process, address = start_serve_process(tmp_path / "ledger.db", token_file)
    try:
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with RemoteLedger(address, ADMIN_TOKEN) as admin:
            assert admin.create_tenant("acme").tenant == "acme"
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0  # a loaded machine exits a torch-importing process slowly
    finally:
        process.kill()


def test_kill_9_during_a_burst_of_commits_keeps_every_acknowledged_commit_exactly_once(tmp_path, token_file):
    db_path = tmp_path / "ledger.db"
    process, address = start_serve_process(db_path, token_file)
    plan = SampledGaussian(0.004, 1.1, 1_000_000)
    try:
        with RemoteLedger(address, ADMIN_TOKEN) as admin:
            token = admin.create_tenant("acme").token
        with RemoteLedger(address, token, timeout_seconds=5) as acme:
            acme.create_dataset("mnist", 1e4, DELTA)
            reservation_id = acme.reserve("mnist", "job-1", plan).reservation_id
        acknowledged, unanswered, lock = {}, [], threading.Lock()

        def commit_burst(first_sequence: int) -> None:
            with RemoteLedger(address, token, timeout_seconds=5) as client:
                for sequence in range(first_sequence, 10**6, 4):
                    try:
                        result = client.commit(reservation_id, 1, sequence)
                    except LedgerUnavailable:
                        with lock:
                            unanswered.append(sequence)
                        return
                    with lock:
                        acknowledged[sequence] = result

        threads = [threading.Thread(target=commit_burst, args=(start,)) for start in range(4)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 60
        while len(acknowledged) < 300 and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(process.pid, signal.SIGKILL)
        for thread in threads:
            thread.join(timeout=30)
        process.wait(timeout=10)
        assert len(acknowledged) >= 300 and len(unanswered) == 4

        with sqlite3.connect(db_path) as connection:
            sequences = [row[0] for row in connection.execute("SELECT sequence FROM commits")]
            (committed_steps,) = connection.execute("SELECT committed_steps FROM reservations").fetchone()
            (committed_events,) = connection.execute("SELECT committed_events FROM datasets").fetchone()
            (logged,) = connection.execute("SELECT COUNT(*) FROM history WHERE action = 'commit'").fetchone()
        assert set(acknowledged) <= set(sequences)
        assert len(sequences) == len(set(sequences)) == committed_steps == logged
        assert set(sequences) - set(acknowledged) <= set(unanswered)
        assert Composition.from_json(committed_events) == split_steps(plan, committed_steps)[0]

        process, address = start_serve_process(db_path, token_file)
        with RemoteLedger(address, token, timeout_seconds=5) as acme:
            for sequence, result in acknowledged.items():
                assert acme.commit(reservation_id, 1, sequence) == result
            for sequence in unanswered:
                acme.commit(reservation_id, 1, sequence)
            job = acme.list_jobs("mnist")[0]
        assert job.committed_steps == len(set(acknowledged) | set(unanswered))
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0  # a loaded machine exits a torch-importing process slowly
    finally:
        process.kill()


_RACER = """
import sys
from accounting.events import Composition, SampledGaussian
from accounting.ledger.client import RemoteLedger
from accounting.ledger.errors import BudgetExceeded

address, token, job_id = sys.argv[1:]
ledger = RemoteLedger(address, token)
ledger.list_datasets()  # connect and pay for the token check before the start signal
print("ready", flush=True)
sys.stdin.readline()
try:
    print("admitted", ledger.reserve("mnist", job_id, SampledGaussian(0.01, 1.0, 200)).reservation_id, flush=True)
except BudgetExceeded as refusal:
    print("refused", refusal.remaining_epsilon, refusal.needed_epsilon, flush=True)
"""


def test_eight_processes_racing_to_reserve_never_overspend_the_budget(tmp_path):
    job = RdpTally.of(SampledGaussian(0.01, 1.0, 200))
    three = job + job + job
    budget = 2.0
    rule = AdmissionRule.for_budget(budget, DELTA)
    assert fits_budget(rule.epsilon(three), budget) and not fits_budget(rule.epsilon(three + job), budget)
    server = start_server(tmp_path / "ledger.db", "127.0.0.1", 0, ADMIN_TOKEN, allow_key_beside_database=True)
    try:
        with RemoteLedger(server.address, ADMIN_TOKEN) as admin:
            token = admin.create_tenant("acme").token
            admin.create_dataset("acme/mnist", budget, DELTA)
        racers = start_racers([[sys.executable, "-c", _RACER, server.address, token, f"job-{index}"] for index in range(8)])
        outcomes = [racer.communicate(timeout=60)[0].split() for racer in racers]
        assert all(racer.returncode == 0 for racer in racers)
        assert sorted(outcome[0] for outcome in outcomes) == ["admitted"] * 3 + ["refused"] * 5
        for outcome in outcomes:
            if outcome[0] == "refused":
                assert float(outcome[2]) > float(outcome[1])  # needed > remaining
        with sqlite3.connect(server.ledger.path) as connection:
            (held,) = connection.execute("SELECT held_rdp FROM datasets").fetchone()
            (reservations,) = connection.execute("SELECT COUNT(*) FROM reservations").fetchone()
        assert reservations == 3
        assert RdpTally.from_json(held) == three
    finally:
        server.stop(grace_seconds=1.0)


def test_the_curve_process_of_a_server_ends_with_it_even_after_kill_9(tmp_path, token_file):
    process, _ = start_serve_process(tmp_path / "ledger.db", token_file)
    try:
        children = psutil.Process(process.pid).children(recursive=True)  # the curve process, multiprocessing's tracker
        assert any("spawn_main" in " ".join(child.cmdline()) for child in children)
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=10)
        _, alive = psutil.wait_procs(children, timeout=30)
        assert alive == []
    finally:
        process.kill()
