"""Pre-registered plans, pure: a dataset's budget split into a filter part and a plan pool, a plan's PLD cost,
and the pool's admission rule (basic composition of approximate DP; docs/ledger.md states and proves it)."""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from typing import Sequence

from accounting.accountants import PldFallbackWarning, get_accountant
from accounting.events import Composition
from accounting.ledger.admission.budgets import fits_budget
from accounting.ledger.admission.rule import AdmissionRule
from accounting.ledger.errors import BudgetExceeded, FailedPrecondition, InvalidArgument

# A plan's delta when it names none: this share of the pool's, so ten such plans fit the pool's delta.
DEFAULT_PLAN_DELTA_SHARE = 0.1
# The largest share of a budget a plan pool may take: the filter keeps some budget of its own.
MAX_PLAN_SHARE = 0.99


def check_plan_share(share: float) -> float:
    """A dataset's plan share: a number in [0, MAX_PLAN_SHARE]."""
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0.0 <= share <= MAX_PLAN_SHARE:
        raise InvalidArgument(f"plan share must be a number from 0 to {MAX_PLAN_SHARE} (got {share!r}): the share "
                              "of the budget set aside for pre-registered plans, the rest staying with the filter")
    return float(share)


def split_budget(epsilon: float, delta: float, share: float) -> tuple[tuple[float, float], tuple[float, float]]:
    """The filter's (epsilon, delta) and the plan pool's, when `share` of a budget of (`epsilon`, `delta`) is
    set aside for plans; the two add up to the budget, which their concurrent composition keeps."""
    pool = (epsilon * share, delta * share)
    return (epsilon - pool[0], delta - pool[1]), pool


def rule_with_pool(epsilon: float, delta: float, share: float) -> AdmissionRule:
    """The admission rule of a new dataset of budget (`epsilon`, `delta`) that sets `share` aside for plans: the
    RDP filter of the rest, with the pool recorded beside it."""
    (filter_epsilon, filter_delta), (pool_epsilon, pool_delta) = split_budget(epsilon, delta, share)
    rule = AdmissionRule.for_budget(filter_epsilon, filter_delta)
    return AdmissionRule(rule.orders, rule.delta, rule.name, pool_epsilon, pool_delta)


def planned_jobs(jobs: Sequence[Composition]) -> Composition:
    """A plan's jobs run one after another: the events the plan's guarantee is about."""
    combined = Composition()
    for job in jobs:
        combined = combined.then(job)
    return combined


def plan_jobs_json(jobs: Sequence[Composition]) -> str:
    """How a plan's row holds its jobs: a JSON list of their events (what `verify` compares it with)."""
    return json.dumps([job.to_dict() for job in jobs], sort_keys=True)


def plan_epsilon(jobs: Sequence[Composition], delta: float) -> float:
    """A plan's epsilon at `delta`: the PLD accountant's rigorous bound on all its jobs composed (its RDP bound
    where PLD's grid is impractical, past epsilon 100)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PldFallbackWarning)
        return get_accountant("pld").epsilon(planned_jobs(jobs), delta)


@dataclass(frozen=True)
class PoolUse:
    """What the plans registered on a dataset take from its pool: their epsilons and deltas, summed."""

    epsilon: float = 0.0
    delta: float = 0.0
    plans: int = 0

    def plus(self, epsilon: float, delta: float) -> "PoolUse":
        """The use after one more plan of (`epsilon`, `delta`)."""
        return PoolUse(self.epsilon + epsilon, self.delta + delta, self.plans + 1)


def default_plan_delta(rule: AdmissionRule) -> float:
    """The delta a plan is charged at when it names none (DEFAULT_PLAN_DELTA_SHARE of the pool's)."""
    return rule.plan_delta * DEFAULT_PLAN_DELTA_SHARE


def check_plan_delta(rule: AdmissionRule, delta: float | None) -> float:
    """A plan's delta: given, in (0, the pool's delta], else `default_plan_delta`."""
    if delta is None:
        return default_plan_delta(rule)
    if isinstance(delta, bool) or not isinstance(delta, (int, float)) or not 0.0 < delta <= rule.plan_delta:
        raise InvalidArgument(f"a plan's delta must be above 0 and at most its pool's delta {rule.plan_delta:g} "
                              f"(got {delta!r})")
    return float(delta)


def _delta_fits(rule: AdmissionRule, used: PoolUse, delta: float) -> bool:
    """Whether the plans' deltas, with one more of `delta`, stay within the pool's (to a last-bit margin)."""
    return used.delta + delta <= rule.plan_delta * (1.0 + 1e-12)


def pool_admits(rule: AdmissionRule, used: PoolUse, epsilon: float, delta: float) -> bool:
    """Whether a plan of (`epsilon`, `delta`) fits the pool after `used`: both sums within the pool's (with the
    filter's margin on epsilon)."""
    return (rule.has_plan_pool and fits_budget(used.epsilon + epsilon, rule.plan_epsilon)
            and _delta_fits(rule, used, delta))


def refuse_without_pool(reference: str, plan: str, rule: AdmissionRule) -> None:
    """Raise FailedPrecondition, in words, when the dataset set no plan pool aside."""
    if not rule.has_plan_pool:
        raise FailedPrecondition(
            f"dataset {reference!r} has no plan pool, so plan {plan!r} cannot be charged its PLD ε; create a "
            "dataset with a plan share (dpfleet ledger dataset create NAME --plan-share 0.5), or run the jobs one "
            "by one through the filter"
        )


def check_pool_admits(reference: str, plan: str, rule: AdmissionRule, used: PoolUse, epsilon: float,
                      delta: float) -> None:
    """Raise, in words, unless `pool_admits`: FailedPrecondition for a dataset without a pool, BudgetExceeded for
    a plan past what its pool has left (of epsilon, or of delta)."""
    refuse_without_pool(reference, plan, rule)
    if not pool_admits(rule, used, epsilon, delta):
        left_delta = max(0.0, rule.plan_delta - used.delta)
        short_of = "" if _delta_fits(rule, used, delta) else \
            f"; δ {left_delta:.3g} left, where the plan asks δ {delta:.3g}"
        raise BudgetExceeded(reference, max(0.0, rule.plan_epsilon - used.epsilon), epsilon, delta,
                             budget=f"the plan pool of dataset {reference!r} ({used.plans} plan(s) so far"
                                    f"{short_of})")
