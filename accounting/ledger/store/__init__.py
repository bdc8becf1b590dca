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
- `local` (where the embedded ledger and the history key live) and `clock` (the ledger's times).
"""

from accounting.ledger.store.authorisation import TOKEN_RECHECK_SECONDS
from accounting.ledger.store.ledger import Ledger, open_embedded_ledger
from accounting.ledger.store.local import default_history_key_path, default_ledger_path, load_history_key
from accounting.ledger.store.rekey import rekey_ledger
from accounting.ledger.store.schema import SCHEMA_VERSION

__all__ = [
    "SCHEMA_VERSION",
    "TOKEN_RECHECK_SECONDS",
    "Ledger",
    "default_history_key_path",
    "default_ledger_path",
    "load_history_key",
    "open_embedded_ledger",
    "rekey_ledger",
]
