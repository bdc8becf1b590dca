"""The ledger's store: its SQL schema, its transactions, and `Ledger`, which composes them with the core."""

from accounting.ledger.store.ledger import TOKEN_RECHECK_SECONDS, Ledger, open_embedded_ledger
from accounting.ledger.store.local import default_history_key_path, default_ledger_path, load_history_key
from accounting.ledger.store.schema import SCHEMA_VERSION

__all__ = [
    "SCHEMA_VERSION",
    "TOKEN_RECHECK_SECONDS",
    "Ledger",
    "default_history_key_path",
    "default_ledger_path",
    "load_history_key",
    "open_embedded_ledger",
]
