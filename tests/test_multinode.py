"""Shards on a real Ray cluster of several nodes on loopback: placement, accounting, lost and returning silos.

The head has no CPUs; each silo is a node of its own with 1 CPU and a custom
resource naming it. Nodes are removed and added for real (never a mocked Ray).
"""

import argparse
import io
import time

import numpy as np
import pytest
import ray
from servers import add_loopback_node, start_loopback_cluster, stop_loopback_cluster

from accounting.accountants import get_accountant
from orchestrator.config import build_config
from orchestrator.errors import ShardTimeoutError
from orchestrator.planning import plan_run
from orchestrator.cli.train import job_ledger
from orchestrator.trainer import Trainer, resume_trainer
from workers.models import flat_parameters

SILOS = ("silo-a", "silo-b", "silo-c")
# The ledger arguments `dpfleet train` gets with no flags: the embedded ledger, the config's dataset name.
NO_LEDGER_FLAGS = argparse.Namespace(ledger=None, token=None, dataset_name=None, wait_for_budget=False, max_wait=None,
                                     priority=0, plan=None)


@pytest.fixture(scope="module")
def cluster():
    """A head with no CPUs and one 1-CPU node per silo; `nodes` maps each silo to its node (tests swap them)."""
    cluster, added = start_loopback_cluster([dict(num_cpus=1, resources={silo: 1}) for silo in SILOS])
    yield cluster, dict(zip(SILOS, added))
    stop_loopback_cluster(cluster)


def sharded_config(tmp_path, name, **overrides):
    values = dict(
        model="gdp_cnn", steps=8, batch_size=30, test_subset=100, noise_multiplier=1.0, clip_norm=1.0,
        learning_rate=0.5, seed=5, run_dir=str(tmp_path / name), max_physical_batch=32, commit_every=2,
        dataset_name=name,
        shards=[{"dataset": "mnist", "part": part, "parts": 3, "resources": {silo: 1}}
                for part, silo in enumerate(SILOS)],
    )
    values.update(overrides)
    return build_config(values)


def run_charged(trainer):
    """Run `trainer` charging the embedded ledger as `dpfleet train` does; return the summary and the job."""
    trainer.ledger = job_ledger(NO_LEDGER_FLAGS, trainer)
    summary = trainer.run()
    trainer.ledger.release()
    (job,) = trainer.ledger.ledger.list_jobs(trainer.ledger.dataset)
    return summary, job, trainer.ledger.status().spent_epsilon


class RecordPlacement(Trainer):
    """A trainer that notes, after its first step, the node each shard worker runs on (as the actor sees it)."""

    def _step(self, workers):
        super()._step(workers)
        if self.step == 1:
            self.nodes = {slot: ray.get(actor.node_id.remote()) for slot, actor in self.shards.actors.items()}


@pytest.fixture(scope="module")
def undisturbed(cluster, tmp_path_factory):
    """The seeded 3-silo run with no node lost: its trainer, summary, ledger job and spent epsilon."""
    run_root = tmp_path_factory.mktemp("undisturbed")
    # Module fixtures start before conftest's per-test ledger home: give this run its own.
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DPFLEET_HOME", str(run_root / "dpfleet-home"))
        trainer = RecordPlacement(sharded_config(run_root, "undisturbed"), show_progress=False, out=io.StringIO())
        return (trainer, *run_charged(trainer))


def test_each_shard_runs_on_its_silo_and_charges_what_a_single_node_run_does(cluster, undisturbed, tmp_path):
    _, nodes = cluster
    trainer, summary, job, spent = undisturbed
    assert trainer.nodes == {(shard, 0): nodes[silo].node_id for shard, silo in enumerate(SILOS)}
    assert summary["dataset_size"] == 60_000 and summary["shard_outages"] == []
    assert "N=60000" in trainer.out.getvalue()
    # The same N, q, sigma and steps without shards, on one worker, driver-sampled.
    single = Trainer(build_config(dict(
        model="gdp_cnn", steps=8, batch_size=30, test_subset=100, noise_multiplier=1.0, workers=1, seed=5,
        run_dir=str(tmp_path / "single"), commit_every=2, dataset_name="single",
    )), show_progress=False, out=io.StringIO())
    single_summary, single_job, single_spent = run_charged(single)
    assert summary["events"] == single_summary["events"]
    assert summary["epsilon"] == single_summary["epsilon"]
    assert job.committed_steps == single_job.committed_steps == 8
    # The ledger composes commits as they arrive, in batches that depend on timing: the last bits may differ.
    assert spent == pytest.approx(single_spent, rel=1e-9)


class RemoveNodeBefore(Trainer):
    """A trainer that removes `silo`'s node just before step `remove_at` + 1, and calls `then` after every step."""

    remove_at, silo, then = 3, "silo-c", None

    def _step(self, workers):
        if self.step == self.remove_at and not getattr(self, "removed", False):
            self.removed = True
            cluster, nodes = self.cluster
            cluster.remove_node(nodes.pop(self.silo))
        super()._step(workers)
        if self.then is not None:
            self.then(self)


