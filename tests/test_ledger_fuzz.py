"""Random and extreme input to every RPC of a real ledger server on loopback, and to the ledger's commands.

Whatever comes in, the answer is a status that names what was wrong (never INTERNAL or UNKNOWN), and a
request that is refused changes nothing: every table of the file reads the same before and after.
"""

import json
import math
import sqlite3

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from accounting.events import SampledGaussian
from accounting.ledger import ledger_pb2 as pb
from accounting.ledger import ledger_pb2_grpc
from accounting.ledger.client import RemoteLedger
from accounting.ledger.service import start_server
from accounting.ledger.store import default_ledger_path
from orchestrator.cli import main

ADMIN_TOKEN = "admin-token-for-tests-0123456789"
DELTA = 1e-5
FAILURES = (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)
EXAMPLES_PER_RPC = 25

EXTREME_NUMBERS = [0.0, -0.0, -1.0, 5e-324, 1e-300, 1e-20, 0.999999, 1.0, 2.0, 1e300, math.inf, -math.inf, math.nan]
wild_numbers = st.one_of(st.sampled_from(EXTREME_NUMBERS), st.floats())
wild_integers = st.one_of(st.sampled_from([0, -1, 2**63 - 1, -(2**63)]), st.integers(-(2**63), 2**63 - 1))
wild_names = st.one_of(st.sampled_from(["", "a/b/c", "x" * 200, "nobody/mnist", "-x", "é"]), st.text(max_size=12))
# A field of an event as JSON: an extreme number, a number sent as a string, or something else altogether.
wild_event_values = st.one_of(wild_numbers, wild_integers, wild_numbers.map(repr), st.text(max_size=4), st.none(),
                              st.booleans())
fresh_names = st.from_regex(r"[a-z][a-z0-9]{2,10}", fullmatch=True)


@st.composite
def plans(draw, wild=False):
    """Planned events as JSON; `wild`: one field of one event, or the whole text, is anything at all."""
    event = {"kind": "sampled_gaussian", "sampling_rate": draw(st.floats(1e-4, 0.1)),
             "noise_multiplier": draw(st.floats(0.5, 20.0)), "steps": draw(st.integers(1, 100))}
    if not wild:
        return json.dumps({"schema": "dpfleet.events", "version": 1, "events": [event]})
    field = draw(st.sampled_from(["sampling_rate", "noise_multiplier", "steps", "sensitivity_factor", "kind",
                                  "version", "text"]))
    if field == "text":
        return draw(st.text(max_size=40))
    version = draw(st.sampled_from([2, "1", None])) if field == "version" else 1
    if field != "version":
        event[field] = draw(st.sampled_from(["laplace", 1]) if field == "kind" else wild_event_values)
    return json.dumps({"schema": "dpfleet.events", "version": version, "events": [event]})


def field(valid, wild):
    """A request field: its strategy for a valid value and for anything."""
    return valid, wild


