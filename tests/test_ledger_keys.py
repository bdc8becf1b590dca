"""The history key apart from the data (a file, an environment variable, a secrets manager's command), a server that
will not start with its key beside its database, and heads signed with Ed25519 that a tenant checks with the public
key alone."""

import json
import shlex
import sqlite3
import sys

import pytest

from accounting.ledger.callers import ADMIN
from accounting.ledger.errors import FailedPrecondition, InvalidArgument
from accounting.ledger.service import start_server
from accounting.ledger.store import (
    HistoryKeySource,
    Ledger,
    history_key_source,
    load_history_key,
    load_public_key,
    load_signing_key,
    new_signing_key,
    open_embedded_ledger,
    served_key_placement_problem,
)
from accounting.ledger.verification import SignedHead, head_signature_findings
from orchestrator.cli import main

ADMIN_TOKEN = "admin-token-for-tests-0123456789"
KEY_HEX = "0123456789abcdef" * 4
# A secrets manager's client, as the operator would name it: prints the key, or fails.
PRINT_KEY = f"{shlex.quote(sys.executable)} -c 'print(\"{KEY_HEX}\")'"


def run(capsys, *argv):
    """Run one ledger command the way `dpfleet` does; return (exit status, stdout, stderr)."""
    status = main(list(argv))
    captured = capsys.readouterr()
    return status, captured.out, captured.err


@pytest.fixture
def key_file(tmp_path):
    path = tmp_path / "keys" / "history.key"
    path.parent.mkdir()
    path.write_text(KEY_HEX + "\n")
    path.chmod(0o600)
    return path


def test_a_file_an_environment_variable_and_a_command_give_the_same_key(key_file, monkeypatch):
    monkeypatch.setenv("LEDGER_HISTORY_KEY", f"  {KEY_HEX}\n")
    sources = [
        history_key_source(file=key_file),
        history_key_source(env="LEDGER_HISTORY_KEY"),
        history_key_source(command=PRINT_KEY),
    ]
    assert [load_history_key(source) for source in sources] == [bytes.fromhex(KEY_HEX)] * 3
    assert load_history_key(key_file) == bytes.fromhex(KEY_HEX)  # a path is a file source
    assert history_key_source() is None  # the default file


def test_a_ledger_chained_under_the_file_is_verified_under_the_same_key_from_elsewhere(tmp_path, key_file, monkeypatch):
    with Ledger(tmp_path / "ledger.db", caller=ADMIN, history_key_file=key_file) as ledger:
        ledger.create_tenant("acme")
        ledger.create_dataset("acme/mnist", 2.0, 1e-5)
    monkeypatch.setenv("LEDGER_HISTORY_KEY", KEY_HEX)
    for source in (history_key_source(env="LEDGER_HISTORY_KEY"), history_key_source(command=PRINT_KEY)):
        with Ledger(tmp_path / "ledger.db", caller=ADMIN, history_key_file=source) as ledger:
            assert ledger.verify(full=True).findings == ()
            ledger.create_dataset(f"acme/more-{source.kind}", 1.0, 1e-5)  # a change checks the key first
    monkeypatch.setenv("LEDGER_HISTORY_KEY", "ab" * 32)
    with pytest.raises(FailedPrecondition, match=r"not chained with the history key \$LEDGER_HISTORY_KEY"):
        with Ledger(tmp_path / "ledger.db", caller=ADMIN,
                    history_key_file=history_key_source(env="LEDGER_HISTORY_KEY")) as ledger:
            ledger.create_dataset("acme/other", 1.0, 1e-5)


