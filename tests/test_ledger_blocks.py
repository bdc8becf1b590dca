"""Blocks of a dataset, tenant quotas and the dry run: pure checks, the store, a real server on loopback, training."""

import hashlib
import json
import os
import sqlite3

import numpy as np
import pytest

from accounting.events import Composition, SampledGaussian
from accounting.ledger.admission import (
    AdmissionRule,
    FitReport,
    RdpTally,
    assess_admission,
    block_data_overlap,
    check_block_data,
)
from accounting.ledger.callers import ADMIN, tenant_caller
from accounting.ledger.client import RemoteLedger
from accounting.ledger.errors import BudgetExceeded, FailedPrecondition, InvalidArgument, NotFound, PermissionDenied
from accounting.ledger.service import start_server
from accounting.ledger.store import Ledger, open_embedded_ledger, rekey_ledger
from accounting.ledger.validation import check_block_names
from accounting.ledger.verification import burn_down
from orchestrator.cli import main
from orchestrator.config import build_config
from orchestrator.errors import UsageError
from orchestrator.ledger_session import (ensure_embedded_dataset, job_fits_now, ledger_dataset_name, name_origin,
                                         with_identity)
from workers.sources import (
    DataError,
    canonical_user_id,
    check_block_people,
    open_source,
    parse_spec,
    read_column,
    select_blocks,
    source_size,
    user_hash_buckets,
    write_parquet_shards,
)
from tests.test_ledger_store import as_unkeyed_version

ADMIN_TOKEN = "admin-token-for-block-tests-012345"
DELTA = 1e-5
STEP = SampledGaussian(0.01, 2.0, 1)
RULE = AdmissionRule.for_budget(2.0, DELTA)


def steps(count):
    return STEP.with_steps(count)


def rows(first, stop):
    """A block's declaration: rows [first, stop) of the dataset's train location."""
    return {"rows": [first, stop]}


# ---------------------------------------------------------------- pure logic


def test_a_budget_check_reports_cost_and_what_would_remain_in_the_filters_epsilon():
    held, planned = RdpTally.of(steps(200)), RdpTally.of(steps(300))
    check = assess_admission("block 'd1' of dataset 'logs'", RULE, 2.0, held, planned)
    assert check.held_epsilon == RULE.epsilon(held)
    assert check.held_after_epsilon == RULE.epsilon(held + planned)
    assert check.needed_epsilon == check.held_after_epsilon - check.held_epsilon > 0
    assert check.remaining_after_epsilon == 2.0 - check.held_after_epsilon
    assert check.fits == (check.remaining_after_epsilon > 0)
    too_much = assess_admission("block 'd1' of dataset 'logs'", RULE, check.held_after_epsilon, held, planned)
    assert not too_much.fits  # equality is refused: the margin only ever refuses at the edge
    refusal = too_much.refusal("logs")
    assert isinstance(refusal, BudgetExceeded) and str(refusal).startswith("block 'd1' of dataset 'logs' has ε")
    report = FitReport("logs", ("d1",), (check, too_much))
    assert not report.fits and report.to_dict()["checks"][1]["fits"] is False


@pytest.mark.parametrize("blocks, problem", [
    ("d1", "list of block names"), (["d1", "d1"], "each block once"), (["d/1"], "block name"),
])
def test_block_names_are_checked(blocks, problem):
    with pytest.raises(InvalidArgument, match=problem):
        check_block_names(blocks)


def parquet_blocks(directory, rows_by_block):
    """One folder of Parquet shards per block."""
    rng = np.random.default_rng(0)
    locations = {}
    for block, rows in rows_by_block.items():
        folder = directory / block
        write_parquet_shards(str(folder), [(rng.random((rows, 784), dtype=np.float32), np.arange(rows) % 10)],
                             rows, 2)
        locations[block] = str(folder)
    test = directory / "test"
    write_parquet_shards(str(test), [(rng.random((100, 784), dtype=np.float32), np.arange(100) % 10)], 100, 1)
    return locations, str(test)


def parquet_dataset(locations, test):
    return {"format": "parquet", "test": test, "shape": [1, 28, 28], "name": "logs", "blocks": locations}


def test_a_config_chooses_blocks_by_name_or_by_range_and_reads_back_the_same(tmp_path):
    locations, test = parquet_blocks(tmp_path, {"2026-11-01": 10, "2026-11-02": 10, "2026-11-03": 10})
    common = {"dataset": parquet_dataset(locations, test), "steps": 1, "noise_multiplier": 1.0, "batch_size": 5}
    by_range = build_config({**common, "blocks": {"from": "2026-11-02", "to": "2026-11-09"}})
    assert by_range.blocks == ("2026-11-02", "2026-11-03")
    assert by_range.dataset["train"] == [locations["2026-11-02"], locations["2026-11-03"]]
    assert build_config(json.loads(json.dumps(by_range.to_dict()))) == by_range  # a resumed run: the same blocks
    assert build_config({**common, "blocks": ["2026-11-03"]}).dataset["train"] == [locations["2026-11-03"]]
    whole = build_config({"steps": 1, "noise_multiplier": 1.0})
    assert whole.blocks == () and build_config(json.loads(json.dumps(whole.to_dict()))) == whole
    for blocks, problem in ((None, "made of blocks"), (["2026-12-01"], "unknown: 2026-12-01"),
                            ({"from": "2027", "to": "2028"}, "no block of the dataset lies between")):
        with pytest.raises(UsageError, match=problem):
            build_config({**common, "blocks": blocks} if blocks is not None else common)


# ---------------------------------------------------------------- the store


