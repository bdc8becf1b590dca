"""The ledger's store: the SQL schema, its tables and `Ledger`, the embedded ledger that composes them."""

from accounting.ledger.store.ledger import (
    SCHEMA_VERSION,
    TOKEN_RECHECK_SECONDS,
    Ledger,
    default_history_key_path,
    default_ledger_path,
    load_history_key,
    open_embedded_ledger,
)

__all__ = [
    "SCHEMA_VERSION",
    "TOKEN_RECHECK_SECONDS",
    "Ledger",
    "default_history_key_path",
    "default_ledger_path",
    "load_history_key",
    "open_embedded_ledger",
]
