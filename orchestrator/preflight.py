"""What a run checks before any budget is reserved or worker started: its model and its data files.

Each check raises UsageError, naming what is wrong and what to do.
"""

from __future__ import annotations

import copy
import sysconfig
import traceback
import warnings
from pathlib import Path

import torch
from torch import nn

from orchestrator import release
from orchestrator.config import TrainConfig
from orchestrator.errors import UsageError
from workers.engines import ExampleSchema, clipped_sum, synthetic_examples
from workers.features import compute_features, feature_map
from workers.models import build_model, flat_parameters
from workers.vmap_engine import microbatch_clipped_sum
from workers.names import task_of
from workers.sources import (SPLITS, DataError, DroppedRows, SplitSchema, check_source, dropped_rows, read_first,
                             split_schema)
from workers.tasks import build_loss
from workers.validation import check_model, unchanged_buffers


def check_trainable(config: TrainConfig, model: nn.Module) -> None:
    """Refuse a model that mixes examples, or one whose trainable parameters layer_clip_norms leaves out."""
    check_model(model)
    layer_clip_norms = config.layer_clip_norms
    if layer_clip_norms is not None:
        unmatched = layer_clip_norms.unmatched([name for name, p in model.named_parameters() if p.requires_grad])
        if unmatched:
            raise UsageError(f"layer_clip_norms gives no clip norm to {', '.join(unmatched)}; every trainable "
                             "parameter needs a prefix (e.g. the layer's name in model.named_parameters())")


def check_data(config: TrainConfig, model: nn.Module, num_classes: int | None = None) -> TrainConfig:
    """Check both splits' files of the config's dataset (UsageError on a bad file); return the config to train on.

    With check_data = "strict" (or its former name "full"), every value is
    scanned too: integer labels must lie below ``label_classes``.
    With "lenient", the returned config's table carries that num_classes, so
    that the driver and every worker drop the same rows (see lenient_drops).
    The built-ins are verified by digest, and a ``module:function``
    dataset's examples are not read in the driver, so only tables are checked.
    """
    if isinstance(config.dataset, str):
        return config
    full = config.check_data in ("strict", "full")
    lenient = config.check_data == "lenient"
    try:
        if full or lenient:
            num_classes = label_classes(config.dataset, config.loss, model, num_classes)
        for split in SPLITS:
            check_source(config.dataset, split, full, num_classes)
    except DataError as error:
        raise UsageError(str(error), error.with_values) from None
    if lenient and num_classes is not None and "num_classes" not in config.dataset:
        return config.model_copy(update={"dataset": {**config.dataset, "num_classes": int(num_classes)}})
    return config


def label_classes(spec: dict, loss: str, model: nn.Module, num_classes: int | None = None) -> int | None:
    """How many classes a table's integer labels must lie below: the dataset's num_classes, else ``num_classes``
    (the model's output width from the dry run), else `model`'s output width on the first test example; None
    where the loss is not a multiclass one."""
    if spec.get("num_classes") is not None:
        return spec["num_classes"]
    if num_classes is not None or task_of(loss) != "multiclass":
        return num_classes
    check_source(spec, "test")
    first_test_input, _ = read_first({**spec, "drop_invalid_rows": False}, "test", 1)
    # The saved model's buffers are the ones it was built with: this forward may not write them.
    with torch.no_grad(), unchanged_buffers(model):
        return model(first_test_input).shape[-1]


def lenient_rows(config: TrainConfig) -> DroppedRows | None:
    """Under check_data = "lenient", which training rows the rule keeps (the driver's, for its samples), else None."""
    if config.check_data != "lenient":
        return None
    try:
        return dropped_rows(config.dataset, "train")
    except DataError as error:
        raise UsageError(str(error), error.with_values) from None


