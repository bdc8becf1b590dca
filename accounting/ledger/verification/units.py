"""What one privacy unit (a row, or a person) could have spent across the blocks that may hold it."""

from __future__ import annotations

import json

from accounting.events import Composition, EventError, event_of
from accounting.ledger.admission import RdpTally, block_data_overlap, canonical, fits_budget
from accounting.ledger.validation import EXAMPLE, USER
from accounting.ledger.verification.findings import Finding
from accounting.ledger.verification.rows import StoredDataset, StoredEntry


class UnitReplay:
    """Per privacy unit (a row, or a person), what every committed step that could touch it spent.

    A unit of block b could be touched by the dataset's own jobs (they read
    every row), by b's jobs, and by the jobs of every block whose declaration
    (as the history records it) may share units with b's
    (`block_data_overlap`). The ε of that union of committed steps is the
    least, over the filters that watched any of them (the dataset's and those
    blocks'), of the filter's ε; it must fit the dataset's budget. Also finds
    a block row whose declaration is not the one its history records.
    Extended entry by entry (`apply`), compared with the rows at the end
    (`findings`).
    """

    def __init__(self) -> None:
        self.unit: dict[int, str] = {}
        self.budget: dict[int, float] = {}
        self.declared: dict[int, dict | None] = {}
        # Per budget, the committed steps per mechanism (sampling rate, noise multiplier, sensitivity factor).
        self.committed: dict[int, dict[tuple[float, float, float], int]] = {}
        # Each training file's SHA-256, as a dataset's registration or first job bound it, and that dataset's id.
        self.content_owner: dict[str, int] = {}
        self.entry_findings: list[Finding] = []

    def apply(self, entry: StoredEntry, rows: dict[int, StoredDataset], block_ids: dict[tuple[int, str], int]) -> None:
        """Extend the replay by one history entry; one it cannot apply is a finding."""
        if entry.action not in ("create_dataset", "bind_content", "raise_budget", "add_block", "commit"):
            return
        try:
            details = json.loads(entry.details_json)
            if entry.action in ("create_dataset", "bind_content"):
                self._bind(entry, details.get("content") or (), rows)
            if entry.action == "create_dataset":
                self.unit[entry.dataset_id] = details.get("privacy_unit", EXAMPLE)
                self.budget[entry.dataset_id] = float(details["epsilon"])
            elif entry.action == "raise_budget":
                self.budget[entry.dataset_id] = float(details["to"])
            elif entry.action == "add_block":
                self.declared[entry.dataset_id] = details.get("data")
            elif entry.action == "commit":
                events = Composition.from_dict(details["events"])
                charged = [block_ids.get((entry.dataset_id, block), -1) for block in details.get("blocks") or ()]
                for budget_id in charged or [entry.dataset_id]:
                    steps = self.committed.setdefault(budget_id, {})
                    for event in events.events:
                        mechanism = event.mechanism_key
                        steps[mechanism] = steps.get(mechanism, 0) + event.steps
        except (KeyError, TypeError, ValueError, EventError) as error:
            name = rows[entry.dataset_id].name if entry.dataset_id in rows else None
            self.entry_findings.append(Finding(entry.entry_id, name, f"its details cannot be replayed "
                                                                     f"({type(error).__name__}: {error})"))

    def _bind(self, entry: StoredEntry, content: list[str], rows: dict[int, StoredDataset]) -> None:
        """Bind `content` to the entry's dataset; a file another dataset holds already is a finding: its rows
        would have two budgets (admission refuses this, so the entry was written past it)."""
        shared = sorted(digest for digest in content
                        if self.content_owner.setdefault(digest, entry.dataset_id) != entry.dataset_id)
        if shared:
            owner = rows.get(self.content_owner[shared[0]])
            name = rows[entry.dataset_id].name if entry.dataset_id in rows else None
            self.entry_findings.append(Finding(
                entry.entry_id, name,
                f"binds {len(shared)} file(s) that dataset {owner.name if owner else '(deleted)'!r} holds already "
                f"(one of SHA-256 {shared[0][:16]}…): the same rows under two budgets",
            ))

    def _spent(self, budget_ids: list[int]) -> Composition:
        return canonical(Composition(tuple(
            event_of(mechanism, steps)
            for budget_id in budget_ids
            for mechanism, steps in self.committed.get(budget_id, {}).items()
        )))

    def findings(self, datasets: list[StoredDataset]) -> list[Finding]:
        """What the replay found, and each block whose units could have spent over the dataset's budget."""
        findings = list(self.entry_findings)
        for dataset in datasets:
            if dataset.block_of is not None or dataset.dataset_id not in self.budget:
                continue
            privacy_unit = self.unit.get(dataset.dataset_id, EXAMPLE)
            budget = self.budget[dataset.dataset_id]
            blocks = [row for row in datasets if row.block_of == dataset.dataset_id]
            for position, block in enumerate(blocks):
                if block.data != self.declared.get(block.dataset_id):
                    findings.append(Finding(None, block.name, "the row's block data is not what its history declares"))
                findings.extend(_shared_with_later(block, blocks[position + 1:], privacy_unit))
                sharing = [
                    other for other in blocks if other is not block and block_data_overlap(
                        self.declared.get(block.dataset_id), self.declared.get(other.dataset_id), privacy_unit
                    ) is not None
                ]
                spent = self._spent([dataset.dataset_id, block.dataset_id, *(row.dataset_id for row in sharing)])
                if spent.steps == 0:
                    continue
                tally = RdpTally.of(spent)
                epsilon = min(rule.epsilon(tally) for rule in [dataset.admission, block.admission,
                                                               *(row.admission for row in sharing)])
                if not fits_budget(epsilon, budget):
                    also = f" and in {', '.join(repr(row.block) for row in sharing)}" if sharing else ""
                    findings.append(Finding(
                        None, dataset.name,
                        f"one {'person' if privacy_unit == USER else 'row'} in block {block.block!r}{also} could "
                        f"have spent ε {epsilon:.6g}, over the dataset's budget ε {budget:g}",
                    ))
        return findings


def _shared_with_later(block: StoredDataset, later: list[StoredDataset], privacy_unit: str) -> list[Finding]:
    """A finding for each later block whose stored declaration may share a unit with `block`'s.

    Admission refuses such a pair, so one in the rows was written past it
    (into the database, or by a ledger that did not check). Blocks that
    declared nothing (added before declarations) are left to the replay of
    what their units spent.
    """
    if block.data is None:
        return []
    return [
        Finding(None, block.name, f"its declared data may be shared with block {other.block!r} ({reason}); a "
                                  "unit's guarantee is one block's budget only when the blocks are disjoint")
        for other in later
        if other.data is not None and (reason := block_data_overlap(block.data, other.data, privacy_unit)) is not None
    ]
