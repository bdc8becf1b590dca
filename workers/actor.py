"""The Ray shell around the clipping core: one actor holds a model and its shard of data.

The driver sends flat weights and example indices; the actor answers with the
sum of the clipped per-example gradients of those examples. The actor opens
its training data itself (``workers.sources``) and reads only the examples a
step asks for; no example crosses from the driver.
"""

from __future__ import annotations

import ctypes
import os
import socket
import time
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import ray
import torch
from torch.func import functional_call

from workers.clipping import check_precision, functional_parameters
from workers.engines import (ExampleSchema, check_engine, clipped_sum, engine_plan, prepare_engine,
                             synthetic_examples)
from workers.features import FeatureCache, compute_features, feature_map
from workers.losses import per_example_losses
from workers.vmap_engine import microbatch_clipped_sum
from workers.models import build_model, parameter_count
from workers.names import task_of
from workers.planned_batches import PlannedBatch, PlannedBatchReader, PlannedDataset, PlannedRunSource
from workers.sampling import make_generator
from workers.sources import ExampleSource, InMemorySource, PrefetchingSource, open_source, spec_name
from workers.tasks import (
    augmented_views,
    build_loss,
    build_metric,
    build_transform,
    metric_inputs,
)
from workers.user_clipping import clipped_user_sum
from workers.users import USER_ROWS_STREAM, UserSpec, rows_of_users, user_index
from workers.validation import check_model, unchanged_buffers


# glibc's mallopt parameters (malloc.h), and the largest mmap threshold it accepts on 64-bit systems.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
LARGEST_MMAP_THRESHOLD = 32 * 2**20
RETAINED_HEAP_BYTES = 2**30
EVALUATION_BATCH = 1000


def retain_freed_memory() -> bool:
    """Have glibc keep the memory a step frees for the next step, instead of returning it to the OS.

    A training step allocates and frees the same large tensors every time.
    By default glibc maps blocks above its mmap threshold fresh from the OS
    and unmaps them when freed, and returns the top of its heap past 128 KB,
    so every step takes page faults on them again. Raising both thresholds
    (mmap to glibc's 32 MB maximum, trimming to 1 GB) keeps them: the fast
    engine's gdp_cnn step went from 55 to 64 ms to 42 to 51 ms on a 2-core
    CPU. The process keeps its peak memory in exchange. Arrow's buffers
    (Parquet reads) are taken from the same allocator: with Arrow's default
    (mimalloc) a 125-example step from Parquet cost about 20 ms more CPU.
    Returns False where the C library is not glibc (the setting is then left
    as it was).
    """
    pa.set_memory_pool(pa.system_memory_pool())
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, LARGEST_MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, RETAINED_HEAP_BYTES)
    )


