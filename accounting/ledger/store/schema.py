"""The ledger's SQL schema, and the steps that bring a file of an older schema version up to this one.

The statements are written once, in the SQL both kinds of database read
(`Database.types` fills in the type names that differ); a new ledger is
created at SCHEMA_VERSION, an older one is migrated in the transaction that
opens it, recorded in its history.

A migration never launders: it first checks the file as the version it
claims wrote it (`_before_migrating`: the chain under that version's rules,
no table or history entry of a later version, no keyed state of a later
version) and refuses, naming what it found. A new ledger and each migration
keep the schema version and the history's head under the history key (the
sealed verified state), so from then on a version number lowered by hand is
a refusal. Re-chaining a history under a key (`rekey_history`, dpfleet
ledger rekey) is an explicit admin command that records an entry.
"""

from __future__ import annotations

import json

from accounting.ledger.admission import AdmissionRule, RdpTally, fits_budget
from accounting.ledger.callers import Caller
from accounting.ledger.databases import Connection, Database
from accounting.ledger.errors import FailedPrecondition
from accounting.ledger.scheduling import SchedulingPolicy
from accounting.ledger.store.history import HistoryChain, by_key
from accounting.ledger.store.local import local_user
from accounting.ledger.store.transactions import Transactions
from accounting.ledger.store.verification import keep_sealed_state
from accounting.ledger.verification import (
    ANCHOR_ACTION,
    SEALED_SINCE_VERSION,
    StoredEntry,
    chain_findings,
    history_hash,
    sealed_version,
    stored_token_digest,
)

# Version 13 added pre-registered plans (`_PLAN_TABLES`).
SCHEMA_VERSION = 13
# The first schema version whose history entries carry an HMAC under the history key.
KEYED_SINCE_VERSION = 9

# The tables each schema version created: a file that says it is older than one of them and holds it was written
# by a later version.
_TABLES_SINCE = {
    5: ("tenant_use",),
    6: ("queued_jobs",),
    8: ("admin_tokens", "token_generation"),
    10: ("composed_pld",),
    11: ("verified_state",),
    13: ("plans", "plan_jobs"),
}

# The indexes each listing reads in order (schema version 10), so that its time follows what it lists, not the
# whole history: a dataset's last history entries, as the admin or one tenant sees them; a dataset's jobs, of
# any state or of one, oldest first ({order_key} is the insertion order where it is not the rowid, PostgreSQL);
# a dataset's queue in its order; a dataset's blocks.
_LISTING_INDEXES = (
    "CREATE INDEX IF NOT EXISTS history_by_dataset_and_tenant ON history (dataset_id, tenant, id)",
    "CREATE INDEX IF NOT EXISTS reservations_by_dataset_in_order ON reservations (dataset_id{order_key})",
    "CREATE INDEX IF NOT EXISTS reservations_by_dataset ON reservations (dataset_id, state{order_key})",
    "CREATE INDEX IF NOT EXISTS queued_jobs_in_position ON queued_jobs (dataset_id, state, position, created_at, id)",
    "CREATE INDEX IF NOT EXISTS blocks_by_dataset ON datasets (block_of, block)",
)

# Each budget's composed PLD as last kept (schema version 10; see store/composed.py): a cache of a report.
_COMPOSED_PLD = """CREATE TABLE IF NOT EXISTS composed_pld (
        budget_id {integer} PRIMARY KEY REFERENCES datasets(id),
        state {bytes} NOT NULL,
        at TEXT NOT NULL
    )"""

# The replays' state at the last entry a verify found nothing wrong up to (schema version 11; see
# verification/verified.py): one row, carrying an HMAC under the history key.
_VERIFIED_STATE = """CREATE TABLE IF NOT EXISTS verified_state (
        id {integer} PRIMARY KEY CHECK (id = 1),
        state {bytes} NOT NULL,
        at TEXT NOT NULL
    )"""

_LEASE_INDEX = (
    "CREATE INDEX leases_by_expiry ON reservations (expires_at) WHERE state = 'active' AND expires_at IS NOT NULL"
)

