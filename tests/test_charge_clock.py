"""The charge clock: small default blocks, a schedule fixed before the first step, and what a stop costs."""

import random
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from accounting.events import SampledGaussian
from accounting.ledger.store import open_embedded_ledger
from orchestrator.charge_clock import (PACE_MARGIN, ChargeClock, block_at, charge_offsets, clock_pace,
                                       progress_refresh_steps)
from orchestrator.cli import main
from orchestrator.config import build_config
from orchestrator.planning import default_block_steps, plan_run
from orchestrator.trainer import Trainer
from servers import TINY_JOB, tiny_job_epsilon


@pytest.mark.parametrize("steps, block", [(1, 100), (60, 100), (2000, 100), (10_000, 100), (10_001, 101),
                                          (50_000, 500)])
def test_a_default_block_is_100_steps_or_1_percent_of_the_run_where_that_is_more(steps, block):
    assert default_block_steps(steps) == block
    plan = plan_run(build_config({"dataset": "mnist", "batch_size": 64, "noise_multiplier": 1.0, "steps": steps}))
    assert plan.charge_ends == (*range(block, steps, block), steps)


def test_commit_every_still_sets_the_blocks():
    plan = plan_run(build_config({"dataset": "mnist", "batch_size": 64, "noise_multiplier": 1.0, "steps": 2000,
                                  "commit_every": 937}))
    assert plan.charge_ends == (937, 1874, 2000)


def test_each_block_is_charged_when_steps_at_the_pace_would_reach_it():
    assert charge_offsets((100, 200, 250), 0, 0, 0.01) == pytest.approx([0.0, 1.0, 2.0])
    # A resumed run's clock starts at its checkpoint's step: the block that holds it at once, the next when the
    # steps from there would reach it.
    assert charge_offsets((100, 200, 250), 1, 150, 0.01) == pytest.approx([0.0, 0.5])
    assert charge_offsets((100, 200, 250), 2, 200, 0.01) == [0.0]
    # Pauses (an evaluation after 100 steps, the progress line's ε after 50 and 200) push back the blocks after
    # them; those at or before where this start begins are behind it.
    pauses = {50: 0.25, 100: 2.0, 200: 0.5}
    assert charge_offsets((100, 200, 250), 0, 0, 0.01, pauses) == pytest.approx([0.0, 1.0 + 2.25, 2.0 + 2.75])
    assert charge_offsets((100, 200, 250), 1, 100, 0.01, pauses) == pytest.approx([0.0, 1.0 + 0.5])


def test_the_progress_line_is_redrawn_four_times_an_epoch_from_where_the_run_starts():
    assert progress_refresh_steps((20, 40), 0) == [5, 10, 15, 20, 25, 30, 35, 40]
    # Resumed at step 7: the rest of the first epoch split in four (3 steps each, the last part shorter).
    assert progress_refresh_steps((20, 40), 7) == [10, 13, 16, 19, 25, 30, 35, 40]
    assert progress_refresh_steps((3, 5), 0) == [1, 2, 3, 4, 5]
    with pytest.raises(ValueError, match="seconds_per_step must be > 0"):
        charge_offsets((100,), 0, 0, 0.0)


def test_the_pace_is_the_configs_interval_else_the_measured_step_with_its_margin():
    assert clock_pace(2.0, 100, 0.5) == pytest.approx(0.02)
    assert clock_pace(None, 100, 0.02) == pytest.approx(PACE_MARGIN * 0.02)
    with pytest.raises(ValueError, match="a pace needs commit_interval or a measured step time"):
        clock_pace(None, 100, None)


def stopped_run(charge_ends, pace, start_up, step_seconds, stop_at, pauses=None, paused=None):
    """(steps run, steps committed) of a run stopped `stop_at` seconds after it began, in simulated time.

    It spends `start_up` seconds before its first step, where the clock
    starts; step s then takes step_seconds[s] once its block is charged (the
    trainer waits for the charge), and after s + 1 steps it spends
    paused[s + 1] seconds outside them (an evaluation), where the clock
    allows pauses[s + 1]. The clock charges on its schedule whatever the
    steps do. A step or pause under way at the stop did not run.
    """
    offsets = charge_offsets(charge_ends, 0, 0, pace, pauses)
    if stop_at < start_up:
        return 0, 0
    now, run = start_up, 0
    for step, seconds in enumerate(step_seconds):
        now = max(now, start_up + offsets[block_at(charge_ends, step)]) + seconds
        if now > stop_at:
            break
        run += 1
        now += (paused or {}).get(run, 0.0)
    charged = sum(1 for offset in offsets if start_up + offset <= stop_at)
    return run, charge_ends[charged - 1] if charged else 0


