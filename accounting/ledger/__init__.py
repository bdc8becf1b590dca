"""The global privacy ledger: one budget per dataset across every job and tenant, embedded or served over gRPC.

- `admission`: the budget arithmetic over event records, pure: plans, RDP tallies, the filter, block rules;
  `caches` computes its RDP curves and PLD figures once, in threads or processes; `composed` keeps each
  budget's composed PLD, extended by new commits.
- `validation`, `errors`, `records`, `callers`, `tokens`: what a request may hold, what the ledger
  refuses it with, the records it answers with, who is asking and their tokens.
- `verification`: `verify`, the history's chain and signed head, and its replays.
- `store`: the SQLite store and the embedded `Ledger`.
- `service` and `client`: the gRPC server and `RemoteLedger`, one interface (`interface.PrivacyLedger`);
  `operations` declares each operation once, and a test holds the store, client, service and CLI to it.
"""

from accounting.lazy import public_face

__getattr__, __dir__, __all__ = public_face(__name__, {
    "caches": ["forget_pld_figures"],
    "callers": ["ADMIN", "LOCAL_TENANT"],
    "client": ["RemoteLedger"],
    "databases": ["is_postgresql", "shown_location"],
    "errors": ["AlreadyExists", "BudgetExceeded", "FailedPrecondition", "InvalidArgument", "LedgerError",
               "LedgerUnavailable", "NotFound", "PermissionDenied", "RateLimited"],
    "interface": ["PrivacyLedger"],
    "limits": ["AUTH_FAILURE_BURST", "AUTH_FAILURE_RATE_PER_SECOND", "CURVE_BURST", "CURVE_RATE_PER_SECOND"],
    "operations": ["OPERATIONS"],
    "records": ["BlockStatus", "DatasetStatus", "JobCharge", "QueuedJob", "Reservation"],
    "scheduling": ["BlockBudget", "DPACK", "DPF", "FCFS", "POLICIES", "PRIORITY_RANGE", "QueuedDemand",
                   "SchedulingPolicy", "schedule"],
    "service": ["LedgerServer", "serve"],
    "store": ["Ledger", "default_ledger_path", "open_embedded_ledger"],
    "tokens": ["hash_token"],
    "validation": ["ACTIVE", "ADMITTED", "EPSILON_RANGE", "MAX_PLAN_MECHANISMS", "NAME_LENGTH", "PRIVACY_UNITS",
                   "QUEUED", "check_budget_epsilon", "check_delta", "delta_warning"],
})