_ONE_ACTIVE_RESERVATION_PER_JOB = (
    "CREATE UNIQUE INDEX one_active_reservation_per_job ON reservations (dataset_id, tenant, job_id) "
    "WHERE state = 'active'"
)
# A tenant's tally on one budget (a dataset or a block), and its quota there when an admin set one.
_TENANT_USE = """CREATE TABLE tenant_use (
        budget_id {integer} NOT NULL REFERENCES datasets(id),
        tenant TEXT NOT NULL REFERENCES tenants(name),
        quota_epsilon {float},
        quota_rule TEXT,
        held_rdp TEXT NOT NULL,
        committed_events TEXT NOT NULL,
        PRIMARY KEY (budget_id, tenant)
    )"""

# Jobs waiting for budget (schema version 6); `position` and `reason` are what the last scheduling pass said,
# `conversion` what the `reserve` entry of its admission records of a job charged other events than its own.
_QUEUE_TABLES = (
    """CREATE TABLE queued_jobs (
        id TEXT PRIMARY KEY,
        dataset_id {integer} NOT NULL REFERENCES datasets(id),
        job_id TEXT NOT NULL,
        tenant TEXT NOT NULL,
        blocks TEXT NOT NULL,
        planned_events TEXT NOT NULL,
        conversion TEXT NOT NULL,
        priority {integer} NOT NULL,
        lease_seconds {float},
        created_at TEXT NOT NULL,
        deadline TEXT,
        state TEXT NOT NULL CHECK (state IN ('queued', 'admitted', 'cancelled', 'timed_out')),
        position {integer} NOT NULL DEFAULT 0,
        reason TEXT NOT NULL DEFAULT '',
        reservation_id TEXT REFERENCES reservations(id),
        ended_at TEXT
    )""",
    "CREATE INDEX queued_jobs_by_dataset ON queued_jobs (dataset_id, state, created_at)",
)

# Admin tokens kept by the ledger (schema version 7): those the servers were started with and those rotated
# in, each as its SHA-256 digest (tokens.token_digest); a revoked one keeps its row, so a server started again
# with it still refuses it. `token_generation` counts rotations and revocations: a server re-reads it at
# most TOKEN_RECHECK_SECONDS after it last did, and forgets the tokens it had verified when it changed.
_TOKEN_TABLES = (
    """CREATE TABLE admin_tokens (
        key_id TEXT PRIMARY KEY,
        token_hash {bytes} NOT NULL,
        created_at TEXT NOT NULL,
        revoked_at TEXT
    )""",
    "CREATE TABLE token_generation (generation {integer} NOT NULL)",
    "INSERT INTO token_generation (generation) VALUES (0)",
)

# Pre-registered plans (schema version 13): each plan a dataset's pool admitted, with its jobs' charged events
# (a JSON list of compositions), the (epsilon, delta) it was charged and how many of its jobs have started; and,
# per job of a plan that started, its reservation and its place in the plan.
_PLAN_TABLES = (
    """CREATE TABLE plans (
        dataset_id {integer} NOT NULL REFERENCES datasets(id),
        name TEXT NOT NULL,
        tenant TEXT NOT NULL,
        jobs TEXT NOT NULL,
        epsilon {float} NOT NULL,
        delta {float} NOT NULL,
        started_jobs {integer} NOT NULL DEFAULT 0,
        created_at TEXT NOT NULL,
        PRIMARY KEY (dataset_id, name)
    )""",
    """CREATE TABLE plan_jobs (
        reservation_id TEXT PRIMARY KEY REFERENCES reservations(id),
        dataset_id {integer} NOT NULL,
        plan TEXT NOT NULL,
        job_index {integer} NOT NULL,
        UNIQUE (dataset_id, plan, job_index)
    )""",
)

