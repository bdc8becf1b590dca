"""The DP-SGD driver: sample, fan out to workers, sum, add noise once, step.

The data flows one way: the driver Poisson-samples each logical batch and
splits its indices across the gradient workers; each worker returns the sum of
its examples' clipped gradients, added up on its node (``orchestrator.
aggregation``); the driver adds up the nodes' sums, adds Gaussian noise
N(0, (sigma * C)^2) once (drawn in the background while the workers computed,
``orchestrator.noise``), divides by the expected batch size, steps the
optimizer and ships the new weights with the next step.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Protocol

import numpy as np
import ray
import torch
from tqdm import tqdm

from accounting.accountants import get_accountant, label, labelled_epsilon
from accounting.events import Composition, group_events
from orchestrator.adaptive_clipping import (
    next_clip_norm,
    noisy_unclipped_fraction,
    noisy_unclipped_microbatch_fraction,
)
from orchestrator.aggregation import NodeAggregation, split_counts
from orchestrator.binding import binding_differences, bound_config, run_binding
from orchestrator.charge_clock import ChargeClock, ChargedBlocks
from orchestrator.checkpoint import latest_checkpoint, save_checkpoint
from orchestrator.config import TrainConfig, test_set_size, user_spec
from orchestrator.errors import LedgerTimeoutError, ShardTimeoutError, UsageError
from orchestrator.noise import (
    COUNT_NOISE,
    GaussianNoise,
    NoiseFeed,
    TorchGaussianNoise,
    driver_threads,
    noisy_mean_gradient,
)
from orchestrator.optimizers import build_lr_scheduler, build_optimizer, update_ema
from orchestrator.planning import RunPlan, plan_run
from orchestrator.report import plot_curves
from orchestrator.sampling import (
    assign_microbatches,
    poisson_sample,
    step_generator,
    worker_shares,
)
from orchestrator.shard_fleet import ShardFleet
from workers.actor import GradientWorkerActor, retain_freed_memory
from workers.fingerprints import dataset_identity
from workers.keys import process_key
from workers.models import bind_flat_views, build_model, parameter_count
from workers.sources import SPLITS, DataError, check_source, read_first, spec_name
from workers.validation import check_model, unchanged_buffers

# 2: no secret (no noise entropy, sampler state or drawn sample), a run id, and the run's binding.
CHECKPOINT_VERSION = 2
WORKER_RESTARTS = 2
WORKER_REPLACEMENTS = 2
_TRAIN_LOSS_EXAMPLES = 10_000
# The breakdown of a step's wall time, per step, averaged over the whole run in the summary: a step's own time
# tracks its realised batch size, so timings never go into the per-row metrics.
BREAKDOWN = ("driver_seconds_per_step", "worker_seconds_per_step", "wait_seconds_per_step")


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
        return True
    cpus = max(os.cpu_count() or 1, config.workers * config.cpus_per_worker)
    gpus = torch.cuda.device_count() if config.gpus_per_worker else 0
    resources = local_shard_resources(config)
    if resources:
        say(f"local Ray: this machine stands in for every shard's resources ({resources})")
    init_local_ray(cpus, gpus, resources, log_to_driver=True, say=say)
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
        say(f"local Ray did not start in time (try {attempt} of {LOCAL_RAY_START_ATTEMPTS}); trying again")
        time.sleep(5.0 * attempt)
        attempt += 1


def local_shard_resources(config: TrainConfig) -> dict[str, float]:
    """The custom resources a one-node local Ray needs to hold every shard's workers at once."""
    resources: dict[str, float] = {}
    for shard in config.shards:
        for name, amount in shard.resources.items():
            resources[name] = resources.get(name, 0.0) + amount * shard.workers
    return resources


@dataclass(frozen=True)
class StepTimes:
    """Seconds over a number of steps: the driver's own, the slowest worker's in its call, the driver's wait.

    The driver's own time is a step's wall time minus its wait for the
    workers' sums: what the workers wait for between steps.
    """

    steps: int = 0
    driver: float = 0.0
    worker: float = 0.0
    wait: float = 0.0

    def plus(self, wall: float, worker: float, wait: float) -> StepTimes:
        """These times and one more step's."""
        return StepTimes(self.steps + 1, self.driver + wall - wait, self.worker + worker, self.wait + wait)

    def minus(self, earlier: StepTimes) -> StepTimes:
        """The steps since `earlier`, a copy of these times taken then."""
        return StepTimes(self.steps - earlier.steps, self.driver - earlier.driver, self.worker - earlier.worker,
                         self.wait - earlier.wait)

    def per_step(self) -> dict[str, float]:
        """The BREAKDOWN means, in seconds per step (empty with no steps)."""
        if not self.steps:
            return {}
        return dict(zip(BREAKDOWN, (self.driver / self.steps, self.worker / self.steps, self.wait / self.steps)))


