"""The ledger's store: its SQL schema, one repository per table, and `Ledger`, which composes them with the core.

Modules, each one concern (code outside the package imports only the names in `__all__`, from here):
- `ledger`: `Ledger`, a thin composition of what follows, and `open_embedded_ledger`;
- `schema`: the tables and the migrations from older schema versions;
- `transactions`: the transaction and lock discipline (group commit, readers, curves outside the lock);
- repositories, rows as named records: `datasets` (datasets and blocks), `uses` (tenant uses and quotas),
  `reservations` (reservations and commits), `queued_jobs`, `tenants` (tenants and tokens), `history` (the
  keyed chain), bundled by `tables`;
- rules: `authorisation`, `admission`, `queueing`, `leases`, `status`, `verification`;
- `rekey`: `rekey_ledger`, the explicit, recorded re-chaining of a history under the key;
- `local` (where the embedded ledger lives, where the history key comes from and where a server may keep it, the
  key files that sign and check heads) and `clock` (the ledger's times).
"""

from accounting.ledger.store.authorisation import TOKEN_RECHECK_SECONDS
from accounting.ledger.store.ledger import Ledger, open_embedded_ledger
from accounting.ledger.store.local import (
    HistoryKeySource,
    default_history_key_path,
    default_ledger_path,
    history_key_source,
    load_history_key,
    load_public_key,
    load_signing_key,
    new_signing_key,
    served_key_placement_problem,
)
from accounting.ledger.store.rekey import rekey_ledger
from accounting.ledger.store.schema import SCHEMA_VERSION

__all__ = [
    "SCHEMA_VERSION",
    "TOKEN_RECHECK_SECONDS",
    "HistoryKeySource",
    "Ledger",
    "default_history_key_path",
    "default_ledger_path",
    "history_key_source",
    "load_history_key",
    "load_public_key",
    "load_signing_key",
    "new_signing_key",
    "open_embedded_ledger",
    "rekey_ledger",
    "served_key_placement_problem",
]