def test_each_key_source_fails_with_what_was_wrong_and_never_the_key(monkeypatch):
    monkeypatch.delenv("NO_SUCH_KEY", raising=False)
    with pytest.raises(FailedPrecondition, match="environment variable NO_SUCH_KEY is not set"):
        load_history_key(HistoryKeySource("env", "NO_SUCH_KEY"))
    monkeypatch.setenv("SHORT_KEY", "abcd")
    with pytest.raises(FailedPrecondition, match=r"history key \$SHORT_KEY is not 64 hex digits"):
        load_history_key(HistoryKeySource("env", "SHORT_KEY"))
    failing = f"{shlex.quote(sys.executable)} -c 'import sys; print(\"ab\" * 32); sys.exit(\"vault: sealed\")'"
    with pytest.raises(FailedPrecondition, match="exited with status 1; it said: vault: sealed") as failed:
        load_history_key(HistoryKeySource("command", failing))
    assert "abab" not in str(failed.value)  # what it printed on its standard output is never shown
    with pytest.raises(FailedPrecondition, match="is not 64 hex digits"):
        load_history_key(HistoryKeySource("command", f"{shlex.quote(sys.executable)} -c 'print(\"not a key\")'"))
    with pytest.raises(FailedPrecondition, match="it cannot run"):
        load_history_key(HistoryKeySource("command", "/no/such/secrets-manager get ledger"))
    with pytest.raises(FailedPrecondition, match="cannot be split into words"):
        load_history_key(HistoryKeySource("command", "vault read 'unclosed"))


def test_a_command_runs_without_a_shell(tmp_path):
    marker = tmp_path / "injected"
    with pytest.raises(FailedPrecondition):
        load_history_key(HistoryKeySource("command", f"echo {KEY_HEX}; touch {marker}"))
    assert not marker.exists()


def test_the_key_comes_from_one_place(capsys, key_file):
    with pytest.raises(InvalidArgument, match="from one place.*got file, env"):
        history_key_source(file=key_file, env="LEDGER_HISTORY_KEY")
    with pytest.raises(SystemExit) as refused:
        main(["ledger", "verify", "--history-key", str(key_file), "--history-key-command", "x"])
    assert refused.value.code == 2 and "not allowed with argument --history-key" in capsys.readouterr().err


def test_a_server_refuses_its_key_beside_its_database_unless_told(tmp_path, monkeypatch):
    database = tmp_path / "ledger.db"
    beside = tmp_path / "ledger-history.key"
    for key in (None, beside):  # the default file; a file in the database's folder
        with pytest.raises(FailedPrecondition, match="does not start.*--history-key-env VAR.*--allow-key-beside"):
            start_server(database, "127.0.0.1", 0, ADMIN_TOKEN, history_key_file=key)
    assert not database.exists() and not beside.exists()  # refused before anything was opened or created
    monkeypatch.setenv("LEDGER_HISTORY_KEY", KEY_HEX)
    for key, allowed in ((beside, True), (history_key_source(env="LEDGER_HISTORY_KEY"), False)):
        running = start_server(database, "127.0.0.1", 0, ADMIN_TOKEN, history_key_file=key,
                               allow_key_beside_database=allowed)
        running.stop(grace_seconds=0.1)


def test_a_ledger_on_postgresql_needs_its_key_named_whatever_the_flag(tmp_path):
    url = "postgresql://ledger@db.internal:5432/ledger"
    for allowed in (False, True):
        assert "on PostgreSQL needs its history key named" in served_key_placement_problem(None, url, True, allowed)
    assert served_key_placement_problem(tmp_path / "key", url, True) is None
    assert served_key_placement_problem(HistoryKeySource("command", "vault read ledger"), url, True) is None


def test_dpfleet_ledger_serve_says_why_it_refuses_and_what_else_to_do(capsys, tmp_path):
    status, _, err = run(capsys, "ledger", "serve", "--db", str(tmp_path / "ledger.db"), "--port", "0")
    assert status == 2
    assert "the history key is the default" in err and "--history-key-command 'CMD'" in err
    assert "docs/ledger.md, 'Where the history key lives'" in err


def test_the_embedded_ledger_needs_no_flag():
    with open_embedded_ledger() as ledger:
        ledger.create_dataset("mnist", 2.0, 1e-5)
        assert ledger.verify().findings == ()


@pytest.fixture
def signing_key(tmp_path):
    private = tmp_path / "operator" / "head-signing"
    private.parent.mkdir()
    public = new_signing_key(private)
    return private, public