def request_fields(reservation_id):
    """For each RPC, its request type and each field's (valid, wild) strategies."""
    dataset = field(st.sampled_from(["mnist", "acme/mnist"]), wild_names)
    epsilon = field(st.floats(0.1, 10.0), wild_numbers)
    delta = field(st.floats(1e-9, 1e-3), wild_numbers)
    lease = field(st.floats(0.0, 3600.0), wild_numbers)
    unit = field(st.just("example"), st.sampled_from(["", "user", "person"]))
    rows = field(st.just(0), wild_integers)
    blocks = field(st.just(["d1"]), st.lists(wild_names, max_size=3))
    plan = field(plans(), plans(wild=True))
    return {
        "CreateTenant": (pb.CreateTenantRequest, {"tenant": field(fresh_names, wild_names)}),
        "CreateDataset": (pb.CreateDatasetRequest, {
            "dataset": field(fresh_names, wild_names), "epsilon": epsilon, "delta": delta, "privacy_unit": unit,
            "scheduling": field(st.none(), st.builds(
                pb.Scheduling, policy=st.sampled_from(["fcfs", "dpf", "dpack", "", "lottery"]),
                unlock_jobs=wild_integers, unlock_seconds=wild_numbers)),
        }),
        "RaiseBudget": (pb.RaiseBudgetRequest, {"dataset": dataset, "epsilon": epsilon}),
        "GetBudget": (pb.GetBudgetRequest, {"dataset": dataset, "pld_may_be_pending": field(st.booleans(),
                                                                                            st.booleans())}),
        "ListDatasets": (pb.ListDatasetsRequest, {"pld_may_be_pending": field(st.booleans(), st.booleans())}),
        "ListJobs": (pb.ListJobsRequest, {"dataset": dataset, "state": field(st.integers(0, 2), st.integers(-3, 9))}),
        "Reserve": (pb.ReserveRequest, {
            "dataset": dataset, "job_id": field(fresh_names, wild_names), "planned_events_json": plan,
            "lease_seconds": lease, "privacy_unit": unit, "rows_per_person": rows, "blocks": blocks,
        }),
        "Commit": (pb.CommitRequest, {
            "reservation_id": field(st.just(reservation_id), wild_names),
            "steps": field(st.integers(1, 3), wild_integers), "sequence": field(st.integers(0, 10**6), wild_integers),
        }),
        "Release": (pb.ReleaseRequest, {"reservation_id": field(st.just("r-0000000000000000"), wild_names)}),
        "History": (pb.HistoryRequest, {"dataset": dataset, "limit": field(st.integers(0, 100),
                                                                           st.integers(-(2**31), 2**31 - 1))}),
        "AddBlock": (pb.AddBlockRequest, {"dataset": dataset, "block": field(fresh_names, wild_names),
                                          "epsilon": field(st.floats(0.1, 2.0), wild_numbers), "delta": delta,
                                          "data": field(st.integers(1000, 10**6).map(
                                              lambda first: json.dumps({"rows": [first, first + 10]})),
                                              st.text(max_size=40))}),
        "SetQuota": (pb.SetQuotaRequest, {"dataset": field(st.just("acme/mnist"), wild_names),
                                          "tenant": field(st.just("acme"), wild_names), "epsilon": epsilon,
                                          "block": field(st.sampled_from(["", "d1"]), wild_names)}),
        "Fits": (pb.FitsRequest, {"dataset": dataset, "planned_events_json": plan, "blocks": blocks,
                                  "privacy_unit": unit, "rows_per_person": rows}),
        "Enqueue": (pb.EnqueueRequest, {
            "dataset": dataset, "job_id": field(fresh_names, wild_names), "planned_events_json": plan,
            "lease_seconds": lease, "priority": field(st.integers(0, 10), st.integers(-(2**31), 2**31 - 1)),
            "max_wait_seconds": field(st.floats(0.0, 3600.0), wild_numbers), "privacy_unit": unit,
            "rows_per_person": rows, "blocks": blocks,
        }),
        "GetQueuedJob": (pb.QueuedJobRequest, {"queue_id": field(st.just("q-0000000000000000"), wild_names)}),
        "CancelQueued": (pb.QueuedJobRequest, {"queue_id": field(st.just("q-0000000000000000"), wild_names)}),
        "ListQueued": (pb.ListQueuedRequest, {
            "dataset": dataset, "state": field(st.sampled_from(["", "queued", "admitted"]),
                                               st.sampled_from(["cancelled", "timed_out", "x"])),
        }),
    }


@st.composite
def requests(draw, rpc, reservation_id):
    """A request for `rpc` with one or two of its fields (or none) anything at all, the others valid."""
    message, fields = request_fields(reservation_id)[rpc]
    wild = draw(st.sets(st.sampled_from(sorted(fields)), max_size=2))
    values = {name: draw(strategies[name in wild], label=name) for name, strategies in fields.items()}
    return message(**{name: value for name, value in values.items() if value is not None})