def add_silo(cluster, silo):
    _, nodes = cluster
    nodes[silo] = add_loopback_node(cluster[0], num_cpus=1, resources={silo: 1})


def test_skip_runs_without_a_lost_silo_records_its_steps_and_takes_it_back(cluster, undisturbed, tmp_path):
    def bring_back_after_step_5(trainer):
        if trainer.step == 5:
            add_silo(cluster, "silo-c")
            # Wait for the replacement to be up, so that it rejoins at step 7 for certain.
            ray.get(list(trainer.shards.probes.values()))

    out = io.StringIO()
    trainer = RemoveNodeBefore(sharded_config(tmp_path, "skip", on_shard_loss="skip"), show_progress=False, out=out)
    trainer.cluster, trainer.then = cluster, bring_back_after_step_5
    summary, job, spent = run_charged(trainer)
    # Lost before step 4; added after step 5; the step that follows (6) finds it up: steps 4 and 5 ran without it.
    assert summary["shard_outages"] == [{"shard": 2, "worker": 0, "workers": 1, "resources": {"silo-c": 1.0},
                                         "first_step": 4, "last_step": 5}]
    log = out.getvalue()
    assert "step 4: shard 2 ({'silo-c': 1.0}) is lost" in log and "on_shard_loss = 'skip'" in log
    assert "step 6: shard 2 ({'silo-c': 1.0}) is up again" in log
    # Each remaining example kept its inclusion probability q: the accounting is the undisturbed run's.
    assert summary["events"] == undisturbed[1]["events"] and spent == pytest.approx(undisturbed[3], rel=1e-9)
    assert job.committed_steps == 8
    assert not np.allclose(flat_parameters(trainer.model), flat_parameters(undisturbed[0].model))


def test_wait_holds_the_step_until_a_replacement_silo_joins(cluster, undisturbed, tmp_path):
    out = io.StringIO()
    trainer = RemoveNodeBefore(sharded_config(tmp_path, "wait", shard_timeout=120), show_progress=False, out=out)
    # Not at a block boundary (commit_every = 2): the loss is found by step 4's call, then waited out.
    trainer.cluster, trainer.remove_at = cluster, 3
    wait_for_placement = trainer.shards._wait_for_placement
    waits = []

    def join_a_new_silo_c_node_while_waiting():
        # Ray nodes start only from the main thread (signal handlers), which is the one waiting here.
        if not waits:
            time.sleep(3.0)
            add_silo(cluster, "silo-c")
        waits.append(time.monotonic())
        return wait_for_placement()

    trainer.shards._wait_for_placement = join_a_new_silo_c_node_while_waiting
    summary, job, spent = run_charged(trainer)
    log = out.getvalue()
    assert len(waits) == 1
    assert "step 4: shard 2 ({'silo-c': 1.0}) is lost; waiting up to shard_timeout = 120 s" in log
    assert "step 4: shard 2 ({'silo-c': 1.0}) placed again" in log
    assert "step 4: recomputing the part of shard 2 ({'silo-c': 1.0}) on its replacement" in log
    # The replacement redrew the same seeded sample: the run is the undisturbed one, exactly.
    np.testing.assert_allclose(flat_parameters(trainer.model), flat_parameters(undisturbed[0].model), atol=1e-6,
                               rtol=0)
    assert summary["shard_outages"] == [] and summary["events"] == undisturbed[1]["events"]
    assert job.committed_steps == 8 and spent == pytest.approx(undisturbed[3], rel=1e-9)


def test_wait_stops_at_a_checkpoint_after_shard_timeout_and_resume_finishes_the_run(cluster, undisturbed, tmp_path):
    config = sharded_config(tmp_path, "timeout", shard_timeout=4)
    trainer = RemoveNodeBefore(config, show_progress=False, out=io.StringIO())

    def remove_silo_c_after_step_4(trainer):
        if trainer.step == 4:
            cluster[0].remove_node(cluster[1].pop("silo-c"))

    # At a block boundary (commit_every = 2): the loss is found before block [4, 6) runs.
    trainer.cluster, trainer.remove_at, trainer.then = cluster, None, remove_silo_c_after_step_4
    trainer.ledger = job_ledger(NO_LEDGER_FLAGS, trainer)
    with pytest.raises(ShardTimeoutError) as stopped:
        trainer.run()
    message = str(stopped.value)
    assert "shard 2 ({'silo-c': 1.0}) could not be placed again within shard_timeout = 4 s" in message
    assert "stopped at a checkpoint after step 4" in message and f"dpfleet train --resume {config.run_dir}" in message
    (job,) = trainer.ledger.ledger.list_jobs("timeout")
    # The charge clock never looks at the steps or the shards: it may have charged blocks past step 4, which the
    # resumed run then runs without charging them again.
    assert 4 <= job.committed_steps <= 8
    add_silo(cluster, "silo-c")
    resumed = resume_trainer(config.run_dir, show_progress=False, out=io.StringIO())
    assert resumed.step == 4
    summary, job, spent = run_charged(resumed)
    assert job.committed_steps == 8 and spent == pytest.approx(undisturbed[3], rel=1e-9)
    assert summary["events"] == undisturbed[1]["events"]
    np.testing.assert_allclose(flat_parameters(resumed.model), flat_parameters(undisturbed[0].model), atol=1e-6,
                               rtol=0)


