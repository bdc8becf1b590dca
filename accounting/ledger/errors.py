"""The errors the ledger reports: one class per gRPC status code, each saying what was wrong and what to do."""

from __future__ import annotations

import math
from decimal import ROUND_CEILING, ROUND_FLOOR, Context, Decimal


class LedgerError(Exception):
    """Base of every error the ledger reports; each subclass maps to one gRPC status code."""


class InvalidArgument(LedgerError):
    """A request value is outside its valid range (gRPC INVALID_ARGUMENT)."""


class NotFound(LedgerError):
    """An admin named a tenant, dataset or reservation that does not exist (gRPC NOT_FOUND)."""


class AlreadyExists(LedgerError):
    """A tenant or dataset of that name exists already (gRPC ALREADY_EXISTS)."""


class FailedPrecondition(LedgerError):
    """The request is well formed but the ledger's state does not allow it (gRPC FAILED_PRECONDITION)."""


class PermissionDenied(LedgerError):
    """The caller may not do this, or may not see the thing named (gRPC PERMISSION_DENIED)."""


class Unauthenticated(LedgerError):
    """No token, or a token the ledger does not know (gRPC UNAUTHENTICATED)."""


class LedgerUnavailable(LedgerError):
    """The remote ledger did not answer in time or could not be reached (gRPC UNAVAILABLE)."""


class RateLimited(LedgerError):
    """Too many costly requests, or failed authentications, in a short time (gRPC RESOURCE_EXHAUSTED).

    `retry_after_seconds` is when the request would be let through, if nothing else arrives before it.
    """

    def __init__(self, message: str, retry_after_seconds: float) -> None:
        self.retry_after_seconds = retry_after_seconds
        super().__init__(message)


class BudgetExceeded(LedgerError):
    """A job does not fit the dataset's budget (gRPC RESOURCE_EXHAUSTED).

    `remaining_epsilon` is the budget minus the RDP epsilon of what is
    committed and reserved; `needed_epsilon` is how much the job would add to
    that RDP epsilon. Both at the dataset's `delta`.
    """

    def __init__(
        self, dataset: str, remaining_epsilon: float, needed_epsilon: float, delta: float, budget: str | None = None
    ) -> None:
        self.dataset = dataset
        self.remaining_epsilon = remaining_epsilon
        self.needed_epsilon = needed_epsilon
        self.delta = delta
        # Which budget refused: the dataset's, a block's, or a tenant's quota on either.
        self.budget = budget or f"dataset {dataset!r}"
        shown_remaining, shown_needed = _shown_shortfall(remaining_epsilon, needed_epsilon)
        super().__init__(
            f"{self.budget} has ε {shown_remaining} left at δ={delta:g}; this job needs ε {shown_needed}. "
            "Run fewer steps or more noise, release reservations that are no longer needed "
            "(dpfleet ledger jobs, dpfleet ledger release), or ask an admin to raise the budget"
        )


def _shown_shortfall(remaining: float, needed: float) -> tuple[str, str]:
    """Remaining rounded down and needed rounded up, to two significant digits of the smaller."""
    smallest = min((value for value in (remaining, needed) if 0.0 < value < math.inf), default=1.0)
    quantum = Decimal(10) ** -min(12, max(2, 1 - math.floor(math.log10(smallest))))

    def shown(value: float, rounding: str) -> str:
        if not math.isfinite(value):
            return "inf"
        # repr: the shortest decimal that reads back as this float, so 0.31 shows as 0.31.
        return str(Decimal(repr(value)).quantize(quantum, rounding=rounding, context=Context(prec=400)))

    return shown(remaining, ROUND_FLOOR), shown(needed, ROUND_CEILING)