# The schema in the SQL both kinds of database read; Database.types fills in the names of types that differ.
_TABLES = (
    "CREATE TABLE schema_version (version {integer} NOT NULL)",
    """CREATE TABLE tenants (
        name TEXT PRIMARY KEY,
        key_id TEXT UNIQUE,
        token_salt {bytes},
        token_hash {bytes},
        created_at TEXT NOT NULL
    )""",
    """CREATE TABLE datasets (
        id {dataset_id},
        tenant TEXT NOT NULL REFERENCES tenants(name),
        name TEXT NOT NULL,
        budget_epsilon {float} NOT NULL,
        delta {float} NOT NULL,
        held_rdp TEXT NOT NULL,
        committed_events TEXT NOT NULL,
        created_at TEXT NOT NULL,
        released_jobs {integer} NOT NULL DEFAULT 0,
        admission_rule TEXT NOT NULL,
        privacy_unit TEXT NOT NULL DEFAULT 'example',
        block_of {integer} REFERENCES datasets(id),
        block TEXT,
        scheduling TEXT NOT NULL DEFAULT '{fcfs}',
        arrived_jobs {integer} NOT NULL DEFAULT 0,
        block_data TEXT,
        UNIQUE (tenant, name)
    )""",
    """CREATE TABLE reservations (
        id TEXT PRIMARY KEY,
        dataset_id {integer} NOT NULL REFERENCES datasets(id),
        job_id TEXT NOT NULL,
        planned_events TEXT NOT NULL,
        committed_steps {integer} NOT NULL,
        state TEXT NOT NULL CHECK (state IN ('active', 'released')),
        created_at TEXT NOT NULL,
        released_at TEXT,
        lease_seconds {float},
        expires_at TEXT,
        lease_expired {integer} NOT NULL DEFAULT 0,
        tenant TEXT NOT NULL,
        blocks TEXT NOT NULL DEFAULT '[]'{order_column}
    )""",
    _ONE_ACTIVE_RESERVATION_PER_JOB,
    _LEASE_INDEX,
    """CREATE TABLE commits (
        reservation_id TEXT NOT NULL REFERENCES reservations(id),
        sequence {integer} NOT NULL,
        steps {integer} NOT NULL,
        committed_steps {integer} NOT NULL,
        at TEXT NOT NULL,
        PRIMARY KEY (reservation_id, sequence)
    )""",
    """CREATE TABLE history (
        id {history_id},
        at TEXT NOT NULL,
        actor TEXT NOT NULL,
        action TEXT NOT NULL,
        tenant TEXT,
        dataset_id {integer} REFERENCES datasets(id),
        details TEXT NOT NULL,
        previous_hash TEXT NOT NULL,
        hash TEXT NOT NULL
    )""",
    "CREATE INDEX history_by_tenant ON history (tenant, id)",
    "CREATE INDEX history_by_dataset ON history (dataset_id, id)",
    _TENANT_USE,
    *_QUEUE_TABLES,
    *_TOKEN_TABLES,
    *_LISTING_INDEXES,
    _COMPOSED_PLD,
    _VERIFIED_STATE,
    *_PLAN_TABLES,
)


def schema_statements(database: Database) -> tuple[str, ...]:
    """The statements that create a new ledger in `database`."""
    return (*(formatted(statement, database) for statement in _TABLES), *database.append_only)


def formatted(statement: str, database: Database) -> str:
    """A statement of the schema with the database's type names and the default scheduling policy filled in."""
    return statement.format(fcfs=json.dumps(SchedulingPolicy().to_dict()), **database.types)


def _count_released_jobs(
    connection: Connection, caller: Caller, database: Database, history: HistoryChain
) -> None:
    """Version 2: a count of released jobs per dataset, so a status reads one row, not every job it ever had."""
    connection.execute("ALTER TABLE datasets ADD COLUMN released_jobs INTEGER NOT NULL DEFAULT 0")
    connection.execute(
        "UPDATE datasets SET released_jobs = "
        "(SELECT COUNT(*) FROM reservations r WHERE r.dataset_id = datasets.id AND r.state = 'released')"
    )


