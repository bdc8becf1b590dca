"""Changes of authority are history, and migrations never launder: the attacks of someone who can write the
ledger's database but does not hold the history key, each a finding of verify or a refusal to open naming it."""

import json
import sqlite3

import pytest

from accounting.ledger.callers import ADMIN
from accounting.ledger.errors import FailedPrecondition
from accounting.ledger.store import SCHEMA_VERSION, Ledger, load_history_key, open_embedded_ledger, rekey_ledger
from accounting.ledger.tokens import admin_key_id, token_digest
from accounting.ledger.verification import history_hash
from orchestrator.cli import main
from tests.test_ledger_store import (
    FIRST,
    LATER_TABLES,
    as_unkeyed_version,
    findings,
    rechain_without_the_key,
    spent_some,
    without_history_triggers,
)

ADMIN_TOKEN = "configured-admin-token-0123456789"


@pytest.fixture
def ledger(tmp_path):
    with open_embedded_ledger(tmp_path / "ledger.db") as opened:
        yield opened


def three_jobs(ledger):
    """A dataset with three released jobs; returns the middle one's reservation id."""
    ledger.create_dataset("mnist", 10.0, 1e-5)
    jobs = []
    for name in ("first", "middle", "last"):
        job = ledger.reserve("mnist", name, FIRST.with_steps(100))
        ledger.commit(job.reservation_id, 100, 0)
        ledger.release(job.reservation_id)
        jobs.append(job.reservation_id)
    return jobs[1]


def cut_a_job(connection, reservation_id):
    """Delete a job's entries from the middle of the history and renumber the entries after, and its rows."""
    connection.execute("DELETE FROM history WHERE details LIKE ?", (f"%{reservation_id}%",))
    for new_id, (old_id,) in enumerate(connection.execute("SELECT id FROM history ORDER BY id").fetchall(), 1):
        connection.execute("UPDATE history SET id = ? WHERE id = ?", (new_id, old_id))
    connection.execute("DELETE FROM commits WHERE reservation_id = ?", (reservation_id,))
    connection.execute("DELETE FROM reservations WHERE id = ?", (reservation_id,))


def refusal(path):
    with pytest.raises(FailedPrecondition) as refused:
        Ledger(path)
    return str(refused.value)


def version_of(path):
    with sqlite3.connect(path) as connection:
        return connection.execute("SELECT version FROM schema_version").fetchone()[0]


# ------------------------------------------------------------ migrations never launder


def test_a_job_cut_from_a_rebuilt_plain_chain_claiming_version_8_is_refused_by_open_and_by_verify(ledger, capsys):
    middle = three_jobs(ledger)
    with without_history_triggers(ledger.path) as connection:
        cut_a_job(connection, middle)
        rechain_without_the_key(connection)
        connection.execute("UPDATE schema_version SET version = 8")
        connection.execute("DELETE FROM verified_state")
    refused = refusal(ledger.path)
    assert refused.startswith(f"the ledger {ledger.path} says schema version 8, but it holds the table composed_pld, "
                              "which schema version 10 and later create; it holds the table verified_state, which "
                              "schema version 11 and later create; it holds the table plans, which schema version 13 "
                              "and later create; it holds the table plan_jobs, which schema version 13 and later "
                              f"create; its history entry 1 (create_ledger) records "
                              f"schema version {SCHEMA_VERSION}: it was changed by hand")
    assert version_of(ledger.path) == 8  # nothing was migrated
    for full in ([], ["--full"]):
        assert main(["ledger", "verify", "--db", str(ledger.path), *full]) == 2
        assert "says schema version 8, but it holds the table composed_pld" in capsys.readouterr().err


def test_a_file_stripped_to_look_like_version_8_is_caught_by_a_head_kept_elsewhere(ledger):
    middle = three_jobs(ledger)
    head = ledger.head()
    # Past what the file can show: every table and entry of later versions gone, the chain rebuilt unkeyed.
    with without_history_triggers(ledger.path) as connection:
        cut_a_job(connection, middle)
    as_unkeyed_version(ledger.path, 8)
    # Opening it does not key it: a keyed ledger that now reads as version 8 must be keyed on purpose.
    with pytest.raises(FailedPrecondition, match="schema version 8, whose history is chained without the history"):
        open_embedded_ledger(ledger.path)
    rekey_ledger(ledger.path)  # an operator who takes it for an old file
    with open_embedded_ledger(ledger.path) as migrated:
        problems = [str(finding) for finding in migrated.verify(head).findings]
    # The file alone cannot show it (its rows are not rolled back here, which replays would see); the head can.
    assert any(problem.startswith("signed head: the history has") for problem in problems)