def lenient_drops(config: TrainConfig, show_values: bool = False) -> str:
    """The line check_data = "lenient" prints: which rows it drops, and how many only with ``show_values``.

    How many rows a rule drops is an exact count over private values, and
    whoever runs the job chooses the rule (the classes, by the model's output
    width): by default the line gives no number, and N counts every row of
    the files so that none shows through it. With ``show_values``, for the
    data's owner, it says how many of each split, and why.
    """
    classes = config.dataset.get("num_classes")
    rules = "finite values" + (f", labels in 0..{classes - 1}" if classes is not None else "")
    if not show_values:
        return release.line("lenient_drops_hidden", detail=(
            f"its rules ({rules}): they take no part in training or evaluation. How many is not printed (a count "
            "of private values; N counts every row of the files): the data's owner counts them with `dpfleet data "
            "check --config FILE`, or dpfleet train --show-values"))
    parts = []
    for split in SPLITS:
        try:
            dropped = dropped_rows(config.dataset, split)
        except DataError as error:
            raise UsageError(str(error), error.with_values) from None
        why = f"{dropped.not_finite} with a NaN or infinite value"
        if classes is not None:
            why += f", {dropped.label_outside} with a label outside 0..{classes - 1}"
        parts.append(f"{dropped.dropped} of {dropped.rows} {split} rows ({why})")
    return release.line("lenient_drops", shown=True, detail=(
        f"{'; '.join(parts)}. This count is for the data's owner (--show-values): it is NOT private, and written "
        "nowhere else"))


# --- the dry run: the model on made-up examples of the data's schema, before anything is reserved ------------

# Made-up examples the dry run passes through the model: two, so that a batch dimension is a batch.
DRY_RUN_EXAMPLES = 2
# What to do when the model fails on examples of the data's shape.
SHAPE_FIX = ("make the model take inputs of this shape (its first layer's input size or channels), or set the "
             "dataset's shape key (e.g. shape = [1, 28, 28] for one-channel 28x28 images)")
# The rooms of dpfleet itself and of the libraries under it: a failure's place in the user's code is the last frame
# outside them.
_NOT_THE_USERS = (*(Path(__file__).resolve().parents[1] / room for room in ("orchestrator", "workers", "accounting")),
                  Path(torch.__file__).resolve().parent)


def build_checked_model(config: TrainConfig) -> nn.Module:
    """The config's model, built; a failure in the user's module is one UsageError naming its file and line."""
    try:
        return build_model(config.model)
    except Exception as error:  # noqa: BLE001 - any failure of the user's code is reported, one paragraph
        if isinstance(error, ValueError) and _users_frame(error) is None:
            raise UsageError(str(error)) from None  # a bad spec, worded by build_model
        raise UsageError(_failure(f"building the model {config.model!r}", error,
                                  "fix the model's module (run with --debug for the traceback)")) from None


def dry_run(config: TrainConfig, model: nn.Module) -> int | None:
    """One forward and backward pass of a copy of ``model`` on made-up examples of the training split's schema,
    then one clipped sum of them by the engine the workers will run (``engine_pass``).

    The schema (shapes, dtypes, feature columns) comes from the files'
    metadata; no private value is read. Refuses, with UsageError, a test
    split whose columns or shapes differ from the training split's, a model
    that fails on the data's shape, and a loss that does not fit the model's
    output. Returns the model's output width (its classes, for integer
    labels), or None where the data's schema is not known without reading
    examples (a ``module:function`` or built-in dataset, an image folder,
    shards, training transforms).
    """
    if (not isinstance(config.dataset, dict) or config.shards or config.augmentations_per_example != 1
            or config.train_transforms):
        return None  # the training data is elsewhere (shards), or the model sees it only after transforms
    try:
        train, test = (split_schema(config.dataset, split) for split in SPLITS)
    except DataError as error:
        raise UsageError(str(error), error.with_values) from None
    if train is None:
        return None
    if test is not None and test != train:
        raise UsageError(f"the test split does not match the training split: {_difference(train, test)}; write both "
                         "splits with the same columns (or name the features in the dataset's features key, or "
                         "leave some out with exclude_columns)")
    where = (f"examples of the data's shape (input {list(train.input_shape)} "
             f"{'float32' if train.input_floating else 'int64'}, one per row)")
    schema = ExampleSchema(train.input_shape, torch.float32 if train.input_floating else torch.int64, (),
                           torch.float32 if train.label_floating else torch.int64)
    trial = copy.deepcopy(model).train()
    random_state = torch.get_rng_state()
    try:
        try:
            inputs, labels = synthetic_examples(trial, schema, DRY_RUN_EXAMPLES)
            outputs = trial(inputs)
        except Exception as error:  # noqa: BLE001 - the user's model, reported one paragraph
            raise UsageError(_failure(f"the model's forward pass on {where}", error, SHAPE_FIX)) from None
        try:
            with warnings.catch_warnings():
                # A loss that broadcasts an output and its labels of different sizes fits neither.
                warnings.filterwarnings("error", message="Using a target size")
                loss = build_loss(config.loss)(outputs, labels)
            loss.mean().backward()
        except Exception as error:  # noqa: BLE001 - the user's loss or model, reported one paragraph
            shape = list(outputs.shape) if isinstance(outputs, torch.Tensor) else type(outputs).__name__
            raise UsageError(_failure(
                f"the loss {config.loss!r} on the model's output (shape {shape}) and "
                f"{'floating-point' if train.label_floating else 'integer'} labels", error,
                "make the model's output fit the loss (classes: one output per class; regression: one output "
                "and the \"mse\" loss), or set loss")) from None
        engine = "microbatch" if config.microbatch_size else config.engine
        try:
            engine_pass(config, trial, inputs, labels)
        except Exception as error:  # noqa: BLE001 - the user's model under the engine, reported one paragraph
            raise UsageError(_failure(
                f"one clipped sum by the {engine} clipping engine (precision {config.precision}) on {where}", error,
                "the model runs in plain autograd but not under the engine the workers run: try engine = "
                "\"vmap\" (docs/training.md, the layer rules), or fix the layer the error names")) from None
    finally:
        torch.set_rng_state(random_state)
    # Only a classifier's output width is its number of classes (a binary model's one logit is not).
    if (train.label_floating or task_of(config.loss) != "multiclass" or not isinstance(outputs, torch.Tensor)
            or outputs.dim() < 2):
        return None
    return int(outputs.shape[-1])