class GradientWorker:
    """Computes clipped per-example gradient sums for one model over a training split it opens itself.

    ``dataset`` is a spec of ``workers.sources`` (a built-in name, a
    ``module:function`` reference or a file-format table); the worker reads
    the examples each call names, never the whole split (the built-ins are
    held in memory). ``train_subset`` keeps only the first that many training
    examples (all when None); example indices sent to ``clipped_grad_sum``
    refer to those.
    ``max_physical_batch`` caps how many per-example gradients are in memory at
    once; ``threads`` is the torch intra-op thread count, which should match
    the CPUs Ray gave the actor; ``engine`` names the clipping engine
    (``workers.engines.ENGINES``); ``loss`` names the per-example loss
    (``workers.tasks.build_loss``); ``train_transforms`` are applied to each
    sampled training example on its own (``workers.tasks.build_transform``);
    with ``augmentations_per_example`` K > 1, K times, and each example's
    gradient is the mean over its K views (augmentation multiplicity).

    A model with a fixed feature map in front (``workers.features.
    FeatureModel``, the ScatterNets) is trained as its head on the map's
    features: without transforms, each example's features are computed the
    first time it is sampled and kept (``FeatureCache``); with transforms,
    each view's features are computed afresh.
    ``users`` (user-level privacy) says who owns which rows, for
    ``user_clipped_sum``. With ``planned_dataset`` (a Parquet dataset
    trained with ``plan_ahead_steps``, as its footers describe it), steps
    read the batches a window's gather wrote, and the worker neither parses
    a footer nor holds an index of the files.
    """

    def __init__(
        self,
        model_spec: str | dict,
        dataset: str | dict,
        train_subset: int | None,
        max_physical_batch: int,
        threads: int = 1,
        data_root: str | None = None,
        engine: str = "fast",
        loss: str = "cross_entropy",
        train_transforms: Sequence[Mapping[str, Any]] = (),
        augmentations_per_example: int = 1,
        users: UserSpec | None = None,
        planned_dataset: PlannedDataset | None = None,
        precision: str = "fp32",
    ) -> None:
        check_engine(engine)
        check_precision(precision)
        self.precision = precision
        if augmentations_per_example != 1 and not train_transforms:
            raise ValueError(f"augmentations_per_example = {augmentations_per_example} needs train_transforms: "
                             "without them every view of an example is the same")
        if threads < 1:
            raise ValueError(f"threads must be >= 1 (got {threads}); match it to the actor's num_cpus")
        if max_physical_batch < 1:
            raise ValueError(
                f"max_physical_batch must be >= 1 (got {max_physical_batch}); it caps per-example "
                "gradients held in memory at once"
            )
        torch.set_num_threads(threads)
        retain_freed_memory()
        self.engine = engine
        self.loss = loss
        self.loss_fn = build_loss(loss)
        self.transform = build_transform(train_transforms) if train_transforms else None
        self.augmentations = augmentations_per_example
        self.dataset, self.data_root = dataset, data_root
        self.test_examples: tuple[int, int, torch.Tensor, torch.Tensor] | None = None
        self.max_physical_batch = max_physical_batch
        self.device = _assigned_device()
        self.model = build_model(model_spec)
        check_model(self.model)
        self.model.to(self.device).train()
        # The engines and evaluation run the model that takes the feature map's output: the whole model without one.
        self.feature_map, self.gradient_model = feature_map(self.model)
        self.planned_dataset = planned_dataset
        self.source, self.train_size = self._training_source(dataset, train_subset, data_root)
        self.feature_cache = (FeatureCache(self.source, self.feature_map, self.device)
                              if self.feature_map is not None and self.transform is None else None)
        self.users = users
        self.made_up_examples: tuple[torch.Tensor, torch.Tensor] | None = None
        self.planned_reader = None if planned_dataset is None else PlannedBatchReader(planned_dataset)
        self.user_index = None if users is None else user_index(users, dataset, self.train_size)
        if self.augmentations == 1:
            # Settled on synthetic examples before any step: no private example decides the engine or its report.
            prepare_engine(engine, self.gradient_model, self._example_schema(), self.loss_fn)

    def _example_schema(self) -> ExampleSchema:
        """The shape and dtype of what the gradient model takes, from the source's schema: no example's values.

        A read of no rows gives the per-example shapes and dtypes; one made-up
        all-zero example goes through the transforms and the feature map to
        give the shape the model sees (with the random generator left as it was).
        """
        inputs, labels = self.source.read(np.zeros(0, dtype=np.int64))
        made_up = torch.zeros((1, *inputs.shape[1:]), dtype=inputs.dtype, device=self.device)
        random_state = torch.get_rng_state()
        try:
            model_inputs = (compute_features(self.feature_map, made_up) if self.feature_cache is not None
                            else self._model_inputs(made_up))
        finally:
            torch.set_rng_state(random_state)
        return ExampleSchema.of(model_inputs, labels)

    def _training_source(
        self, dataset: str | dict, train_subset: int | None, data_root: str | None
    ) -> tuple[ExampleSource, int]:
        """The source this worker trains on and how many of its examples it uses (the first ``train_subset``)."""
        # A planned run's steps read planned batches: the worker holds no index of the files' row groups.
        source = (open_source(dataset, "train", data_root) if self.planned_dataset is None
                  else PlannedRunSource(dataset, self.planned_dataset))
        if not isinstance(source, (InMemorySource, PlannedRunSource)):
            source = PrefetchingSource(source)
        full_size = len(source)
        if train_subset is not None and not 1 <= train_subset <= full_size:
            raise ValueError(
                f"train_subset must be between 1 and {full_size} for {spec_name(dataset)!r} (got {train_subset}); "
                "use None for the whole training split"
            )
        return source, train_subset or full_size

    def clipped_grad_sum(
        self,
        weights: np.ndarray,
        indices: np.ndarray,
        clip_norm: float,
        group_ids: np.ndarray | None = None,
        count_unclipped: bool = False,
        next_indices: np.ndarray | None = None,
        count_zeroed: bool = False,
        planned: PlannedBatch | None = None,
        next_planned: PlannedBatch | None = None,
    ) -> np.ndarray:
        """Sum of the examples' gradients at ``weights``, each clipped to L2 norm ``clip_norm``.

        ``weights`` is the flat float32 parameter vector; ``indices`` are
        positions in this worker's training examples. With ``group_ids`` (one
        per index), each microbatch's mean-loss gradient is clipped instead of
        each example's. An example whose gradient holds a NaN or inf
        contributes exactly zero. Returns a flat float32 array of the same
        length as ``weights`` (zeros for no indices), followed by raw counts
        for the driver, which releases none of them as they are: with
        ``count_unclipped``, how many examples (or non-empty microbatches) had
        a norm <= ``clip_norm``; then with ``count_zeroed``, how many examples
        were left out for a non-finite gradient. ``next_indices``, the
        worker's share of the next step's sample when it is already drawn,
        are read in the background while this sum computes (for sources not
        held in memory). With ``planned``, the rows at ``indices`` are read
        from the batch a window's gather wrote for this worker
        (``workers.planned_batches``), and ``next_planned`` is read ahead.
        """
        indices = self._checked_indices(indices)
        inputs, labels = self._step_examples(indices, next_indices, planned, next_planned)
        inputs, labels = self._model_inputs(inputs.to(self.device)), labels.to(self.device)
        return self._clipped_sum_of(inputs, labels, _as_tensor(weights), clip_norm, group_ids, count_unclipped,
                                    count_zeroed)

    def made_up_clipped_sum(self, weights: np.ndarray, count: int, clip_norm: float) -> np.ndarray:
        """What ``clipped_grad_sum`` returns (with the count of zeroed examples) for ``count`` made-up examples of
        the model's input schema (``synthetic_examples``) in place of rows of the data: a step's work on as many
        examples, with no row read. The charge clock's pace is timed on it
        (``orchestrator.fleet.made_up_step_seconds``).
        """
        if self.made_up_examples is None or len(self.made_up_examples[1]) != count:
            self.made_up_examples = synthetic_examples(self.gradient_model, self._example_schema(), count)
        return self._clipped_sum_of(*self.made_up_examples, _as_tensor(weights), clip_norm, count_zeroed=True)

    def _clipped_sum_of(self, inputs: torch.Tensor, labels: torch.Tensor, flat_weights: torch.Tensor,
                        clip_norm: float, group_ids: np.ndarray | None = None, count_unclipped: bool = False,
                        count_zeroed: bool = False) -> np.ndarray:
        """``clipped_grad_sum``'s answer for the examples (``inputs``, ``labels``) as the gradient model takes them."""
        wants_norms = count_unclipped or count_zeroed
        if group_ids is not None:
            if self.augmentations != 1:
                raise ValueError("microbatches clip each microbatch's mean gradient; they cannot be combined with "
                                 "augmentations_per_example")
            result = microbatch_clipped_sum(
                self.gradient_model, flat_weights, inputs, labels,
                torch.as_tensor(np.asarray(group_ids, dtype=np.int64)), clip_norm, self.loss_fn,
                return_norms=wants_norms,
            )
            if wants_norms:
                summed, norms, zeroed = result
        else:
            result = clipped_sum(
                self.engine, self.gradient_model, flat_weights, inputs, labels,
                clip_norm, self.max_physical_batch, self.loss_fn, return_norms=wants_norms,
                augmentations=self.augmentations, precision=self.precision,
            )
            if wants_norms:
                summed, norms_by_parameter = result
                # Each example's total norm from its per-parameter norms; not finite for an example left out.
                norms = (torch.stack(list(norms_by_parameter.values())).pow(2).sum(0).sqrt() if norms_by_parameter
                         else summed.new_zeros(len(labels)))
                zeroed = int((~norms.isfinite()).sum())
        if not wants_norms:
            # On the CPU this is a view of the sum itself; Ray then ships that one buffer.
            return result.cpu().numpy()
        counts = ([int((norms <= clip_norm).sum())] if count_unclipped else []) + ([zeroed] if count_zeroed else [])
        return torch.cat([summed, summed.new_tensor(counts)]).cpu().numpy()

    def _step_examples(self, indices: np.ndarray, next_indices: np.ndarray | None, planned: PlannedBatch | None,
                       next_planned: PlannedBatch | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows at ``indices``, from the planned batch when there is one, and the next step's read ahead."""
        if planned is None or not len(indices) or self.feature_cache is not None:
            inputs, labels = (self.feature_cache or self.source).read(indices)
        else:
            inputs, labels = self.planned_reader.read(planned)
            if len(labels) != len(indices):
                raise RuntimeError(f"the planned batch of step {planned.step} holds {len(labels)} rows where the "
                                   f"step sampled {len(indices)}; its window's folder was changed or removed")
        if next_planned is not None and self.feature_cache is None:
            self.planned_reader.prefetch(next_planned)
        elif next_indices is not None and isinstance(self.source, PrefetchingSource):
            self.source.prefetch(self._checked_indices(next_indices))
        return inputs, labels

    def _model_inputs(self, inputs: torch.Tensor) -> torch.Tensor:
        """What the gradient model takes for training examples read from the cache or the source.

        Cached features as they are; otherwise each example's views (with
        transforms), then their features (with a feature map).
        """
        if self.feature_cache is not None:
            return inputs
        if self.transform is not None:
            inputs = augmented_views(self.transform, inputs, self.augmentations)
        if self.feature_map is not None and self.augmentations == 1:
            inputs = compute_features(self.feature_map, inputs)
        elif self.feature_map is not None:
            inputs = compute_features(self.feature_map, inputs.flatten(0, 1)).unflatten(0, inputs.shape[:2])
        return inputs

    def user_clipped_sum(self, weights: np.ndarray, users: np.ndarray, clip_norm: float, step: int) -> np.ndarray:
        """Sum over ``users`` (sampled user numbers) of each user's contribution, clipped to L2 norm ``clip_norm``.

        A user's contribution is the gradient of its mean loss over its rows
        (at most ``max_examples_per_user`` of them, drawn afresh each step), or
        with ``local_steps`` its model delta after local SGD (DP-FedAvg). All
        of a user's rows are read and combined here, before clipping, so one
        user moves the sum by at most ``clip_norm``. Returns the flat float32
        sum followed by one raw count, for the driver only: the rows of users
        left out whole for a non-finite gradient or delta.
        """
        if self.users is None:
            raise RuntimeError("user_clipped_sum needs a worker built with users (privacy_unit = \"user\")")
        users = np.asarray(users, dtype=np.int64)
        if users.size and (users.min() < 0 or users.max() >= self.user_index.user_count):
            raise ValueError(f"users must lie in 0..{self.user_index.user_count - 1} (got {users.min()}..{users.max()})")
        rows, owners = rows_of_users(self.user_index, users, self.users.max_examples_per_user,
                                     make_generator(self.users.seed, USER_ROWS_STREAM, step, *users[:1].tolist()))
        inputs, labels = (self.feature_cache or self.source).read(rows)
        inputs, labels = self._model_inputs(inputs.to(self.device)), labels.to(self.device)
        summed, left_out = clipped_user_sum(
            self.gradient_model, _as_tensor(weights), inputs, labels, torch.from_numpy(owners), clip_norm, self.loss_fn,
            self.users.local_steps or 0, self.users.local_learning_rate or 0.0,
        )
        return torch.cat([summed, summed.new_tensor([left_out])]).cpu().numpy()

    def _checked_indices(self, indices: np.ndarray) -> np.ndarray:
        """``indices`` as int64 positions, refused unless they are a 1-D integer array within this worker's examples."""
        indices = np.asarray(indices)
        example_count = self.train_size
        if indices.ndim != 1 or (indices.size and not np.issubdtype(indices.dtype, np.integer)):
            raise ValueError(f"indices must be a 1-D integer array (got {indices.dtype} of shape {indices.shape})")
        if indices.size and (indices.min() < 0 or indices.max() >= example_count):
            raise ValueError(
                f"indices must lie in 0..{example_count - 1} for this worker's {example_count} examples "
                f"(got {indices.min()}..{indices.max()})"
            )
        return indices.astype(np.int64)

    def evaluate(self, weights: np.ndarray, split: str, start: int, stop: int, metrics: tuple[str, ...]) -> dict:
        """The model at ``weights``, in eval mode, on examples start..stop-1 of ``split``: sums to merge.

        Like a training step, it leaves every buffer as it was (a model whose
        forward writes one is refused). Returns ``loss_sum`` (the per-example
        losses added up), ``count`` and, by name, a torchmetrics object
        updated on these examples, which the caller merges with the other
        parts' (``merge_state``) before computing.
        """
        inputs, labels = self._split_examples(split, start, stop)
        model = self.gradient_model
        _, params, fixed = functional_parameters(model, _as_tensor(weights), self.device)
        task = task_of(self.loss)
        built: dict = {}
        loss_sum = 0.0
        self.model.eval()
        try:
            with torch.no_grad(), unchanged_buffers(model):
                for first in range(0, len(labels), EVALUATION_BATCH):
                    batch_labels = labels[first : first + EVALUATION_BATCH]
                    outputs = functional_call(model, (params, fixed), (inputs[first : first + EVALUATION_BATCH],))
                    loss_sum += per_example_losses(self.loss_fn, outputs, batch_labels).double().sum().item()
                    for name in metrics:
                        metric = built.setdefault(name, build_metric(name, task, outputs))
                        metric.update(*metric_inputs(task, outputs.cpu(), batch_labels.cpu()))
        finally:
            self.model.train()
        return {"loss_sum": loss_sum, "count": len(labels), "metrics": built}

    def _split_examples(self, split: str, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Examples start..stop-1 of a split as the gradient model takes them (features, with a feature map).

        Read through the split's source; the test part is kept for the next call.
        """
        if split == "train":
            reader = self.feature_cache or self.source
            inputs, labels = reader.read(np.arange(start, stop))
            if self.feature_map is not None and self.feature_cache is None:
                inputs = compute_features(self.feature_map, inputs.to(self.device))
            return inputs.to(self.device), labels.to(self.device)
        if self.test_examples is None or self.test_examples[:2] != (start, stop):
            inputs, labels = open_source(self.dataset, split, self.data_root).read(np.arange(start, stop))
            inputs = inputs.to(self.device)
            if self.feature_map is not None:
                inputs = compute_features(self.feature_map, inputs)
            self.test_examples = (start, stop, inputs, labels.to(self.device))
        return self.test_examples[2], self.test_examples[3]

    def engine_report(self) -> list[str] | None:
        """How each layer's per-example gradients are computed, one line per layer.

        Settled when the worker starts, on synthetic examples of the data's
        schema (``workers.engines.settle_plan``); None only where that schema
        could not be known before a first call.
        """
        if self.engine == "vmap":
            return ['every layer: vmap (engine = "vmap")']
        if self.augmentations != 1:
            return [f"every layer: vmap (the mean gradient of each example's {self.augmentations} augmentations; "
                    "the layer rules see one view per row)"]
        plan = engine_plan(self.gradient_model)
        return None if plan is None else plan.describe()

    def timed_call(self, method: str, *args, **kwargs) -> tuple[Any, float]:
        """This worker's ``method(*args, **kwargs)`` and the seconds it took, for the driver's breakdown of a step."""
        started = time.perf_counter()
        result = getattr(self, method)(*args, **kwargs)
        return result, time.perf_counter() - started

    def parameter_count(self) -> int:
        """Length of the flat parameter vector this worker expects and returns."""
        return parameter_count(self.model)

    def device_name(self) -> str:
        """The device this worker computes on: "cuda" when Ray assigned it a GPU, else "cpu"."""
        return self.device.type

    def ping(self) -> str:
        """``hostname:pid`` of the process holding this worker, for health checks."""
        return f"{socket.gethostname()}:{os.getpid()}"

    def node_id(self) -> str:
        """The Ray node this worker runs on (hex): the driver sums the partial sums of each node there."""
        return ray.get_runtime_context().get_node_id()


def _as_tensor(weights: np.ndarray) -> torch.Tensor:
    """The flat float32 weights as a tensor over the same memory when they already are float32.

    Ray hands arrays out of its object store read-only and zero-copy; torch
    warns when it wraps a read-only array because writes through the tensor
    would be undefined. The engines only read the weights (they never load
    them into the model), so the warning is silenced rather than paid for
    with a copy.
    """
    weights = np.asarray(weights, dtype=np.float32)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(weights)


def _assigned_device() -> torch.device:
    # Ray sets CUDA_VISIBLE_DEVICES to the GPUs it assigned, so "cuda" is ours;
    # an actor given no GPU stays on the CPU even on a GPU host.
    if torch.cuda.is_available() and ray.is_initialized() and ray.get_gpu_ids():
        return torch.device("cuda")
    return torch.device("cpu")


GradientWorkerActor = ray.remote(GradientWorker)