def _adopt_filters_leases_and_hashes(
    connection: Connection, caller: Caller, database: Database, history: HistoryChain
) -> None:
    """Version 3: hash-chained history, leases, and an RDP filter for every dataset, keeping its events.

    Each dataset gets the rule a new dataset of its budget would get, in a
    history entry of its own that says whether what it holds fits the
    filter; one that does not admits no new job, and its reservations
    commit only what still fits.
    """
    for statement in (
        "ALTER TABLE datasets ADD COLUMN admission_rule TEXT NOT NULL DEFAULT ''",
        "ALTER TABLE reservations ADD COLUMN lease_seconds REAL",
        "ALTER TABLE reservations ADD COLUMN expires_at TEXT",
        "ALTER TABLE reservations ADD COLUMN lease_expired INTEGER NOT NULL DEFAULT 0",
        _LEASE_INDEX,
        "ALTER TABLE history ADD COLUMN previous_hash TEXT NOT NULL DEFAULT ''",
        "ALTER TABLE history ADD COLUMN hash TEXT NOT NULL DEFAULT ''",
        "DROP TRIGGER history_is_append_only_update",
        "DROP TRIGGER history_is_append_only_delete",
    ):
        connection.execute(statement)
    previous = ""
    for entry_id, at, actor, action, tenant, dataset_id, details in connection.execute(
        "SELECT id, at, actor, action, tenant, dataset_id, details FROM history ORDER BY id"
    ).fetchall():
        entry_hash = history_hash(previous, entry_id, at, actor, action, tenant, dataset_id, details)
        connection.execute(
            "UPDATE history SET previous_hash = ?, hash = ? WHERE id = ?", (previous, entry_hash, entry_id)
        )
        previous = entry_hash
    for statement in database.append_only:
        connection.execute(statement)
    unkeyed = HistoryChain(None, None, database.location)  # the key came with version 9
    for dataset_id, tenant, budget_epsilon, delta, held in connection.execute(
        "SELECT id, tenant, budget_epsilon, delta, held_rdp FROM datasets ORDER BY id"
    ).fetchall():
        rule = AdmissionRule.for_budget(budget_epsilon, delta)
        connection.execute(
            "UPDATE datasets SET admission_rule = ? WHERE id = ?", (json.dumps(rule.to_dict()), dataset_id)
        )
        held_epsilon = rule.epsilon(RdpTally.from_json(held))
        unkeyed.record(
            connection, caller, "adopt_admission_rule", tenant, dataset_id,
            {"admission": rule.to_dict(), "held_epsilon_filter": held_epsilon,
             "held_fits_budget": fits_budget(held_epsilon, budget_epsilon)},
        )


def _add_privacy_units(
    connection: Connection, caller: Caller, database: Database, history: HistoryChain
) -> None:
    """Version 4: each dataset says what it protects; every existing one protects rows ('example')."""
    connection.execute("ALTER TABLE datasets ADD COLUMN privacy_unit TEXT NOT NULL DEFAULT 'example'")


def _add_blocks_and_quotas(
    connection: Connection, caller: Caller, database: Database, history: HistoryChain
) -> None:
    """Version 5: blocks of a dataset, and each tenant's tally and quota per budget.

    Until now only a dataset's owner could reserve on it, so the owner's
    tally on each dataset is the dataset's own, and every reservation is the
    owner's.
    """
    types = database.types
    for statement in (
        f"ALTER TABLE datasets ADD COLUMN block_of {types['integer']} REFERENCES datasets(id)",
        "ALTER TABLE datasets ADD COLUMN block TEXT",
        "ALTER TABLE reservations ADD COLUMN tenant TEXT NOT NULL DEFAULT ''",
        "ALTER TABLE reservations ADD COLUMN blocks TEXT NOT NULL DEFAULT '[]'",
        "UPDATE reservations SET tenant = (SELECT d.tenant FROM datasets d WHERE d.id = reservations.dataset_id)",
        "DROP INDEX one_active_reservation_per_job",
        _ONE_ACTIVE_RESERVATION_PER_JOB,
        _TENANT_USE.format(**types),
        "INSERT INTO tenant_use (budget_id, tenant, held_rdp, committed_events) "
        "SELECT id, tenant, held_rdp, committed_events FROM datasets",
    ):
        connection.execute(statement)


