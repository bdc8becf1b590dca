"""`verify` and the history it reads: the keyed hash chain, the signed head, and replays checked against the tables."""

from accounting.ledger.verification.chain import (
    ANCHOR_ACTION,
    HEAD_SCHEMA,
    SignedHead,
    chain_findings,
    head_findings,
    head_signature_findings,
    history_hash,
    sign_head,
)
from accounting.ledger.verification.findings import (
    Finding,
    Verification,
)
from accounting.ledger.verification.history import (
    HistoryReplay,
    job_charges,
    verify_history,
)
from accounting.ledger.verification.replay import (
    BurnDownPoint,
    burn_down,
)
from accounting.ledger.verification.rows import (
    StoredAdminToken,
    StoredCommit,
    StoredDataset,
    StoredEntry,
    StoredPlan,
    StoredPlanJob,
    StoredReservation,
    StoredTenant,
    StoredTenantUse,
    stored_token_digest,
)
from accounting.ledger.verification.verified import (
    SEALED_SINCE_VERSION,
    VerifiedState,
    sealed_version,
)

__all__ = [
    "ANCHOR_ACTION",
    "BurnDownPoint",
    "Finding",
    "HEAD_SCHEMA",
    "HistoryReplay",
    "SEALED_SINCE_VERSION",
    "SignedHead",
    "StoredAdminToken",
    "StoredCommit",
    "StoredDataset",
    "StoredEntry",
    "StoredPlan",
    "StoredPlanJob",
    "StoredReservation",
    "StoredTenant",
    "StoredTenantUse",
    "Verification",
    "VerifiedState",
    "burn_down",
    "chain_findings",
    "head_findings",
    "head_signature_findings",
    "sealed_version",
    "history_hash",
    "job_charges",
    "sign_head",
    "stored_token_digest",
    "verify_history",
]
