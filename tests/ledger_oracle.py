"""An oracle of the ledger's promise, kept apart from the ledger: which rows (or people) each block holds, which
charges were admitted, and whether each row's composed ε stays within every budget that protects it.

It knows what a block holds from the files the test wrote (a link, a URL or a copy of a file holds that file's
rows), never from the ledger's declarations, and it composes charges with dp-accounting's own RdpAccountant at the
orders each budget published when it was created: it calls none of the ledger's admission code.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import dp_accounting

# (sampling rate, noise multiplier, sensitivity factor) of one step.
Mechanism = tuple[float, float, float]
# Float differences between dp-accounting's sum and the ledger's exact tally (the ledger rounds up, with a margin
# of 1e-9 on admission): a row over its budget by less than this is not a finding.
TOLERANCE = 1e-9
# The atom that stands for every row of a dataset that no block declares: a charge to the dataset reaches it.
UNDECLARED = ("undeclared",)


@dataclass(frozen=True)
class Budget:
    """A budget as published when it was created: (epsilon, delta) and its filter's orders, fixed from then on."""

    epsilon: float
    delta: float
    orders: tuple[float, ...]


@dataclass
class Charge:
    """An admitted job as the oracle saw it admitted: its charged steps in plan order and how many are committed."""

    tenant: str
    dataset: str
    blocks: tuple[str, ...]
    events: tuple[tuple[Mechanism, int], ...]
    committed: int = 0
    active: bool = True

    @property
    def planned_steps(self) -> int:
        """Steps in the plan."""
        return sum(steps for _, steps in self.events)

    def held(self) -> tuple[tuple[Mechanism, int], ...]:
        """The steps that count against a budget: the committed ones, and while active the unrun ones too."""
        if self.active:
            return self.events
        left, held = self.committed, []
        for mechanism, steps in self.events:
            if left <= 0:
                break
            held.append((mechanism, min(steps, left)))
            left -= steps
        return tuple(held)


def group_charge(events: tuple[tuple[Mechanism, int], ...], rows_per_person: int):
    """What one person of at most `rows_per_person` rows is charged for example-level steps: each step samples the
    person with probability 1 - (1 - q)^k, whose rows move the sum by k times the sensitivity (docs/privacy.md)."""
    if rows_per_person == 1:
        return events
    return tuple(((1.0 - (1.0 - rate) ** rows_per_person, sigma, factor * rows_per_person), steps)
                 for (rate, sigma, factor), steps in events)


@functools.lru_cache(maxsize=4096)
def filter_epsilon(orders: tuple[float, ...], delta: float, steps: tuple[tuple[Mechanism, int], ...]) -> float:
    """The least over `orders` of the epsilon at delta / len(orders) of the composed steps (dp-accounting)."""
    best = float("inf")
    for order in orders:
        accountant = dp_accounting.rdp.RdpAccountant([order])
        for (rate, sigma, factor), count in steps:
            accountant.compose(
                dp_accounting.PoissonSampledDpEvent(rate, dp_accounting.GaussianDpEvent(sigma / factor)), count
            )
        best = min(best, accountant.get_epsilon(delta / len(orders)))
    return best


def merged(steps) -> tuple[tuple[Mechanism, int], ...]:
    """Steps of the same mechanism added together, in a fixed order (composition does not depend on order)."""
    totals: dict[Mechanism, int] = {}
    for mechanism, count in steps:
        totals[mechanism] = totals.get(mechanism, 0) + count
    return tuple(sorted(item for item in totals.items() if item[1]))


@dataclass
class Dataset:
    """A dataset as the oracle knows it: its unit, owner, budget and blocks (each with the atoms it holds)."""

    owner: str
    unit: str
    budget: Budget
    blocks: dict[str, tuple[Budget, frozenset]] = field(default_factory=dict)


@dataclass
class Oracle:
    """The ledger's promise, recomputed: datasets, blocks, quotas and admitted charges, and what they break."""

    datasets: dict[str, Dataset] = field(default_factory=dict)
    charges: dict[str, Charge] = field(default_factory=dict)
    # (dataset, tenant, block or None) -> the quota's budget as published when it was set.
    quotas: dict[tuple[str, str, str | None], Budget] = field(default_factory=dict)

    def atoms_of(self, dataset: str, blocks: tuple[str, ...]) -> frozenset | None:
        """The atoms a charge on `blocks` reaches; None for a charge to the dataset, which reaches all of them."""
        if not blocks:
            return None
        return frozenset().union(*(self.datasets[dataset].blocks[block][1] for block in blocks))

    def overspent(self) -> list[str]:
        """Every row or person whose composed charges exceed a budget protecting it (empty when none does).

        A unit is protected by the dataset's budget and by each block that holds it; its charges were admitted by
        the filters of the blocks that hold it (the dataset's when none does), so each requirement must be met at
        one of those filters' published orders.
        """
        problems = []
        for name, dataset in self.datasets.items():
            charges = [charge for charge in self.charges.values() if charge.dataset == name]
            atoms = {UNDECLARED}.union(*(atoms for _, atoms in dataset.blocks.values()))
            groups: dict[tuple, list] = {}
            for atom in atoms:
                covering = tuple(sorted(block for block, (_, held) in dataset.blocks.items() if atom in held))
                reaching = tuple(index for index, charge in enumerate(charges)
                                 if not charge.blocks or atom in self.atoms_of(name, charge.blocks))
                groups.setdefault((covering, reaching), []).append(atom)
            for (covering, reaching), members in groups.items():
                steps = merged(step for index in reaching for step in charges[index].held())
                if not steps:
                    continue
                certificates = [dataset.blocks[block][0] for block in covering] or [dataset.budget]
                for requirement_name, requirement in (
                        [("the dataset", dataset.budget)]
                        + [(f"block {block!r}", dataset.blocks[block][0]) for block in covering]):
                    spent = min(filter_epsilon(certificate.orders, requirement.delta, steps)
                                for certificate in certificates)
                    if spent > requirement.epsilon * (1.0 + TOLERANCE):
                        problems.append(
                            f"dataset {name}: {len(members)} units (e.g. {sorted(map(str, members))[0]}) in blocks "
                            f"{list(covering)} spent ε {spent:.6g} over {requirement_name}'s ε {requirement.epsilon}"
                        )
        return problems

    def quota_overspent(self, charge: Charge) -> list[str]:
        """Where the tenant of a just-admitted `charge` now holds more than its quota on a budget it charged."""
        problems = []
        for block in charge.blocks or (None,):
            quota = self.quotas.get((charge.dataset, charge.tenant, block))
            if quota is None and block is not None:
                quota = self.quotas.get((charge.dataset, charge.tenant, None))
            if quota is None:
                continue
            steps = merged(step for other in self.charges.values()
                           if other.tenant == charge.tenant and other.dataset == charge.dataset
                           and (block in other.blocks or (block is None and not other.blocks))
                           for step in other.held())
            spent = filter_epsilon(quota.orders, quota.delta, steps)
            if spent > quota.epsilon * (1.0 + TOLERANCE):
                problems.append(f"tenant {charge.tenant!r} holds ε {spent:.6g} on {charge.dataset} block {block} "
                                f"over its quota ε {quota.epsilon}")
        return problems
