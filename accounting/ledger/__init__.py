"""The global privacy ledger: one budget per dataset across every job and tenant.

- `core`: budget arithmetic over event records, validation, errors (pure).
- `store`: the SQLite store and the embedded `Ledger`.
- `service` and `client`: the gRPC server and `RemoteLedger`, same interface.
"""
