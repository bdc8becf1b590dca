"""The driver-sampled run's gradient workers: started, summed node by node, replaced when lost, and asked to evaluate.

See ``WorkerFleet``; a run with shards has a ``ShardFleet`` instead
(``orchestrator.shard_fleet``). The evaluation and engine-report helpers
serve both: they take the actors that are up.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import numpy as np
import ray

from orchestrator import release
from orchestrator.aggregation import Gathered, NodeAggregation
from orchestrator.config import TrainConfig, user_spec
from workers.actor import GradientWorkerActor
from workers.planned_batches import PlannedDataset

WORKER_RESTARTS = 2
WORKER_REPLACEMENTS = 2
# Passes made_up_step_seconds times after one that warms up (the workers' engines, the allocators): their median.
TIMED_PASSES = 9


def gradient_worker(config: TrainConfig, actor=GradientWorkerActor, restarts: int = WORKER_RESTARTS,
                    planned_dataset: PlannedDataset | None = None) -> ray.actor.ActorHandle:
    """A new gradient worker actor for `config`'s model, data and engine, sized by its per-worker CPUs and GPUs.

    `actor` is the worker's Ray class (a collective rank's, on that path);
    `restarts` how often Ray restarts it and retries its call when it dies;
    `planned_dataset` the Parquet training files, as the driver read their
    footers, of a run with plan_ahead_steps.
    """
    # A killed worker is restarted by Ray, which re-runs its interrupted call: the call is a
    # pure function of (weights, indices, clip norm), so the retry returns the same sum.
    return actor.options(
        **release.UNRECORDED_BY_RAY,
        num_cpus=config.cpus_per_worker,
        num_gpus=config.gpus_per_worker,
        max_restarts=restarts,
        max_task_retries=restarts,
    ).remote(
        config.model_spec,
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
        planned_dataset=planned_dataset,
        precision=config.precision,
    )


def made_up_step_seconds(workers: list, parameters: int, examples: int, clip_norm: float) -> float:
    """Seconds a step's round trip takes on made-up examples: weights of `parameters` zeros put in the object
    store, each worker's sum of `examples` made-up examples clipped to `clip_norm` (``made_up_clipped_sum``,
    by the run's engine, physical batch and precision), the sums fetched and added, and a noise vector of their
    size drawn; the median of TIMED_PASSES after one that warms up.

    No row of the data is read and no trained weight is used, so the figure
    is the same whatever the data holds: the charge clock's pace comes from
    it (orchestrator/charge_clock.py).
    """
    weights, noise = np.zeros(parameters, dtype=np.float32), np.random.default_rng(0)
    seconds = []
    for _ in range(1 + TIMED_PASSES):
        started = time.perf_counter()
        reference = ray.put(weights)
        sums = ray.get([worker.made_up_clipped_sum.remote(reference, examples, clip_norm) for worker in workers])
        np.sum(sums, axis=0)[:parameters] + noise.standard_normal(parameters, dtype=np.float32)
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds[1:])


class WorkerFleet:
    """`count` gradient workers made by `new_worker`, with a reducer on each node that runs several of them.

    `workers` is the list the trainer's step hooks see; a lost worker is
    replaced in it, in place.
    """

    def __init__(self, count: int, new_worker: Callable[[], ray.actor.ActorHandle], say: Callable[[str], None]):
        self.new_worker, self.say = new_worker, say
        self.workers = [new_worker() for _ in range(count)]
        self.aggregation = NodeAggregation()
        self.worker_nodes: dict[int, str] = {}
        self.place_reducers(range(count))

    def place_reducers(self, indices) -> None:
        """Learn the nodes of workers `indices` and give each node that runs several of them its reducer."""
        indices = list(indices)
        nodes = ray.get([self.workers[index].node_id.remote() for index in indices])
        self.worker_nodes.update(zip(indices, nodes))
        self.aggregation.place(dict(enumerate(self.workers)), self.worker_nodes)

    def gather(self, method: str, weights: ray.ObjectRef, arguments: dict[int, tuple], options: dict) -> Gathered:
        """Every worker's ``method(weights, *arguments[index], **options)``, added up node by node.

        The calls of a node whose sum failed are made again worker by
        worker; a worker that is gone for good is replaced (at most
        WORKER_REPLACEMENTS times within the call) and its call made again.
        """
        aggregation = self.aggregation
        gathered = aggregation.gather(aggregation.run(dict(enumerate(self.workers)), self.worker_nodes,
                                                      method, weights, arguments, options))
        aggregation.forget(gathered.failed)
        failed, replacements = gathered.failed, 0
        while failed:
            retried = aggregation.gather(aggregation.run(
                dict(enumerate(self.workers)), self.worker_nodes, method, weights,
                {index: arguments[index] for index in failed}, options, direct=True))
            gathered.add(retried)
            failed = retried.failed
            if failed and replacements == WORKER_REPLACEMENTS:
                raise RuntimeError(f"gradient worker(s) {failed} were lost again after {WORKER_REPLACEMENTS} "
                                   "replacements within one step; check the workers' logs (ray logs)")
            for index in failed:
                self.say(release.line("worker_replaced", index=index))
                self.workers[index] = self.new_worker()
            replacements += bool(failed)
        if gathered.failed:
            self.place_reducers(gathered.failed)
        return gathered

    def close(self) -> None:
        """Stop the node reducers and let go of the workers.

        Ray ends an actor once no handle to it is left, freeing its CPUs for
        the next run; a worker that whoever made it still holds (a pool)
        keeps running.
        """
        self.aggregation.close()
        self.workers.clear()


def start_evaluation(actors: list, weights: ray.ObjectRef, split: str, size: int,
                     metrics: tuple[str, ...]) -> list[ray.ObjectRef]:
    """Ask `actors` for their parts of an evaluation over the first ``size`` examples of a split."""
    bounds = np.linspace(0, size, len(actors) + 1).astype(int)
    return [actor.evaluate.remote(weights, split, int(start), int(stop), metrics)
            for actor, start, stop in zip(actors, bounds[:-1], bounds[1:]) if stop > start]


def merge_evaluation(pending: list[ray.ObjectRef]) -> dict[str, float]:
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


def engine_report(actors: list, microbatches: int | None) -> list[str] | None:
    """How each layer's per-example gradients are computed, as the first of `actors` to decide says (None: none has).

    With microbatches every layer runs under vmap, whatever the workers say.
    """
    if microbatches:
        return ["every layer: vmap (each microbatch's mean-loss gradient)"]
    return next((report for report in ray.get([actor.engine_report.remote() for actor in actors])
                 if report is not None), None)