def snapshot(path):
    """Every row of every table of the ledger file."""
    with sqlite3.connect(path) as connection:
        tables = [name for (name,) in connection.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        return {table: sorted(map(repr, connection.execute(f"SELECT * FROM {table}").fetchall())) for table in tables}


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory):
    """One server for the module, with a tenant, a dataset, a block and an active reservation to aim at."""
    folder = tmp_path_factory.mktemp("fuzzed")
    server = start_server(folder / "ledger.db", "127.0.0.1", 0, ADMIN_TOKEN,
                          history_key_file=folder / "ledger-history.key", allow_key_beside_database=True)
    # No sweeps: a lease that runs out between two snapshots would look like a refusal that changed something.
    server.stopping.set()
    with RemoteLedger(server.address, ADMIN_TOKEN) as admin:
        token = admin.create_tenant("acme").token
    with RemoteLedger(server.address, token) as acme:
        acme.create_dataset("mnist", 2.0, DELTA)
        acme.add_block("mnist", "d1", 1.0, data={"rows": [0, 1000]})
        reservation = acme.reserve("mnist", "job-1", SampledGaussian(0.001, 5.0, 1000), blocks=["d1"])
    with grpc.insecure_channel(server.address) as channel:
        yield server, ledger_pb2_grpc.LedgerStub(channel), {"admin": ADMIN_TOKEN, "acme": token}, reservation
    server.stop(grace_seconds=1.0)


RPCS = list(request_fields("r-0"))


@pytest.mark.parametrize("rpc", RPCS)
@settings(max_examples=EXAMPLES_PER_RPC, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_every_rpc_refuses_bad_input_by_name_and_a_refusal_changes_nothing(fuzzed, rpc, data):
    server, stub, tokens, reservation = fuzzed
    request = data.draw(requests(rpc, reservation.reservation_id), label="request")
    token = tokens[data.draw(st.sampled_from(sorted(tokens)), label="sent by")]
    before = snapshot(server.ledger.path)
    try:
        getattr(stub, rpc)(request, metadata=(("authorization", f"Bearer {token}"),), timeout=60)
    except grpc.RpcError as refusal:
        assert refusal.code() not in FAILURES, refusal.details()
        assert snapshot(server.ledger.path) == before, f"{refusal.code()}: {refusal.details()}"


flag_values = st.one_of(wild_numbers.map(repr), wild_numbers.map(str), wild_integers.map(str), st.text(max_size=8),
                        st.sampled_from(["1", "2", "1e-5", "0x10", "1_000", " 1 ", "nan", "-inf", "1e400"]))
cli_names = st.one_of(fresh_names, st.sampled_from(["mnist", "local/mnist", "x" * 200, "a/b", "r-0000000000000000"]))


@st.composite
def command_lines(draw):
    """One ledger command against the embedded ledger, with random flag values."""
    value, name, other = draw(flag_values), draw(cli_names), draw(st.one_of(st.just("1e-5"), flag_values))
    return draw(st.sampled_from([
        ["dataset", "create", name, "--epsilon", value, "--delta", other],
        ["dataset", "create", name, "--epsilon", "1", "--delta", value],
        ["dataset", "create", name, "--epsilon", "1", "--delta", "1e-5", "--dataset-size", value],
        ["dataset", "raise", name, "--epsilon", value],
        ["block", "add", "mnist", name, "--epsilon", value, "--rows", draw(st.sampled_from(["0:10", "10:20"])),
         *(["--delta", other] * draw(st.booleans()))],
        ["quota", "set", "local/mnist", "local", "--epsilon", value],
        ["history", "--limit", value],
        ["release", name],
        ["status", "--dataset", name],
    ]))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(argv=command_lines())
def test_every_ledger_command_refuses_bad_flags_with_exit_2_and_a_refusal_changes_nothing(argv, capsys):
    if not default_ledger_path().exists():
        assert main(["ledger", "dataset", "create", "mnist", "--epsilon", "2", "--delta", "1e-5"]) == 0
    before = snapshot(default_ledger_path())
    try:
        status = main(["ledger", *argv])
    except SystemExit as exit:  # argparse refusing a value that reads as a flag
        status = exit.code
    err = capsys.readouterr().err
    assert status in (0, 2, 3), err
    if status != 0:
        assert snapshot(default_ledger_path()) == before, err
