"""The DP-SGD driver: sample, fan out to workers, sum, add noise once, step.

The data flows one way: the driver Poisson-samples each logical batch and
splits its indices across the gradient workers; each worker returns the sum of
its examples' clipped gradients, added up on its node (``orchestrator.
aggregation``); the driver adds up the nodes' sums, adds Gaussian noise
N(0, (sigma * C)^2) once (drawn in the background while the workers computed,
``orchestrator.noise``), divides by the expected batch size, steps the
optimizer and ships the new weights with the next step.

``Trainer`` is the loop; each of its concerns is a collaborator, built
complete when it is made:

- the sample: PRF(run key, step) (``orchestrator.sampling.step_sample``);
- the fleet: ``WorkerFleet`` (``orchestrator.fleet``), or with shards
  ``ShardFleet`` (``orchestrator.shard_fleet``), or on the collective path
  (``aggregation = "collective"``) ``CollectiveFleet``
  (``orchestrator.collective``), whose ranks reduce-scatter, noise, step
  and all-gather among themselves while the driver sends index shares,
  slice keys and scalars;
- the noise: the run's generator and ``CentralNoise`` (``orchestrator.noise``);
- the ledger: a ``LedgerSession`` and its ``ChargeClock`` (``orchestrator.charge_clock``);
- the record of what ran, which checkpoints carry: ``RunRecord``
  (``orchestrator.run_record``; the file format in ``orchestrator.checkpoint``);
- what the run reports: ``RunReport`` (``orchestrator.report``).

The fleet, the noise's feed and the charge clock hold threads or actors, so
`run` makes them and stops them; the rest is made with the Trainer. The
stages of a step (`_draw_sample`, `_partial_sums`, `_apply_noise`, ...) are
methods, so that a subclass can watch or change one.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from contextlib import ExitStack, closing
from functools import cached_property
from pathlib import Path
from typing import Callable

import numpy as np
import ray
import torch

from accounting.accountants import get_accountant, labelled_epsilon
from orchestrator import release
from orchestrator.adaptive_clipping import adapted_clip_norm
from orchestrator.aggregation import Gathered, split_counts
from orchestrator.binding import bound_config, run_binding
from orchestrator.charge_clock import (PACE_MARGIN, ChargeClock, LedgerSession, block_at, blocks_covered,
                                      charge_offsets, clock_pace, progress_refresh_steps, uncharged_blocks)
from orchestrator.collective import CollectiveFleet, kept_on_driver_by_planned_batches, resolved_aggregation
from orchestrator.checkpoint import (
    CHECKPOINT_VERSION,
    check_checkpoint_version,
    check_same_run,
    latest_checkpoint,
    save_checkpoint,
)
from orchestrator.config import TrainConfig, test_set_size
from orchestrator.errors import LedgerTimeoutError, ShardTimeoutError, UsageError
from orchestrator.fleet import (WorkerFleet, engine_report, gradient_worker, made_up_step_seconds, merge_evaluation,
                               start_evaluation)
from orchestrator.noise import COUNT_NOISE, CentralNoise, GaussianNoise, TorchGaussianNoise
from orchestrator.optimizers import build_lr_scheduler, build_optimizer
from orchestrator.planning import RunPlan, plan_run
from orchestrator.early_stopping import stops_early
from orchestrator.preflight import CheckedModel, checked_model, lenient_drops, lenient_rows
from orchestrator.report import RunReport
from orchestrator.run_record import RunRecord
from orchestrator.stopping import keep_stop_handlers
from orchestrator.planned_windows import driver_windows, ray_of_one_node, run_planned_batches
from orchestrator.sampling import correlated_step_sample, shuffled_order, step_sample, worker_shares
from orchestrator.shard_fleet import ShardFleet, extend_outages
from workers.actor import retain_freed_memory
from workers.collective import ShardCollectiveRankActor
from workers.fingerprints import dataset_identity, file_digests
from workers.keys import process_key
from workers.models import bind_flat_views, module_folder, parameter_count
from workers.optimizers import update_ema
from workers.planned_batches import read_planned_dataset, remove_stale_window_folders_on
from workers.shard_worker import ShardWorkerActor

_TRAIN_LOSS_EXAMPLES = 10_000


LOCAL_RAY_START_ATTEMPTS = 3


def start_ray(config: TrainConfig, say: Callable[[str], None] = print) -> bool:
    """Connect to RAY_ADDRESS if set, else start a local Ray sized for the workers.

    With shards, a local Ray is one node standing in for every shard's
    custom resources (and says so); on a cluster, only the nodes started
    with a shard's resources run its workers. A local start that times out
    is retried (`init_local_ray`). Returns True when this call started Ray
    (and so should shut it down).
    """
    if ray.is_initialized():
        return False
    if os.environ.get("RAY_ADDRESS"):
        ray.init(log_to_driver=True)
        keep_stop_handlers()
        return True
    cpus = max(os.cpu_count() or 1, config.workers * config.cpus_per_worker)
    gpus = torch.cuda.device_count() if config.gpus_per_worker else 0
    resources = local_shard_resources(config)
    if resources:
        say(release.line("local_ray_shards", resources=resources))
    init_local_ray(cpus, gpus, resources, log_to_driver=True, say=say)
    # Ray's start replaced the command's SIGTERM handler with its own, which ends the run without its clean-up.
    keep_stop_handlers()
    return True


def ray_start_timed_out(error: Exception) -> bool:
    """Whether `error` is Ray giving up on a node that did not come up in time, which a later try may not hit.

    Ray reports it as a bare Exception ("The current node timed out during
    startup"), or as a RuntimeError from the wait for the GCS port file
    ("Timed out waiting for file ...").
    """
    return "timed out" in str(error).lower()


def init_local_ray(num_cpus: int, num_gpus: int = 0, resources: dict[str, float] | None = None,
                   log_to_driver: bool = True, say: Callable[[str], None] = print) -> None:
    """Start a new in-process Ray of this size, retrying a start that timed out (LOCAL_RAY_START_ATTEMPTS in all).

    A loaded machine, or the processes of a killed run still exiting, can
    keep the GCS or the raylet from answering in Ray's own 30 s; each retry
    is announced through `say`.
    """
    attempt = 1
    while True:
        try:
            # address="local": a new in-process cluster, never one some other program left running here.
            ray.init(address="local", num_cpus=num_cpus, num_gpus=num_gpus, resources=resources,
                     include_dashboard=False, log_to_driver=log_to_driver)
            return
        except Exception as error:  # noqa: BLE001 - Ray's start-up errors have no class of their own
            if not ray_start_timed_out(error) or attempt == LOCAL_RAY_START_ATTEMPTS:
                raise
        ray.shutdown()
        say(release.line("local_ray_retry", attempt=attempt, attempts=LOCAL_RAY_START_ATTEMPTS))
        time.sleep(5.0 * attempt)
        attempt += 1


def local_shard_resources(config: TrainConfig) -> dict[str, float]:
    """The custom resources a one-node local Ray needs to hold every shard's workers at once."""
    resources: dict[str, float] = {}
    for shard in config.shards:
        for name, amount in shard.resources.items():
            resources[name] = resources.get(name, 0.0) + amount * shard.workers
    return resources


class Trainer:
    """One DP-SGD run over Ray gradient workers, resumable from its checkpoints.

    `noise` replaces the driver's noise source (tests observe it); `ledger`
    is charged for each block of steps before the block runs;
    `charge_epsilon` is what target_epsilon_basis = "filter" calibrates σ by
    (see plan_run). With `non_private_train_loss`, each metrics row also
    holds the loss on the first training examples, labelled not private.
    With `show_values` (for the data's owner), check_data = "lenient" says
    how many rows it drops. `checked` is what `checked_model` returned for
    `config` (`dpfleet train` checks the model before loading Ray); without
    it the Trainer builds and checks the model itself.
    With shards, constructing the Trainer starts Ray (unless it is up) and
    the shards' workers, because N is the sum of the example counts they
    report.
    """

    def __init__(self, config: TrainConfig, *args, **options):
        # A silo's workers hold rows in their windows from the moment the fleet starts: whatever the trainer
        # starts is closed on every exit path, here when the construction fails, else by `run` or `close`.
        self.closing = ExitStack()
        try:
            self._build(config, *args, **options)
        except BaseException:
            self.closing.close()
            raise

    def _build(
        self,
        config: TrainConfig,
        noise: GaussianNoise | None = None,
        show_progress: bool = True,
        non_private_train_loss: bool = False,
        ledger: LedgerSession | None = None,
        out=None,
        charge_epsilon: Callable[[RunPlan], float] | None = None,
        show_values: bool = False,
        checked: CheckedModel | None = None,
    ):
        # sys.stdout as it is when the run is made, not when this module was imported (`out` None).
        self.config, self.out, self.ledger = config, out or sys.stdout, ledger
        self.non_private_train_loss = non_private_train_loss
        # Before any budget is reserved or worker started: the model on made-up examples, then the data's files.
        # Under check_data = "lenient" the config's table then names its classes; N counts every row of the files,
        # and a sampled row that the rule drops takes no part (`kept_rows`), so that no count of them is released.
        if checked is None:
            checked = checked_model(config, self.say)
        self.config = config = checked.config
        self.model = checked.model
        self.kept_rows = lenient_rows(config)
        if self.kept_rows is not None:
            self.say(lenient_drops(config, show_values))
        # Batches planned ahead (steps ahead, or None: rows read one by one); a Parquet table read row by row says why.
        self.planned_steps, self.row_by_row_reason = run_planned_batches(config, ray_of_one_node())
        # "driver" or "collective" (orchestrator.collective), by the model's size under "auto"; on the collective
        # path the ranks hold the weights and each its slice of the optimizer's state, which checkpoints carry as
        # `optimizer_slices`.
        planned = self.planned_steps is not None
        self.aggregation = resolved_aggregation(config, parameter_count(self.model), planned)
        if kept_on_driver_by_planned_batches(config, parameter_count(self.model), planned):
            self.say(release.line("aggregation_for_planned_batches"))
        self.optimizer_slices: list[dict] | None = None
        self.started_ray, self.shards, dataset_size = self._start_shards()
        self.plan = self._plan_run(dataset_size, charge_epsilon)
        # The driver's secret: every step's sample and noise derive from it. In memory only, never saved.
        self.run_key = process_key(config.seed)
        if self.shards is not None:
            correlation = self.plan.correlation
            fixed_order = correlation is not None and correlation.sampler == "fixed-order"
            # Under fixed order each silo worker's order derives from the run key, so a replacement keeps it.
            self.shards.set_sampling_rate(self.plan.sampling_rate, self.plan.steps,
                                          self.run_key if fixed_order else None,
                                          correlation.steps_per_epoch if fixed_order else None)
        if config.noise_placement == "silos":
            self._place_noise_in_silos()
        self.report = RunReport(config, self.plan, self.say, show_progress)
        # The driver's GPU, when it has one, draws the noise and runs the optimizer.
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.noise = self._run_noise() if noise is None else noise
        # The next step's (indices, microbatch ids), drawn a step early so the workers can read its examples ahead.
        # In memory only: a resumed run draws its samples afresh.
        self.drawn_sample: tuple[np.ndarray, np.ndarray | None] | None = None
        # The fixed-order and cyclic Poisson samplers' shuffle of the data, from the run key; in memory only.
        self.sample_order: np.ndarray | None = None
        self.bound_config = bound_config(config)
        self.dataset_identity = (self.shards.dataset_identity if config.shards
                                 else dataset_identity(config.dataset, self.training_file_digests))
        # Parameters and gradients are views into two flat buffers: no copy in or out of the model per step.
        self.model.to(self.device)
        self.flat_weights, self.flat_gradient = bind_flat_views(self.model)
        self.optimizer = build_optimizer(config.optimizer, config.learning_rate, self.model.parameters())
        self.lr_scheduler = build_lr_scheduler(config.lr_schedule, self.optimizer, self.plan.steps)
        # Parameter averaging: a function of the noisy updates only, kept here and shipped for evaluation.
        self.ema_weights = None if config.ema_decay is None else self.flat_weights.clone()
        # The bound noise is scaled to: the total of the per-layer norms, or the (possibly adaptive) clip norm.
        self.record = RunRecord(clip_norm=config.layer_clip_norms.total_norm if config.layer_clip_norms
                                else config.clip_norm)
        # The reservation {"id", "dataset"} a resumed run continues under, as its checkpoint recorded it.
        self.resumed_reservation: dict | None = None
        # The last step's sums: they stay in the driver and are never logged or saved.
        self.gathered = Gathered()
        self.engine_reported = False
        # The bytes of the last step's sample shares (the driver path's part of `_driver_bytes`; none with shards).
        self.sample_bytes = 0
        # Set at an evaluation point when early_stopping_patience evaluations in a row did not improve.
        self.stopped_early = False

    def _start_shards(self) -> tuple[bool, ShardFleet | None, int | None]:
        """With shards: start Ray (unless it is up) and the shards' workers; (started Ray, the fleet, their N)."""
        config = self.config
        if not config.shards:
            return False, None, None
        if self.non_private_train_loss:
            raise UsageError("--non-private-train-loss evaluates training examples on the driver's terms; with "
                             "shards the training data stays on its nodes, so leave it off")
        started_ray = start_ray(config, self.say)
        shards = ShardFleet(config, self.say,
                            ShardCollectiveRankActor if self.aggregation == "collective" else ShardWorkerActor)
        self.closing.callback(shards.close)
        return started_ray, shards, shards.start()

    def _place_noise_in_silos(self) -> None:
        """Have the silos add the noise in Skellam shares (docs/silos.md), and say what ε that noise gives."""
        plan, config, secure = self.plan, self.config, self.shards.secure
        largest = max(sigma for sigma, _ in plan.noise_blocks)
        try:
            secure.place_noise_in_silos(parameter_count(self.model), largest, plan.rounding_ratio)
        except ValueError as error:
            raise UsageError(f'noise_placement = "silos": {error}') from None
        epsilon, accountant = labelled_epsilon(get_accountant(config.accountant), plan.planned_events, config.delta)
        self.say(release.line("silo_noise", detail=(
            f"each of {secure.silos} silos adds an exact discrete Gaussian share of std "
            f"σ·C·s on the ring, whose scale becomes s = 2^{int(np.log2(secure.scale))} (√d ≤ s·C / "
            f"2^{int(-np.log2(plan.rounding_ratio))}); one honest silo's share carries the target alone, so "
            f"up to {secure.silos - secure.threshold} dropouts and {secure.threshold - 1} silos colluding with "
            f"the driver leave std σ·C unknown to them; the driver adds none. ε {epsilon:.4g} at δ = "
            f"{config.delta:g} ({accountant})")))

    def _plan_run(self, dataset_size: int | None, charge_epsilon: Callable[[RunPlan], float] | None) -> RunPlan:
        """The run's plan (N, q, sigma, steps, events) for a dataset of `dataset_size` units (None: the config's)."""
        return plan_run(self.config, dataset_size, charge_epsilon)

    def _run_noise(self) -> GaussianNoise:
        """The run's noise generator, keyed by the run key, on the driver's GPU when it has one."""
        if self.device.type == "cuda":
            return TorchGaussianNoise(self.run_key, self.config.secure_noise, self.device)
        return GaussianNoise(self.run_key, secure=self.config.secure_noise)

    @cached_property
    def training_file_digests(self) -> list[str] | None:
        """The SHA-256 of each training file (``file_digests``; None for a built-in or ``module:function``
        dataset), read once: the run's identity and the ledger's binding of its files both take it."""
        return file_digests(self.config.dataset)

    @property
    def resumed_reservation_id(self) -> str | None:
        """The id of the reservation a resumed run continues under (None for a new run, or one without a ledger)."""
        return None if self.resumed_reservation is None else self.resumed_reservation["id"]

    def continue_charged(self, reservation_id: str, committed_steps: int) -> None:
        """Take the ledger's `committed_steps` of a resumed run (under `reservation_id`) as its charged blocks: none
        is charged again, the blocks the clock charged ahead of the checkpoint included.

        UsageError when they are not whole blocks of the plan, or fewer than
        the checkpoint's charged blocks: that ledger is not the run's.
        """
        try:
            covered = blocks_covered(self.plan.charge_ends, committed_steps)
        except ValueError as error:
            covered, why = None, str(error)
        else:
            why = f"the checkpoint's run had charged its first {self.record.charged_blocks} block(s)"
        if covered is None or covered < self.record.charged_blocks:
            raise UsageError(f"reservation {reservation_id} holds {committed_steps} committed steps, but {why}; "
                             "resume against the ledger the run was charged to (--ledger, or the config's ledger)")
        self.record.charged_blocks = covered

    @property
    def step(self) -> int:
        """Steps run so far."""
        return self.record.step

    def epsilon(self) -> float:
        """Epsilon of the steps run so far, at the config's delta, by the config's accountant.

        Also sets the report's ``epsilon_label``: how that figure was obtained, for the log and the plot.
        """
        return self.report.epsilon(self.record.events)

    def say(self, text: str) -> None:
        """Print one line of the run's log."""
        print(text, file=self.out, flush=True)

    # --- checkpoints -------------------------------------------------------

    def binding(self) -> dict:
        """What ties a checkpoint to this run: its bound config keys, its data, N and its reservation."""
        reservation = None if self.ledger is None else {"id": self.ledger.reservation_id,
                                                        "dataset": getattr(self.ledger, "dataset", None)}
        return run_binding(self.bound_config, self.dataset_identity, self.plan.dataset_size, reservation)

    def state(self) -> dict:
        """The run's working state, enough to continue it: no key, generator state or drawn sample.

        A resumed run draws a new key, and so fresh samples and noise for the
        steps that remain; the steps before stay accounted and charged.
        """
        return {
            "version": CHECKPOINT_VERSION,
            "binding": self.binding(),
            **self.record.to_state(),
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "lr_scheduler": None if self.lr_scheduler is None else self.lr_scheduler.state_dict(),
            "noise_multiplier": self.plan.noise_multiplier,
            # Laid out as workers.models.flat_parameters: load_flat_parameters(model, ...) gives the averaged model.
            "ema_weights": None if self.ema_weights is None else self.ema_weights.cpu().clone(),
            "optimizer_slices": self.optimizer_slices,
            # Where the model's module was imported from: the folder a later load from elsewhere names.
            "module_folder": module_folder(self.config.model_spec),
        }

    def load_state(self, state: dict) -> None:
        """Continue from a checkpoint's state (see `state`), refused unless it is this run's (`binding`)."""
        check_same_run(state, self.binding(), Path(self.config.run_dir))
        if self.plan.correlation is not None:
            raise UsageError(correlated_resume_refusal(self.config.mechanism, state["step"], self.plan.steps))
        self.record = RunRecord.from_state(state)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.lr_scheduler is not None and state["lr_scheduler"] is not None:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        self.resumed_reservation = state["binding"]["reservation"]
        self.optimizer_slices = state.get("optimizer_slices")
        if (self.optimizer_slices is None) != (self.aggregation == "driver"):
            saved = "driver" if self.optimizer_slices is None else "collective"
            raise UsageError(f"the checkpoint was written on the {saved} path and holds its optimizer state there; "
                             f'resume with aggregation = "{saved}"')
        if self.ema_weights is not None:
            if state.get("ema_weights") is None:
                raise ValueError("the checkpoint holds no averaged weights, but the run has ema_decay set; "
                                 "resume with the configuration the run started with")
            self.ema_weights.copy_(state["ema_weights"])

    def _save_checkpoint(self) -> None:
        if self.aggregation == "collective":
            # The ranks' state at a checkpoint is also where the group restarts from after losing a rank.
            weights, self.optimizer_slices, averaged = self.fleet.checkpoint(self.step)
            self.flat_weights.copy_(torch.tensor(weights))
            if averaged is not None:
                self.ema_weights.copy_(torch.tensor(averaged))
        save_checkpoint(Path(self.config.run_dir), self.record.run_id, self.step,
                        dict(release.record("checkpoint", self.state())))

    def _stop_at_checkpoint(self, error: ShardTimeoutError) -> None:
        """Save a checkpoint of the steps that ran and stop with a message that says how to continue."""
        self._save_checkpoint()
        raise ShardTimeoutError(
            f"{error}. The run stopped at a checkpoint after step {self.step}; the ledger block it was in stays "
            f"charged once and is not charged again; continue with: dpfleet train --resume {self.config.run_dir}"
        ) from None

    # --- the run -------------------------------------------------------------

    def run(self) -> dict:
        """Train the remaining planned steps and return the summary (also written to run_dir).

        For the run's length it holds the fleet (`fleet`, without shards),
        the noise being drawn and added (`central_noise`) and, with a
        ledger, the clock that charges its blocks (`charge_clock`, started
        with the first step); all are stopped when it ends, as is a Ray it
        started.
        """
        self.report.start(self.step)
        started_ray = start_ray(self.config, self.say) or self.started_ray
        # The driver allocates and frees the same large buffers every step, as the workers do.
        retain_freed_memory()
        with ExitStack() as running:
            if started_ray:
                running.callback(ray.shutdown)
            running.enter_context(self.closing)
            self.central_noise = running.enter_context(closing(
                CentralNoise(self.noise, parameter_count(self.model), self.plan.steps, self.plan.correlation,
                             at_driver=self.config.noise_placement != "silos")))
            self.planned_windows = self.planned_dataset = None
            if self.row_by_row_reason is not None:
                self.say(release.line("parquet_row_by_row", reason=self.row_by_row_reason))
            # With shards, each silo's workers plan and gather their own windows (workers.shard_worker).
            if self.planned_steps is not None and self.shards is None:
                # Read here once, so that no gradient worker parses a footer.
                self.planned_dataset = read_planned_dataset(self.config.dataset)
                # The fleet always holds config.workers workers (a lost one is replaced), so the shares are known
                # before it starts: the first window gathers while the workers start.
                self.planned_windows = driver_windows(
                    self.planned_steps, self.planned_dataset, self.plan.expected_batch_size,
                    self.plan.steps, self.step,
                    lambda step: worker_shares(*self._draw_sample(step), self.config.workers)[0],
                    self.config.workers, self.plan.microbatches)
                running.callback(self.planned_windows.close)
            workers = self._start_workers(running)
            # Killed runs' windows on these nodes (sealed, but sampled rows) go as any run starts.
            remove_stale_window_folders_on(ray.get([worker.node_id.remote() for worker in workers]))
            self.charge_clock = None
            if self.ledger is not None:
                # Timed before any window gathers sampled rows: nothing of the data's shares the machine with it.
                charged = self.record.charged_blocks
                self.charge_clock = ChargeClock(self.ledger, uncharged_blocks(self.plan, charged),
                                                charge_offsets(self.plan.charge_ends, charged, self.step,
                                                               self._charge_pace(workers), self._pauses(workers)))
                running.callback(self.charge_clock.stop)
            if self.planned_windows is not None:
                self.planned_windows.start()
            self._train(workers)
        return self._finish()

    def _charge_pace(self, workers: list) -> float:
        """The charge clock's seconds per step (``clock_pace``): the config's commit_interval, else the round trip
        of a step of made-up examples through `workers`, each given its share of an expected batch
        (``made_up_step_seconds``)."""
        config, plan = self.config, self.plan
        measured = None
        if config.commit_interval is None:
            # Under privacy_unit = "user" a sampled person gives up to max_examples_per_user rows (without it, one
            # stands for all of a person's rows, a count of the data's).
            rows = (config.max_examples_per_user or 1) if plan.privacy_unit == "user" else 1
            actors = self._workers_now(workers)
            examples = max(1, math.ceil(plan.expected_batch_size * rows / len(actors)))
            measured = made_up_step_seconds(actors, self.flat_weights.numel(), examples, self.record.clip_norm)
        return clock_pace(config.commit_interval, plan.charge_ends[0], measured)

    def _pauses(self, workers: list) -> dict[int, float]:
        """The seconds the run spends outside its steps, by the step count they follow (``charge_offsets``): at
        each evaluation, an evaluation and the accountant's ε; at each redraw of a shown progress line, the ε. Each
        is PACE_MARGIN times its time here, before the first step: an evaluation (unreleased) at the current
        weights after one that warms up, and the slowest of the ε of the plan's events at three step counts.
        Neither reads a training row (but under non_private_train_loss, the same number as every evaluation
        reads). None where the config sets commit_interval, which covers them.
        """
        if self.config.commit_interval is not None:
            return {}
        self._evaluate(workers)  # the workers' first evaluation reads and holds the test split: it is not timed
        started = time.perf_counter()
        self._evaluate(workers)
        evaluation = time.perf_counter() - started
        epsilon = max(map(self._epsilon_seconds, {self.step + 1, self.plan.steps // 2, self.plan.steps}))
        refreshes = progress_refresh_steps(self.plan.epoch_ends, self.step) if self.report.show_progress else []
        pauses = dict.fromkeys(refreshes, PACE_MARGIN * epsilon)
        for step in self.plan.evaluation_steps:
            pauses[step] = pauses.get(step, 0.0) + PACE_MARGIN * (evaluation + epsilon)
        return pauses

    def _epsilon_seconds(self, steps: int) -> float:
        """Seconds the accountant takes for the ε of the plan's first `steps` steps (a function of the plan)."""
        started = time.perf_counter()
        self.report.epsilon(self.plan.events_between(0, max(1, steps)))
        return time.perf_counter() - started

    def close(self) -> None:
        """Stop what constructing the trainer started (a silo's workers, which delete their windows first).

        For a trainer that will not run (its job stopped before `run`);
        `run` does the same as it ends, and a second close does nothing.
        """
        self.closing.close()

    def _start_workers(self, running: ExitStack) -> list:
        """Start the gradient workers (without shards, as `fleet`), say where they run and how they clip.

        Returns the workers the step hooks see: with shards the fleet holds
        the workers (placed while planning), and the list is empty.
        """
        if self.aggregation == "collective":
            self.fleet = running.enter_context(closing(CollectiveFleet(
                self.config, self.flat_weights.cpu().numpy(), self.optimizer_slices, self.step, self.noise,
                self.optimizer.param_groups[0]["lr"], self.say,
                ranks=None if self.shards is None else self.shards.present_actors(),
                averaged_weights=None if self.ema_weights is None else self.ema_weights.cpu().numpy())))
        elif self.shards is None:
            self.fleet = running.enter_context(closing(WorkerFleet(self.config.workers, self._new_worker, self.say)))
        workers = self.fleet.workers if self.aggregation == "collective" or self.shards is None else []
        devices = ray.get([worker.device_name.remote() for worker in self._workers_now(workers)])
        self.say(release.line("workers_devices", devices=", ".join(devices)))
        # The workers settled their engine on synthetic examples as they started: the start says what runs where.
        self._report_engine(workers)
        return workers

    def _new_worker(self) -> ray.actor.ActorHandle:
        """A new gradient worker for this run (the fleet's factory: at its start and for each replacement)."""
        return gradient_worker(self.config, planned_dataset=self.planned_dataset)

    def _workers_now(self, workers: list) -> list:
        """The workers to evaluate on and ask for reports: `workers`, or the shards' workers that are up."""
        return workers if self.shards is None else self.shards.present_actors()

    def _report_engine(self, workers: list) -> None:
        """Log once how each layer's per-example gradients are computed, as the first worker to decide says."""
        lines = engine_report(self._workers_now(workers), self.plan.microbatches)
        if lines is None:  # no worker has had an example yet
            return
        self.say(release.line("engine", layers="; ".join(lines)))
        self.engine_reported = True

    def _train(self, workers: list) -> None:
        """Run every epoch that is not done, each followed by its metrics row and a checkpoint."""
        plan = self.plan
        self.record.restart_clock()
        if not self.record.metrics:
            self._record_epoch(0, workers)
        for epoch, epoch_end in enumerate(plan.epoch_ends, start=1):
            if epoch_end <= self.step:
                continue
            self._train_epoch(epoch, epoch_end, workers)
            if self.step == epoch_end and epoch_end in plan.evaluation_steps:
                self._record_epoch(epoch, workers)
            self._save_checkpoint()
            if self.stopped_early:
                self.say(release.line("stopped_early", step=self.step, steps=plan.steps,
                                      metric=self.config.early_stopping_metric,
                                      patience=self.config.early_stopping_patience))
                return

    def _train_epoch(self, epoch: int, epoch_end: int, workers: list) -> None:
        """Run the steps of epoch `epoch` (1-based) up to step `epoch_end`: its bar, rows within it, checkpoints."""
        plan, config = self.plan, self.config
        bar = self.report.progress_bar(epoch, epoch_end - self.step)
        # The ε on the bar costs an accountant's call: not made for a bar that is not shown.
        refreshes = set(progress_refresh_steps((epoch_end,), self.step)) if self.report.show_progress else set()
        while self.step < epoch_end:
            self._charge_block_at(self.step)
            self._step(workers)
            if not self.engine_reported:
                self._report_engine(workers)
            bar.update(1)
            if self.step in refreshes:
                bar.set_postfix_str(release.line("progress", epsilon=f"{self.epsilon():.3f}"))
            if self.step in plan.evaluation_steps and self.step < epoch_end:
                self._record_epoch(self.step * config.batch_size / plan.dataset_size, workers)
                if self.stopped_early:
                    break
                # A resume runs the steps after its checkpoint again, with fresh noise and under their first charge:
                # none of those steps may have released a row of metrics.
                self._save_checkpoint()
            elif config.checkpoint_every and self.step % config.checkpoint_every == 0 and self.step < epoch_end:
                self._save_checkpoint()
        bar.close()

    def _charge_block_at(self, step: int) -> None:
        """Wait until the block that starts at `step` is charged (on the charge clock, which starts with the run's
        first step) before any of its steps run."""
        if self.charge_clock is not None:
            self.charge_clock.start()
        block = block_at(self.plan.charge_ends, step)
        if block < self.record.charged_blocks:
            return
        if self.shards is not None and self.config.on_shard_loss == "wait":
            # Start a block only once every shard is up to run it (the clock charges it on its own schedule).
            try:
                self.shards.wait_for_all(step)
            except ShardTimeoutError as error:
                self._stop_at_checkpoint(error)
        if self.charge_clock is not None:
            try:
                self.charge_clock.wait_for(block)
            except LedgerTimeoutError:
                self._save_checkpoint()
                raise
        self.record.charged_blocks = block + 1

    # --- a step --------------------------------------------------------------

    def _step(self, workers: list) -> None:
        """One DP-SGD step: sample, fan out, sum, noise once, average, optimizer step; its times are kept."""
        started = time.perf_counter()
        if self.aggregation == "collective":
            self._collective_step(workers)
        else:
            self.central_noise.request(self.step)
            if self.shards is not None:
                self._shard_step()
            else:
                self._sampled_step(workers)
        self.record.times = self.record.times.plus(time.perf_counter() - started,
                                                   self.gathered.slowest_worker_seconds, self.gathered.wait_seconds,
                                                   self._driver_bytes())

    def _driver_bytes(self) -> int:
        """The bytes the driver moved in the step just run.

        On the collective path, what it sent to and received from the ranks
        (pickled). On the driver path: the weights written to the object
        store, once more for each other node they reach, the sample shares
        sent and the sums received.
        """
        if self.aggregation == "collective":
            return self.gathered.driver_bytes
        weights = self.flat_weights.numel() * self.flat_weights.element_size()
        nodes = (set(self.shards.nodes.values()) if self.shards is not None
                 else set(self.fleet.worker_nodes.values())) - {ray.get_runtime_context().get_node_id()}
        return weights * (1 + len(nodes)) + self.sample_bytes + self.gathered.bytes_in

    def _draw_sample(self, step: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Step `step`'s Poisson sample and, with microbatches, each sampled example's microbatch (`step_sample`);
        a correlated mechanism's sampler's batch (`correlated_step_sample`). Both are drawn over all N rows; under
        check_data = "lenient" the drawn rows that the rule drops are left out, the others named as the workers'
        sources number them (their positions among the rows kept)."""
        plan = self.plan
        if plan.correlation is not None:
            if self.sample_order is None:
                self.sample_order = shuffled_order(self.run_key, plan.dataset_size)
            indices, group_ids = correlated_step_sample(self.run_key, self.sample_order, step, plan.correlation,
                                                        plan.batch_size), None
        else:
            indices, group_ids = step_sample(self.run_key, step, plan.dataset_size, plan.sampling_rate,
                                             plan.microbatches)
        if self.kept_rows is None:
            return indices, group_ids
        kept, positions = self.kept_rows.among_kept(indices)
        return positions, None if group_ids is None else group_ids[kept]

    def _sampled_step(self, workers: list) -> None:
        """A step of driver-sampled examples, split across `workers`; the next step's sample is drawn here too."""
        plan, step = self.plan, self.step
        indices, group_ids = self.drawn_sample or self._draw_sample(step)
        self.drawn_sample = self._draw_sample(step + 1) if step + 1 < plan.steps else None
        weights = self._weights()
        shards, group_shards = worker_shares(indices, group_ids, len(workers))
        self.sample_bytes = indices.nbytes + (0 if group_ids is None else group_ids.nbytes)
        # Under users, a worker picks each user's rows itself when the step runs, so nothing is read ahead.
        next_shards = (None if self.drawn_sample is None or self.config.privacy_unit == "user"
                       else worker_shares(*self.drawn_sample, len(workers))[0])
        partial_sums = self._partial_sums(workers, weights, shards, group_shards, next_shards)
        adaptive = self.config.adaptive_clipping is not None
        partial_sums, counts = split_counts(partial_sums, self.flat_weights.numel(), 2 if adaptive else 1)
        # The last count is the raw number of zeroed examples: un-noised, so it is dropped unread (rule 3).
        clip_norm = self.record.clip_norm
        if adaptive:
            self._adapt_clip_norm(counts[0], len(indices), group_ids)
        self._noise_and_step(partial_sums, self._noise_std(step, clip_norm))

    def _collective_step(self, workers: list) -> None:
        """A step on the collective path: the driver samples and sends shares, keys and scalars; the ranks do the rest.

        Each rank gets its share of the sample and its slice's noise key;
        the ranks reduce-scatter, noise their slices once, step and
        all-gather (`workers.collective`). The driver keeps the learning-rate
        schedule, adaptive clipping's noisy count and the events.
        """
        plan, step, config = self.plan, self.step, self.config
        if self.shards is not None:  # each rank samples its own shard's examples
            shares, group_shares = [None] * len(workers), None
        else:
            indices, group_ids = self.drawn_sample or self._draw_sample(step)
            self.drawn_sample = self._draw_sample(step + 1) if step + 1 < plan.steps else None
            shares, group_shares = worker_shares(indices, group_ids, len(workers))
        clip_norm = self.record.clip_norm
        adaptive = config.adaptive_clipping is not None
        self.gathered = self.fleet.step(step, shares, group_shares, config.layer_clip_norms or clip_norm,
                                        self._noise_std(step, clip_norm), plan.contributions_per_step,
                                        self.optimizer.param_groups[0]["lr"], adaptive)
        if adaptive:
            self._adapt_clip_norm(self.gathered.unclipped, len(indices), group_ids)
        self.record.account_step(plan.events_between(step, step + 1))
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()

    def _noise_std(self, step: int, clip_norm: float) -> float:
        """The std of step `step`'s noise on the sum: sigma at that step times the clip norm."""
        return self.plan.sigma_at(step) * clip_norm

    def _collect_weights(self) -> None:
        """On the collective path, copy the ranks' weights into the driver's model (to evaluate or checkpoint), and
        with ema_decay their slices of the moving average into `ema_weights`."""
        if self.aggregation == "collective":
            self.flat_weights.copy_(torch.tensor(self.fleet.weights(self.step)))
            if self.ema_weights is not None:
                self.ema_weights.copy_(torch.tensor(self.fleet.averaged_weights(self.step)))

    def _shard_step(self) -> None:
        """One DP-SGD step with shards: each worker samples its own examples; sum, noise once, average, step.

        The driver sends the weights and the step number and gets back only
        clipped sums (and the raw zeroed count). A shard lost under "skip"
        contributes nothing; the normaliser stays q*N for the declared N.
        """
        step, clip_norm = self.step, self.record.clip_norm
        weights = self._weights()
        silos_noise = self.config.noise_placement == "silos"
        try:
            self.gathered, missing = self.shards.clipped_sums(weights, step, self.config.layer_clip_norms
                                                              or clip_norm, self.plan.sigma_at(step) if silos_noise
                                                              else 0.0)
        except ShardTimeoutError as error:
            self._stop_at_checkpoint(error)
        # The count is the raw number of zeroed examples: un-noised, so it is dropped unread (rule 3); under
        # secure aggregation it never leaves its silo.
        partial_sums, counts = split_counts(self.gathered.parts, self.flat_weights.numel(),
                                            0 if self.config.secure_aggregation else 1)
        extend_outages(self.record.shard_outages, step, missing, self.config.shards)
        # With the noise in the silos the unmasked total already carries it: the driver adds none.
        self._noise_and_step(partial_sums, 0.0 if silos_noise else self._noise_std(step, clip_norm))

    def _partial_sums(
        self, workers: list, weights, shards: list[np.ndarray], group_shards: list[np.ndarray] | None,
        next_shards: list[np.ndarray] | None,
    ) -> list[np.ndarray]:
        """The clipped sums of the workers' shards: one per node, added there, or per worker on the driver's node.

        Each sum carries raw counts after it: with adaptive clipping the
        unclipped count, then always the count of examples left out for a
        non-finite gradient. `next_shards`, the workers' shares of the next
        step's sample, are read ahead while the sums compute. The shards of a
        node whose sum failed are recomputed by calling its workers one by
        one; a worker that is gone for good is replaced (`WorkerFleet.gather`).
        """
        clip_norm = self.config.layer_clip_norms or self.record.clip_norm
        if self.config.privacy_unit == "user":
            # The shards hold user numbers: each user, with all its rows, goes to one worker.
            method, options = "user_clipped_sum", {}
            arguments = {index: (shards[index], clip_norm, self.step) for index in range(len(workers))}
        else:
            count = self.config.adaptive_clipping is not None
            groups = group_shards or [None] * len(shards)
            upcoming = next_shards or [None] * len(shards)
            method, options = "clipped_grad_sum", {}
            planned = self._planned_batches(len(workers))
            arguments = {index: (shards[index], clip_norm, groups[index], count, upcoming[index], True,
                                 *planned[index])
                         for index in range(len(workers))}
        self.gathered = self.fleet.gather(method, weights, arguments, options)
        return self.gathered.parts

    def _planned_batches(self, workers: int) -> list[tuple]:
        """Each worker's (planned batch of this step, of the next step) with planned windows, else ()."""
        windows, step = self.planned_windows, self.step
        if windows is None:
            return [()] * workers
        # The windows before this step's have all run: their folders go now.
        windows.done_with(step - 1)
        return [(windows.batch(step, worker), windows.batch(step + 1, worker)) for worker in range(workers)]

    def _adapt_clip_norm(self, unclipped: float, realised_batch: int, group_ids: np.ndarray | None) -> None:
        """Move the clip norm for the next step by the noisy unclipped fraction (the raw counts stay here).

        `unclipped` counts examples, or with microbatches (`group_ids`) the
        non-empty microbatches; empty ones are added as unclipped.
        """
        settings, plan = self.config.adaptive_clipping, self.plan
        count_noise = float(self.noise.draw(1, settings.count_noise_multiplier, (COUNT_NOISE, self.step))[0])
        microbatches = None if group_ids is None else plan.microbatches
        empty = 0 if group_ids is None else plan.microbatches - np.unique(group_ids).size
        self.record.clip_norm = adapted_clip_norm(self.record.clip_norm, settings, count_noise, unclipped,
                                                  realised_batch, plan.expected_batch_size, microbatches, empty)

    def _noise_and_step(self, partial_sums: list[np.ndarray], noise_std: float) -> None:
        """Take the step's noise, add it once (`_apply_noise`) and account the step's events."""
        step = self.step
        # Taken after every shard is in: a recomputed shard never causes a second draw.
        self._apply_noise(partial_sums, self.central_noise.take(step), noise_std)
        self.record.account_step(self.plan.events_between(step, step + 1))

    def _apply_noise(self, partial_sums: list[np.ndarray], unit_noise, noise_std: float) -> None:
        """Add the step's noise once to the sum of `partial_sums`, average by q*N, step the optimizer and LR schedule.

        `unit_noise` is the step's N(0, 1) vector; `noise_std` is sigma times
        the clip norm. The noisy mean gradient is written straight into the
        model's flat gradient buffer.
        """
        self.central_noise.mean_gradient(partial_sums, unit_noise, noise_std, self.plan.contributions_per_step,
                                         self.flat_gradient)
        if self.config.local_steps is not None:
            # DP-FedAvg: the noisy mean is a model delta, a step the server optimizer takes as minus a gradient.
            self.flat_gradient.neg_()
        self.optimizer.step()
        if self.ema_weights is not None:
            update_ema(self.ema_weights, self.flat_weights, self.config.ema_decay, self.step)
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()

    def _weights(self, evaluated: bool = False) -> ray.ObjectRef:
        """The current flat float32 weights in the object store (one copy, straight from the model's buffer).

        With ``evaluated``, the weights an evaluation uses: their moving average when ``ema_decay`` is set.
        """
        weights = self.ema_weights if evaluated and self.ema_weights is not None else self.flat_weights
        return ray.put(weights.numpy() if self.device.type == "cpu" else weights.cpu().numpy())

    # --- reporting -----------------------------------------------------------

    def _start_evaluation(self, workers: list, split: str, size: int) -> list[ray.ObjectRef]:
        """Ask the workers for their parts of an evaluation over the first ``size`` examples of a split."""
        return start_evaluation(self._workers_now(workers), self._weights(evaluated=True), split, size,
                                self.config.metrics)

    def _evaluate(self, workers: list, epsilon: Callable[[], float] | None = None) -> dict:
        """The test metrics at the current weights ("test_" names), with ``non_private_train_loss`` the training
        loss too, and with `epsilon` its figure, computed while the workers evaluate."""
        test = self._start_evaluation(workers, "test", test_set_size(self.config))
        if self.non_private_train_loss:
            # Under check_data = "lenient" the workers' training split is the rows kept, fewer than N.
            held = self.plan.dataset_size if self.kept_rows is None else len(self.kept_rows.kept)
            train = self._start_evaluation(workers, "train", min(_TRAIN_LOSS_EXAMPLES, held))
        row = {} if epsilon is None else {"epsilon": epsilon()}
        row = {**{f"test_{name}": value for name, value in merge_evaluation(test).items()}, **row}
        if self.non_private_train_loss:
            row["train_loss_non_private"] = merge_evaluation(train)["loss"]
        return row

    def _record_epoch(self, epoch: float, workers: list) -> None:
        """Evaluate and log one row of metrics; ``epoch`` is fractional for a row within an epoch."""
        self._collect_weights()
        self.report.add_row(self.record.metrics, {"epoch": epoch, "step": self.step,
                                                  **self._evaluate(workers, self.epsilon)})
        config = self.config
        if config.early_stopping_patience is not None and self.step < self.plan.steps:
            self.stopped_early = stops_early(self.record.metrics, config.early_stopping_metric,
                                             config.early_stopping_patience, config.early_stopping_min_delta)

    def _finish(self) -> dict:
        """The run's summary (`RunReport.finish`)."""
        return self.report.finish(self.record, None if self.ledger is None else self.ledger.reservation_id)


def correlated_resume_refusal(mechanism: str, steps_run: int, steps: int) -> str:
    """Why a correlated run stopped after `steps_run` of its `steps` is not resumed, and what to do instead.

    Its noise at every step depends on the vectors before it (BandMF's last
    b - 1, DP-FTRL's tree), and they and its order or groups derive from a
    key that lives in memory only and is never written (threat model, rule
    10). A resumed run would have to start a fresh strategy and order for the
    steps that remain: a second mechanism whose participations (one more
    when the stop fell inside an epoch or a group's cycle) the job's
    reservation does not hold.
    """
    return (f'a mechanism = "{mechanism}" run cannot resume: its noise at each step is correlated with the noise '
            "of the steps before, which derives from a key held in memory only and never written, so the "
            "strategy cannot be continued, and a fresh one would need participations this job did not reserve. "
            f"The {steps_run} of {steps} steps that ran stay charged to the ledger. Start the run again in "
            "another run_dir (a job of its own on the ledger), or choose mechanism = \"dp-sgd\", whose runs "
            "resume")


def resume_trainer(run_dir: str, trainer_class: type[Trainer] = Trainer, **options) -> Trainer:
    """A Trainer for the run in `run_dir`, at its newest intact checkpoint (`trainer_class`: a subclass that watches
    or changes a stage of the steps; `options` are its arguments)."""
    from orchestrator.config import build_config

    config_path = Path(run_dir) / "config.json"
    if not config_path.exists():
        raise UsageError(f"{run_dir!r} holds no config.json; --resume takes the run_dir of an earlier run")
    found = latest_checkpoint(Path(run_dir))
    if found is None:
        raise UsageError(f"{run_dir!r} holds no intact checkpoint to resume from")
    values = json.loads(config_path.read_text())
    values["run_dir"] = run_dir
    path, state = found
    check_checkpoint_version(state, path)
    # The run's keys as config.json gives them, before sigma is fixed below: what the checkpoint was bound to.
    written = bound_config(build_config(values))
    # The checkpoint fixes sigma: recalibrating from target_epsilon could drift by a rounding step.
    values["noise_multiplier"], values["target_epsilon"] = state["noise_multiplier"], None
    values.pop("target_epsilon_basis", None)
    trainer = trainer_class(build_config(values), **options)
    trainer.bound_config = written
    trainer.load_state(state)
    return trainer