@st.composite
def runs(draw, slowest):
    """(charge_ends, block, pace, start-up, step times up to `slowest` times the pace, stop time) of a run."""
    steps = draw(st.integers(1, 600))
    block = draw(st.integers(1, 60))
    charge_ends = (*range(block, steps, block), steps)
    pace = draw(st.floats(1e-3, 1.0))
    step_seconds = draw(st.lists(st.floats(0.0, slowest * pace), min_size=steps, max_size=steps))
    start_up = draw(st.floats(0.0, 60.0))
    # Evaluations after some step counts, each allowed up to 50 steps' time and taking up to `slowest` times that.
    pauses = draw(st.dictionaries(st.integers(1, steps), st.floats(0.0, 50 * pace), max_size=10))
    paused = {at: draw(st.floats(0.0, slowest * allowed)) for at, allowed in sorted(pauses.items())}
    stop_at = draw(st.floats(0.0, start_up + slowest * (pace * steps + sum(pauses.values())) + 1.0))
    return charge_ends, block, pace, start_up, step_seconds, stop_at, pauses, paused


@settings(max_examples=200, deadline=None)
@given(runs(slowest=1.0))
def test_a_stop_costs_at_most_two_blocks_beyond_the_steps_that_ran_while_they_keep_the_pace(run):
    charge_ends, block, pace, start_up, step_seconds, stop_at, pauses, paused = run
    ran, committed = stopped_run(charge_ends, pace, start_up, step_seconds, stop_at, pauses, paused)
    assert ran <= committed <= ran + 2 * block
    # Within a block and a step, in fact, and nothing before the first step.
    assert committed <= ran + block + 1
    assert committed == 0 or stop_at >= start_up


@settings(max_examples=200, deadline=None)
@given(runs(slowest=3.0))
def test_steps_slower_than_the_pace_leave_the_clock_ahead_by_what_they_lag(run):
    charge_ends, block, pace, start_up, step_seconds, stop_at, pauses, paused = run
    ran, committed = stopped_run(charge_ends, pace, start_up, step_seconds, stop_at)
    lag = max(0.0, (stop_at - start_up) / pace - ran)
    assert ran <= committed <= ran + block + lag + 1e-6 * (1 + lag)


class Charges:
    """A ledger session that notes when each block is charged."""

    reservation_id = "charges"

    def __init__(self):
        self.charges = []

    def charge(self, sequence, events):
        self.charges.append((sequence, time.monotonic()))


def test_the_clock_charges_nothing_before_it_starts_and_then_keeps_its_offsets():
    ledger = Charges()
    blocks = [(sequence, SampledGaussian(0.05, 1.0, 5)) for sequence in range(3)]
    clock = ChargeClock(ledger, blocks, [0.0, 0.3, 0.6])
    time.sleep(0.2)
    assert ledger.charges == []  # a run stopped during its start-up charges nothing
    started = time.monotonic()
    clock.start()
    clock.start()  # the trainer starts it before every block; the first start counts
    clock.wait_for(2)
    assert [sequence for sequence, _ in ledger.charges] == [0, 1, 2]
    offsets = [at - started for _, at in ledger.charges]
    assert offsets == pytest.approx([0.0, 0.3, 0.6], abs=0.15)
    with pytest.raises(ValueError, match="offsets must be one per block, in order"):
        ChargeClock(ledger, blocks, [0.0, 0.6, 0.3])


class SlowCharges(Charges):
    """A ledger session whose charges take `seconds` each (a commit through a slow ledger)."""

    def __init__(self, seconds):
        super().__init__()
        self.seconds = seconds

    def charge(self, sequence, events):
        time.sleep(self.seconds)
        super().charge(sequence, events)