def engine_pass(config: TrainConfig, model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor) -> None:
    """One clipped sum of ``inputs`` by the engine the run's workers will use, at the run's precision.

    That is the microbatch engine with microbatch_size, else the config's
    engine (fast or vmap), on the model behind any fixed feature map, as the
    workers run it. User-level runs clip each user's rows in the workers'
    own path, which this pass does not take.
    """
    features, gradient_model = feature_map(model)
    if features is not None:
        inputs = compute_features(features, inputs)
    weights, loss_fn = flat_parameters(gradient_model), build_loss(config.loss)
    with warnings.catch_warnings():
        # A fallback to the vmap engine is the workers' to report, once, when they start.
        warnings.simplefilter("ignore")
        if config.microbatch_size:
            microbatch_clipped_sum(gradient_model, weights, inputs, labels, torch.zeros(len(labels), dtype=torch.int64),
                                   1.0, loss_fn)
        else:
            clipped_sum(config.engine, gradient_model, weights, inputs, labels, 1.0, DRY_RUN_EXAMPLES, loss_fn,
                        precision=config.precision)


def _difference(train: SplitSchema, test: SplitSchema) -> str:
    """How two splits' schemas differ, in words: the columns one has and the other lacks, else shape or types."""
    only_train = [name for name in train.columns if name not in test.columns]
    only_test = [name for name in test.columns if name not in train.columns]
    if only_train or only_test:
        return (f"feature columns only in the training split: {', '.join(only_train) or 'none'}; only in the test "
                f"split: {', '.join(only_test) or 'none'}")
    if train.input_shape != test.input_shape or train.columns != test.columns:
        return (f"training examples have shape {list(train.input_shape)}, test examples {list(test.input_shape)}"
                if train.input_shape != test.input_shape else "the feature columns are in another order")
    kinds = [("floating-point" if floating else "integer") for floating in
             (train.input_floating, test.input_floating, train.label_floating, test.label_floating)]
    return (f"training features are {kinds[0]} and labels {kinds[2]}; test features are {kinds[1]} and labels "
            f"{kinds[3]}")


def _failure(what: str, error: BaseException, fix: str) -> str:
    """One paragraph: what failed, where in the user's code (file:line) when it failed there, the error, the fix."""
    frame = _users_frame(error)
    place = f" at {frame.filename}:{frame.lineno} (in {frame.name})" if frame is not None else ""
    lines = str(error).strip().splitlines()
    reason = f"{type(error).__name__}: {lines[0] if lines else ''}".rstrip(": ")
    return f"{what} failed{place}: {reason}. No budget was reserved; {fix}"


def _users_frame(error: BaseException) -> traceback.FrameSummary | None:
    """The innermost frame of the traceback outside dpfleet, torch and the standard library: the user's code."""
    standard = Path(sysconfig.get_paths()["stdlib"]).resolve()
    for frame in reversed(traceback.extract_tb(error.__traceback__)):
        path = Path(frame.filename).resolve()
        if frame.filename.startswith("<") or path.is_relative_to(standard):
            continue
        if not any(path.is_relative_to(room) for room in _NOT_THE_USERS) and "site-packages" not in path.parts:
            return frame
    return None