class LedgerSession(ChargedBlocks, Protocol):
    """What the trainer needs from the privacy ledger: its reservation, and blocks charged before they run."""

    reservation_id: str


class Trainer:
    """One DP-SGD run over Ray gradient workers, resumable from its checkpoints.

    `noise` replaces the driver's noise source (tests observe it); `ledger`
    is charged for each block of steps before the block runs;
    `charge_epsilon` is what target_epsilon_basis = "filter" calibrates σ by
    (see plan_run). With `non_private_train_loss`, each metrics row also
    holds the loss on the first training examples, labelled not private.
    With shards, constructing the Trainer starts Ray (unless it is up) and
    the shards' workers, because N is the sum of the example counts they
    report.
    """

    def __init__(
        self,
        config: TrainConfig,
        noise: GaussianNoise | None = None,
        show_progress: bool = True,
        non_private_train_loss: bool = False,
        ledger: LedgerSession | None = None,
        out=sys.stdout,
        charge_epsilon: Callable[[RunPlan], float] | None = None,
    ):
        self.config = config
        self.out = out
        self.started_ray = False
        self.shards: ShardFleet | None = None
        self.shard_outages: list[dict] = []
        dataset_size = None
        if config.shards:
            if non_private_train_loss:
                raise UsageError("--non-private-train-loss evaluates training examples on the driver's terms; with "
                                 "shards the training data stays on its nodes, so leave it off")
            self.started_ray = start_ray(config, self.say)
            self.shards = ShardFleet(config, self.say)
            dataset_size = self.shards.start()
        self.plan = plan_run(config, dataset_size, charge_epsilon)
        if self.shards is not None:
            self.shards.set_sampling_rate(self.plan.sampling_rate)
        # The driver's GPU, when it has one, draws the noise and runs the optimizer.
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        # The driver's secret: every step's sample and noise derive from it. In memory only, never saved.
        self.run_key = process_key(config.seed)
        if noise is None:
            noise = (TorchGaussianNoise(self.run_key, config.secure_noise, self.device) if self.device.type == "cuda"
                     else GaussianNoise(self.run_key, secure=config.secure_noise))
        self.noise = noise
        # The next step's (indices, microbatch ids), drawn a step early so the workers can read its examples ahead.
        # In memory only: a resumed run draws its samples afresh.
        self.drawn_sample: tuple[np.ndarray, np.ndarray | None] | None = None
        self.show_progress = show_progress
        self.non_private_train_loss = non_private_train_loss
        self.ledger = ledger
        self.accountant = get_accountant(config.accountant)
        self.epsilon_label = label(self.accountant)
        if config.seed is not None:
            torch.manual_seed(config.seed)
        self.model = build_model(config.model)
        check_model(self.model)
        if config.layer_clip_norms is not None:
            unmatched = config.layer_clip_norms.unmatched([name for name, p in self.model.named_parameters()
                                                           if p.requires_grad])
            if unmatched:
                raise UsageError(f"layer_clip_norms gives no clip norm to {', '.join(unmatched)}; every trainable "
                                 "parameter needs a prefix (e.g. the layer's name in model.named_parameters())")
        self._check_data()
        # A new run's id names its checkpoints; a resume takes the id of the run it continues.
        self.run_id = secrets.token_hex(8)
        self.bound_config = bound_config(config)
        self.dataset_identity = ({"source": [shard.dataset for shard in config.shards]} if config.shards
                                 else dataset_identity(config.dataset))
        # Parameters and gradients are views into two flat buffers: no copy in or out of the model per step.
        self.model.to(self.device)
        self.flat_weights, self.flat_gradient = bind_flat_views(self.model)
        self.optimizer = build_optimizer(config.optimizer, config.learning_rate, self.model.parameters())
        self.lr_scheduler = build_lr_scheduler(config.lr_schedule, self.optimizer, self.plan.steps)
        # Parameter averaging: a function of the noisy updates only, kept here and shipped for evaluation.
        self.ema_weights = None if config.ema_decay is None else self.flat_weights.clone()
        self.events = Composition()
        # The bound noise is scaled to: the total of the per-layer norms, or the (possibly adaptive) clip norm.
        self.clip_norm = config.layer_clip_norms.total_norm if config.layer_clip_norms else config.clip_norm
        self.metrics: list[dict] = []
        self.zeroed_examples = 0
        self.engine_reported = False
        self.charged_blocks = 0
        self.wall_seconds_before = 0.0
        # The reservation {"id", "dataset"} a resumed run continues under, as its checkpoint recorded it.
        self.resumed_reservation: dict | None = None
        self.run_dir = Path(config.run_dir)
        self.times = StepTimes()
        self.aggregation: NodeAggregation | None = None
        self.worker_nodes: dict[int, str] = {}
        self.noise_feed: NoiseFeed | None = None
        self.arithmetic: ThreadPoolExecutor | None = None
        self.charge_clock: ChargeClock | None = None

    def _check_data(self) -> None:
        """Check both splits' files before any budget is reserved or worker started (UsageError on a bad file).

        With check_data = "full", integer labels must lie below the dataset's
        num_classes, else below the model's output width on a test example.
        The built-ins are verified by digest, and a ``module:function``
        dataset's examples are not read in the driver, so only tables are checked.
        """
        config = self.config
        if isinstance(config.dataset, str):
            return
        full = config.check_data == "full"
        try:
            num_classes = None
            if full:
                check_source(config.dataset, "test")
                first_test_input, _ = read_first(config.dataset, "test", 1)
                # The saved model's buffers are the ones it was built with: this forward may not write them.
                with torch.no_grad(), unchanged_buffers(self.model):
                    num_classes = self.model(first_test_input).shape[-1]
            for split in SPLITS:
                check_source(config.dataset, split, full, num_classes)
        except DataError as error:
            raise UsageError(str(error), error.with_values) from None

    @property
    def resumed_reservation_id(self) -> str | None:
        """The id of the reservation a resumed run continues under (None for a new run, or one without a ledger)."""
        return None if self.resumed_reservation is None else self.resumed_reservation["id"]

    @property
    def step(self) -> int:
        """Steps run so far."""
        return self.events.steps

    def epsilon(self) -> float:
        """Epsilon of the steps run so far, at the config's delta, by the config's accountant.

        Also sets ``epsilon_label``: how that figure was obtained, for the log and the plot.
        """
        value, self.epsilon_label = labelled_epsilon(self.accountant, self.events, self.config.delta)
        return value

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
            "run_id": self.run_id,
            "binding": self.binding(),
            "step": self.step,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "lr_scheduler": None if self.lr_scheduler is None else self.lr_scheduler.state_dict(),
            "events": self.events.to_dict(),
            "metrics": self.metrics,
            "charged_blocks": self.charged_blocks,
            "noise_multiplier": self.plan.noise_multiplier,
            "clip_norm": self.clip_norm,
            "wall_seconds": self._wall_seconds(),
            "shard_outages": self.shard_outages,
            "step_times": asdict(self.times),
            # Laid out as workers.models.flat_parameters: load_flat_parameters(model, ...) gives the averaged model.
            "ema_weights": None if self.ema_weights is None else self.ema_weights.cpu().clone(),
        }

    def load_state(self, state: dict) -> None:
        """Continue from a checkpoint's state (see `state`), refused unless it is this run's (`binding`)."""
        check_checkpoint_version(state)
        differences = binding_differences(state["binding"], self.binding())
        if differences:
            raise UsageError(
                f"the checkpoint in {str(self.run_dir)!r} is not of this run: " + "; ".join(differences)
                + ". A resume continues the same run on the same data under the same reservation; to train "
                "with this configuration or data, start a new run: dpfleet train --config FILE --run-dir NEW_DIR"
            )
        self.run_id = state["run_id"]
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.lr_scheduler is not None and state["lr_scheduler"] is not None:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        self.events = Composition.from_dict(state["events"])
        self.metrics = list(state["metrics"])
        self.charged_blocks = state["charged_blocks"]
        self.clip_norm = state["clip_norm"]
        self.wall_seconds_before = state["wall_seconds"]
        self.resumed_reservation = state["binding"]["reservation"]
        self.shard_outages = list(state.get("shard_outages", []))
        self.times = StepTimes(**state.get("step_times", {}))
        if self.ema_weights is not None:
            if state.get("ema_weights") is None:
                raise ValueError("the checkpoint holds no averaged weights, but the run has ema_decay set; "
                                 "resume with the configuration the run started with")
            self.ema_weights.copy_(state["ema_weights"])

    def _save_checkpoint(self) -> None:
        self.wall_seconds_before, self.started = self._wall_seconds(), time.perf_counter()
        save_checkpoint(self.run_dir, self.run_id, self.step, self.state())

    def _wall_seconds(self) -> float:
        return self.wall_seconds_before + (time.perf_counter() - self.started if hasattr(self, "started") else 0.0)

    # --- the run -------------------------------------------------------------

    def run(self) -> dict:
        """Train the remaining planned steps and return the summary (also written to run_dir)."""
        config, plan = self.config, self.plan
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.json").write_text(json.dumps(config.to_dict(), indent=2, sort_keys=True))
        if config.seed is not None:
            self.say(f"seeded: not for production use (seed {config.seed})")
        self.say(
            f"dpfleet: {config.model} on "
            + (f"{len(config.shards)} shards" if config.shards else spec_name(config.dataset))
            + (f" (N={plan.dataset_size})" if plan.privacy_unit == "example" else f" ({plan.dataset_size} users)")
            + f", {plan.steps} steps, "
            f"q={plan.sampling_rate:.4g}, sigma={plan.noise_multiplier:.4g}, C={config.clip_norm:g}, "
            f"{config.workers} worker(s)" + (f", resuming at step {self.step}" if self.step else "")
        )
        started_ray = start_ray(config, self.say) or self.started_ray
        # The driver allocates and frees the same large buffers every step, as the workers do.
        retain_freed_memory()
        self.noise_feed = NoiseFeed(self.noise, parameter_count(self.model))
        # The workers are idle while the driver adds the noise: its arithmetic may take every core it has.
        self.arithmetic = ThreadPoolExecutor(driver_threads(), thread_name_prefix="driver")
        try:
            # With shards the fleet holds the workers (placed while planning); `workers` stays empty.
            workers = [] if self.shards else [self._new_worker() for _ in range(config.workers)]
            devices = ray.get([worker.device_name.remote() for worker in self._workers_now(workers)])
            self.say("gradient workers on " + ", ".join(devices))
            # The workers settled their engine on synthetic examples as they started: the start says what runs where.
            self._report_engine(workers)
            if not self.shards:
                self.aggregation = NodeAggregation()
                self._place_reducers(workers, range(len(workers)))
            if self.ledger is not None:
                self.charge_clock = ChargeClock(self.ledger, self._uncharged_blocks(), config.commit_interval).start()
            self._train(workers)
        finally:
            if self.charge_clock is not None:
                self.charge_clock.stop()
            self.noise_feed.close()
            self.arithmetic.shutdown()
            if self.aggregation is not None:
                self.aggregation.close()
            if self.shards is not None:
                self.shards.close()
            if started_ray:
                ray.shutdown()
        return self._finish()

    def _workers_now(self, workers: list) -> list:
        """The workers to evaluate on and ask for reports: `workers`, or the shards' workers that are up."""
        return workers if self.shards is None else self.shards.present_actors()

    def _weights(self, evaluated: bool = False) -> ray.ObjectRef:
        """The current flat float32 weights in the object store (one copy, straight from the model's buffer).

        With ``evaluated``, the weights an evaluation uses: their moving average when ``ema_decay`` is set.
        """
        weights = self.ema_weights if evaluated and self.ema_weights is not None else self.flat_weights
        return ray.put(weights.numpy() if self.device.type == "cpu" else weights.cpu().numpy())

    def _start_evaluation(self, workers: list, split: str, size: int) -> list[ray.ObjectRef]:
        """Ask the workers for their parts of an evaluation over the first ``size`` examples of a split."""
        workers = self._workers_now(workers)
        bounds = np.linspace(0, size, len(workers) + 1).astype(int)
        weights = self._weights(evaluated=True)
        return [worker.evaluate.remote(weights, split, int(start), int(stop), self.config.metrics)
                for worker, start, stop in zip(workers, bounds[:-1], bounds[1:]) if stop > start]

    @staticmethod
    def _merge_evaluation(pending: list[ray.ObjectRef]) -> dict[str, float]:
        """Mean loss and metrics from the workers' parts of an evaluation.

        Each worker returns sums over its part (loss sum, count, torchmetrics
        states); the driver merges them and never loads an example.
        """
        parts = ray.get(pending)
        merged = parts[0]["metrics"]
        for part in parts[1:]:
            for name, metric in part["metrics"].items():
                merged[name].merge_state(metric)
        result = {"loss": sum(part["loss_sum"] for part in parts) / sum(part["count"] for part in parts)}
        return result | {name: float(metric.compute()) for name, metric in merged.items()}

    def _new_worker(self):
        config = self.config
        # A killed worker is restarted by Ray, which re-runs its interrupted call: the call is a
        # pure function of (weights, indices, clip norm), so the retry returns the same sum.
        return GradientWorkerActor.options(
            num_cpus=config.cpus_per_worker,
            num_gpus=config.gpus_per_worker,
            max_restarts=WORKER_RESTARTS,
            max_task_retries=WORKER_RESTARTS,
        ).remote(
            config.model,
            config.dataset,
            config.train_subset,
            config.max_physical_batch,
            threads=config.cpus_per_worker,
            data_root=config.data_root,
            engine=config.engine,
            loss=config.loss,
            train_transforms=config.train_transforms,
            augmentations_per_example=config.augmentations_per_example,
            users=user_spec(config),
        )

    def _place_reducers(self, workers: list, indices) -> None:
        """Learn the nodes of workers `indices` and give each node that runs several of them its reducer."""
        indices = list(indices)
        nodes = ray.get([workers[index].node_id.remote() for index in indices])
        self.worker_nodes.update(zip(indices, nodes))
        self.aggregation.place(dict(enumerate(workers)), self.worker_nodes)

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
        one; a worker that is gone for good is replaced.
        """
        clip_norm, count = self.config.layer_clip_norms or self.clip_norm, self.config.adaptive_clipping is not None
        if self.config.privacy_unit == "user":
            # The shards hold user numbers: each user, with all its rows, goes to one worker.
            method, options = "user_clipped_sum", {}
            arguments = {index: (shards[index], clip_norm, self.step) for index in range(len(workers))}
        else:
            groups = group_shards or [None] * len(shards)
            upcoming = next_shards or [None] * len(shards)
            method, options = "clipped_grad_sum", {"count_zeroed": True}
            arguments = {index: (shards[index], clip_norm, groups[index], count, upcoming[index])
                         for index in range(len(workers))}
        gathered = self.aggregation.gather(self.aggregation.run(dict(enumerate(workers)), self.worker_nodes,
                                                                method, weights, arguments, options))
        self.aggregation.forget(gathered.failed)
        failed, replacements = gathered.failed, 0
        while failed:
            retried = self.aggregation.gather(self.aggregation.run(
                dict(enumerate(workers)), self.worker_nodes, method, weights,
                {index: arguments[index] for index in failed}, options, direct=True))
            gathered.add(retried)
            failed = retried.failed
            if failed and replacements == WORKER_REPLACEMENTS:
                raise RuntimeError(f"gradient worker(s) {failed} were lost again after {WORKER_REPLACEMENTS} "
                                   "replacements within one step; check the workers' logs (ray logs)")
            for index in failed:
                self.say(f"worker {index} is gone; replacing it and recomputing its shard")
                workers[index] = self._new_worker()
            replacements += bool(failed)
        if gathered.failed:
            self._place_reducers(workers, gathered.failed)
        self.gathered = gathered
        return gathered.parts

    def _step(self, workers: list) -> None:
        """One DP-SGD step: sample, fan out, sum, noise once, average, optimizer step; its times are kept."""
        started = time.perf_counter()
        step = self.step
        self.noise_feed.request(step)
        if step + 1 < self.plan.steps:
            self.noise_feed.request(step + 1)
        if self.shards is not None:
            self._shard_step()
        else:
            self._sampled_step(workers)
        self.times = self.times.plus(time.perf_counter() - started, self.gathered.slowest_worker_seconds,
                                     self.gathered.wait_seconds)

    def _draw_sample(self, step: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Step `step`'s Poisson sample and, with microbatches, each sampled example's microbatch.

        Both come from PRF(run key, "sample", step): drawn again, the step gets the same sample.
        """
        plan = self.plan
        generator = step_generator(self.run_key, step)
        indices = poisson_sample(generator, plan.dataset_size, plan.sampling_rate)
        return indices, assign_microbatches(generator, len(indices), plan.microbatches) if plan.microbatches else None

    def _sampled_step(self, workers: list) -> None:
        """A step of driver-sampled examples, split across `workers`; the next step's sample is drawn here too."""
        plan = self.plan
        step = self.step
        indices, group_ids = self.drawn_sample or self._draw_sample(step)
        self.drawn_sample = self._draw_sample(step + 1) if step + 1 < plan.steps else None
        weights = self._weights()
        shards, group_shards = worker_shares(indices, group_ids, len(workers))
        # Under users, a worker picks each user's rows itself when the step runs, so nothing is read ahead.
        next_shards = (None if self.drawn_sample is None or self.config.privacy_unit == "user"
                       else worker_shares(*self.drawn_sample, len(workers))[0])
        partial_sums = self._partial_sums(workers, weights, shards, group_shards, next_shards)
        adaptive = self.config.adaptive_clipping is not None
        partial_sums, counts = split_counts(partial_sums, self.flat_weights.numel(), 2 if adaptive else 1)
        # Raw counts: they stay in the driver and are never logged or saved.
        self.zeroed_examples += int(counts[-1])
        clip_norm = self.clip_norm
        if adaptive:
            self._adapt_clip_norm(counts[0], len(indices), group_ids)
        # Taken after every shard is in: a recomputed shard never causes a second draw.
        self._apply_noise(partial_sums, self.noise_feed.take(step), plan.sigma_at(step) * clip_norm)
        self.events = self.events.then(plan.events_between(step, step + 1))

    def _shard_step(self) -> None:
        """One DP-SGD step with shards: each worker samples its own examples; sum, noise once, average, step.

        The driver sends the weights and the step number and gets back only
        clipped sums (and the raw zeroed count). A shard lost under "skip"
        contributes nothing; the normaliser stays q*N for the declared N.
        """
        plan, step = self.plan, self.step
        weights = self._weights()
        try:
            self.gathered, missing = self.shards.clipped_sums(weights, step, self.config.layer_clip_norms
                                                              or self.clip_norm)
        except ShardTimeoutError as error:
            self._stop_at_checkpoint(error)
        partial_sums, counts = split_counts(self.gathered.parts, self.flat_weights.numel(), 1)
        # A raw count: it stays in the driver and is never logged or saved.
        self.zeroed_examples += int(counts[-1])
        self._record_missing_shards(step, missing)
        # Taken after every shard is in: a recomputed shard never causes a second draw.
        self._apply_noise(partial_sums, self.noise_feed.take(step), plan.sigma_at(step) * self.clip_norm)
        self.events = self.events.then(plan.events_between(step, step + 1))

    def _record_missing_shards(self, step: int, missing: list[tuple[int, int]]) -> None:
        """Extend each missing (shard, worker) slot's outage to step `step` (0-based).

        An outage names the shard, the worker within it (of the shard's
        `workers`: with several, the others' examples still took part) and
        1-based steps, inclusive.
        """
        for shard, worker in missing:
            open_outage = next((outage for outage in reversed(self.shard_outages)
                                if (outage["shard"], outage["worker"]) == (shard, worker)), None)
            if open_outage is not None and open_outage["last_step"] == step:
                open_outage["last_step"] = step + 1
            else:
                spec = self.config.shards[shard]
                self.shard_outages.append({"shard": shard, "worker": worker, "workers": spec.workers,
                                           "resources": dict(spec.resources), "first_step": step + 1,
                                           "last_step": step + 1})

    def _stop_at_checkpoint(self, error: ShardTimeoutError) -> None:
        """Save a checkpoint of the steps that ran and stop with a message that says how to continue."""
        self._save_checkpoint()
        raise ShardTimeoutError(
            f"{error}. The run stopped at a checkpoint after step {self.step}; the ledger block it was in stays "
            f"charged once and is not charged again; continue with: dpfleet train --resume {self.config.run_dir}"
        ) from None

    def _report_engine(self, workers: list) -> None:
        """Log once how each layer's per-example gradients are computed, as the first worker to decide says."""
        if self.plan.microbatches:
            lines = ["every layer: vmap (each microbatch's mean-loss gradient)"]
        else:
            lines = next((report for report in ray.get([worker.engine_report.remote()
                                                        for worker in self._workers_now(workers)])
                          if report is not None), None)
            if lines is None:  # no worker has had an example yet
                return
        self.say("clipping engine, per layer: " + "; ".join(lines))
        self.engine_reported = True

    def _adapt_clip_norm(self, unclipped: float, realised_batch: int, group_ids: np.ndarray | None) -> None:
        """Move the clip norm for the next step by the noisy unclipped fraction (the raw counts stay here).

        `unclipped` counts examples, or with microbatches (`group_ids`) the
        non-empty microbatches; empty ones are added here as unclipped.
        """
        settings = self.config.adaptive_clipping
        count_noise = float(self.noise.draw(1, settings.count_noise_multiplier, (COUNT_NOISE, self.step))[0])
        if group_ids is None:
            fraction = noisy_unclipped_fraction(unclipped, realised_batch, count_noise, self.plan.expected_batch_size)
        else:
            empty = self.plan.microbatches - np.unique(group_ids).size
            fraction = noisy_unclipped_microbatch_fraction(unclipped + empty, self.plan.microbatches, count_noise)
        self.clip_norm = next_clip_norm(self.clip_norm, fraction, settings)

    def _apply_noise(self, partial_sums: list[np.ndarray], unit_noise, noise_std: float) -> None:
        """Add the step's noise once to the sum of `partial_sums`, average by q*N, step the optimizer and LR schedule.

        `unit_noise` is the step's N(0, 1) vector; `noise_std` is sigma times
        the clip norm. The noisy mean gradient is written straight into the
        model's flat gradient buffer.
        """
        noisy_mean_gradient(partial_sums, unit_noise, noise_std, self.plan.contributions_per_step, self.flat_gradient,
                            self.arithmetic)
        if self.config.local_steps is not None:
            # DP-FedAvg: the noisy mean is a model delta, a step the server optimizer takes as minus a gradient.
            self.flat_gradient.neg_()
        self.optimizer.step()
        if self.ema_weights is not None:
            update_ema(self.ema_weights, self.flat_weights, self.config.ema_decay, self.step)
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()

    def _uncharged_blocks(self) -> list[tuple[int, Composition]]:
        """(sequence, row-level events) of each block of the plan this run has not charged, in order."""
        ends = self.plan.charge_ends
        return [(index, self.plan.row_level_events_between(ends[index - 1] if index else 0, end))
                for index, end in enumerate(ends) if index >= self.charged_blocks]

    def _charge_block_at(self, step: int) -> None:
        """Wait until the block that starts at `step` is charged (on the charge clock) before any of its steps run."""
        plan = self.plan
        block_index = plan.charge_ends.index(next(end for end in plan.charge_ends if end > step))
        if block_index < self.charged_blocks:
            return
        if self.shards is not None and self.config.on_shard_loss == "wait":
            # Start a block only once every shard is up to run it (the clock charges it on its own schedule).
            try:
                self.shards.wait_for_all(step)
            except ShardTimeoutError as error:
                self._stop_at_checkpoint(error)
        if self.charge_clock is not None:
            try:
                self.charge_clock.wait_for(block_index)
            except LedgerTimeoutError:
                self._save_checkpoint()
                raise
        self.charged_blocks = block_index + 1

    def _train(self, workers: list) -> None:
        plan, config = self.plan, self.config
        self.started = time.perf_counter()
        if not self.metrics:
            self._record_epoch(0, workers)
        for epoch, epoch_end in enumerate(plan.epoch_ends, start=1):
            if epoch_end <= self.step:
                continue
            bar = tqdm(
                total=epoch_end - self.step,
                desc=f"epoch {epoch}/{len(plan.epoch_ends)}",
                unit="step",
                disable=not self.show_progress,
                file=sys.stderr,
                dynamic_ncols=True,
            )
            bar_started, bar_steps = time.perf_counter(), 0
            refresh_every = max(1, (epoch_end - self.step) // 4)
            while self.step < epoch_end:
                self._charge_block_at(self.step)
                self._step(workers)
                if not self.engine_reported:
                    self._report_engine(workers)
                bar.update(1)
                bar_steps += 1
                if bar_steps % refresh_every == 0:
                    bar.set_postfix(
                        eps=f"{self.epsilon():.3f}",
                        samples_s=f"{bar_steps * plan.expected_batch_size / (time.perf_counter() - bar_started):.0f}",
                    )
                if self.step in plan.evaluation_steps and self.step < epoch_end:
                    self._record_epoch(self.step * config.batch_size / plan.dataset_size, workers)
                if config.checkpoint_every and self.step % config.checkpoint_every == 0 and self.step < epoch_end:
                    self._save_checkpoint()
            bar.close()
            if epoch_end in plan.evaluation_steps:
                self._record_epoch(epoch, workers)
            self._save_checkpoint()

    def _record_epoch(self, epoch: float, workers: list) -> None:
        """Evaluate and log one row of metrics; ``epoch`` is fractional for a row within an epoch."""
        test = self._start_evaluation(workers, "test", test_set_size(self.config))
        if self.non_private_train_loss:
            train = self._start_evaluation(workers, "train", min(_TRAIN_LOSS_EXAMPLES, self.plan.dataset_size))
        # The accountant runs while the workers evaluate.
        epsilon = self.epsilon()
        row = {
            "epoch": epoch,
            "step": self.step,
            **{f"test_{name}": value for name, value in self._merge_evaluation(test).items()},
            "epsilon": epsilon,
        }
        if self.non_private_train_loss:
            row["train_loss_non_private"] = self._merge_evaluation(train)["loss"]
        self.metrics.append(row)
        (self.run_dir / "metrics.jsonl").write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in self.metrics))
        if epoch:
            self.say(self._epoch_line(row))

    def _epoch_line(self, row: dict) -> str:
        figures = ", ".join(f"test {name.replace('_', ' ')} {row[f'test_{name}']:.4f}"
                            for name in (*self.config.metrics, "loss"))
        line = (
            f"epoch {row['epoch']:.4g}: {figures}, "
            f"epsilon {row['epsilon']:.4f} ({self.epsilon_label}{self._unit_label()}, delta={self.config.delta:g})"
        )
        if "train_loss_non_private" in row:
            line += f", train loss {row['train_loss_non_private']:.4f} (NOT private: read from training rows)"
        return line

    def _unit_label(self) -> str:
        """", per user" when ε protects each user rather than each row."""
        return ", per user" if self.plan.privacy_unit == "user" else ""

    def _finish(self) -> dict:
        config, plan = self.config, self.plan
        wall_seconds = self._wall_seconds()
        last = self.metrics[-1]
        summary = {
            **{key: value for key, value in last.items() if key.startswith("test_")},
            "loss": config.loss,
            "epsilon": self.epsilon(),
            "epsilon_label": self.epsilon_label,
            "epsilon_rigorous": self.accountant.rigorous,
            "delta": config.delta,
            "accountant": config.accountant,
            "steps": self.step,
            "noise_multiplier": plan.noise_multiplier,
            "sampling_rate": plan.sampling_rate,
            "clip_norm": config.clip_norm,
            "final_clip_norm": self.clip_norm,
            "batch_size": config.batch_size,
            "epochs": self.step * config.batch_size / plan.dataset_size,
            "dataset": spec_name(config.dataset),
            "dataset_size": plan.dataset_size,
            "model": config.model,
            "workers": config.workers,
            "wall_seconds": wall_seconds,
            # From the expected batch size: the realised sizes are raw counts and stay inside the driver.
            "samples_per_second": self.step * plan.expected_batch_size / wall_seconds,
            # Means over the run's steps: like wall_seconds, timings of whole steps, never of one example.
            **self.times.per_step(),
            "seeded": config.seed is not None,
            "reservation_id": None if self.ledger is None else self.ledger.reservation_id,
            "events": self.events.to_dict(),
        }
        if plan.privacy_unit == "user":
            # Each user's ε is `epsilon`; what one row reveals is bounded by the events the ledger was charged.
            summary["privacy_unit"] = "user"
            summary["users"] = plan.dataset_size
            summary["row_epsilon"] = labelled_epsilon(self.accountant, plan.row_level_events_between(0, self.step),
                                                      config.delta)[0]
        if plan.rows_per_person is not None:
            # Group privacy: what the events so far reveal about a person of at most this many rows.
            summary["rows_per_person"] = plan.rows_per_person
            summary["user_epsilon"] = labelled_epsilon(self.accountant, group_events(self.events, plan.rows_per_person),
                                                       config.delta)[0]
        if config.shards:
            summary["shards"] = len(config.shards)
            summary["shard_outages"] = self.shard_outages
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True))
        plot_curves(self.metrics, self.run_dir / "curves.png",
                    f"{self.epsilon_label} epsilon at delta={config.delta:g}", config.metrics[0])
        return summary


