"""`verify` and the history it reads: the keyed hash chain, the signed head, and replays checked against the tables."""

from accounting.ledger.verification.chain import (
    ANCHOR_ACTION,
    HEAD_SCHEMA,
    SignedHead,
    chain_findings,
    head_findings,
    history_hash,
    sign_head,
)
from accounting.ledger.verification.findings import (
    Finding,
    Verification,
)
from accounting.ledger.verification.history import (
    verify_history,
)
from accounting.ledger.verification.replay import (
    BurnDownPoint,
    burn_down,
    replay_findings,
    use_findings,
)
from accounting.ledger.verification.rows import (
    StoredCommit,
    StoredDataset,
    StoredEntry,
    StoredReservation,
    StoredTenant,
    StoredTenantUse,
    stored_token_digest,
)
from accounting.ledger.verification.tables import (
    job_findings,
    queue_findings,
    tenant_findings,
)
from accounting.ledger.verification.units import (
    unit_findings,
)

__all__ = [
    "ANCHOR_ACTION",
    "BurnDownPoint",
    "Finding",
    "HEAD_SCHEMA",
    "SignedHead",
    "StoredCommit",
    "StoredDataset",
    "StoredEntry",
    "StoredReservation",
    "StoredTenant",
    "StoredTenantUse",
    "Verification",
    "burn_down",
    "chain_findings",
    "head_findings",
    "history_hash",
    "job_findings",
    "queue_findings",
    "replay_findings",
    "sign_head",
    "stored_token_digest",
    "tenant_findings",
    "unit_findings",
    "use_findings",
    "verify_history",
]