def _add_queues(
    connection: Connection, caller: Caller, database: Database, history: HistoryChain
) -> None:
    """Version 6: a queue of jobs waiting for budget, and each dataset's scheduling policy (fcfs until changed)."""
    for statement in (
        "ALTER TABLE datasets ADD COLUMN scheduling TEXT NOT NULL DEFAULT '{fcfs}'",
        "ALTER TABLE datasets ADD COLUMN arrived_jobs {integer} NOT NULL DEFAULT 0",
        *_QUEUE_TABLES,
    ):
        connection.execute(formatted(statement, database))


def _declare_block_data(
    connection: Connection, caller: Caller, database: Database, history: HistoryChain
) -> None:
    """Version 7: each block declares where its rows are (`block_data`, JSON; see admission.check_block_data).

    A block of an older file declared nothing, so nothing shows which rows
    it holds: it keeps its history and its active reservations, admits no
    new job (the dataset's new blocks each declare their data), and `verify`
    counts it as sharing rows with every other block of its dataset.
    """
    connection.execute("ALTER TABLE datasets ADD COLUMN block_data TEXT")


def _add_fast_tokens_and_revocation(
    connection: Connection, caller: Caller, database: Database, history: HistoryChain
) -> None:
    """Version 8: admin tokens and a token generation in the ledger, so tokens can be rotated and revoked.

    Tenant tokens hashed with scrypt before (those with a salt) stay as
    they are: the first request that shows one is checked with scrypt once,
    and its row then takes the token's SHA-256 digest and loses its salt
    (`Ledger.authenticate`). Until then a wrong token for such a key id
    costs one scrypt, which the servers' limit on failed authentications
    per peer bounds.
    """
    for statement in _TOKEN_TABLES:
        connection.execute(formatted(statement, database))


def _key_the_history(
    connection: Connection, caller: Caller, database: Database, history: HistoryChain
) -> None:
    """Version 9: re-anchor the unkeyed hash chain under the history key, and refuse TRUNCATE on PostgreSQL.

    The unkeyed chain is checked first; what it shows wrong (a row edited or
    removed before now) goes into an `anchor_history` entry with the number
    of entries and their unkeyed head hash, and `verify` reports it there
    from then on. Then every entry is re-chained with the key, so from now
    on a chain that is not keyed is a finding, not an older format.
    """
    entries = HistoryChain.entries(connection)
    unkeyed_findings = [str(finding) for finding in chain_findings(entries, {})]
    _rechain(connection, database, entries, history.key)
    history.record(
        connection, caller, ANCHOR_ACTION, None, None,
        {"entries": len(entries), "unkeyed_head_hash": entries[-1].entry_hash if entries else "",
         "unkeyed_chain_findings": unkeyed_findings},
    )


def _rechain(connection: Connection, database: Database, entries: list[StoredEntry], key: bytes) -> None:
    """Chain every entry of the history under `key`, each to the hash of the one before it as chained now."""
    for statement in database.drop_append_only:
        connection.execute(statement)
    previous = ""
    for entry in entries:
        entry_hash = history_hash(
            previous, entry.entry_id, entry.at, entry.actor, entry.action, entry.tenant, entry.dataset_id,
            entry.details_json, key,
        )
        connection.execute(
            "UPDATE history SET previous_hash = ?, hash = ? WHERE id = ?", (previous, entry_hash, entry.entry_id)
        )
        previous = entry_hash
    for statement in database.append_only:
        connection.execute(statement)