def resume_trainer(run_dir: str, **options) -> Trainer:
    """A Trainer for the run in `run_dir`, at its newest intact checkpoint."""
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
    trainer = Trainer(build_config(values), **options)
    trainer.bound_config = written
    trainer.load_state(state)
    return trainer


def check_checkpoint_version(state: dict, path: Path | None = None) -> None:
    """Refuse a checkpoint of another format: those of version 1 held the run's secrets and no binding to its data.

    A version 1 checkpoint kept the noise's root entropy and the sampler's
    state, from which every step's noise and sample can be recomputed, and
    nothing to check that a resume is the same run. It is refused rather
    than resumed without them: the run cannot be shown to continue on the
    same data, and the file itself should not be kept.
    """
    version = state.get("version")
    if version == CHECKPOINT_VERSION:
        return
    where = f" {str(path)!r}" if path is not None else ""
    if version == 1:
        raise UsageError(
            f"checkpoint{where} is of version 1, which holds the run's noise and sampling secrets and no binding "
            "to its data, and cannot be resumed: delete it (anyone who reads it can recompute every step's noise "
            "and sample) and start a new run: dpfleet train --config FILE --run-dir NEW_DIR"
        )
    raise UsageError(f"checkpoint{where} is of version {version!r}; this dpfleet reads version {CHECKPOINT_VERSION} "
                     "only: resume with the dpfleet that wrote it, or start a new run")
