"""The queue's scheduling policies (pure): fcfs, dpf and dpack orders, unlocking, priorities, reasons."""

import random

import pytest

from accounting.ledger.admission import AdmissionRule, order_epsilon
from accounting.ledger.scheduling import (
    DPACK,
    DPF,
    FCFS,
    BlockBudget,
    QueuedDemand,
    SchedulingPolicy,
    best_orders,
    dominant_share,
    schedule,
)


def one_block(capacity=1.0, held=0.0, unlocked=1.0):
    return {"d": BlockBudget("d", (capacity,), (held,), unlocked)}


def job(name, need, arrival, priority=0, block="d"):
    return QueuedDemand(name, {block: need if isinstance(need, tuple) else (need,)}, arrival, priority)


def admitted(decisions):
    return [decision.job for decision in decisions if decision.admitted]


def test_capacities_are_where_each_order_reaches_the_budget():
    for budget, delta in ((10.0, 1e-5), (1.0, 1e-7), (3.0, 1e-6)):
        rule = AdmissionRule.for_budget(budget, delta)
        for order, capacity in zip(rule.orders, rule.capacities(budget)):
            assert order_epsilon(order, capacity, rule.delta_per_order) == pytest.approx(budget, rel=1e-12)


def test_fcfs_admits_in_arrival_order_whatever_fits_the_whole_budget():
    queue = [job("small-2", 0.3, 2.0), job("big", 0.8, 0.0), job("small-1", 0.3, 1.0)]
    decisions = schedule(SchedulingPolicy(FCFS), one_block(unlocked=0.1), queue)
    # fcfs ignores unlocking: the big job, first to arrive, takes 80% and the small ones wait.
    assert admitted(decisions) == ["big"]
    assert [(d.job, d.position, d.reason) for d in decisions[1:]] == [
        ("small-1", 1, "needs 30.0% of the budget; 20.0% is unlocked and not held"),
        ("small-2", 2, "needs 30.0% of the budget; 20.0% is unlocked and not held"),
    ]


def test_dpf_admits_smallest_dominant_share_first_within_what_is_unlocked():
    queue = [job("big", 0.8, 0.0), job("small-1", 0.3, 1.0), job("small-2", 0.3, 2.0)]
    decisions = schedule(SchedulingPolicy(DPF, unlock_jobs=10), one_block(unlocked=0.7), queue)
    assert admitted(decisions) == ["small-1", "small-2"]
    assert decisions[2].reason == "needs 80.0% of the budget; 10.0% is unlocked and not held"


def test_higher_priority_goes_first_under_every_policy():
    queue = [job("small", 0.3, 0.0), job("urgent-big", 0.8, 1.0, priority=5)]
    for policy in (SchedulingPolicy(FCFS), SchedulingPolicy(DPF), SchedulingPolicy(DPACK)):
        assert admitted(schedule(policy, one_block(), queue)) == ["urgent-big"]


def test_one_order_with_room_is_enough_as_in_the_filter():
    blocks = {"d": BlockBudget("d", (1.0, 1.0), (0.0, 0.9))}
    assert admitted(schedule(SchedulingPolicy(FCFS), blocks, [job("j", (0.5, 2.0), 0.0)])) == ["j"]
    assert admitted(schedule(SchedulingPolicy(FCFS), blocks, [job("j", (1.5, 0.2), 0.0)])) == []


def test_dpack_packs_by_efficiency_where_dpf_goes_by_dominant_share():
    blocks = {"a": BlockBudget("a", (0.7,), (0.0,)), "b": BlockBudget("b", (1.0,), (0.0,))}
    narrow = QueuedDemand("narrow", {"a": (0.5,)}, 0.0)
    wide = QueuedDemand("wide", {"a": (0.3,), "b": (0.3,)}, 1.0)
    # Dominant shares: narrow 0.5/0.7 = 0.71, wide 0.3/0.7 = 0.43; efficiencies: narrow 1/0.71, wide 1/(0.43+0.3).
    assert dominant_share(wide.demand, blocks) == pytest.approx(0.3 / 0.7)
    assert admitted(schedule(SchedulingPolicy(DPF), blocks, [narrow, wide])) == ["wide"]
    decisions = schedule(SchedulingPolicy(DPACK), blocks, [narrow, wide])
    assert admitted(decisions) == ["narrow"]
    assert decisions[1].reason == "block 'a': needs 42.9% of the budget; 28.6% is unlocked and not held"