def _index_listings_and_keep_composed_plds(
    connection: Connection, caller: Caller, database: Database, history: HistoryChain
) -> None:
    """Version 10: an index for each listing, read in the listing's order (`_LISTING_INDEXES`), and each
    budget's composed PLD (`_COMPOSED_PLD`, empty until a status composes one).

    The jobs' index of a dataset and state replaces the one of version 1,
    which on PostgreSQL did not hold the insertion order.
    """
    connection.execute("DROP INDEX IF EXISTS reservations_by_dataset")
    for statement in (*_LISTING_INDEXES, _COMPOSED_PLD):
        connection.execute(formatted(statement, database))


def _keep_the_verified_state(
    connection: Connection, caller: Caller, database: Database, history: HistoryChain
) -> None:
    """Version 11: the replays' state at the last verified entry (`_VERIFIED_STATE`, empty until a verify
    finds nothing), so the next verify replays only the entries after it."""
    connection.execute(formatted(_VERIFIED_STATE, database))


def _adopt_admin_tokens(
    connection: Connection, caller: Caller, database: Database, history: HistoryChain
) -> None:
    """Version 12: the admin tokens kept before now, which no history entry created, recorded by key id and
    digest (never the token) in an `adopt_admin_tokens` entry, so `verify` finds any admin token row the history
    does not explain from then on; the keyed state is sealed at the end of every migration (`_migrate`)."""
    tokens = [
        {"key_id": key_id, "token_digest": stored_token_digest(None, bytes(token_hash)), "revoked": revoked is not None}
        for key_id, token_hash, revoked in connection.execute(
            "SELECT key_id, token_hash, revoked_at FROM admin_tokens ORDER BY key_id"
        ).fetchall()
    ]
    if tokens:
        history.record(connection, caller, "adopt_admin_tokens", None, None, by_key(caller, {"admin_tokens": tokens}))


def _add_plans(connection: Connection, caller: Caller, database: Database, history: HistoryChain) -> None:
    """Version 13: the tables of pre-registered plans (`_PLAN_TABLES`), empty: no dataset of an older file has a
    plan pool."""
    for statement in _PLAN_TABLES:
        connection.execute(formatted(statement, database))


# Each version's step brings a file of the previous version up to it, in the transaction that opens it; the steps
# that append to the history append to `history` (the one that re-chains it under the key uses the key).
_MIGRATIONS = {
    2: _count_released_jobs,
    3: _adopt_filters_leases_and_hashes,
    4: _add_privacy_units,
    5: _add_blocks_and_quotas,
    6: _add_queues,
    7: _declare_block_data,
    8: _add_fast_tokens_and_revocation,
    9: _key_the_history,
    10: _index_listings_and_keep_composed_plds,
    11: _keep_the_verified_state,
    12: _adopt_admin_tokens,
    13: _add_plans,
}


def create_or_check_schema(
    transactions: Transactions, database: Database, history: HistoryChain, caller: Caller | None
) -> None:
    """Create a new ledger in `database`, or migrate an older one (recorded by `caller`, default the local user).

    Refuses a ledger of a newer schema version than this dpfleet reads, and
    an older one that is not what the version it claims wrote
    (`_before_migrating`). A new ledger's history starts with a
    `create_ledger` entry naming its schema version.
    """
    with transactions.change() as connection:
        if not connection.execute(database.schema_exists).fetchone():
            for statement in schema_statements(database):
                connection.execute(statement)
            connection.execute("INSERT INTO schema_version (version) VALUES (?)", (SCHEMA_VERSION,))
            history.record(connection, _opener(caller, "creating"), "create_ledger", None, None,
                           {"schema_version": SCHEMA_VERSION})
            keep_sealed_state(connection, history.key, SCHEMA_VERSION)
            return
        (version,) = connection.execute("SELECT version FROM schema_version").fetchone()
        if version < SCHEMA_VERSION:
            problems = _before_migrating(connection, database, history, version)
            if problems:
                raise _laundering_refused(database, version, problems)
            if version < KEYED_SINCE_VERSION:
                raise _unkeyed_refused(database, version)
            _migrate(connection, database, history, caller, version, [])
            return
    if version != SCHEMA_VERSION:
        raise FailedPrecondition(
            f"the ledger {database.location} has schema version {version}; this dpfleet reads versions "
            f"up to {SCHEMA_VERSION}. Open it with the dpfleet version that wrote it, or a newer one"
        )


