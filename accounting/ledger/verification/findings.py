"""What `verify` reports: each thing found wrong, and the whole check."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Finding:
    """One thing `verify` found wrong: the history entry (None: the dataset's row), its dataset, and what."""

    entry_id: int | None
    dataset: str | None
    problem: str
    # What the finding is about when it is no history entry: a table's row, or the signed head.
    row: str = "dataset row"

    def __str__(self) -> str:
        where = f"entry {self.entry_id}" if self.entry_id is not None else self.row
        return f"{where}{f' of dataset {self.dataset}' if self.dataset else ''}: {self.problem}"

    def to_dict(self) -> dict:
        """JSON-ready dict."""
        return {"entry_id": self.entry_id, "dataset": self.dataset, "problem": self.problem}


@dataclass(frozen=True)
class Verification:
    """What `verify` checked and found: keep `head_hash` elsewhere to notice a history rewritten from the start.

    Every entry's hash is checked; `replayed` entries were replayed (all of
    them, or those after the last verified entry: see verify_history).
    """

    entries: int
    datasets: int
    head_hash: str
    findings: tuple[Finding, ...]
    replayed: int

    def to_dict(self) -> dict:
        """JSON-ready dict (the `dpfleet ledger verify --json` shape)."""
        return {
            "entries": self.entries,
            "datasets": self.datasets,
            "head_hash": self.head_hash,
            "replayed": self.replayed,
            "findings": [finding.to_dict() for finding in self.findings],
        }
