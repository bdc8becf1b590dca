"""The global privacy ledger: one budget per dataset across every job and tenant.

- `admission`: the budget arithmetic over event records, pure: plans, RDP tallies, the filter, block rules;
  `caches` computes its RDP curves and PLD figures once, in threads or processes.
- `validation`, `errors`, `records`, `callers`, `tokens`: what a request may hold, what the ledger
  refuses it with, the records it answers with, who is asking and their tokens.
- `verification`: `verify`, the history's chain and signed head, and its replays.
- `store`: the SQLite store and the embedded `Ledger`.
- `service` and `client`: the gRPC server and `RemoteLedger`, one interface (`interface.PrivacyLedger`).
"""