def test_a_stopped_clock_returns_once_its_charge_under_way_has_ended_and_charges_no_more():
    """The process may end right after a stop: no thread of the clock is left inside the ledger's arithmetic."""
    ledger = SlowCharges(0.5)
    clock = ChargeClock(ledger, [(sequence, SampledGaussian(0.05, 1.0, 5)) for sequence in range(3)], [0.0] * 3)
    clock.start()
    time.sleep(0.1)  # block 0's charge is under way
    clock.stop()
    assert not clock._thread.is_alive()
    assert [sequence for sequence, _ in ledger.charges] == [0]
    with pytest.raises(RuntimeError, match="stopped before block 1 was charged"):
        clock.wait_for(1)
    ChargeClock(ledger, [], []).stop()  # a clock never started stops at once


# A step past two blocks to stop after, drawn once (as a test's parameters are fixed).
RANDOM_STOP = random.Random(51).randint(201, 300)


@pytest.mark.parametrize("stop_after", [None, 5, RANDOM_STOP])
def test_a_2000_step_run_stopped_early_is_charged_at_most_two_blocks_beyond_its_steps(
        local_ray, worker_pool, tmp_path, monkeypatch, stop_after):
    # None: stopped during its start-up, at the evaluation before the first step. The pace and the pauses are
    # measured as the run starts: a step's round trip on made-up examples, an evaluation and the accountant's ε.
    config = tmp_path / "job.toml"
    config.write_text(TINY_JOB + f'steps = 2000\ndataset_budget_epsilon = 40\nrun_dir = "{tmp_path / "run"}"\n')
    record, step = Trainer._record_epoch, Trainer._step

    def evaluate_then_stop(trainer, epoch, workers):
        if stop_after is None:
            raise KeyboardInterrupt
        record(trainer, epoch, workers)

    def step_then_stop(trainer, workers):
        step(trainer, workers)
        if trainer.step == stop_after:
            raise KeyboardInterrupt

    monkeypatch.setattr(Trainer, "_record_epoch", evaluate_then_stop)
    monkeypatch.setattr(Trainer, "_step", step_then_stop)
    assert main(["train", "--config", str(config), "--no-progress"]) == 130
    with open_embedded_ledger() as ledger:
        (job,) = ledger.list_jobs()
        spent = ledger.get_budget("mnist").spent_epsilon
    ran = stop_after or 0
    # The clock starts with the first step: a stop before it charges nothing; after it, the block the steps were in
    # and at most one more.
    assert job.state == "released" and ran <= job.committed_steps <= ran + 2 * 100, job
    assert (job.committed_steps == 0) == (ran == 0)
    # The ledger's ε is the accountant's for the committed steps: between that of the steps that ran and 2 blocks more.
    assert spent == pytest.approx(tiny_job_epsilon(job.committed_steps) if job.committed_steps else 0.0, rel=1e-6)
    assert (tiny_job_epsilon(ran) if ran else 0.0) - 1e-9 <= spent <= tiny_job_epsilon(ran + 200) + 1e-9


def test_the_made_up_step_the_pace_is_timed_on_reads_no_row_and_is_the_same_whatever_the_data_holds(monkeypatch):
    # Whoever operates the ledger sees the commit times, which follow the pace: a pace timed on rows could carry
    # what they hold. Two workers on different data of one schema give the same made-up sum, and read no row.
    from workers.actor import GradientWorker

    workers = [GradientWorker("gdp_cnn", dataset, 64, 16) for dataset in ("mnist", "fashion-mnist")]
    weights = np.zeros(workers[0].parameter_count(), dtype=np.float32)
    for worker in workers:
        read = worker.source.read
        monkeypatch.setattr(worker.source, "read", lambda indices, read=read: (
            read(indices) if len(indices) == 0 else pytest.fail("the made-up step read a row of the data")))
    first, second = (worker.made_up_clipped_sum(weights, 12, 1.0) for worker in workers)
    assert first.shape == (weights.size + 1,) and first[-1] == 0  # the sum, then the count of zeroed examples
    np.testing.assert_array_equal(first, second)
    assert 0 < np.linalg.norm(first[:-1]) <= 12 * 1.0 * (1 + 1e-6)