class RecordWorkerNodes(Trainer):
    """A trainer that notes, after its first step, the nodes its gradient workers run on."""

    def _step(self, workers):
        super()._step(workers)
        if self.step == 1:
            self.worker_nodes = set(ray.get([worker.node_id.remote() for worker in workers]))


def test_band_mf_with_fixed_order_trains_across_the_nodes_and_the_ledger_charges_its_participations(cluster, tmp_path):
    config = build_config(dict(
        model="gdp_cnn", steps=8, batch_size=30, train_subset=120, test_subset=100, noise_multiplier=1.0, workers=3,
        seed=5, run_dir=str(tmp_path / "band-mf"), commit_every=2, dataset_name="band-mf", mechanism="band-mf",
        sampler="fixed-order", band_width=2, max_physical_batch=32, accountant="rdp",
    ))
    trainer = RecordWorkerNodes(config, show_progress=False, out=io.StringIO())
    summary, job, spent = run_charged(trainer)
    # 120 examples in batches of 30: an epoch is 4 steps, so 8 steps are two participations of every example.
    assert trainer.plan.correlation.period == 4
    assert job.committed_steps == 2 and summary["steps"] == 8
    # The ledger's ε is PLD's; the run's is RDP's (PLD's calibration for the summary's comparison is slow).
    assert spent == pytest.approx(get_accountant("pld").epsilon(trainer.record.events, config.delta), rel=1e-9)
    assert summary["epsilon"] == pytest.approx(trainer.epsilon())
    assert len(trainer.worker_nodes) == 3


class RecordSiloSums(Trainer):
    """A trainer that asks each silo worker, at step 1, for its clipped sums of steps 0, 1 and one epoch later."""

    def _step(self, workers):
        if self.step == 1:
            weights, later = self._weights(), self.plan.correlation.steps_per_epoch
            self.silo_sums = [ray.get([actor.sampled_clipped_grad_sum.remote(weights, step, 1.0)
                                       for step in (0, 1, later)]) for actor in self.shards.present_actors()]
        super()._step(workers)


def test_a_silo_run_with_fixed_order_participation_takes_each_example_once_an_epoch_and_is_charged_its_epochs(
        cluster, tmp_path):
    # Three silos of 120 examples (parts 0..2 of 500), batches of 60: an epoch is N // 60 = 6 steps. The noise is
    # the driver's, as without shards; DP-FTRL samples as BandMF does here. RDP: PLD's calibration of DP-SGD's σ
    # for the summary's comparison would take most of the run.
    silos = [{"dataset": "mnist", "part": part, "parts": 500, "resources": {silo: 1}}
             for part, silo in enumerate(SILOS)]
    mechanism, extra = "band-mf", {"band_width": 3}
    config = sharded_config(tmp_path, mechanism, steps=12, batch_size=60, shards=silos, mechanism=mechanism,
                            sampler="fixed-order", accountant="rdp", **extra)
    trainer = RecordSiloSums(config, show_progress=False, out=io.StringIO())
    summary, job, spent = run_charged(trainer)
    # Each silo took the same examples one epoch later (the sums at the same weights are equal), and others
    # at the next step: its own slice of a fixed order, not a Poisson sample.
    for first, following, next_epoch in trainer.silo_sums:
        np.testing.assert_array_equal(first, next_epoch)
        assert not np.array_equal(first, following)
    # The accounting is the driver path's fixed-order plan for the same N: two participations, charged.
    single = plan_run(build_config(dict(model="gdp_cnn", steps=12, batch_size=60, train_subset=360,
                                        noise_multiplier=1.0, mechanism=mechanism, sampler="fixed-order",
                                        accountant="rdp", **extra)))
    assert trainer.plan.correlation == single.correlation and trainer.plan.correlation.period == 6
    assert summary["events"] == single.planned_events.to_dict()
    assert job.committed_steps == 2 and summary["steps"] == 12
    assert summary["epsilon"] == pytest.approx(get_accountant("rdp").epsilon(single.planned_events, config.delta))
    assert spent == pytest.approx(get_accountant("pld").epsilon(single.planned_events, config.delta), rel=1e-9)
