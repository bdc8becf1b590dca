"""Errors the command line turns into exit statuses, without a traceback."""


class UsageError(ValueError):
    """Bad input from the user: a flag or config key outside its valid range, or a bad data file (exit status 2).

    A message about the data names the file, column and rule, never a row,
    a count of rows or a value from it; ``with_values`` is the same message
    with the rows, their count and values, for the data's owners
    (``dpfleet train --show-values``, ``dpfleet data check``).
    """

    exit_status = 2

    def __init__(self, message: str, with_values: str | None = None) -> None:
        super().__init__(message)
        self.with_values = with_values or message


class BudgetRefusedError(RuntimeError):
    """The privacy ledger refused the job's reservation (exit status 3)."""

    exit_status = 3


class LedgerTimeoutError(RuntimeError):
    """The ledger stayed unreachable past ledger_timeout; the run stopped at a resumable checkpoint (exit 4)."""

    exit_status = 4


class ShardTimeoutError(RuntimeError):
    """A shard's worker could not be placed within shard_timeout; the run stopped at a resumable checkpoint (exit 5)."""

    exit_status = 5