def _opener(caller: Caller | None, doing: str) -> Caller:
    """Who a creation or migration is recorded as: `caller`, default the local user `doing` it."""
    return caller or Caller(actor=f"{local_user()} ({doing} the file)", tenant=None)


def _migrate(
    connection: Connection, database: Database, history: HistoryChain, caller: Caller | None, version: int,
    accepted: list[str],
) -> None:
    """Bring a file of an older schema version up to SCHEMA_VERSION, recorded in its history with what the
    checks before it found and an admin `accepted` (dpfleet ledger rekey --accept-findings), and seal it."""
    caller = _opener(caller, "opening")
    for target in range(version + 1, SCHEMA_VERSION + 1):
        _MIGRATIONS[target](connection, caller, database, history)
    connection.execute("UPDATE schema_version SET version = ?", (SCHEMA_VERSION,))
    history.record(connection, caller, "migrate_schema", None, None, {
        "from": version, "to": SCHEMA_VERSION, **({"accepted_findings": accepted} if accepted else {}),
    })
    keep_sealed_state(connection, history.key, SCHEMA_VERSION)


def _has_table(connection: Connection, database: Database, table: str) -> bool:
    # `schema_exists` asks whether the table schema_version exists; the same question for another of the schema's.
    return connection.execute(database.schema_exists.replace("schema_version", table)).fetchone() is not None


def _before_migrating(connection: Connection, database: Database, history: HistoryChain, version: int) -> list[str]:
    """What shows that a file claiming schema `version` is not what that version wrote: a table of a later
    version, a history entry recording a later one, a keyed state of a later one (or not under the key), an
    HMAC-keyed entry before version 9, or its chain failing the rules of its version. Empty when none."""
    problems = [
        f"it holds the table {table}, which schema version {since} and later create"
        for since, tables in _TABLES_SINCE.items() if since > version
        for table in tables if _has_table(connection, database, table)
    ]
    for entry_id, action, details in connection.execute(
        "SELECT id, action, details FROM history WHERE action IN ('create_ledger', 'migrate_schema', ?) ORDER BY id",
        (ANCHOR_ACTION,),
    ).fetchall():
        recorded = json.loads(details)
        implied = 9 if action == ANCHOR_ACTION else recorded.get("schema_version", recorded.get("to", 0))
        if implied > version:
            problems.append(f"its history entry {entry_id} ({action}) records schema version {implied}")
    if version >= 11 and _has_table(connection, database, "verified_state"):
        row = connection.execute("SELECT state FROM verified_state WHERE id = 1").fetchone()
        try:
            sealed = sealed_version(history.key, bytes(row[0])) if row is not None else None
        except ValueError as error:
            problems.append(f"its verified state: {error}")
        else:
            if sealed is not None and sealed > version:
                problems.append(f"its verified state, under the history key, was kept at schema version {sealed}")
    if version >= 3:  # the chain came with version 3, its key with 9
        problems += _chain_problems(HistoryChain.entries(connection), history.key, version)
    return problems


def _chain_problems(entries: list[StoredEntry], key: bytes, version: int) -> list[str]:
    """What the history's chain shows wrong under the rules of schema `version` (unkeyed before 9)."""
    if version < KEYED_SINCE_VERSION:
        keyed = sum(entry.entry_hash == history_hash(entry.previous_hash, *entry[:7], key) for entry in entries)
        if keyed:
            return [f"{keyed} of its {len(entries)} history entries carry an HMAC under the history key, which "
                    "only schema version 9 and later write"]
    findings = chain_findings(entries, {}, key if version >= KEYED_SINCE_VERSION else None, recorded=False)
    if not findings:
        return []
    shown = "; ".join(str(finding) for finding in findings[:3])
    return [f"its history's chain, checked as schema version {version} chained it, has {len(findings)} "
            f"finding(s): {shown}{'; …' if len(findings) > 3 else ''}"]


