"""A dataset's rows get one budget, whatever it is called: a job binds the files it reads to its dataset, on a
served ledger as on the embedded one, and the ledger refuses files that another dataset holds."""

import pytest

from accounting.ledger.client import RemoteLedger
from accounting.ledger.errors import FailedPrecondition, InvalidArgument
from accounting.ledger.service import start_server
from accounting.ledger.store import admission as store_admission
from accounting.ledger.store import open_embedded_ledger
from orchestrator.errors import UsageError
from orchestrator.ledger_session import bind_dataset_content
from tests.test_ledger_blocks import parquet_blocks
from workers.fingerprints import dataset_identity, file_digests

ADMIN_TOKEN = "admin-token-for-content-tests-0123"
DELTA = 1e-5


@pytest.fixture
def served(tmp_path):
    """A served ledger (its history key in a folder of its own) with tenants acme and globex; yields their clients."""
    (tmp_path / "key").mkdir()
    running = start_server(tmp_path / "ledger.db", "127.0.0.1", 0, ADMIN_TOKEN,
                           history_key_file=tmp_path / "key" / "history.key")
    with RemoteLedger(running.address, ADMIN_TOKEN) as admin:
        tokens = {tenant: admin.create_tenant(tenant).token for tenant in ("acme", "globex")}
    clients = {tenant: RemoteLedger(running.address, token) for tenant, token in tokens.items()}
    try:
        yield clients
    finally:
        for client in clients.values():
            client.close()
        running.stop(grace_seconds=1.0)


def test_a_served_dataset_binds_its_files_on_first_use_and_no_other_name_gets_them(served, tmp_path):
    """The reproduction: datasets created on a served ledger carried no content, so a tenant could train the same
    files under a second dataset, with a budget of its own, and another tenant under a third."""
    locations, _ = parquet_blocks(tmp_path / "d", {"day1": 20, "day2": 20})
    copied = tmp_path / "copy"
    copied.mkdir()
    for shard in sorted((tmp_path / "d" / "day1").iterdir()):
        (copied / shard.name).write_bytes(shard.read_bytes())
    day1 = {"format": "parquet", "train": locations["day1"]}
    acme, globex = served["acme"], served["globex"]
    for name in ("day1", "again", "day2"):
        acme.create_dataset(name, 2.0, DELTA)
    globex.create_dataset("theirs", 2.0, DELTA)

    bind_dataset_content(acme, "day1", file_digests(day1))  # first use binds
    copy = file_digests({"format": "parquet", "train": str(copied)})
    bind_dataset_content(acme, "day1", copy)  # the same bytes elsewhere: its own
    with pytest.raises(UsageError, match="already dataset acme/day1's"):
        bind_dataset_content(acme, "again", copy)
    with pytest.raises(UsageError, match="already another tenant's dataset's") as refused:
        bind_dataset_content(globex, "theirs", file_digests(day1))
    assert "day1" not in str(refused.value) and "acme" not in str(refused.value)  # not named to another tenant
    both = file_digests({"format": "parquet", "train": [locations["day1"], locations["day2"]]})
    with pytest.raises(UsageError, match="not dataset 'day1''s"):  # new files are another dataset, or a block
        bind_dataset_content(acme, "day1", both)
    bind_dataset_content(acme, "day2", file_digests({"format": "parquet", "train": locations["day2"]}))
    bind_dataset_content(acme, "day2", file_digests("mnist"))  # a built-in dataset's name says it: nothing to bind

    # A run reads its files once: its identity takes the digests it binds.
    assert dataset_identity(day1, file_digests(day1)) == dataset_identity(day1)
    binds = [entry for entry in acme.history("day1") if entry.action == "bind_content"]
    assert len(binds) == 1 and binds[0].details["content"] == sorted(file_digests(day1))
    with pytest.raises(FailedPrecondition):  # the raw call, as any client could send it
        globex.bind_content("theirs", file_digests(day1))
    with pytest.raises(InvalidArgument, match="SHA-256s"):
        acme.bind_content("again", ["not a digest"])


def test_verify_finds_the_same_files_bound_to_two_datasets_by_a_ledger_that_did_not_check(tmp_path, monkeypatch):
    locations, _ = parquet_blocks(tmp_path / "d", {"day1": 20})
    content = file_digests({"format": "parquet", "train": locations["day1"]})
    with open_embedded_ledger(tmp_path / "ledger.db") as ledger:
        ledger.create_dataset("first", 2.0, DELTA)
        ledger.create_dataset("second", 2.0, DELTA)
        ledger.bind_content("first", content)
        assert ledger.verify().findings == ()
        # A ledger that did not check:
        monkeypatch.setattr(store_admission, "content_holder", lambda *args, **kwargs: None)
        ledger.bind_content("second", content)
        (finding,) = ledger.verify(full=True).findings
    assert finding.dataset == "local/second" and "dataset 'local/first' holds already" in finding.problem
    assert "the same rows under two budgets" in finding.problem
