"""Blocks of a dataset, tenant quotas and the dry run: pure checks, the store, a real server on loopback, training."""

import json
import sqlite3

import numpy as np
import pytest

from accounting.events import Composition, SampledGaussian
from accounting.ledger.client import RemoteLedger
from accounting.ledger.core import (
    ADMIN,
    AdmissionRule,
    BudgetExceeded,
    FailedPrecondition,
    FitReport,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    RdpTally,
    assess_admission,
    burn_down,
    check_block_names,
    tenant_caller,
)
from accounting.ledger.service import start_server
from accounting.ledger.store import Ledger, open_embedded_ledger
from orchestrator.cli import main
from orchestrator.config import build_config
from orchestrator.errors import UsageError
from workers.sources import write_parquet_shards

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


def parquet_blocks(directory, rows_by_block, corrupt=()):
    """One folder of Parquet shards per block; a block in `corrupt` holds a file that is not Parquet at all."""
    rng = np.random.default_rng(0)
    locations = {}
    for block, rows in rows_by_block.items():
        folder = directory / block
        if block in corrupt:
            folder.mkdir(parents=True)
            (folder / "part-00000.parquet").write_bytes(b"not a parquet file")
        else:
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
    running = start_server(tmp_path / "ledger.db", "127.0.0.1", 0, ADMIN_TOKEN)
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


def test_training_on_two_parquet_blocks_reads_only_them_and_charges_each(server, tmp_path, capsys):
    # d3's file is not Parquet at all: a run that opened it would fail.
    locations, test = parquet_blocks(tmp_path / "data", {"d1": 240, "d2": 360, "d3": 100}, corrupt=("d3",))
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
        (job,) = acme.list_jobs()
    d1, d2, d3 = status.blocks
    charged = RdpTally.of(SampledGaussian(30 / 600, 1.0, 4))
    assert job.blocks == ("d1", "d2") and job.committed_steps == 4
    assert d1.spent_epsilon_filter == d2.spent_epsilon_filter == d1.admission.epsilon(charged)
    assert d1.spent_epsilon_filter == pytest.approx(dry_run["checks"][0]["needed_epsilon"], rel=1e-12)
    assert d3.spent_epsilon_filter == 0.0 and status.spent_epsilon_filter == 0.0
    assert job.planned == Composition((SampledGaussian(30 / 600, 1.0, 4),))