def _unkeyed_refused(database: Database, version: int) -> FailedPrecondition:
    """The refusal to key, on open, a history that schema `version` (before the key) chained without one."""
    return FailedPrecondition(
        f"the ledger {database.location} has schema version {version}, whose history is chained without the "
        f"history key (the key came with version {KEYED_SINCE_VERSION}). Opening it does not key it: a keyed "
        "ledger rewritten by hand as such a file looks the same, and keying it would vouch for whatever it holds. "
        "If it is the file you expect (an old ledger, never opened by this dpfleet), key and migrate it on purpose "
        "with dpfleet ledger rekey, which checks it first and records the migration; see docs/ledger.md, 'What a "
        "migration refuses'"
    )


def _laundering_refused(database: Database, version: int, problems: list[str]) -> FailedPrecondition:
    """The refusal to migrate a file that is not what schema `version` wrote (`_before_migrating`)."""
    return FailedPrecondition(
        f"the ledger {database.location} says schema version {version}, but {'; '.join(problems)}: it was changed "
        "by hand or comes from another ledger, and a migration would key and seal it as it is. Restore it from its "
        "backup; or, to migrate it as it is with these findings recorded in its history, run dpfleet ledger rekey "
        "--accept-findings. See docs/ledger.md, 'What a migration refuses'"
    )


def rekey_history(
    transactions: Transactions,
    database: Database,
    history: HistoryChain,
    caller: Caller,
    previous_key: bytes | None,
    accept_findings: bool,
) -> list[str]:
    """Chain the history under `history`'s key and seal it, recorded by `caller`; what was found and accepted.

    A file of an older schema version is migrated, its checks
    (`_before_migrating`) refused unless `accept_findings`, then recorded.
    A file of this version has its chain checked under `previous_key` (the
    key it was chained with; None: the same key, to seal a history whose
    kept state was lost) and refused on any finding unless
    `accept_findings`; then every entry is chained under the key, and a
    `rekey_history` entry records how many, the head it had and what was
    accepted.
    """
    with transactions.change() as connection:
        if not connection.execute(database.schema_exists).fetchone():
            raise FailedPrecondition(f"{database.location} holds no ledger; there is no history to key")
        (version,) = connection.execute("SELECT version FROM schema_version").fetchone()
        if version > SCHEMA_VERSION:
            raise FailedPrecondition(
                f"the ledger {database.location} has schema version {version}; this dpfleet reads versions up to "
                f"{SCHEMA_VERSION}. Use the dpfleet version that wrote it, or a newer one"
            )
        if version < SCHEMA_VERSION:
            problems = _before_migrating(connection, database, history, version)
            if problems and not accept_findings:
                raise _laundering_refused(database, version, problems)
            # A keyed chain that does not hold, accepted: chained as it is.
            if problems and version >= KEYED_SINCE_VERSION:
                _rechain(connection, database, HistoryChain.entries(connection), history.key)
            _migrate(connection, database, history, caller, version, problems)
            return problems
        entries = HistoryChain.entries(connection)
        old_key = history.key if previous_key is None else previous_key
        problems = [str(finding) for finding in chain_findings(entries, {}, old_key, recorded=False)]
        if problems and not accept_findings:
            raise FailedPrecondition(
                f"the history of {database.location}, checked under the key it was chained with, has "
                f"{len(problems)} finding(s): {'; '.join(problems[:3])}. Restore it from its backup, give the key "
                "it was chained with (--from-key), or re-key it as it is with --accept-findings (they are recorded "
                "in its history)"
            )
        _rechain(connection, database, entries, history.key)
        history.record(connection, caller, "rekey_history", None, None, by_key(caller, {
            "entries": len(entries), "previous_head_hash": entries[-1].entry_hash if entries else "",
            "another_key": old_key != history.key, "accepted_findings": problems,
        }))
        keep_sealed_state(connection, history.key, SCHEMA_VERSION)
        return problems
