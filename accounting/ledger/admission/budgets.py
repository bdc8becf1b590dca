"""Budgets: whether a job fits a dataset's, a block's or a quota's filter, and the figures a status reports.

A total fits a budget only with a relative margin of `ADMISSION_MARGIN`,
which covers the last-bit error of the RDP-to-epsilon conversion.

Reports. `spent_epsilon_filter` is what the filter counts against the
committed events: the epsilon its rule gives them; `reserved_epsilon` what
the reservations add to it, and `remaining_epsilon` the budget minus the
filter's epsilon of committed + reserved, which is the view admission uses,
so spent_filter + reserved + remaining = budget. `spent_epsilon` is the PLD
epsilon of the committed events as if every job had been fixed in advance
(non-adaptive: tight, but no guarantee when jobs depend on earlier results),
or, for a caller that would rather not wait the 0.1-1 s the PLD of newly
committed events takes, their RDP epsilon over the whole order grid until
the PLD figure is ready (`spent_epsilon_accountant` says which);
`spent_epsilon_rdp` is that non-adaptive RDP epsilon.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Hashable

from accounting.events import Composition
from accounting.ledger.admission.rule import AdmissionRule
from accounting.ledger.admission.tally import RdpTally, forget_stored_tallies
from accounting.ledger.caches import forget_curves, forget_pld_figures, spent_pld_epsilon
from accounting.ledger.errors import BudgetExceeded, FailedPrecondition
from accounting.ledger.validation import check_budget_epsilon

# Relative margin a total must clear below the budget; covers the few-ulp
# error of the RDP-to-epsilon conversion (about 1e-15) by a wide factor.
ADMISSION_MARGIN = 1e-9


def fits_budget(epsilon: float, budget_epsilon: float) -> bool:
    """True when `epsilon` is below `budget_epsilon` by the safety margin (so equality is refused)."""
    return epsilon * (1.0 + ADMISSION_MARGIN) <= budget_epsilon


@dataclass(frozen=True)
class BudgetCheck:
    """One budget's answer to a job: does held + planned pass its filter, and by how much.

    `budget` says which budget ("dataset 'mnist'", "block 'd1' of dataset
    'mnist'", "tenant 'b''s quota on ..."); epsilons are the filter's, at
    `delta`: `held_epsilon` of what is committed and reserved now,
    `needed_epsilon` what the job adds to it, `remaining_epsilon` the budget
    minus held (what is left now); `held_after_epsilon` that of held +
    planned and `remaining_after_epsilon` the budget minus it (what would be
    left; negative when the job does not fit).
    """

    budget: str
    budget_epsilon: float
    delta: float
    held_epsilon: float
    held_after_epsilon: float
    needed_epsilon: float
    remaining_epsilon: float
    remaining_after_epsilon: float
    fits: bool

    def refusal(self, dataset: str) -> BudgetExceeded:
        """The BudgetExceeded this check stands for, on `dataset` as the caller names it."""
        return BudgetExceeded(dataset, self.remaining_epsilon, self.needed_epsilon, self.delta, self.budget)

    def to_dict(self) -> dict:
        """JSON-ready dict."""
        return {
            "budget": self.budget,
            "budget_epsilon": self.budget_epsilon,
            "delta": self.delta,
            "held_epsilon": self.held_epsilon,
            "held_after_epsilon": self.held_after_epsilon,
            "needed_epsilon": self.needed_epsilon,
            "remaining_epsilon": self.remaining_epsilon,
            "remaining_after_epsilon": self.remaining_after_epsilon,
            "fits": self.fits,
        }


def assess_admission(
    budget: str, rule: AdmissionRule, budget_epsilon: float, held: RdpTally, planned: RdpTally
) -> BudgetCheck:
    """Whether held + planned passes the filter `rule` within `budget_epsilon`, with the figures (see BudgetCheck)."""
    total_epsilon = rule.epsilon(held + planned)
    held_epsilon = rule.epsilon(held)
    return BudgetCheck(
        budget=budget,
        budget_epsilon=budget_epsilon,
        delta=rule.delta,
        held_epsilon=held_epsilon,
        held_after_epsilon=total_epsilon,
        needed_epsilon=total_epsilon - held_epsilon,
        remaining_epsilon=max(0.0, budget_epsilon - held_epsilon),
        remaining_after_epsilon=budget_epsilon - total_epsilon,
        fits=fits_budget(total_epsilon, budget_epsilon),
    )


def check_admission(
    dataset: str, rule: AdmissionRule, budget_epsilon: float, held: RdpTally, planned: RdpTally,
    budget: str | None = None,
) -> float:
    """Return the filter's epsilon of held + planned, or raise BudgetExceeded if it does not fit the budget.

    `held` is the tally of committed and reserved steps on the budget (the
    dataset's, a block's or a tenant's quota: `budget` says which, in
    words); `planned` the tally of the job asking for a reservation.
    """
    check = assess_admission(budget or f"dataset {dataset!r}", rule, budget_epsilon, held, planned)
    if not check.fits:
        raise check.refusal(dataset)
    return check.held_after_epsilon


@dataclass(frozen=True)
class FitReport:
    """A dry run of a reservation: `fits` when every budget the job would be charged to admits it.

    `checks` has one BudgetCheck per budget: the dataset's or each named
    block's, then the caller's quota on each where one is set.
    """

    dataset: str
    blocks: tuple[str, ...]
    checks: tuple[BudgetCheck, ...]

    @property
    def fits(self) -> bool:
        """True when every budget admits the job."""
        return all(check.fits for check in self.checks)

    def to_dict(self) -> dict:
        """JSON-ready dict (the `dpfleet ledger fits --json` shape)."""
        return {
            "dataset": self.dataset,
            "blocks": list(self.blocks),
            "fits": self.fits,
            "checks": [check.to_dict() for check in self.checks],
        }


def check_new_budget(dataset: str, rule: AdmissionRule, budget_epsilon: float, held: RdpTally) -> float:
    """A new budget for a dataset; refused when it would not cover what is committed and reserved."""
    budget_epsilon = check_budget_epsilon(budget_epsilon)
    held_epsilon = rule.epsilon(held)
    if not fits_budget(held_epsilon, budget_epsilon):
        raise FailedPrecondition(
            f"dataset {dataset!r} already has ε {held_epsilon:.6g} committed or reserved at δ={rule.delta:g}; "
            f"a budget of ε {budget_epsilon:g} would not cover it. Choose a budget above {held_epsilon:.6g}, "
            "or release reservations first"
        )
    return budget_epsilon


@dataclass(frozen=True)
class BudgetFigures:
    """A dataset's budget in epsilon at its delta (see the module docstring for each figure).

    `spent_epsilon_accountant` says which accountant gave `spent_epsilon`:
    "pld", or "rdp" when the caller chose not to wait for the PLD figure.
    """

    spent_epsilon: float
    spent_epsilon_rdp: float
    spent_epsilon_filter: float
    reserved_epsilon: float
    remaining_epsilon: float
    spent_epsilon_accountant: str


@functools.lru_cache(maxsize=1024)
def rdp_figures(budget_epsilon: float, rule: AdmissionRule, committed: RdpTally, held: RdpTally) -> BudgetFigures:
    """The figures of `budget_figures` with the non-adaptive RDP ε as `spent_epsilon` (no PLD): cached.

    `committed` is the tally of the committed steps (tally.stored_tally of
    them as stored: remembered, or read back with the composed state after a
    restart, so a status computes no mechanism's curve again).
    """
    spent_rdp = committed.epsilon(rule.delta)
    spent_filter = rule.epsilon(committed)
    held_filter = rule.epsilon(held)
    return BudgetFigures(
        spent_epsilon=spent_rdp,
        spent_epsilon_rdp=spent_rdp,
        spent_epsilon_filter=spent_filter,
        reserved_epsilon=max(0.0, held_filter - spent_filter),
        remaining_epsilon=max(0.0, budget_epsilon - held_filter),
        spent_epsilon_accountant="rdp",
    )


def budget_figures(
    budget_epsilon: float,
    rule: AdmissionRule,
    committed_events: Composition,
    committed: RdpTally,
    held: RdpTally,
    pld_may_be_pending: bool = False,
    lineage: Hashable | None = None,
) -> BudgetFigures:
    """Spent (filter, and non-adaptive PLD and RDP), reserved and remaining epsilon of one dataset.

    `committed_events` are the dataset's committed steps and `committed`
    their tally; `held` the tally of committed and reserved-unrun steps;
    `rule` the dataset's admission rule. Cached: a status of an unchanged
    dataset costs no accounting. The PLD epsilon of newly committed events
    takes 0.1-1 s; with `pld_may_be_pending` a caller gets the figures at
    once, with the non-adaptive RDP bound as `spent_epsilon` (labelled
    "rdp") until the PLD figure, started in the background, is ready.
    `lineage` names the budget, whose composed PLD is then extended by new
    commits, not composed again (see caches.spent_pld_epsilon).
    """
    figures = rdp_figures(budget_epsilon, rule, committed, held)
    spent_pld = spent_pld_epsilon(
        committed_events, rule.delta, figures.spent_epsilon_rdp, wait=not pld_may_be_pending, lineage=lineage
    )
    if spent_pld is None:
        return figures
    return replace(figures, spent_epsilon=spent_pld, spent_epsilon_accountant="pld")


def forget_figures() -> None:
    """Forget every figure, RDP curve, tally and PLD computed in this process, as a restart does (the next
    status reads what the ledger kept, and computes only what that lacks)."""
    forget_pld_figures()
    forget_curves()
    forget_stored_tallies()
    rdp_figures.cache_clear()
