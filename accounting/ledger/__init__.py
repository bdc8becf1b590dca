"""The global privacy ledger: one budget per dataset across every job and tenant, embedded or served over gRPC."""

from accounting.lazy import public_face

__getattr__, __dir__, __all__ = public_face(__name__, {
    "client": ["RemoteLedger"],
    "core": ["ADMIN", "ADMITTED", "AdmissionRule", "BudgetExceeded", "DatasetStatus", "FailedPrecondition",
             "InvalidArgument", "LedgerError", "LedgerUnavailable", "MAX_PLAN_MECHANISMS", "NotFound",
             "PermissionDenied", "PrivacyLedger", "QUEUED", "QueuedJob", "RateLimited", "RdpTally", "SignedHead",
             "charged_plan", "check_block_data", "check_budget_epsilon", "check_delta", "delta_warning",
             "fits_budget", "hash_token"],
    "databases": ["is_postgresql", "shown_location"],
    "limits": ["AUTH_FAILURE_BURST", "AUTH_FAILURE_RATE_PER_SECOND", "CURVE_BURST", "CURVE_RATE_PER_SECOND"],
    "scheduling": ["BlockBudget", "DPACK", "DPF", "FCFS", "POLICIES", "PRIORITY_RANGE", "QueuedDemand",
                   "SchedulingPolicy", "schedule"],
    "service": ["LedgerServer", "serve"],
    "store": ["Ledger", "default_ledger_path", "open_embedded_ledger"],
})
