"""The ledger's gRPC service on loopback, against a real SQLite file."""

import math
import shutil
import sqlite3
import subprocess
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from accounting.accountants import get_accountant
from accounting.events import Composition, SampledGaussian
from accounting.ledger import generate
from accounting.ledger import ledger_pb2 as pb
from accounting.ledger import ledger_pb2_grpc
from accounting.ledger.admission import RdpTally
from accounting.ledger.client import RemoteLedger
from accounting.ledger.errors import (
    AlreadyExists,
    BudgetExceeded,
    FailedPrecondition,
    InvalidArgument,
    LedgerUnavailable,
    NotFound,
    PermissionDenied,
    RateLimited,
    Unauthenticated,
)
from accounting.ledger.service import SERVICE_NAME, start_server
from accounting.ledger.tokens import admin_key_id
from servers import self_signed_certificate

ADMIN_TOKEN = "admin-token-for-tests-0123456789"
DELTA = 1e-5
STEP = SampledGaussian(0.004, 1.1, 1)
TABLES = ("tenants", "datasets", "reservations", "commits", "history")
VALID_PLAN = '{"schema": "dpfleet.events", "version": 1, "events": [%s]}'


def event_json(sampling_rate="0.01", noise_multiplier="1.0", steps="10", kind='"sampled_gaussian"'):
    return VALID_PLAN % (
        f'{{"kind": {kind}, "sampling_rate": {sampling_rate}, "noise_multiplier": {noise_multiplier}, '
        f'"steps": {steps}}}'
    )


@pytest.fixture
def server(tmp_path):
    running = start_server(tmp_path / "ledger.db", "127.0.0.1", 0, ADMIN_TOKEN, allow_key_beside_database=True)
    yield running
    running.stop(grace_seconds=1.0)


@pytest.fixture
def admin(server):
    with RemoteLedger(server.address, ADMIN_TOKEN) as client:
        yield client


@pytest.fixture
def acme_token(admin):
    return admin.create_tenant("acme").token


@pytest.fixture
def acme(server, acme_token):
    with RemoteLedger(server.address, acme_token) as client:
        client.create_dataset("mnist", 2.0, DELTA)
        yield client


def bearer(token):
    return (("authorization", f"Bearer {token}"),)


def row_counts(server):
    with sqlite3.connect(server.ledger.path) as connection:
        return {table: connection.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0] for table in TABLES}


def test_checked_in_stubs_equal_freshly_generated_ones():
    stubs = generate.generate_stubs()
    assert set(stubs) == {"ledger_pb2.py", "ledger_pb2_grpc.py"}
    for name, text in stubs.items():
        stale = f"{name} is stale; run python -m accounting.ledger.generate"
        assert (generate.PACKAGE_DIR / name).read_text() == text, stale
    assert "from . import ledger_pb2" in stubs["ledger_pb2_grpc.py"]


def test_a_status_may_answer_with_the_rdp_bound_while_the_pld_figure_is_computed(acme, held_back_pld):
    uncommon = SampledGaussian(0.0037, 1.07, 1)  # a composition no other test has had the PLD of
    reservation = acme.reserve("mnist", "job-1", uncommon.with_steps(100))
    acme.commit(reservation.reservation_id, 23, 1)
    quick = acme.get_budget("mnist", pld_may_be_pending=True)
    assert (quick.spent_epsilon_accountant, quick.spent_epsilon) == ("rdp", quick.spent_epsilon_rdp)
    assert [status.spent_epsilon_accountant for status in acme.list_datasets(pld_may_be_pending=True)] == ["rdp"]
    held_back_pld.set()
    exact = acme.get_budget("mnist")
    assert exact.spent_epsilon_accountant == "pld"
    assert exact.spent_epsilon == get_accountant("pld").epsilon(uncommon.with_steps(23), DELTA) < quick.spent_epsilon


