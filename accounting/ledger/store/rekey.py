"""`rekey_ledger`: chain a ledger's history under the history key, as an admin's explicit, recorded act.

Opening a ledger never re-chains a history it cannot vouch for: a file
that is not what its schema version wrote is refused (store/schema.py), and
a ledger opened with another key refuses to chain to its history. This is
the one way to do either on purpose: it checks the history first, refuses on
what it finds unless the admin accepts it, and records what it did.
"""

from __future__ import annotations

import os

from accounting.ledger.callers import Caller
from accounting.ledger.databases import open_database
from accounting.ledger.store.history import HistoryChain
from accounting.ledger.store.local import default_history_key_path, load_history_key, local_user
from accounting.ledger.store.schema import rekey_history
from accounting.ledger.store.transactions import Transactions


def rekey_ledger(
    path: str | os.PathLike,
    history_key_file: str | os.PathLike | None = None,
    previous_key_file: str | os.PathLike | None = None,
    accept_findings: bool = False,
    caller: Caller | None = None,
) -> list[str]:
    """Chain the history of the ledger at `path` under the key of `history_key_file` (default
    `default_history_key_path()`) and seal it; what was found and accepted (empty: nothing).

    A file of an older schema version is migrated as it is, even when its
    checks found something (only with `accept_findings`). A file of this
    version has its chain checked under the key of `previous_key_file`
    (default: the same key, to seal again a history whose kept state was
    lost) and is re-chained. Every finding is refused unless
    `accept_findings`, and recorded in the history when accepted. `caller`
    defaults to the local user.
    """
    history = HistoryChain(
        load_history_key(history_key_file), history_key_file or default_history_key_path(), str(path)
    )
    previous_key = load_history_key(previous_key_file) if previous_key_file is not None else None
    caller = caller or Caller(actor=f"{local_user()} (dpfleet ledger rekey)", tenant=None, admin=True)
    database = open_database(path)
    transactions = Transactions(database)
    try:
        return rekey_history(transactions, database, history, caller, previous_key, accept_findings)
    finally:
        transactions.close()