def test_a_keyed_history_claiming_version_11_to_migrate_a_forged_admin_token_into_its_history_is_refused(ledger):
    spent_some(ledger)
    with sqlite3.connect(ledger.path) as connection:
        connection.execute("INSERT INTO admin_tokens (key_id, token_hash, created_at) VALUES (?, ?, '')",
                           (admin_key_id(ADMIN_TOKEN), token_digest(ADMIN_TOKEN)))
        connection.execute("UPDATE schema_version SET version = 11")
        connection.execute("DELETE FROM verified_state")
    assert f"its history entry 1 (create_ledger) records schema version {SCHEMA_VERSION}" in refusal(ledger.path)


def test_a_lowered_version_with_the_keyed_state_kept_is_refused_naming_the_state(ledger):
    spent_some(ledger)
    with sqlite3.connect(ledger.path) as connection:
        connection.execute("UPDATE schema_version SET version = 11")
    assert (f"its verified state, under the history key, was kept at schema version {SCHEMA_VERSION}"
            in refusal(ledger.path))


def test_a_keyed_history_claiming_a_version_before_the_key_is_refused_naming_its_keyed_entries(ledger):
    spent_some(ledger)
    entries = len(ledger.history())
    with sqlite3.connect(ledger.path) as connection:
        for since, tables in LATER_TABLES.items():
            for table in tables.split() if since > 8 else ():
                connection.execute(f"DROP TABLE {table}")
        connection.execute("UPDATE schema_version SET version = 8")
    assert (f"{entries} of its {entries} history entries carry an HMAC under the history key, which only schema "
            "version 9 and later write") in refusal(ledger.path)


def as_keyed_version_11(path, admin_tokens=()):
    """The file as schema version 11 left it, made with the key: admin tokens kept with no history entry, no entry
    recording a creation, no kept state."""
    key = load_history_key()
    with without_history_triggers(path) as connection:
        connection.execute("DELETE FROM history WHERE action = 'create_ledger'")
        for token in admin_tokens:
            connection.execute("INSERT INTO admin_tokens (key_id, token_hash, created_at) VALUES (?, ?, '')",
                               (admin_key_id(token), token_digest(token)))
        previous = ""
        for row in connection.execute(
            "SELECT id, at, actor, action, tenant, dataset_id, details FROM history ORDER BY id"
        ).fetchall():
            entry_hash = history_hash(previous, *row, key)
            connection.execute("UPDATE history SET previous_hash = ?, hash = ? WHERE id = ?",
                               (previous, entry_hash, row[0]))
            previous = entry_hash
        connection.execute("DELETE FROM verified_state")
        for table in LATER_TABLES[13].split():
            connection.execute(f"DROP TABLE {table}")
        connection.execute("UPDATE schema_version SET version = 11")


def test_a_version_11_file_migrates_adopting_its_admin_tokens_and_verifies_clean(ledger):
    spent_some(ledger)
    as_keyed_version_11(ledger.path, [ADMIN_TOKEN])
    with open_embedded_ledger(ledger.path) as migrated:
        adopted, migration = migrated.history()[-2:]
        assert (adopted.action, migration.action) == ("adopt_admin_tokens", "migrate_schema")
        assert [token["key_id"] for token in adopted.details["admin_tokens"]] == [admin_key_id(ADMIN_TOKEN)]
        assert ADMIN_TOKEN not in json.dumps(adopted.details) and migration.details == {"from": 11, "to": SCHEMA_VERSION}
        assert migrated.verify().findings == ()
        assert migrated.authenticate(ADMIN_TOKEN).admin


def test_a_version_11_file_with_an_edited_entry_is_refused_and_migrated_only_by_rekey_which_records_it(ledger):
    spent_some(ledger)
    as_keyed_version_11(ledger.path)
    with without_history_triggers(ledger.path) as connection:
        connection.execute("UPDATE history SET actor = 'someone else' WHERE action = 'release'")
    assert "its history's chain, checked as schema version 11 chained it, has 1 finding(s)" in refusal(ledger.path)
    with pytest.raises(FailedPrecondition, match="run dpfleet ledger rekey --accept-findings"):
        rekey_ledger(ledger.path)
    assert main(["ledger", "rekey", "--db", str(ledger.path), "--accept-findings"]) == 0
    with open_embedded_ledger(ledger.path) as migrated:
        (accepted,) = migrated.history()[-1].details["accepted_findings"]
        assert "its fields do not match its hash (the row was edited)" in accepted
        (reported,) = migrated.verify().findings  # what was accepted stays a finding
        assert reported.problem == f"an admin accepted, when it was migrated or re-keyed as it was: {accepted}"