def test_a_job_on_blocks_is_charged_to_each_in_full_all_or_nothing_and_verify_replays_it(tmp_path):
    with open_embedded_ledger(tmp_path / "ledger.db") as ledger:
        ledger.create_dataset("logs", 10.0, DELTA)
        ledger.add_block("logs", "d1", 2.0, data=rows(0, 100))
        ledger.add_block("logs", "d2", 1.0, data=rows(100, 200))
        with pytest.raises(FailedPrecondition, match=r"made of blocks \(d1, d2\)"):
            ledger.reserve("logs", "whole", steps(10))
        first = ledger.reserve("logs", "first", steps(300), blocks=["d1", "d2"])
        ledger.commit(first.reservation_id, 100, 0)
        ledger.release(first.reservation_id)
        d1, d2 = ledger.get_budget("logs").blocks
        charged = RdpTally.of(steps(100))
        assert (d1.name, d2.name) == ("d1", "d2")
        assert d1.spent_epsilon_filter == AdmissionRule.for_budget(2.0, DELTA).epsilon(charged)
        assert d2.spent_epsilon_filter == AdmissionRule.for_budget(1.0, DELTA).epsilon(charged)
        assert ledger.get_budget("logs").spent_epsilon_filter == 0.0  # the dataset's own budget is untouched
        # d1 alone admits this job, d2 does not: nothing is held anywhere.
        fits_d1 = ledger.fits("logs", steps(3000), ["d1"])
        assert fits_d1.fits
        with pytest.raises(BudgetExceeded, match="block 'd2' of dataset 'logs'"):
            ledger.reserve("logs", "second", steps(3000), blocks=["d1", "d2"])
        assert ledger.get_budget("logs").blocks == (d1, d2)
        assert ledger.fits("logs", steps(3000), ["d1"]) == fits_d1  # a dry run reserved nothing
        with pytest.raises(NotFound, match="no block 'd9'"):
            ledger.reserve("logs", "third", steps(10), blocks=["d9"])
        assert ledger.verify().findings == ()
        # The page's burn-down of the dataset's own budget leaves the blocks' entries out.
        last = burn_down(ledger.history("logs"))[-1]
        assert (last.budget_epsilon, last.spent_epsilon_filter, last.remaining_epsilon) == (10.0, 0.0, 10.0)


def test_quotas_limit_a_tenant_beside_the_global_filter_and_verify_finds_an_edited_tally(tmp_path):
    path = tmp_path / "ledger.db"
    with Ledger(path) as ledger:
        ledger.create_tenant("owner", caller=ADMIN)
        ledger.create_tenant("guest", caller=ADMIN)
        owner, guest = tenant_caller("owner"), tenant_caller("guest")
        ledger.create_dataset("logs", 10.0, DELTA, caller=owner)
        ledger.add_block("logs", "d1", 5.0, data=rows(0, 100), caller=owner)
        ledger.add_block("logs", "d2", 5.0, data=rows(100, 200), caller=owner)
        with pytest.raises(PermissionDenied):
            ledger.get_budget("owner/logs", caller=guest)
        ledger.set_quota("owner/logs", "guest", 1.0, caller=ADMIN)  # the dataset's quota stands in for each block
        ledger.set_quota("owner/logs", "guest", 2.0, block="d2", caller=ADMIN)
        quotas = {(quota.block, quota.inherited): quota for quota in ledger.get_budget("owner/logs",
                                                                                      caller=guest).quotas}
        assert set(quotas) == {(None, False), ("d1", True), ("d2", False)}
        needed_on_d1 = AdmissionRule.for_budget(1.0, DELTA).epsilon(RdpTally.of(steps(3000)))
        assert needed_on_d1 > 1.0 and AdmissionRule.for_budget(5.0, DELTA).epsilon(RdpTally.of(steps(3000))) < 5.0
        with pytest.raises(BudgetExceeded, match="tenant 'guest''s quota on block 'd1'"):
            ledger.reserve("owner/logs", "big", steps(3000), blocks=["d1"], caller=guest)
        job = ledger.reserve("owner/logs", "small", steps(100), blocks=["d1", "d2"], caller=guest)
        ledger.commit(job.reservation_id, 50, 0, caller=guest)
        mine = ledger.reserve("logs", "own", steps(100), blocks=["d1"], caller=owner)
        # Each tenant sees its own jobs and quotas only; the admin sees all.
        assert [j.job_id for j in ledger.get_budget("owner/logs", caller=guest).jobs] == ["small"]
        assert [j.job_id for j in ledger.get_budget("logs", caller=owner).jobs] == ["own"]
        assert ledger.get_budget("logs", caller=owner).quotas == ()
        assert [j.job_id for j in ledger.list_jobs(caller=guest)] == ["small"]
        assert {entry.details.get("job_id") for entry in ledger.history(caller=owner)} == {None, "own"}
        with pytest.raises(PermissionDenied):
            ledger.release(mine.reservation_id, caller=guest)
        used = quotas[("d2", False)]
        after = next(q for q in ledger.get_budget("owner/logs", caller=guest).quotas if q.block == "d2")
        assert after.remaining_epsilon < used.remaining_epsilon == 2.0
        assert ledger.verify(caller=ADMIN).findings == ()
    with sqlite3.connect(path) as connection:
        # d2's quota is its own, d1's the dataset's: both tallies are replayed.
        connection.execute("UPDATE tenant_use SET held_rdp = ? WHERE tenant = 'guest' AND budget_id IN "
                           "(SELECT id FROM datasets WHERE block IS NOT NULL)", (RdpTally.zero().to_json(),))
    with Ledger(path) as ledger:
        problems = [str(finding) for finding in ledger.verify(caller=ADMIN).findings]
    assert problems == [f"dataset row of dataset owner/logs:{block} (tenant guest): the tenant's RDP tally of "
                        "committed and reserved steps is not what its history replays to" for block in ("d1", "d2")]


# ---------------------------------------------------------------- a real server on loopback


@pytest.fixture
def server(tmp_path):
    running = start_server(tmp_path / "ledger.db", "127.0.0.1", 0, ADMIN_TOKEN, allow_key_beside_database=True)
    yield running
    running.stop(grace_seconds=1.0)