def test_a_new_signing_key_is_its_owners_only_and_never_overwritten(signing_key):
    private, public = signing_key
    assert private.stat().st_mode & 0o777 == 0o600 and public == private.with_name("head-signing.pub")
    assert load_signing_key(private).public_key() == load_public_key(public)
    with pytest.raises(FailedPrecondition, match="never written over"):
        new_signing_key(private)
    private.chmod(0o644)
    with pytest.raises(FailedPrecondition, match="may be read or written by others"):
        load_signing_key(private)


def test_a_tenant_checks_a_signed_head_with_the_public_key_alone(signing_key):
    private, public = signing_key
    with open_embedded_ledger() as ledger:
        ledger.create_dataset("mnist", 2.0, 1e-5)
        head = ledger.head(load_signing_key(private))
    kept = SignedHead.from_dict(json.loads(json.dumps(head.to_dict())))
    assert kept == head and kept.scheme == "ed25519"
    assert head_signature_findings(kept, None, load_public_key(public)) == []


def forged(head: SignedHead, **changes) -> SignedHead:
    return SignedHead.from_dict({**head.to_dict(), **changes})


def test_an_edited_or_forged_head_is_a_finding(signing_key, tmp_path):
    private, public = signing_key
    other_public = new_signing_key(tmp_path / "someone-else")
    with open_embedded_ledger() as ledger:
        ledger.create_dataset("mnist", 2.0, 1e-5)
        head = ledger.head(load_signing_key(private))
        hmac_head = ledger.head()  # signed with the history key: whoever holds it can make one
        by_another = ledger.head(load_signing_key(tmp_path / "someone-else"))
        public_key = load_public_key(public)
        assert ledger.verify(head, head_public_key=public_key).findings == ()
        cases = {
            "its signature does not match the public key": [
                forged(head, entries=head.entries - 1), forged(head, head_hash="0" * 64),
                forged(head, at="2030-01-01T00:00:00.000+00:00"), forged(head, signature="00" * 64),
                forged(by_another, public_key=head.public_key),
            ],
            "names another signing key than the public key": [by_another],
            "signed with hmac-sha256, not Ed25519": [hmac_head],
        }
        for problem, heads in cases.items():
            for kept in heads:
                findings = ledger.verify(kept, head_public_key=public_key).findings
                assert [finding.row for finding in findings] == ["head file"], (problem, kept)
                assert problem in findings[0].problem
        assert ledger.verify(by_another, head_public_key=load_public_key(other_public)).findings == ()
        with pytest.raises(InvalidArgument, match="check it with its signer's public key"):
            ledger.verify(head)


def test_a_history_cut_below_a_kept_head_is_a_finding(capsys, signing_key, tmp_path):
    private, public = signing_key
    database = tmp_path / "dpfleet-home" / "ledger.db"
    with open_embedded_ledger() as ledger:
        ledger.create_dataset("mnist", 2.0, 1e-5)
        ledger.create_dataset("cifar", 2.0, 1e-5)
    head_file = tmp_path / "tenant" / "head.json"
    head_file.parent.mkdir()
    status, out, _ = run(capsys, "ledger", "head", "--signing-key", str(private))
    assert status == 0
    head_file.write_text(out)
    status, out, _ = run(capsys, "ledger", "verify", "--head", str(head_file), "--public-key", str(public))
    assert status == 0 and "no findings" in out
    with sqlite3.connect(database) as connection:
        connection.execute("DROP TRIGGER history_is_append_only_delete")
        connection.execute("DELETE FROM history WHERE id = (SELECT MAX(id) FROM history)")
    status, out, _ = run(capsys, "ledger", "verify", "--head", str(head_file), "--public-key", str(public))
    kept = json.loads(head_file.read_text())["entries"]
    assert status == 1
    assert f"signed head: the history has {kept - 1} entries; at " in out and "entries were cut from its tail" in out
    status, _, err = run(capsys, "ledger", "verify", "--public-key", str(public))
    assert status == 2 and "give the head too" in err
