"""The admission rule: an RDP filter at K orders fixed when a dataset is created.

Each dataset keeps a running RDP tally of everything committed or
reserved-but-unrun, and the `AdmissionRule` it was created with: an RDP
filter (Feldman & Zrnic 2021) at K orders fixed at creation, with the
(epsilon, delta) conversion of each order taken at delta/K. A reservation is
admitted when, at one of those orders at least, the RDP of (tally + the
job's plan) converts to an epsilon within the budget; a commit only when the
committed steps plus its block still do. A union bound over the K orders
makes every sequence of jobs, however adaptively chosen, (budget, delta)-DP
(the theorem and its proof are in docs/ledger.md). A reserve costs O(orders),
not O(history).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from accounting.accountants import RDP_ORDERS, compute_epsilon
from accounting.ledger.admission.tally import RdpTally

FILTER_RULE = "rdp-filter"
# Orders a new dataset's filter watches: around the order where a budget of Gaussian-like steps is used best.
FILTER_ORDER_COUNT = 3
# The orders sit at (alpha* - 1) times these factors; alpha* is that best order.
_FILTER_ORDER_FACTORS = (0.5, 1.0, 2.0)
# dp-accounting converts RDP to (epsilon, delta) only above this order (it returns inf at and below it).
_LOWEST_CONVERTIBLE_ORDER = 1.01


@functools.lru_cache(maxsize=None)  # a rule's few orders, each looked up for every tally it converts
def _order_index(order: float) -> int:
    matches = np.flatnonzero(RDP_ORDERS == order)
    if len(matches) != 1 or order <= _LOWEST_CONVERTIBLE_ORDER:
        raise ValueError(
            f"filter order {order!r} is not an order of the RDP grid above {_LOWEST_CONVERTIBLE_ORDER} "
            "(accounting.accountants.RDP_ORDERS); the ledger file was written by another dpfleet version"
        )
    return int(matches[0])


def order_epsilon(order: float, divergence: float, delta: float) -> float:
    """The epsilon at `delta` of a mechanism whose Renyi divergence at `order` is `divergence` (nats).

    dp-accounting's conversion at that one order (Canonne, Kamath and
    Steinke 2020, Proposition 12); inf when the divergence is unbounded.
    """
    if not math.isfinite(divergence):
        return math.inf
    epsilon, _ = compute_epsilon([order], [divergence], delta)
    return float(epsilon)


@dataclass(frozen=True)
class AdmissionRule:
    """How a dataset admits jobs: an RDP filter at fixed `orders`, with delta split evenly between them.

    Fixed when the dataset is created, from its budget alone (never from
    the jobs), and recorded with it. A job fits when, at one of the orders
    at least, the tally converts to an epsilon within the budget at
    `delta_per_order` = delta / K. Under that rule any sequence of jobs,
    each chosen after seeing the results of the earlier ones, is
    (budget, delta)-DP: at each order alone the rule is a Renyi filter
    (Feldman & Zrnic 2021), and a union bound over the K orders adds their
    delta/K (docs/ledger.md states and proves it).
    """

    orders: tuple[float, ...]
    delta: float
    name: str = FILTER_RULE
    # The plan pool set aside at creation (`plan_pool`): pre-registered plans are charged their PLD (epsilon,
    # delta) from it, by basic composition; none when both are 0.
    plan_epsilon: float = 0.0
    plan_delta: float = 0.0

    def __post_init__(self) -> None:
        if self.name != FILTER_RULE:
            raise ValueError(f"unknown admission rule {self.name!r}; this dpfleet knows {FILTER_RULE!r}")
        if not self.orders or len(set(self.orders)) != len(self.orders):
            raise ValueError(f"an RDP filter needs one or more distinct orders (got {self.orders!r})")
        for order in self.orders:
            _order_index(order)
        if not (0.0 <= self.plan_epsilon < math.inf and 0.0 <= self.plan_delta < 1.0) or (
            (self.plan_epsilon > 0.0) != (self.plan_delta > 0.0)
        ):
            raise ValueError(f"a plan pool needs an epsilon and a delta in [0, 1) both above 0, or neither "
                             f"(got {self.plan_epsilon!r}, {self.plan_delta!r})")

    @classmethod
    def for_budget(cls, budget_epsilon: float, delta: float) -> "AdmissionRule":
        """The rule of a new dataset with budget (`budget_epsilon`, `delta`).

        For Gaussian steps of total zCDP rho, the RDP epsilon rho * alpha +
        log(1/d) / (alpha - 1) is least at alpha* - 1 = sqrt(log(1/d) / rho);
        solving for the rho that fills the budget at d = delta / K gives
        alpha*. The filter watches the grid orders nearest (alpha* - 1) * 1/2,
        * 1 and * 2: subsampled steps with little noise are used best a
        little below alpha*, many small budgets a little above.
        """
        log_inverse_delta = math.log(FILTER_ORDER_COUNT / delta)
        best_minus_one = math.sqrt(log_inverse_delta) / (
            math.sqrt(log_inverse_delta + budget_epsilon) - math.sqrt(log_inverse_delta)
        )
        candidates = RDP_ORDERS[RDP_ORDERS > _LOWEST_CONVERTIBLE_ORDER]
        orders = sorted(
            {
                float(candidates[np.argmin(np.abs(np.log(candidates - 1.0) - math.log(best_minus_one * factor)))])
                for factor in _FILTER_ORDER_FACTORS
            }
        )
        return cls(tuple(orders), delta)

    @property
    def has_plan_pool(self) -> bool:
        """Whether the dataset set a plan pool aside when it was created."""
        return self.plan_epsilon > 0.0

    @property
    def delta_per_order(self) -> float:
        """The delta each order's conversion is taken at: delta / K."""
        return self.delta / len(self.orders)

    def order_epsilons(self, tally: RdpTally) -> tuple[float, ...]:
        """Per order of the rule, the epsilon at delta / K of the tally's divergence there."""
        return tuple(
            order_epsilon(order, tally.divergence(_order_index(order)), self.delta_per_order)
            for order in self.orders
        )

    def epsilon(self, tally: RdpTally) -> float:
        """The filter's epsilon of a tally: the least of `order_epsilons`; it fits a budget when one order does."""
        return min(self.order_epsilons(tally))

    def order_divergences(self, tally: RdpTally) -> tuple[float, ...]:
        """Per order of the rule, the tally's Renyi divergence (nats, rounded up; inf where unbounded)."""
        divergences = tally.divergences()
        return tuple(float(divergences[_order_index(order)]) for order in self.orders)

    def capacities(self, budget_epsilon: float) -> tuple[float, ...]:
        """Per order of the rule, the divergence (nats) at which its epsilon at delta / K reaches `budget_epsilon`.

        Inverts eps_k(rho) = rho + log(1 - 1/a) - log(a * delta / K) / (a - 1),
        which is linear in rho. What a scheduler compares demands with;
        admission itself stays `check_admission`.
        """
        return tuple(
            budget_epsilon - math.log1p(-1.0 / order) + math.log(order * self.delta_per_order) / (order - 1.0)
            for order in self.orders
        )

    def to_dict(self) -> dict:
        """JSON-ready dict, as stored with the dataset and in its history."""
        pool = {"plan_pool": {"epsilon": self.plan_epsilon, "delta": self.plan_delta}} if self.has_plan_pool else {}
        return {
            "rule": self.name,
            "orders": list(self.orders),
            "delta": self.delta,
            "delta_per_order": self.delta_per_order,
            **pool,
        }

    @classmethod
    def from_dict(cls, data: dict) -> "AdmissionRule":
        """Inverse of `to_dict`."""
        pool = data.get("plan_pool") or {"epsilon": 0.0, "delta": 0.0}
        return cls(tuple(float(order) for order in data["orders"]), float(data["delta"]), data["rule"],
                   float(pool["epsilon"]), float(pool["delta"]))