def test_blocks_quotas_and_the_dry_run_over_grpc(server, capsys):
    with RemoteLedger(server.address, ADMIN_TOKEN) as admin:
        owner_token = admin.create_tenant("owner").token
        guest_token = admin.create_tenant("guest").token
        with RemoteLedger(server.address, owner_token) as owner, RemoteLedger(server.address, guest_token) as guest:
            owner.create_dataset("logs", 10.0, DELTA)
            status = owner.add_block("logs", "d1", 3.0, data=rows(0, 100))
            assert [(block.name, block.budget_epsilon, block.delta) for block in status.blocks] == [("d1", 3.0, DELTA)]
            with pytest.raises(PermissionDenied):
                owner.set_quota("logs", "guest", 1.0)
            with pytest.raises(PermissionDenied):
                guest.fits("owner/logs", steps(10), ["d1"])
            assert main(["ledger", "quota", "set", "owner/logs", "guest", "--epsilon", "1.5", "--block", "d1",
                         "--ledger", server.address, "--token", ADMIN_TOKEN, "--json"]) == 0
            (shown,) = json.loads(capsys.readouterr().out)["datasets"]
            assert [(quota["tenant"], quota["block"], quota["quota_epsilon"]) for quota in shown["quotas"]] == [
                ("guest", "d1", 1.5)]
            report = guest.fits("owner/logs", steps(200), ["d1"])
            assert report.fits and [check.budget for check in report.checks] == [
                "block 'd1' of dataset 'owner/logs'", "tenant 'guest''s quota on block 'd1' of dataset 'owner/logs'"]
            assert report == guest.fits("owner/logs", steps(200), ["d1"])  # nothing was reserved
            held = guest.reserve("owner/logs", "job", steps(200), blocks=["d1"])
            assert held.blocks == ("d1",) and held.dataset == "owner/logs"
            (quota,) = guest.get_budget("owner/logs").quotas
            assert quota.reserved_epsilon == pytest.approx(report.checks[1].needed_epsilon)
            assert quota.remaining_epsilon == pytest.approx(report.checks[1].remaining_after_epsilon)
            refused = guest.fits("owner/logs", steps(5000), ["d1"])
            assert not refused.fits and not refused.checks[1].fits and refused.checks[1].remaining_after_epsilon < 0
            with pytest.raises(BudgetExceeded) as caught:
                guest.reserve("owner/logs", "big", steps(5000), blocks=["d1"])
            assert caught.value.budget == refused.checks[1].budget
            assert caught.value.needed_epsilon == refused.checks[1].needed_epsilon
            assert owner.get_budget("logs").jobs == () and owner.list_jobs() == []
            assert [status.name for status in guest.list_datasets()] == ["owner/logs"]
    assert server.ledger.verify(caller=ADMIN).findings == ()


# ---------------------------------------------------------------- training on blocks, end to end


