"""What one privacy unit (a row, or a person) could have spent across the blocks that may hold it."""

from __future__ import annotations

import json

from accounting.events import Composition, EventError
from accounting.ledger.admission import RdpTally, block_data_overlap, canonical, fits_budget
from accounting.ledger.validation import EXAMPLE, USER
from accounting.ledger.verification.findings import Finding
from accounting.ledger.verification.rows import StoredDataset, StoredEntry


def unit_findings(entries: list[StoredEntry], datasets: list[StoredDataset]) -> list[Finding]:
    """Replay, per privacy unit (a row, or a person), what every committed step that could touch it spent.

    A unit of block b could be touched by the dataset's own jobs (they read
    every row), by b's jobs, and by the jobs of every block whose declaration
    (as the history records it) may share units with b's
    (`block_data_overlap`). The ε of that union of committed steps is the
    least, over the filters that watched any of them (the dataset's and those
    blocks'), of the filter's ε; it must fit the dataset's budget. Also finds
    a block row whose declaration is not the one its history records.
    """
    rows = {row.dataset_id: row for row in datasets}
    block_ids = {(row.block_of, row.block): row.dataset_id for row in datasets if row.block_of is not None}
    unit: dict[int, str] = {}
    budget: dict[int, float] = {}
    declared: dict[int, dict | None] = {}
    committed: dict[int, Composition] = {}
    findings = []
    for entry in entries:
        if entry.action not in ("create_dataset", "raise_budget", "add_block", "commit"):
            continue
        try:
            details = json.loads(entry.details_json)
            if entry.action == "create_dataset":
                unit[entry.dataset_id] = details.get("privacy_unit", EXAMPLE)
                budget[entry.dataset_id] = float(details["epsilon"])
            elif entry.action == "raise_budget":
                budget[entry.dataset_id] = float(details["to"])
            elif entry.action == "add_block":
                declared[entry.dataset_id] = details.get("data")
            else:
                events = Composition.from_dict(details["events"])
                charged = [block_ids.get((entry.dataset_id, block), -1) for block in details.get("blocks") or ()]
                for budget_id in charged or [entry.dataset_id]:
                    committed[budget_id] = canonical(committed.get(budget_id, Composition()).then(events))
        except (KeyError, TypeError, ValueError, EventError) as error:
            name = rows[entry.dataset_id].name if entry.dataset_id in rows else None
            findings.append(Finding(entry.entry_id, name, f"its details cannot be replayed ({type(error).__name__}: "
                                                          f"{error})"))
    for dataset in datasets:
        if dataset.block_of is not None or dataset.dataset_id not in budget:
            continue
        privacy_unit = unit.get(dataset.dataset_id, EXAMPLE)
        blocks = [row for row in datasets if row.block_of == dataset.dataset_id]
        for block in blocks:
            if block.data != declared.get(block.dataset_id):
                findings.append(Finding(None, block.name, "the row's block data is not what its history declares"))
            sharing = [
                other for other in blocks if other is not block and block_data_overlap(
                    declared.get(block.dataset_id), declared.get(other.dataset_id), privacy_unit) is not None
            ]
            spent = committed.get(dataset.dataset_id, Composition())
            for row in [block, *sharing]:
                spent = spent.then(committed.get(row.dataset_id, Composition()))
            if spent.steps == 0:
                continue
            tally = RdpTally.of(canonical(spent))
            epsilon = min(rule.epsilon(tally) for rule in [dataset.admission, block.admission,
                                                           *(row.admission for row in sharing)])
            if not fits_budget(epsilon, budget[dataset.dataset_id]):
                also = f" and in {', '.join(repr(row.block) for row in sharing)}" if sharing else ""
                findings.append(Finding(
                    None, dataset.name,
                    f"one {'person' if privacy_unit == USER else 'row'} in block {block.block!r}{also} could have "
                    f"spent ε {epsilon:.6g}, over the dataset's budget ε {budget[dataset.dataset_id]:g}",
                ))
    return findings