def test_blocks_unlock_per_arriving_job_or_over_time_and_never_beyond_the_budget():
    by_jobs = SchedulingPolicy(DPF, unlock_jobs=10)
    assert by_jobs.unlocked_fraction(3, 1e9) == pytest.approx(0.3)
    assert by_jobs.unlocked_fraction(25, 0.0) == 1.0
    by_time = SchedulingPolicy(DPF, unlock_seconds=100.0)
    assert by_time.unlocked_fraction(0, 50.0) == pytest.approx(0.5)
    assert by_time.unlocked_fraction(0, -5.0) == 0.0
    both = SchedulingPolicy(DPACK, unlock_jobs=10, unlock_seconds=100.0)
    assert both.unlocked_fraction(2, 50.0) == pytest.approx(0.5)
    assert SchedulingPolicy(FCFS, unlock_jobs=10).unlocked_fraction(0, 0.0) == 1.0
    assert SchedulingPolicy(DPF).unlocked_fraction(0, 0.0) == 1.0
    assert SchedulingPolicy.from_dict(both.to_dict()) == both


def test_what_is_admitted_always_fits_the_unlocked_budget_at_some_order():
    generator = random.Random(7)
    for trial in range(200):
        blocks = {
            name: BlockBudget(name, (1.0, 2.0, 3.0), tuple(generator.uniform(0, 0.5) * c for c in (1.0, 2.0, 3.0)),
                              generator.uniform(0.2, 1.0))
            for name in ("a", "b", "c")
        }
        queue = [
            QueuedDemand(f"j{index}", {name: tuple(generator.uniform(0, 0.4) * c for c in (1.0, 2.0, 3.0))
                                       for name in generator.sample(sorted(blocks), generator.randint(1, 3))},
                         float(index), generator.randint(0, 1))
            for index in range(8)
        ]
        for policy in (SchedulingPolicy(DPF, 4), SchedulingPolicy(DPACK, 4), SchedulingPolicy(FCFS)):
            chosen = {decision.job for decision in schedule(policy, blocks, queue) if decision.admitted}
            for name, block in blocks.items():
                fraction = 1.0 if policy.name == FCFS else block.unlocked_fraction
                total = [held + sum(j.demand[name][k] for j in queue if j.job in chosen and name in j.demand)
                         for k, held in enumerate(block.held)]
                if any(j.job in chosen and name in j.demand for j in queue):
                    assert any(t <= fraction * c + 1e-12 for t, c in zip(total, block.capacity)), (trial, policy)


def test_bad_policies_and_unknown_blocks_are_refused_with_the_valid_choices():
    with pytest.raises(ValueError, match="one of fcfs, dpf, dpack"):
        SchedulingPolicy("lottery")
    with pytest.raises(ValueError, match="unlock_jobs must be an integer >= 1"):
        SchedulingPolicy(DPF, unlock_jobs=0)
    with pytest.raises(ValueError, match="unlock_seconds must be"):
        SchedulingPolicy(DPF, unlock_seconds=float("nan"))
    with pytest.raises(ValueError, match="blocks \\['x'\\]"):
        schedule(SchedulingPolicy(DPF), one_block(), [job("j", 0.1, 0.0, block="x")])


def test_dpack_fills_a_block_at_the_order_where_most_waiting_jobs_fit():
    # Order 0 fits three of these jobs, order 1 only two: dpack ranks them at order 0, where "low" is cheaper.
    blocks = {"d": BlockBudget("d", (1.0, 1.0), (0.0, 0.0))}
    queue = [
        QueuedDemand("high", {"d": (0.35, 0.2)}, 0.0),
        QueuedDemand("low", {"d": (0.3, 0.5)}, 1.0),
        QueuedDemand("low-2", {"d": (0.3, 0.5)}, 2.0),
    ]
    free = {"d": (1.0, 1.0)}
    assert best_orders(queue, free) == {"d": 0}
    assert [d.job for d in schedule(SchedulingPolicy(DPACK), blocks, queue)][:2] == ["low", "low-2"]
    # dpf goes by each job's own best order: "high" has the smallest dominant share, 0.2.
    assert [d.job for d in schedule(SchedulingPolicy(DPF), blocks, queue)][0] == "high"