def test_health_check_answers_serving(server):
    with grpc.insecure_channel(server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", SERVICE_NAME):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_remote_ledger_round_trip_matches_the_embedded_records(server, acme, acme_token):
    reservation = acme.reserve("mnist", "job-1", STEP.with_steps(100))
    assert reservation.planned == Composition((STEP.with_steps(100),))
    assert (reservation.dataset, reservation.job_id, reservation.state) == ("mnist", "job-1", "active")
    result = acme.commit(reservation.reservation_id, 40, 1)
    assert (result.committed_steps, result.unrun_steps) == (40, 60)
    remote = acme.get_budget("mnist")
    embedded = server.ledger.get_budget("mnist", caller=server.ledger.authenticate(acme_token))
    assert remote == embedded
    assert remote.spent_epsilon == get_accountant("pld").epsilon(STEP.with_steps(40), DELTA)
    assert [job.reservation_id for job in acme.list_jobs(state="active")] == [reservation.reservation_id]
    released = acme.release(reservation.reservation_id)
    assert (released.state, released.committed_steps) == ("released", 40)
    assert acme.list_jobs(state="active") == []
    assert [entry.action for entry in acme.history("mnist")] == ["create_dataset", "reserve", "commit", "release"]
    assert [status.name for status in acme.list_datasets()] == ["mnist"]


def test_a_commit_retried_after_a_lost_reply_is_charged_once(server, acme):
    reservation = acme.reserve("mnist", "job-1", STEP.with_steps(100))
    first = acme.commit(reservation.reservation_id, 25, 3)
    before = row_counts(server)
    assert acme.commit(reservation.reservation_id, 25, 3) == first  # the retry of a reply that never arrived
    assert row_counts(server) == before
    assert acme.get_budget("mnist").jobs[0].committed_steps == 25


def test_a_reservation_that_does_not_fit_is_refused_with_remaining_and_needed_epsilon(server, acme, acme_token):
    acme.reserve("mnist", "job-1", STEP.with_steps(2000))
    status = acme.get_budget("mnist")
    before = row_counts(server)
    with pytest.raises(BudgetExceeded) as refusal:
        acme.reserve("mnist", "job-2", SampledGaussian(0.02, 0.8, 5000))
    error = refusal.value
    assert error.remaining_epsilon == status.remaining_epsilon
    assert error.needed_epsilon > error.remaining_epsilon
    assert (error.dataset, error.delta) == ("mnist", DELTA)
    shown_remaining = f"{math.floor(status.remaining_epsilon * 100) / 100:.2f}"
    assert f"dataset 'mnist' has ε {shown_remaining} left at δ=1e-05; this job needs ε " in str(error)
    assert row_counts(server) == before
    with grpc.insecure_channel(server.address) as channel:
        request = reserve_request(job_id="job-3", sampling_rate="0.02", noise_multiplier="0.8", steps="5000")
        with pytest.raises(grpc.RpcError) as raw:
            ledger_pb2_grpc.LedgerStub(channel).Reserve(request, metadata=bearer(acme_token), timeout=10)
    assert raw.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert dict(raw.value.trailing_metadata())["dpfleet-remaining-epsilon"] == repr(status.remaining_epsilon)
    assert row_counts(server) == before


def test_tenants_are_isolated_and_existence_is_never_revealed(server, admin, acme):
    globex = RemoteLedger(server.address, admin.create_tenant("globex").token)
    reservation = acme.reserve("mnist", "job-1", STEP.with_steps(10))
    before = row_counts(server)

    def refused(call):
        with pytest.raises(PermissionDenied) as raised:
            call()
        return str(raised.value)

    existing = refused(lambda: globex.get_budget("acme/mnist"))
    missing = refused(lambda: globex.get_budget("acme/nosuch"))
    assert existing.replace("mnist", "X") == missing.replace("nosuch", "X")
    assert refused(lambda: globex.reserve("acme/mnist", "job-2", STEP.with_steps(1))).replace("mnist", "X") == (
        refused(lambda: globex.reserve("acme/nosuch", "job-2", STEP.with_steps(1))).replace("nosuch", "X")
    )
    other = refused(lambda: globex.commit(reservation.reservation_id, 1, 0))
    bogus = refused(lambda: globex.commit("r-0000000000000000", 1, 0))
    assert other.replace(reservation.reservation_id, "X") == bogus.replace("r-0000000000000000", "X")
    refused(lambda: globex.release(reservation.reservation_id))
    refused(lambda: globex.history("acme/mnist"))
    refused(lambda: globex.list_jobs("acme/mnist"))
    assert globex.list_datasets() == [] and globex.list_jobs() == []
    assert [entry.action for entry in globex.history()] == ["create_tenant"]
    assert row_counts(server) == before
    assert [status.name for status in admin.list_datasets()] == ["acme/mnist"]
    with pytest.raises(NotFound):
        admin.get_budget("acme/nosuch")


def test_admin_actions_need_the_admin_token(server, admin, acme):
    before = row_counts(server)
    with pytest.raises(PermissionDenied, match="admin token"):
        acme.create_tenant("sneaky")
    with pytest.raises(PermissionDenied, match="admin token"):
        acme.raise_budget("mnist", 100.0)
    assert row_counts(server) == before
    assert admin.raise_budget("acme/mnist", 3.0).budget_epsilon == 3.0
    # The entry names the key id of the admin token the change was made with, never the token.
    assert admin.history("acme/mnist")[-1].details == {"from": 2.0, "to": 3.0, "actor_key_id": admin_key_id(ADMIN_TOKEN)}
    with pytest.raises(AlreadyExists):
        admin.create_tenant("acme")
    acme.reserve("mnist", "job-1", STEP.with_steps(3000))
    with pytest.raises(FailedPrecondition, match="would not cover it"):
        admin.raise_budget("acme/mnist", 0.5)


@pytest.mark.parametrize(
    "metadata",
    [(), (("authorization", "Bearer wrong"),), (("authorization", "Basic " + ADMIN_TOKEN),),
     (("authorization", "Bearer dpf_0123456789abcdef_guessedsecret"),)],
)
def test_requests_without_a_valid_token_are_unauthenticated(server, acme, metadata):
    before = row_counts(server)
    with grpc.insecure_channel(server.address) as channel:
        with pytest.raises(grpc.RpcError) as refusal:
            ledger_pb2_grpc.LedgerStub(channel).CreateDataset(
                pb.CreateDatasetRequest(dataset="acme/x", epsilon=1.0, delta=DELTA), metadata=metadata, timeout=10
            )
    assert refusal.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert row_counts(server) == before
    with pytest.raises(Unauthenticated):
        RemoteLedger(server.address, "wrong").list_datasets()


TEN_MEGABYTES = "x" * (10 * 1024 * 1024)
INVALID = grpc.StatusCode.INVALID_ARGUMENT


def dataset_request(dataset="cifar", epsilon=1.0, delta=DELTA):
    return pb.CreateDatasetRequest(dataset=dataset, epsilon=epsilon, delta=delta)


def reserve_request(job_id="j", planned_events_json=None, **event):
    planned_events_json = planned_events_json or event_json(**event)
    return pb.ReserveRequest(dataset="mnist", job_id=job_id, planned_events_json=planned_events_json)


# How a refusal of bad input begins: with the name of what was wrong.
FIELD_NAMES = {
    "tenant", "dataset", "budget", "block", "quota", "delta", "job", "planned", "steps", "sequence", "reservation",
    "history",
}
# case: (RPC, request, sent by, expected code). Commit requests get the test's reservation id.
BAD_REQUESTS = {
    "empty tenant name": ("CreateTenant", pb.CreateTenantRequest(tenant=""), "admin", INVALID),
    "10k-character tenant name": ("CreateTenant", pb.CreateTenantRequest(tenant="t" * 10_000), "admin", INVALID),
    "tenant name with a slash": ("CreateTenant", pb.CreateTenantRequest(tenant="a/b"), "admin", INVALID),
    "empty dataset name": ("CreateDataset", dataset_request(dataset=""), "acme", INVALID),
    "10k-character dataset name": ("CreateDataset", dataset_request(dataset="d" * 10_000), "acme", INVALID),
    "NaN budget": ("CreateDataset", dataset_request(epsilon=math.nan), "acme", INVALID),
    "infinite budget": ("CreateDataset", dataset_request(epsilon=math.inf), "acme", INVALID),
    "negative budget": ("CreateDataset", dataset_request(epsilon=-1.0), "acme", INVALID),
    "NaN delta": ("CreateDataset", dataset_request(delta=math.nan), "acme", INVALID),
    "infinite delta": ("CreateDataset", dataset_request(delta=-math.inf), "acme", INVALID),
    "delta of 1": ("CreateDataset", dataset_request(delta=1.0), "acme", INVALID),
    "NaN raised budget": (
        "RaiseBudget", pb.RaiseBudgetRequest(dataset="acme/mnist", epsilon=math.nan), "admin", INVALID
    ),
    "infinite raised budget": (
        "RaiseBudget", pb.RaiseBudgetRequest(dataset="acme/mnist", epsilon=math.inf), "admin", INVALID
    ),
    "budget of 1e-300 (underflow)": ("CreateDataset", dataset_request(epsilon=1e-300), "acme", INVALID),
    "budget of 1e300 (overflow)": ("CreateDataset", dataset_request(epsilon=1e300), "acme", INVALID),
    "delta of 0.999999": ("CreateDataset", dataset_request(delta=0.999999), "acme", INVALID),
    "delta of 5e-324": ("CreateDataset", dataset_request(delta=5e-324), "acme", INVALID),
    "raised budget of 1e300": (
        "RaiseBudget", pb.RaiseBudgetRequest(dataset="acme/mnist", epsilon=1e300), "admin", INVALID
    ),
    "block budget of 1e-300": (
        "AddBlock", pb.AddBlockRequest(dataset="mnist", block="d1", epsilon=1e-300), "acme", INVALID
    ),
    "quota of 1e-300": (
        "SetQuota", pb.SetQuotaRequest(dataset="acme/mnist", tenant="acme", epsilon=1e-300), "admin", INVALID
    ),
    "noise multiplier of 1e300": ("Reserve", reserve_request(noise_multiplier="1e300"), "acme", INVALID),
    "noise multiplier of 1e-300": ("Reserve", reserve_request(noise_multiplier="1e-300"), "acme", INVALID),
    "noise multiplier of 1e300 in a fit": (
        "Fits", pb.FitsRequest(dataset="mnist", planned_events_json=event_json(noise_multiplier="1e300")), "acme",
        INVALID,
    ),
    "noise multiplier sent as a string": ("Reserve", reserve_request(noise_multiplier='"1.0"'), "acme", INVALID),
    "sampling rate sent as a string": ("Reserve", reserve_request(sampling_rate='"0.01"'), "acme", INVALID),
    "empty job id": ("Reserve", reserve_request(job_id=""), "acme", INVALID),
    "10k-character job id": ("Reserve", reserve_request(job_id="j" * 10_000), "acme", INVALID),
    "NaN noise multiplier": ("Reserve", reserve_request(noise_multiplier="NaN"), "acme", INVALID),
    "infinite sampling rate": ("Reserve", reserve_request(sampling_rate="Infinity"), "acme", INVALID),
    "infinite steps": ("Reserve", reserve_request(steps="1e400"), "acme", INVALID),
    "unknown event kind": ("Reserve", reserve_request(kind='"laplace"'), "acme", INVALID),
    "event schema from the future": (
        "Reserve", reserve_request(planned_events_json=event_json().replace('"version": 1', '"version": 2')), "acme",
        INVALID,
    ),
    "events that are not JSON": ("Reserve", reserve_request(planned_events_json="{"), "acme", INVALID),
    "10 MB request": (
        "Reserve", reserve_request(planned_events_json=TEN_MEGABYTES), "acme", grpc.StatusCode.RESOURCE_EXHAUSTED
    ),
    "zero steps": ("Commit", pb.CommitRequest(steps=0, sequence=1), "acme", INVALID),
    "negative steps": ("Commit", pb.CommitRequest(steps=-5, sequence=1), "acme", INVALID),
    "negative sequence": ("Commit", pb.CommitRequest(steps=1, sequence=-1), "acme", INVALID),
    "more steps than planned": ("Commit", pb.CommitRequest(steps=11, sequence=1), "acme", INVALID),
    "10k-character reservation id": ("Release", pb.ReleaseRequest(reservation_id="r" * 10_000), "acme", INVALID),
    "unknown job state": ("ListJobs", pb.ListJobsRequest(state=7), "acme", INVALID),
    "negative history limit": ("History", pb.HistoryRequest(limit=-5), "acme", INVALID),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_input_is_refused_with_its_code_and_nothing_is_written(server, acme, acme_token, case):
    method, template, who, code = BAD_REQUESTS[case]
    request = type(template)()
    request.CopyFrom(template)
    reservation = acme.reserve("mnist", "job-1", STEP.with_steps(10))
    if method == "Commit":
        request.reservation_id = reservation.reservation_id
    metadata = bearer(ADMIN_TOKEN if who == "admin" else acme_token)
    before = row_counts(server)
    with grpc.insecure_channel(server.address) as channel:
        with pytest.raises(grpc.RpcError) as refusal:
            getattr(ledger_pb2_grpc.LedgerStub(channel), method)(request, metadata=metadata, timeout=10)
    assert refusal.value.code() == code, refusal.value.details()
    if code == INVALID:
        assert refusal.value.details().split()[0] in FIELD_NAMES, refusal.value.details()  # it names the field
    assert row_counts(server) == before
    assert acme.get_budget("mnist").jobs[0].reservation_id == reservation.reservation_id  # still serving


def test_client_maps_refusals_back_to_the_core_exceptions(server, acme):
    with pytest.raises(InvalidArgument, match="dataset name must be 1 to 128"):
        acme.create_dataset("x" * 10_000, 1.0, DELTA)
    alternating = [SampledGaussian(0.004 + (i % 2) * 1e-3, 1.1, 1) for i in range(1001)]
    with pytest.raises(InvalidArgument, match="at most 1000 records"):
        acme.reserve("mnist", "j", alternating)
    with pytest.raises(InvalidArgument, match=r"steps must be an integer in \[1, 10000000\]"):
        acme.commit("r-0", 2**70, 1)
    with pytest.raises(InvalidArgument, match="CreateDatasetRequest: .*types"):
        acme.create_dataset(17, 1.0, DELTA)
    with pytest.raises(LedgerUnavailable, match="did not answer"):
        RemoteLedger("127.0.0.1:1", "token", timeout_seconds=2).list_datasets()


def test_privacy_units_travel_over_grpc_and_mixed_units_are_refused_as_failed_precondition(server, acme):
    from accounting.events import group_events

    assert acme.create_dataset("people", 8.0, DELTA, "user").privacy_unit == "user"
    assert acme.get_budget("mnist").privacy_unit == "example"
    plan = SampledGaussian(0.004, 5.0, 100)
    with pytest.raises(FailedPrecondition, match="does not bound how many rows one person has"):
        acme.reserve("people", "unbounded", plan)
    with pytest.raises(FailedPrecondition, match="bound one person, not one row"):
        acme.reserve("mnist", "per-person", plan, privacy_unit="user")
    with pytest.raises(InvalidArgument, match="privacy unit must be one of example, user"):
        acme.create_dataset("households", 8.0, DELTA, "household")
    bounded = acme.reserve("people", "bounded", plan, privacy_unit="example", rows_per_person=7)
    assert bounded.planned == group_events(plan, 7)
    assert acme.get_budget("people").reserved_epsilon > 0


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_tls_serves_clients_that_trust_the_certificate_only(tmp_path):
    certificate, key = self_signed_certificate(tmp_path)
    running = start_server(
        tmp_path / "ledger.db", "127.0.0.1", 0, ADMIN_TOKEN, tls_cert=certificate, tls_key=key, allow_key_beside_database=True
    )
    try:
        with RemoteLedger(running.address, ADMIN_TOKEN, tls_ca=certificate) as secure:
            assert secure.create_tenant("acme").tenant == "acme"
        with pytest.raises(LedgerUnavailable):
            RemoteLedger(running.address, ADMIN_TOKEN, timeout_seconds=2).list_datasets()
    finally:
        running.stop(grace_seconds=1.0)


def test_server_refuses_a_short_admin_token_and_half_a_tls_pair(tmp_path):
    with pytest.raises(InvalidArgument, match="at least 16 characters"):
        start_server(tmp_path / "ledger.db", "127.0.0.1", 0, "short")
    with pytest.raises(InvalidArgument, match="both a certificate and its key"):
        start_server(tmp_path / "ledger.db", "127.0.0.1", 0, ADMIN_TOKEN, tls_cert=tmp_path / "cert.pem")


def test_a_server_releases_an_expired_lease_by_itself_and_refuses_its_next_commit(server, acme):
    reservation = acme.reserve("mnist", "job-1", STEP.with_steps(1000), lease_seconds=0.3)
    assert (reservation.lease_seconds, reservation.lease_expired) == (0.3, False) and reservation.expires_at
    acme.commit(reservation.reservation_id, 10, 0)
    deadline = time.monotonic() + 10
    while acme.get_budget("mnist").jobs and time.monotonic() < deadline:  # no request but the server's sweep
        time.sleep(0.1)
    status = acme.get_budget("mnist")
    assert status.jobs == () and status.released_jobs == 1
    (expired,) = acme.list_jobs("mnist")
    assert (expired.state, expired.lease_expired, expired.committed_steps) == ("released", True, 10)
    with pytest.raises(FailedPrecondition, match="lease of reservation .* expired"):
        acme.commit(reservation.reservation_id, 10, 1)
    assert status.admission.orders and status.spent_epsilon_filter > status.spent_epsilon


def test_failed_authentications_are_limited_per_key_id_and_never_refuse_the_right_token(tmp_path):
    running = start_server(tmp_path / "ledger.db", "127.0.0.1", 0, ADMIN_TOKEN, auth_failure_burst=3,
                           auth_failure_rate_per_second=0.01, allow_key_beside_database=True)
    try:
        with RemoteLedger(running.address, ADMIN_TOKEN) as admin:
            tenant = admin.create_tenant("acme").token
            key_id = tenant.split("_")[1]

            def refused_after_three(token: str, bucket: str) -> RateLimited:
                with RemoteLedger(running.address, token) as guesser:
                    for _ in range(3):
                        with pytest.raises(Unauthenticated):
                            guesser.list_datasets()
                    with pytest.raises(RateLimited, match=f"too many failed authentications with {bucket}") as refused:
                        guesser.list_datasets()
                return refused.value

            # Made-up key ids share one bucket: each new one starts none of its own.
            made_up = refused_after_three("dpf_0123456789abcdef_guessedsecret", "tokens of key ids the ledger")
            assert made_up.retry_after_seconds > 50
            with pytest.raises(RateLimited):
                RemoteLedger(running.address, "dpf_fedcba9876543210_another").list_datasets()
            # Guesses at acme's key id spend acme's key id's allowance...
            refused_after_three(f"dpf_{key_id}_guessedsecret", f"key id {key_id}")
            # ...but acme's own token, never verified on this server before, still passes: it is checked first.
            assert RemoteLedger(running.address, tenant).list_datasets() == []
            assert admin.list_datasets() == []
    finally:
        running.stop(grace_seconds=1.0)


def test_a_tenants_costly_requests_are_rate_limited_with_retry_after_metadata(tmp_path):
    running = start_server(tmp_path / "ledger.db", "127.0.0.1", 0, ADMIN_TOKEN, curve_burst=2,
                           curve_rate_per_second=0.01, allow_key_beside_database=True)
    try:
        with RemoteLedger(running.address, ADMIN_TOKEN) as admin:
            token = admin.create_tenant("acme").token
        with RemoteLedger(running.address, token) as acme:
            acme.create_dataset("mnist", 2.0, DELTA)
            RdpTally.of(STEP)  # the server shares this process's curves: each Fits below costs one, none new
            acme.fits("mnist", STEP.with_steps(10))
            acme.fits("mnist", STEP.with_steps(20))
            with grpc.insecure_channel(running.address) as channel:
                with pytest.raises(grpc.RpcError) as refused:
                    ledger_pb2_grpc.LedgerStub(channel).Fits(
                        pb.FitsRequest(dataset="mnist", planned_events_json=Composition((STEP.with_steps(30),)).to_json()),
                        metadata=bearer(token), timeout=10,
                    )
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert float(dict(refused.value.trailing_metadata())["dpfleet-retry-after-seconds"]) > 50
            acme.reserve("mnist", "job-1", STEP.with_steps(10))  # nothing new to compute: not limited
    finally:
        running.stop(grace_seconds=1.0)


def test_a_plan_over_the_mechanism_cap_is_invalid_argument_naming_the_cap(server, acme_token):
    plan = Composition(tuple(SampledGaussian(0.01, 1.0 + i / 1000, 1) for i in range(101)))
    with grpc.insecure_channel(server.address) as channel:
        stub = ledger_pb2_grpc.LedgerStub(channel)
        for call, request in (
            (stub.Fits, pb.FitsRequest(dataset="mnist", planned_events_json=plan.to_json())),
            (stub.Reserve, pb.ReserveRequest(dataset="mnist", job_id="j", planned_events_json=plan.to_json())),
            (stub.Enqueue, pb.EnqueueRequest(dataset="mnist", job_id="j", planned_events_json=plan.to_json())),
        ):
            with pytest.raises(grpc.RpcError) as refused:
                call(request, metadata=bearer(acme_token), timeout=10)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "at most 100 distinct mechanisms" in refused.value.details()


def test_tokens_rotate_and_revoke_over_grpc(server, admin, acme_token):
    with RemoteLedger(server.address, acme_token) as acme:
        rotated = acme.rotate_token("acme")
        with pytest.raises(PermissionDenied, match="needs the admin token"):
            RemoteLedger(server.address, rotated.token).revoke_token("acme")
    with pytest.raises(Unauthenticated):
        RemoteLedger(server.address, acme_token).list_datasets()
    assert RemoteLedger(server.address, rotated.token).list_datasets() == []
    new_admin = admin.rotate_token()
    assert new_admin.tenant is None
    with pytest.raises(Unauthenticated):
        admin.list_datasets()
    with RemoteLedger(server.address, new_admin.token) as admin_again:
        assert admin_again.revoke_token("acme") == rotated.token.split("_")[1]
    with pytest.raises(Unauthenticated):
        RemoteLedger(server.address, rotated.token).list_datasets()