def test_rekey_moves_a_history_to_a_new_key_and_refuses_one_that_does_not_hold_under_the_old(ledger, tmp_path):
    spent_some(ledger)
    old_key = tmp_path / "dpfleet-home" / "ledger-history.key"
    new_key = tmp_path / "new.key"
    entries = len(ledger.history())
    with pytest.raises(FailedPrecondition, match=f"has {entries} finding"):  # each entry: the key never chained it
        rekey_ledger(ledger.path, new_key)
    assert rekey_ledger(ledger.path, new_key, old_key) == []
    with Ledger(ledger.path, caller=ADMIN, history_key_file=new_key) as rekeyed:
        assert rekeyed.history()[-1].details["another_key"] is True
        assert rekeyed.verify().findings == ()


# ------------------------------------------------------------ every change of authority is history


@pytest.fixture
def served(ledger):
    """The ledger as a server started with ADMIN_TOKEN keeps it; returns the admin caller of that token."""
    ledger.register_admin_token(ADMIN_TOKEN)
    ledger.register_admin_token(ADMIN_TOKEN)  # started again: recorded once
    return ledger.authenticate(ADMIN_TOKEN)


def test_admin_tokens_registered_rotated_and_revoked_are_entries_naming_key_ids_and_no_secret(ledger, served):
    rotated = ledger.rotate_token(caller=served)
    new_admin = ledger.authenticate(rotated.token)
    second = ledger.rotate_token(caller=new_admin)
    third = ledger.authenticate(second.token)
    tenant = ledger.create_tenant("acme", caller=third)
    ledger.revoke_token("acme", caller=third)
    entries = [entry for entry in ledger.history() if "token" in entry.action or entry.action == "create_tenant"]
    assert [(entry.action, entry.details.get("key_id"), entry.details["actor_key_id"]) for entry in entries] == [
        ("create_tenant", None, None),  # the embedded ledger's tenant 'local', made by the local admin
        ("register_admin_token", served.key_id, served.key_id),
        ("rotate_token", new_admin.key_id, served.key_id),
        ("rotate_token", third.key_id, new_admin.key_id),
        ("create_tenant", tenant.token.split("_")[1], third.key_id),
        ("revoke_token", tenant.token.split("_")[1], third.key_id),
    ]
    history = json.dumps([entry.details for entry in ledger.history()])
    assert all(secret not in history for secret in (ADMIN_TOKEN, rotated.token, second.token, tenant.token))
    assert ledger.verify().findings == ()


def test_an_admin_token_inserted_by_hand_works_but_verify_names_it_and_the_budget_it_raised(ledger, served):
    ledger.create_dataset("mnist", 2.0, 1e-5)
    forged = "forged-admin-token-9876543210abcdef"
    with sqlite3.connect(ledger.path) as connection:
        connection.execute("INSERT INTO admin_tokens (key_id, token_hash, created_at) VALUES (?, ?, '')",
                           (admin_key_id(forged), token_digest(forged)))
    mallory = Ledger(ledger.path).authenticate(forged)
    ledger.raise_budget("local/mnist", 9999.0, caller=mallory)
    assert ledger.history()[-1].details["actor_key_id"] == admin_key_id(forged)
    assert findings(ledger) == [f"admin token: {admin_key_id(forged)} has a row but no history"]


def test_a_revoked_admin_token_revived_by_hand_or_swapped_is_a_finding(ledger, served):
    rotated = ledger.rotate_token(caller=served)
    assert ledger.verify().findings == ()
    with sqlite3.connect(ledger.path) as connection:
        connection.execute("UPDATE admin_tokens SET revoked_at = NULL WHERE key_id = ?", (served.key_id,))
        connection.execute("UPDATE admin_tokens SET token_hash = ? WHERE key_id = ?",
                           (token_digest("another-admin-token-000000000000"), admin_key_id(rotated.token)))
    assert sorted(findings(ledger)) == sorted([
        f"admin token: {admin_key_id(rotated.token)}: its token is not the one its history records (a token was "
        "swapped in the table)",
        f"admin token: {served.key_id}: its history revoked it, but its row is live (its revocation was cleared)",
    ])