def test_training_on_two_parquet_blocks_reads_only_them_and_charges_each(server, tmp_path, capsys, monkeypatch):
    from orchestrator.trainer import Trainer

    said = []
    monkeypatch.setattr(Trainer, "say", lambda trainer, text: said.append(text))
    locations, test = parquet_blocks(tmp_path / "data", {"d1": 240, "d2": 360, "d3": 100})
    dataset = parquet_dataset(locations, test)
    with RemoteLedger(server.address, ADMIN_TOKEN) as admin:
        token = admin.create_tenant("acme").token
    client = ["--ledger", server.address, "--token", token, "--json"]
    assert main(["ledger", "dataset", "create", "logs", "--epsilon", "10", "--delta", "1e-5", *client]) == 0
    for block in ("d1", "d2", "d3"):
        assert main(["ledger", "block", "add", "logs", block, "--epsilon", "4", "--files", locations[block],
                     *client]) == 0
    (added,) = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["datasets"]
    assert [(block["name"], block["budget_epsilon"], block["delta"]) for block in added["blocks"]] == [
        ("d1", 4.0, DELTA), ("d2", 4.0, DELTA), ("d3", 4.0, DELTA)]
    # d3's files are no longer Parquet at all: a run that opened them would fail.
    for shard in (tmp_path / "data" / "d3").iterdir():
        shard.write_bytes(b"not a parquet file")
    blocks_toml = "".join(f'"{name}" = "{location}"\n' for name, location in dataset["blocks"].items())
    config = tmp_path / "job.toml"
    config.write_text(
        f'model = "gdp_cnn"\nworkers = 1\nbatch_size = 30\nsteps = 4\nnoise_multiplier = 1.0\nclip_norm = 1.0\n'
        f'learning_rate = 0.5\nseed = 3\nrun_dir = "{tmp_path / "run"}"\nblocks = ["d1", "d2"]\n'
        f'ledger = "{server.address}"\n'
        f'[dataset]\nformat = "parquet"\ntest = "{test}"\nshape = [1, 28, 28]\nname = "logs"\n'
        f'[dataset.blocks]\n{blocks_toml}'
    )
    assert main(["ledger", "fits", "--config", str(config), "--token", token, "--json"]) == 0
    dry_run = json.loads(capsys.readouterr().out)
    assert dry_run["fits"] and dry_run["sampling_rate"] == 30 / 600 and dry_run["blocks"] == ["d1", "d2"]
    assert main(["train", "--config", str(config), "--token", token, "--no-progress", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["dataset_size"] == 600 and summary["sampling_rate"] == 30 / 600
    with RemoteLedger(server.address, token) as acme:
        status = acme.get_budget("logs")
        (job,) = acme.list_jobs(charges=True)
    d1, d2, d3 = status.blocks
    charged = RdpTally.of(SampledGaussian(30 / 600, 1.0, 4))
    assert job.blocks == ("d1", "d2") and job.committed_steps == 4
    assert d1.spent_epsilon_filter == d2.spent_epsilon_filter == d1.admission.epsilon(charged)
    assert d1.spent_epsilon_filter == pytest.approx(dry_run["checks"][0]["needed_epsilon"], rel=1e-12)
    # The charge was known before the job: the dry run and train's start line say what it takes of each block.
    assert dry_run["filter_charges"] == [{"budget": f"block {block.name}", "filter_epsilon": block.spent_epsilon_filter}
                                         for block in (d1, d2)]
    assert [(take["block"], take["epsilon"], take["remaining_epsilon"]) for take in dry_run["takes"]] == [
        (block.name, block.spent_epsilon_filter, 4.0) for block in (d1, d2)]
    assert "this job takes " + ", ".join(
        f"ε {block.spent_epsilon_filter:.3g} of block {block.name!r} (remaining 4 → {4 - block.spent_epsilon_filter:.3g})"
        for block in (d1, d2)) + "; its own privacy: ε " in "\n".join(said)
    assert [(charge.block, charge.charged_epsilon) for charge in job.charges] == [
        (block.name, block.spent_epsilon_filter) for block in (d1, d2)]
    assert d3.spent_epsilon_filter == 0.0 and status.spent_epsilon_filter == 0.0
    assert job.planned == Composition((SampledGaussian(30 / 600, 1.0, 4),))


# ---------------------------------------------------------------- blocks own disjoint data


def stand_in(text):
    """A stand-in SHA-256 named by `text`, for the identities of files these tests only name."""
    return hashlib.sha256(text.encode()).hexdigest()


def files(*locations, contents=None, people=None, user_id="user_id"):
    """A declaration of `locations` with its identity: files holding `contents` (default: one per location, named
    by it), and on a per-person dataset `people` (stand-in ids), named by the column `user_id`."""
    identity = {"files": [[stand_in(content), 10] for content in contents or locations]}
    if people is not None:
        identity.update(user_id=user_id, people=[stand_in(str(person))[:16] for person in people])
    return {"files": list(locations), "identity": identity}


BUCKET_0, BUCKET_1 = {"user_hash": {"buckets": 2, "bucket": 0}}, {"user_hash": {"buckets": 2, "bucket": 1}}


@pytest.mark.parametrize("first, second, unit, shared", [
    (files("/d/a"), files("/d/b"), "example", False),
    (files("/d/a"), files("/d/a/"), "example", True),
    (files("/d/a"), files("/d/a/part-0.parquet"), "example", True),
    (files("/d"), files("/d/a", "/e"), "example", True),
    # A link, a URL or a copy of /d/a under another name holds the same bytes: its identity gives it away.
    (files("/d/a"), files("/d/link-to-a", contents=["/d/a"]), "example", True),
    (files("/d/a", "/d/b"), files("/e/c", contents=["/d/b", "/e/c"]), "example", True),
    ({"rows": [0, 10]}, {"rows": [10, 20]}, "example", False),
    ({"rows": [0, 11]}, {"rows": [10, 20]}, "example", True),
    ({**files("/d/a"), "rows": [0, 10]}, {**files("/d/b"), "rows": [0, 10]}, "example", False),
    ({**files("/d/a"), "rows": [0, 10]}, {"rows": [20, 30]}, "example", True),  # other files: unknown order
    # The same bytes under other names: row ranges of the same files in the same order can be apart...
    ({**files("/d/a", "/d/b"), "rows": [0, 10]}, {**files("/e/a", "/e/b", contents=["/d/a", "/d/b"]),
                                                  "rows": [10, 20]}, "example", False),
    # ...but not in another order, where row 10 is another row.
    ({**files("/d/a", "/d/b"), "rows": [0, 10]}, {**files("/e/a", "/e/b", contents=["/d/b", "/d/a"]),
                                                  "rows": [10, 20]}, "example", True),
    ({"partition": {"column": "day", "value": 1}}, {"partition": {"column": "day", "value": "2"}}, "example", False),
    ({"partition": {"column": "day", "value": 1}}, {"partition": {"column": "day", "value": "1"}}, "example", True),
    ({"partition": {"column": "day", "value": "1"}}, {"partition": {"column": "hour", "value": "2"}}, "example", True),
    ({"rows": [0, 10]}, {"partition": {"column": "day", "value": "1"}}, "example", True),
    ({"user_hash": {"buckets": 4, "bucket": 0}}, {"user_hash": {"buckets": 4, "bucket": 1}}, "user", False),
    ({"user_hash": {"buckets": 4, "bucket": 0}}, {"user_hash": {"buckets": 8, "bucket": 1}}, "user", True),
    ({"user_range": [0, 100]}, {"user_range": [100, 200]}, "user", False),
    ({"user_range": [0, 101]}, {**files("/x", people=[7]), "user_range": [100, 200]}, "user", True),
    ({"user_hash": {"buckets": 4, "bucket": 0}}, {"user_range": [0, 10]}, "user", True),
    ({**files("/d/a", people=[7, 8]), **BUCKET_0}, {**files("/d/b", people=[9]), **BUCKET_1}, "user", False),
    # People are known by their digests, whatever the buckets say (7 stored as 7.0 hashed to another bucket).
    ({**files("/d/a", people=[7, 8]), **BUCKET_0}, {**files("/d/b", people=[7, 9]), **BUCKET_1}, "user", True),
    ({**files("/d/a", people=[7]), **BUCKET_0}, {**files("/d/b", people=[9], user_id="other"), **BUCKET_1}, "user",
     True),
])
def test_two_declarations_share_data_unless_they_provably_cannot(first, second, unit, shared):
    first, second = check_block_data(first, unit), check_block_data(second, unit)
    assert (block_data_overlap(first, second, unit) is not None) == shared
    assert (block_data_overlap(second, first, unit) is not None) == shared
    assert block_data_overlap(None, first, unit) is not None  # a block that declared nothing may hold anything


@pytest.mark.parametrize("data, unit, problem", [
    (None, "example", "a block declares where its rows are"),
    ({}, "example", "a block declares where its rows are"),
    ({"rows": [5, 5]}, "example", "FIRST < STOP"),
    ({"rows": [0, 5], "partition": {"column": "day", "value": "1"}}, "example", "at most one selector"),
    ({"files": []}, "example", "1 to 1000 non-empty locations"),
    ({"user_hash": {"buckets": 4, "bucket": 4}}, "user", r"bucket must be an integer in \[0, 3\]"),
    (files("/d/a"), "user", "must partition people"),
    ({"rows": [0, 5]}, "user", "must partition people"),
    ("not json", "example", "must be a JSON object"),
    ({"files": ["/d/a"]}, "example", "need the files' identity"),
    ({"files": ["/d/a"], "identity": {"files": [["0" * 63, 1]]}}, "example", "64 lowercase hex digits"),
    ({**files("/d/a"), **BUCKET_0}, "user", "a block's identity names its people"),
    ({"rows": [0, 5], "identity": files("/d/a")["identity"]}, "example", "declare them with files"),
    # Over raw gRPC a location is the declared text: every spelling that hides its place is refused.
    (files("d/a"), "example", "must be absolute paths or URLs"),
    (files("/d/./a"), "example", "without '.', '..' or '//' parts"),
    (files("/d/b/../a"), "example", "without '.', '..' or '//' parts"),
    (files("/d//a"), "example", "without '.', '..' or '//' parts"),
    (files("file://host/d/a"), "example", "file:///PATH"),
])
def test_a_declaration_that_cannot_bound_its_data_is_refused(data, unit, problem):
    with pytest.raises(InvalidArgument, match=problem):
        check_block_data(data, unit)


def test_a_file_url_is_its_path_and_a_trailing_slash_is_dropped():
    assert check_block_data(files("file:///d/a/", "s3://bucket/d/"), "example")["files"] == ["/d/a", "s3://bucket/d"]


def test_the_owner_cannot_add_blocks_over_the_same_rows_nor_above_the_dataset_budget(tmp_path):
    """The reproduction: an owner, no admin, adds blocks over the same rows of an ε 2 dataset to train under each."""
    rows_at, new = str(tmp_path / "rows"), str(tmp_path / "new")
    with Ledger(tmp_path / "ledger.db") as ledger:
        ledger.create_tenant("owner", caller=ADMIN)
        owner = tenant_caller("owner")
        ledger.create_dataset("logs", 2.0, DELTA, caller=owner)
        ledger.add_block("logs", "d1", 2.0, data=files(rows_at), caller=owner)
        for block, data in (("d2", files(rows_at + "/", contents=[rows_at])),
                            ("d3", files(rows_at + "/part-0.parquet")), ("d4", files(str(tmp_path))),
                            ("d5", files(rows_at, new)),
                            ("d6", files(str(tmp_path / "elsewhere"), contents=[rows_at]))):
            with pytest.raises(FailedPrecondition, match="may hold data of block 'd1'"):
                ledger.add_block("logs", block, 2.0, data=data, caller=owner)
        with pytest.raises(InvalidArgument, match="above dataset 'logs''s budget of ε 2"):
            ledger.add_block("logs", "big", 3.0, data=files(new), caller=owner)
        with pytest.raises(InvalidArgument, match="above dataset 'logs''s budget"):
            ledger.add_block("logs", "loose", 1.0, 1e-3, data=files(new), caller=owner)
        ledger.add_block("logs", "d2", 2.0, data=files(new), caller=owner)
        # Each block is exhausted on its own rows; none can be charged again for the same rows.
        for block in ("d1", "d2"):
            job = ledger.reserve("logs", f"on-{block}", steps(5000), blocks=[block], caller=owner)
            ledger.commit(job.reservation_id, 5000, 0, caller=owner)
        with pytest.raises(BudgetExceeded):
            ledger.reserve("logs", "again", steps(5000), blocks=["d1"], caller=owner)
        with pytest.raises(FailedPrecondition, match="its budget, the most any row or person of it may spend"):
            ledger.raise_budget("owner/logs", 1.5, caller=ADMIN)
        assert ledger.raise_budget("owner/logs", 4.0, caller=ADMIN).budget_epsilon == 4.0
        assert [block.data for block in ledger.get_budget("logs", caller=owner).blocks] == [files(rows_at), files(new)]
        assert ledger.verify(caller=ADMIN).findings == ()


def test_a_dataset_whose_own_budget_was_charged_takes_no_block(tmp_path):
    with open_embedded_ledger(tmp_path / "ledger.db") as ledger:
        ledger.create_dataset("logs", 10.0, DELTA)
        ledger.reserve("logs", "whole", steps(10))
        with pytest.raises(FailedPrecondition, match="jobs on its own budget, which read every row"):
            ledger.add_block("logs", "d1", 2.0, data=rows(0, 10))


def people_file(path, user_ids):
    """A Parquet file of one row per entry of `user_ids`, with its user_id column beside features and label."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    count = len(user_ids)
    table = pa.table({"features": pa.FixedSizeListArray.from_arrays(pa.array(np.zeros(count * 4, np.float32)), 4),
                      "label": pa.array(np.arange(count) % 2), "user_id": pa.array(user_ids)})
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, str(path))
    return str(path)


def test_a_person_with_rows_in_three_blocks_never_exceeds_the_budget(tmp_path):
    """On a per-person dataset blocks partition people: a person is charged by one block, whatever files hold them."""
    budget = 2.0
    # Person 7 has rows in all three days' files; in the by-person folders each person's rows are in its block's.
    folders = [str(tmp_path / f"day-{day}") for day in range(3)]
    for day, folder in enumerate(folders):
        people_file(tmp_path / f"day-{day}" / "part-0.parquet", [7, 7, 8 + day])
    for other in range(3):
        people_file(tmp_path / "by-person" / f"b{other}" / "part-0.parquet",
                    [int(user) for user in range(100) if user_hash_buckets(np.array([user]), 3)[0] == other])
    apart = {f"b{other}": {"files": [str(tmp_path / "by-person" / f"b{other}")],
                           "user_hash": {"buckets": 3, "bucket": other}} for other in range(3)}
    with open_embedded_ledger(tmp_path / "ledger.db") as ledger:
        ledger.create_dataset("people", budget, DELTA, privacy_unit="user")
        with pytest.raises(InvalidArgument, match="must partition people"):
            ledger.add_block("people", "day-0", budget, data={"files": [folders[0]]})
        status = ledger.get_budget("people")
        for bucket in range(3):
            ledger.add_block("people", f"b{bucket}", budget,
                             data=with_identity(f"b{bucket}", apart[f"b{bucket}"], status, "user_id"))
        # The days' files hold people of those blocks: no block over them is admitted, whatever its bucket says.
        with pytest.raises(FailedPrecondition, match="people are in both"):
            ledger.add_block("people", "days", budget, data=with_identity(
                "days", {"files": folders, "user_hash": {"buckets": 4, "bucket": 0}}, status, "user_id"))
        with pytest.raises(FailedPrecondition, match="may hold data of block 'b0'"):
            ledger.add_block("people", "again", budget, data={"user_hash": {"buckets": 6, "bucket": 0}})
        # Every block spends its whole budget; person 7 is in exactly one of them.
        for bucket in range(3):
            job = ledger.reserve("people", f"job-{bucket}", steps(5000), privacy_unit="user",
                                 blocks=[f"b{bucket}"])
            ledger.commit(job.reservation_id, 5000, 0)
        status = ledger.get_budget("people")
        (bucket,) = user_hash_buckets(np.array([7]), 3)
        spent_by_person_7 = [block.spent_epsilon_filter for block in status.blocks
                             if block.data["user_hash"]["bucket"] == bucket]
        assert len(spent_by_person_7) == 1 and spent_by_person_7[0] <= budget
        assert ledger.verify().findings == ()
    # The training side: a block reads the days' files only when every row's person is one of its own, so person
    # 7's rows are read under 7's block alone.
    declared = {f"b{bucket}": {"files": folders, "user_hash": {"buckets": 3, "bucket": bucket}} for bucket in range(3)}
    ids = np.array([7, 7, 8, 7, 7, 9, 7, 7, 10])
    for other in range(3):
        spec = select_blocks({**parquet_spec(), "blocks": declared}, [f"b{other}"])
        outsiders = ids[user_hash_buckets(ids, 3) != other]
        if len(outsiders):
            with pytest.raises(DataError, match=f"belongs to user {outsiders[0]}, who is not in the block's declared"):
                check_block_people(spec, "user_id")
        else:
            check_block_people(spec, "user_id")
    assert (user_hash_buckets(ids, 3) != bucket).any()  # so 7's own block was refused too
    with pytest.raises(DataError, match="user_id, the column naming each row's person, not synthetic_users"):
        check_block_people(spec, None)
    # Each person's rows in its own block's folder: every block reads.
    for other in range(3):
        check_block_people(select_blocks({**parquet_spec(), "blocks": apart}, [f"b{other}"]), "user_id")
    # A user-level run builds its users through user_index, which makes the same check before it samples anyone.
    from workers.users import UserSpec, user_index

    with pytest.raises(DataError, match="not in the block's declared people"):
        user_index(UserSpec("user_id", None), select_blocks({**parquet_spec(), "blocks": declared}, ["b0"]), 9)
    assert len(user_index(UserSpec("user_id", None), select_blocks({**parquet_spec(), "blocks": apart}, ["b0"]),
                          5).starts) > 1


def parquet_spec():
    return {"format": "parquet", "test": "unused", "features": "features", "label": "label"}


def test_a_run_reads_only_the_rows_its_blocks_select(tmp_path):
    folder = tmp_path / "events"
    folder.mkdir()
    import pyarrow as pa
    import pyarrow.parquet as pq

    count = 30
    pq.write_table(pa.table({"x": pa.array(np.arange(count, dtype=np.float32)), "label": pa.array(np.arange(count)),
                             "day": pa.array([f"d{row % 3}" for row in range(count)])}), str(folder / "p.parquet"))
    spec = {"format": "parquet", "train": str(folder), "test": str(folder), "features": "x",
            "blocks": {"first": {"rows": [0, 5]}, "late": {"rows": [25, 30]}, "d1": {"partition": {"column": "day",
                                                                                                   "value": "d1"}}}}
    chosen = select_blocks(parse_spec(spec), ["late", "first"])
    assert source_size(chosen, "train") == 10
    _, labels = open_source(chosen, "train").read(np.array([9, 0, 5]))
    assert labels.tolist() == [4, 25, 0]
    by_day = select_blocks(parse_spec(spec), ["d1"])
    assert read_column(by_day, "train", "label").tolist() == list(range(1, count, 3))
    assert parse_spec(json.loads(json.dumps(chosen))) == chosen  # a resumed run reads the same rows


def test_training_is_refused_when_its_config_reads_other_rows_than_the_ledgers_block_declares(server, tmp_path,
                                                                                            capsys):
    locations, test = parquet_blocks(tmp_path / "data", {"d1": 60, "d2": 60})
    with RemoteLedger(server.address, ADMIN_TOKEN) as admin:
        token = admin.create_tenant("acme").token
    client = ["--ledger", server.address, "--token", token, "--json"]
    assert main(["ledger", "dataset", "create", "logs", "--epsilon", "10", "--delta", "1e-5", *client]) == 0
    assert main(["ledger", "block", "add", "logs", "d1", "--epsilon", "4", "--files", locations["d1"], *client]) == 0
    assert main(["ledger", "block", "add", "logs", "d2", "--epsilon", "4", "--files", locations["d1"], *client]) == 2
    assert "may hold data of block 'd1'" in capsys.readouterr().err
    assert main(["ledger", "block", "add", "logs", "d2", "--epsilon", "4", "--files", locations["d2"], *client]) == 0
    capsys.readouterr()
    # The config says block d1 is d2's rows: the run would be charged to d1 for rows d2 owns.
    config = tmp_path / "job.toml"
    config.write_text(
        f'model = "gdp_cnn"\nworkers = 1\nbatch_size = 30\nsteps = 2\nnoise_multiplier = 1.0\nclip_norm = 1.0\n'
        f'run_dir = "{tmp_path / "run"}"\nblocks = ["d1"]\nledger = "{server.address}"\n'
        f'[dataset]\nformat = "parquet"\ntest = "{test}"\nshape = [1, 28, 28]\nname = "logs"\n'
        f'[dataset.blocks]\n"d1" = "{locations["d2"]}"\n'
    )
    assert main(["ledger", "fits", "--config", str(config), "--token", token]) == 2
    assert "is bound in the ledger to" in capsys.readouterr().err
    assert main(["train", "--config", str(config), "--token", token, "--no-progress"]) == 2
    with RemoteLedger(server.address, token) as acme:
        assert acme.list_jobs() == []


def test_a_file_of_version_6_keeps_its_blocks_undeclared_and_verify_finds_a_row_charged_by_each(tmp_path):
    """Before blocks declared their data, an owner could charge the same rows to several blocks; verify finds it."""
    path = tmp_path / "ledger.db"
    with open_embedded_ledger(path) as ledger:
        ledger.create_dataset("people", 2.0, DELTA, privacy_unit="user")
        for bucket in range(3):
            ledger.add_block("people", f"b{bucket}", 2.0, data={"user_hash": {"buckets": 3, "bucket": bucket}})
            job = ledger.reserve("people", f"job-{bucket}", steps(5000), privacy_unit="user", blocks=[f"b{bucket}"])
            ledger.commit(job.reservation_id, 5000, 0)
        assert ledger.verify().findings == ()
    with sqlite3.connect(path) as connection:  # the same file as version 6 wrote it: its blocks declared nothing
        connection.execute("ALTER TABLE datasets DROP COLUMN block_data")
        for (entry_id, details) in connection.execute(
                "SELECT id, details FROM history WHERE action = 'add_block'").fetchall():
            connection.execute("DROP TRIGGER IF EXISTS history_is_append_only_update")
            old = {key: value for key, value in json.loads(details).items() if key != "data"}
            connection.execute("UPDATE history SET details = ? WHERE id = ?", (json.dumps(old, sort_keys=True),
                                                                              entry_id))
    rekey_ledger(as_unkeyed_version(path, 6))
    with open_embedded_ledger(path) as ledger:
        assert [block.data for block in ledger.get_budget("people").blocks] == [None, None, None]
        with pytest.raises(FailedPrecondition, match="was added before blocks declared where their rows are"):
            ledger.reserve("people", "new", steps(10), privacy_unit="user", blocks=["b0"])
        with pytest.raises(FailedPrecondition, match="may hold data of block 'b0'"):
            ledger.add_block("people", "b3", 1.0, data={"user_hash": {"buckets": 4, "bucket": 3}})
        problems = [str(finding) for finding in ledger.verify().findings if finding.entry_id is None]
    assert len(problems) == 3 and all("could have spent ε" in problem and "over the dataset's budget ε 2" in problem
                                      for problem in problems)
    # Each block alone charged filter ε 1.73 of 2; a person in all three spent the three together.
    assert "one person in block 'b0' and in 'b1', 'b2' could have spent ε 3.11239, over" in problems[0]


def test_verify_finds_a_block_whose_declaration_was_edited_in_the_database(tmp_path):
    path = tmp_path / "ledger.db"
    with open_embedded_ledger(path) as ledger:
        ledger.create_dataset("logs", 2.0, DELTA)
        ledger.add_block("logs", "d1", 2.0, data=rows(0, 100))
        ledger.add_block("logs", "d2", 2.0, data=rows(100, 200))
    with sqlite3.connect(path) as connection:  # d2 now claims d1's rows, unknown to the history
        connection.execute("UPDATE datasets SET block_data = ? WHERE block = 'd2'", (json.dumps(rows(0, 100)),))
    with open_embedded_ledger(path) as ledger:
        problems = [str(finding) for finding in ledger.verify().findings]
    assert problems == [
        "dataset row of dataset local/logs:d1: its declared data may be shared with block 'd2' (row ranges [0, 100] "
        "and [0, 100] of the same files meet); a unit's guarantee is one block's budget only when the blocks are "
        "disjoint",
        "dataset row of dataset local/logs:d2: the row's block data is not what its history declares",
    ]


# ---------------------------------------------------------------- blocks are known by what they hold


@pytest.mark.parametrize("stored, canonical", [
    (7, "7"), (7.0, "7"), ("7", "7"), ("7.0", "7"), ("007", "7"), (np.int64(7), "7"), (np.float64(7.0), "7"),
    (b"7", "7"), ("alice", "alice"), ("7.5", "7.5"), (-3, "-3"),
])
def test_a_person_is_one_id_whatever_type_a_file_stores_it_as(stored, canonical):
    assert canonical_user_id(stored) == canonical
    assert user_hash_buckets(np.array([stored]), 1000)[0] == user_hash_buckets(np.array([canonical]), 1000)[0]


@pytest.mark.parametrize("stored", [7.5, float("nan"), True])
def test_an_id_that_could_be_two_people_is_refused(stored):
    with pytest.raises(DataError, match="a user id must be an integer or a text"):
        canonical_user_id(stored)


def test_no_alias_of_a_blocks_files_is_sold_again_through_the_command_line(server, tmp_path, capsys):
    """The reproduction: a symlink, a file:// URL, a hard link and a copy of day1 each asked for a budget of its own."""
    locations, _ = parquet_blocks(tmp_path / "d", {"day1": 20, "day2": 20})
    day1 = tmp_path / "d" / "day1"
    (tmp_path / "alias").symlink_to(day1)
    part = sorted(day1.iterdir())[0]
    (tmp_path / "linked").mkdir()
    os.link(part, tmp_path / "linked" / "part.parquet")
    (tmp_path / "copied").mkdir()
    (tmp_path / "copied" / "part.parquet").write_bytes(part.read_bytes())
    with RemoteLedger(server.address, ADMIN_TOKEN) as admin:
        token = admin.create_tenant("acme").token
    client = ["--ledger", server.address, "--token", token, "--json"]
    assert main(["ledger", "dataset", "create", "logs", "--epsilon", "2", "--delta", "1e-5", *client]) == 0
    assert main(["ledger", "block", "add", "logs", "day1", "--epsilon", "2", "--files", locations["day1"],
                 *client]) == 0
    capsys.readouterr()
    for alias in (str(tmp_path / "alias"), f"file://{day1}", str(tmp_path / "linked"), str(tmp_path / "copied")):
        assert main(["ledger", "block", "add", "logs", "again", "--epsilon", "2", "--files", alias, *client]) == 2
        assert "may hold data of block 'day1'" in capsys.readouterr().err, alias
    assert main(["ledger", "block", "add", "logs", "day2", "--epsilon", "2", "--files", locations["day2"],
                 *client]) == 0
    with RemoteLedger(server.address, token) as acme:
        assert [block.name for block in acme.get_budget("logs").blocks] == ["day1", "day2"]
    assert server.ledger.verify(caller=ADMIN).findings == ()


def test_a_block_whose_identity_is_a_lie_cannot_be_trained(server, tmp_path, capsys):
    """Over raw gRPC: spellings that hide a place are refused, and a declaration with a made-up identity is accepted
    by the ledger (which reads no file) but refused by the run, which recomputes what it would read."""
    locations, test = parquet_blocks(tmp_path / "d", {"day1": 60})
    with RemoteLedger(server.address, ADMIN_TOKEN) as admin:
        token = admin.create_tenant("acme").token
    with RemoteLedger(server.address, token) as acme:
        acme.create_dataset("logs", 2.0, DELTA)
        day1 = locations["day1"]
        for spelling in (f"{tmp_path}/./d/day1", f"{tmp_path}/d/x/../day1", f"{tmp_path}//d/day1",
                         os.path.relpath(day1)):
            with pytest.raises(InvalidArgument, match="absolute paths|'.', '..' or '//'"):
                acme.add_block("logs", "again", 2.0, data=files(spelling))
        acme.add_block("logs", "day1", 2.0, data=files(day1))
    config = tmp_path / "job.toml"
    config.write_text(
        f'model = "gdp_cnn"\nworkers = 1\nbatch_size = 30\nsteps = 2\nnoise_multiplier = 1.0\nclip_norm = 1.0\n'
        f'run_dir = "{tmp_path / "run"}"\nblocks = ["day1"]\nledger = "{server.address}"\n'
        f'[dataset]\nformat = "parquet"\ntest = "{test}"\nshape = [1, 28, 28]\nname = "logs"\n'
        f'[dataset.blocks]\n"day1" = "{day1}"\n'
    )
    assert main(["ledger", "fits", "--config", str(config), "--token", token]) == 2
    assert "holding the same bytes" in capsys.readouterr().err
    assert main(["train", "--config", str(config), "--token", token, "--no-progress"]) == 2
    with RemoteLedger(server.address, token) as acme:
        assert acme.list_jobs() == []


def test_one_person_stored_as_int64_and_as_float64_is_in_one_block_only(server, tmp_path, capsys):
    """The reproduction: ids 0..199 as int64 in one file and as float64 in another, one file per block by user hash.
    Hashing the ids' text put 7 and 7.0 in different buckets; canonical ids and the people's digests do not."""
    ids = np.arange(200)
    as_int = people_file(tmp_path / "int" / "part.parquet", ids.astype(np.int64))
    as_float = people_file(tmp_path / "float" / "part.parquet", ids.astype(np.float64))
    assert (user_hash_buckets(ids.astype(np.int64), 2) == user_hash_buckets(ids.astype(np.float64), 2)).all()
    with RemoteLedger(server.address, ADMIN_TOKEN) as admin:
        token = admin.create_tenant("acme").token
    client = ["--ledger", server.address, "--token", token]
    assert main(["ledger", "dataset", "create", "people", "--epsilon", "2", "--delta", "1e-5", "--privacy-unit",
                 "user", *client]) == 0
    assert main(["ledger", "block", "add", "people", "b0", "--epsilon", "2", "--files", as_int, "--user-hash", "0/2",
                 *client]) == 2
    assert "name the column of each row's person" in capsys.readouterr().err
    assert main(["ledger", "block", "add", "people", "b0", "--epsilon", "2", "--files", as_int, "--user-hash", "0/2",
                 "--user-id", "user_id", *client]) == 0
    assert main(["ledger", "block", "add", "people", "b1", "--epsilon", "2", "--files", as_float, "--user-hash",
                 "1/2", "--user-id", "user_id", *client]) == 2
    assert "200 people are in both" in capsys.readouterr().err
    with RemoteLedger(server.address, token) as acme:
        (stored,) = acme.get_budget("people").blocks
    assert stored.data["identity"]["user_id"] == "user_id" and len(stored.data["identity"]["people"]) == 200
    assert not {str(person) for person in ids} & set(stored.data["identity"]["people"])  # digests, not ids


def test_verify_finds_two_stored_blocks_that_hold_the_same_file(tmp_path):
    path = tmp_path / "ledger.db"
    with open_embedded_ledger(path) as ledger:
        ledger.create_dataset("logs", 2.0, DELTA)
        ledger.add_block("logs", "d1", 2.0, data=files("/d/day1"))
        ledger.add_block("logs", "d2", 2.0, data=files("/d/day2"))
        assert ledger.verify().findings == ()
    with sqlite3.connect(path) as connection:  # d2 now holds day1's file under its own name
        connection.execute("UPDATE datasets SET block_data = ? WHERE block = 'd2'",
                           (json.dumps(files("/d/day2", contents=["/d/day1"]), sort_keys=True),))
    with open_embedded_ledger(path) as ledger:
        problems = [str(finding) for finding in ledger.verify().findings]
    assert "its declared data may be shared with block 'd2' (both hold the same files, by their locations or by " \
           "their contents)" in problems[0]


def test_the_same_rows_moved_or_renamed_get_no_second_budget_on_first_use(tmp_path):
    """The reproduction: a dataset registered on first use took its name from its path, so the same files in another
    folder got a fresh budget. Its registration records its files' SHA-256s, and a dataset holding one is refused."""
    locations, _ = parquet_blocks(tmp_path / "d", {"day1": 20, "day2": 20})
    moved = tmp_path / "moved"
    moved.mkdir()
    for shard in sorted((tmp_path / "d" / "day1").iterdir()):
        (moved / shard.name).write_bytes(shard.read_bytes())
    said = []
    with open_embedded_ledger(tmp_path / "ledger.db") as ledger:
        ensure_embedded_dataset(ledger, "day1", 10.0, DELTA, "example", said.append,
                                spec={"format": "parquet", "train": locations["day1"]})
        with pytest.raises(UsageError, match="already registered as dataset local/day1 .*--dataset-name day1"):
            ensure_embedded_dataset(ledger, "moved", 10.0, DELTA, "example", said.append,
                                    spec={"format": "parquet", "train": str(moved)})
        with pytest.raises(UsageError, match="already registered as dataset local/day1"):
            ensure_embedded_dataset(ledger, "both", 10.0, DELTA, "example", said.append,
                                    spec={"format": "parquet", "train": [locations["day2"], str(moved)]})
        # `dpfleet ledger fits` before the first use answers as the first use would, and registers nothing.
        moved_job = build_config({"steps": 1, "noise_multiplier": 1.0, "batch_size": 4,
                                  "dataset": {"format": "parquet", "train": str(moved), "test": str(moved)}})
        with pytest.raises(UsageError, match="already registered as dataset local/day1 .*--dataset-name day1"):
            job_fits_now(ledger, "moved", moved_job)
        ensure_embedded_dataset(ledger, "day2", 10.0, DELTA, "example", said.append,
                                spec={"format": "parquet", "train": locations["day2"]})
        assert [status.name for status in ledger.list_datasets()] == ["day1", "day2"]
        assert ledger.verify().findings == ()


def test_a_name_made_from_a_path_is_said_with_the_path_and_how_moved_files_keep_their_budget(tmp_path):
    """A new user moves a folder and finds a refusal: the first registration already named the path and the fix."""
    locations, _ = parquet_blocks(tmp_path / "d", {"day1": 20})
    table = {"format": "parquet", "train": locations["day1"], "test": locations["day1"]}
    config = build_config({"steps": 1, "noise_multiplier": 1.0, "batch_size": 4, "dataset": table})
    assert name_origin(None, config) == locations["day1"]
    assert name_origin("chosen", config) is None
    assert name_origin(None, build_config({"steps": 1, "noise_multiplier": 1.0, "batch_size": 4, "dataset": {**table, "name": "days"}})) is None
    assert name_origin(None, build_config({"steps": 1, "noise_multiplier": 1.0, "batch_size": 4, "dataset": "mnist"})) is None
    said = []
    dataset = ledger_dataset_name(None, config)
    with open_embedded_ledger(tmp_path / "ledger.db") as ledger:
        ensure_embedded_dataset(ledger, dataset, 10.0, DELTA, "example", said.append, spec=table,
                                named_after=name_origin(None, config))
    assert said == [f"registered dataset {dataset!r} in the embedded ledger with budget epsilon 10 at delta 1e-05 "
                    f"(first use; dpfleet ledger status shows it); its name comes from the train location "
                    f"{locations['day1']}: if the files move, set dataset_name = \"{dataset}\" to go on spending "
                    "this budget (the ledger refuses the same files under a second name)"]


def test_jobs_that_first_use_one_dataset_at_once_register_it_once(tmp_path, monkeypatch):
    """Two jobs on the same files start together: both find no dataset, one registers it, and the other, refused
    as the same name, carries on under it rather than being taken for the same rows under another name."""
    locations, _ = parquet_blocks(tmp_path / "d", {"day1": 20})
    spec = {"format": "parquet", "train": locations["day1"]}
    said = []
    with open_embedded_ledger(tmp_path / "ledger.db") as ledger:
        ensure_embedded_dataset(ledger, "day1", 10.0, DELTA, "example", said.append, spec=spec)
        real_get_budget = ledger.get_budget
        looks = []

        def not_there_at_first_look(dataset, *args, **kwargs):
            looks.append(dataset)
            if len(looks) == 1:
                raise NotFound(f"dataset {dataset!r} does not exist")
            return real_get_budget(dataset, *args, **kwargs)

        monkeypatch.setattr(ledger, "get_budget", not_there_at_first_look)
        ensure_embedded_dataset(ledger, "day1", 10.0, DELTA, "example", said.append, spec=spec)
        assert looks == ["day1", "day1"] and len(said) == 1
        assert [status.name for status in ledger.list_datasets()] == ["day1"]
