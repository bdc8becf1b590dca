"""What a run checks before any budget is reserved or worker started: its model and its data files.

Each check raises UsageError, naming what is wrong and what to do.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import sysconfig
import traceback
import warnings
from collections.abc import Callable, Iterator
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
                             spec_name, split_schema)
from workers.tasks import augmented_views, build_loss, build_transform
from workers.validation import check_model, unchanged_buffers


@dataclasses.dataclass(frozen=True)
class CheckedModel:
    """A run's model, built and checked by ``checked_model``, with the config it trains on (``check_data``'s)."""

    config: TrainConfig
    model: nn.Module


def checked_model(config: TrainConfig, say: Callable[[str], None]) -> CheckedModel:
    """The config's model, built (after the config's seed) and checked before any budget is reserved or worker
    started: trainable (``check_trainable``), on made-up examples of the data's schema (``dry_run``; ``say`` gets its
    warnings), then the data's files (``check_data``). UsageError, one paragraph naming the fix, on the first that
    fails.

    It needs torch but not Ray: `dpfleet train` runs it before loading the
    trainer, so a model that does not fit the data is refused in a blink,
    and hands the result to the Trainer, which runs it itself otherwise.
    """
    if config.seed is not None:
        torch.manual_seed(config.seed)
    model = build_checked_model(config)
    check_trainable(config, model)
    # Under check_data = "lenient" the config's table then names its classes (the model's output width).
    return CheckedModel(check_data(config, model, dry_run(config, model, say)), model)


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
# What to do when the model fails on examples of the data's shape; a table may also be reshaped by its shape key.
SHAPE_FIX = "make the model take inputs of this shape (its first layer's input size or channels)"
SHAPE_KEY_FIX = "set the dataset's shape key (e.g. shape = [1, 28, 28] for one-channel 28x28 images)"
# ... and when token ids are cut and padded to the dataset's max_length, which may exceed the model's positions.
MAX_LENGTH_FIX = ("set the dataset's max_length to at most the tokens the model takes (its config's "
                  "max_position_embeddings or n_positions)")
# The rooms of dpfleet itself and of the libraries under it: a failure's place in the user's code is the last frame
# outside them.
_NOT_THE_USERS = (*(Path(__file__).resolve().parents[1] / room for room in ("orchestrator", "workers", "accounting")),
                  Path(torch.__file__).resolve().parent)


def build_checked_model(config: TrainConfig) -> nn.Module:
    """The config's model, built; a failure in the user's module is one UsageError naming its file and line."""
    try:
        return build_model(config.model_spec)
    except Exception as error:  # noqa: BLE001 - any failure of the user's code is reported, one paragraph
        if isinstance(error, ValueError) and _users_frame(error) is None:
            raise UsageError(str(error)) from None  # a bad spec, worded by build_model
        raise UsageError(_failure(f"building the model {config.model!r}", error,
                                  "fix the model's module (run with --debug for the traceback)")) from None


def dry_run(config: TrainConfig, model: nn.Module, say: Callable[[str], None] | None = None) -> int | None:
    """One forward and backward pass of a copy of ``model`` on made-up examples of each training dataset's schema
    (``training_schemas``), then one clipped sum of them by the engine the workers will run (``engine_pass``).

    Every kind of data has a schema without a training example's values:
    a built-in's is known, a table's comes from its files' metadata, an
    image folder's from its class folders and first image's header, a
    ``module:function`` dataset's from its declaration (else its first test
    example); with ``train_transforms`` the model sees the transforms'
    output on a made-up example of that schema. Refuses, with UsageError, a
    test split whose schema differs from the training split's, transforms
    or a model that fail on the data's shape, a loss that does not fit the
    model's output, a classifier with fewer outputs than the data's classes,
    and a model the engine cannot run. ``say`` gets the public warning that
    a classifier has more outputs than the data's classes. Returns the
    model's output width where it numbers the classes (a classifier on
    integer labels), else None.
    """
    widths = [_dry_run_on(config, model, spec, schema, say or (lambda _: None))
              for spec, schema in training_schemas(config) if schema is not None]
    return widths[0] if widths else None


def training_schemas(config: TrainConfig) -> list[tuple[str | dict, SplitSchema | None]]:
    """(spec, schema) of each dataset the run trains on: the config's, or each shard's once.

    A shard's training files live on its silo: its schema is its test
    split's, which the driver reads to evaluate on. Elsewhere it is the
    training split's, or the test split's where the training split's needs
    a training example (a ``module:function`` dataset without a declared
    schema). None where neither is known without reading values (a
    variable-length list column without ``shape``). UsageError when the two
    splits' schemas differ, or the data cannot be described.
    """
    specs: list[str | dict] = []
    for spec in [shard.dataset for shard in config.shards] if config.shards else [config.dataset]:
        if spec not in specs:
            specs.append(spec)
    found = []
    for spec in specs:
        try:
            train = None if config.shards else split_schema(spec, "train")
            test = split_schema(spec, "test")
        except DataError as error:
            raise UsageError(str(error), error.with_values) from None
        except Exception as error:  # noqa: BLE001 - the user's dataset function or files, reported one paragraph
            raise UsageError(_failure(f"describing the dataset {spec_name(spec)!r}", error,
                                      "fix the dataset's module or files (run with --debug for the traceback)")
                             ) from None
        if train is not None and test is not None and test != train:
            raise UsageError(f"the test split does not match the training split: {_difference(train, test)}; write "
                             "both splits with the same columns (or name the features in the dataset's features "
                             "key, or leave some out with exclude_columns)")
        found.append((spec, train or test))
    return found


def _example_schema(data: SplitSchema) -> ExampleSchema:
    """The shapes and dtypes of one example of a split (``data``), as the engines and synthetic examples take them:
    float32 or int64 inputs (token ids), and one label or one per token."""
    return ExampleSchema(data.input_shape, torch.float32 if data.input_floating else torch.int64, data.label_shape,
                         torch.float32 if data.label_floating else torch.int64)


def _dry_run_on(config: TrainConfig, model: nn.Module, spec: str | dict, data: SplitSchema,
                say: Callable[[str], None]) -> int | None:
    """``dry_run`` on one dataset of schema ``data``: the model's output width where it numbers the classes."""
    data_schema = _example_schema(data)
    trial = copy.deepcopy(model).train()
    random_state = torch.get_rng_state()
    try:
        schema = _model_schema(config, data_schema)
        seen = f": input {_shape_words(schema)}" if schema != data_schema else ""
        where = f"examples of the data's shape (input {_shape_words(data_schema)}{_transformed(config)}{seen})"
        # Inputs first: the labels' range comes from the model's output, which may be what fails.
        inputs, _ = synthetic_examples(trial, dataclasses.replace(schema, label_dtype=torch.float32),
                                       DRY_RUN_EXAMPLES)
        try:
            with _layers_entered(trial) as entered:
                outputs = trial(inputs)
        except Exception as error:  # noqa: BLE001 - the user's model, reported one paragraph
            if isinstance(spec, dict) and "max_length" in spec:
                fix, why = MAX_LENGTH_FIX, ""
            else:
                fix, why = _shape_fix(entered, data.input_shape, schema != data_schema,
                                      isinstance(spec, dict) and spec["format"] != "imagefolder")
            raise UsageError(_failure(f"the model's forward pass on {where}", error, fix, why)) from None
        _, labels = synthetic_examples(trial, schema, DRY_RUN_EXAMPLES)
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
                f"{'floating-point' if data.label_floating else 'integer'} labels", error,
                f"make the model's output fit the loss ({output_hint(config.loss, outputs)}), or set loss "
                "(\"cross_entropy\" for classes, \"bce_with_logits\" for 0/1 labels, \"mse\" for numbers)")) from None
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
    if (data.label_floating or task_of(config.loss) != "multiclass" or not isinstance(outputs, torch.Tensor)
            or outputs.dim() < 2):
        return None
    width = int(outputs.shape[-1])
    if config.loss == "cross_entropy" and outputs.dim() == 2:
        _check_classes(spec, data.classes, width, say)
    return width


def _check_classes(spec: str | dict, classes: int | None, width: int, say: Callable[[str], None]) -> None:
    """A cross-entropy classifier against the data's classes where the data names them: refused with fewer
    outputs, warned with more; where a table names none, a note that the outputs number them."""
    if classes is None:
        if isinstance(spec, dict):
            say(release.line("classes_from_outputs", outputs=width, last=width - 1))
        return
    if width < classes:
        raise UsageError(f"the model gives {width} outputs per example and the data {spec_name(spec)!r} has {classes} "
                         f"classes (labels 0..{classes - 1}): cross_entropy takes one output per class. No budget "
                         f"was reserved; give the model's last layer {classes} outputs")
    if width > classes:
        say(release.line("outputs_beyond_classes", outputs=width, data=repr(spec_name(spec)), classes=classes,
                         last=classes - 1))


def output_hint(loss: str, outputs: object) -> str:
    """What output ``loss`` takes, in words, against what the model gives (``outputs``, a batch of them)."""
    width = outputs.shape[-1] if isinstance(outputs, torch.Tensor) and outputs.dim() >= 2 else 1
    gives = f"the model gives {width} per example" if isinstance(outputs, torch.Tensor) else "the model's output " \
        f"is a {type(outputs).__name__}, not a tensor"
    hints = {
        "cross_entropy": "cross_entropy takes one output per class, K outputs for labels 0..K-1",
        "token_cross_entropy": "token_cross_entropy takes [batch, tokens, vocabulary] logits for [batch, tokens] "
                               "labels",
        "bce_with_logits": "bce_with_logits takes one output per label column: 1 output for one 0/1 label column, "
                           "k for k 0/1 target columns, never one per class",
        "mse": "mse takes one output per target column: 1 output for one number",
    }
    return f"{hints.get(loss, 'a custom loss takes what its function takes')}; {gives}"


def _transformed(config: TrainConfig) -> str:
    """Words for what the model sees instead of the data's examples: their views under train_transforms."""
    if not config.train_transforms:
        return ""
    views = f" ({config.augmentations_per_example} views each)" if config.augmentations_per_example != 1 else ""
    return f", after train_transforms{views}"


def _model_schema(config: TrainConfig, data: ExampleSchema) -> ExampleSchema:
    """The schema of what the model takes: the data's, or the transforms' output on a made-up example of it."""
    if not config.train_transforms:
        return data
    # A made-up all-zero example, as the workers' own check makes one.
    example = torch.zeros((1, *data.input_shape), dtype=data.input_dtype)
    try:
        view = augmented_views(build_transform(config.train_transforms), example, 1)
    except Exception as error:  # noqa: BLE001 - the user's transforms, reported one paragraph
        raise UsageError(_failure(f"train_transforms on a made-up example of the data's shape (input "
                                  f"{_shape_words(data)})", error, "make each transform fit the data's shape "
                                  "(e.g. its channels), or set the dataset's shape key")) from None
    return dataclasses.replace(data, input_shape=tuple(view.shape[1:]), input_dtype=view.dtype)


def _shape_words(schema: ExampleSchema) -> str:
    return f"{list(schema.input_shape)} {str(schema.input_dtype).removeprefix('torch.')}"


# The layers whose input size the dry run names when the model fails on the data's shape.
_SIZED_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


@contextlib.contextmanager
def _layers_entered(model: nn.Module) -> Iterator[list[tuple[str, nn.Module, tuple[int, ...] | None]]]:
    """Within the block, (name, layer, input shape) of each sized layer the model's forward pass entered, in order."""
    entered: list[tuple[str, nn.Module, tuple[int, ...] | None]] = []

    def watch(name: str) -> Callable:
        def pre_hook(layer: nn.Module, args: tuple) -> None:
            first = args[0] if args else None
            entered.append((name, layer, tuple(first.shape) if isinstance(first, torch.Tensor) else None))
        return pre_hook

    handles = [layer.register_forward_pre_hook(watch(name)) for name, layer in model.named_modules()
               if isinstance(layer, _SIZED_LAYERS)]
    try:
        yield entered
    finally:
        for handle in handles:
            handle.remove()


def _shape_fix(entered: list[tuple[str, nn.Module, tuple[int, ...] | None]], data_shape: tuple[int, ...],
               transformed: bool, reshapeable: bool) -> tuple[str, str]:
    """(the fix, why it failed) for a forward pass that failed: why in the data's terms, when the last sized layer
    it entered takes another size than it got (else ""); the shape key too where the data is a table that takes
    one (``reshapeable``)."""
    also = f", or {SHAPE_KEY_FIX}" if reshapeable else ""
    if not entered or entered[-1][2] is None:
        return SHAPE_FIX + also, ""
    name, layer, shape = entered[-1]
    which = "first layer" if len(entered) == 1 else "layer"
    if isinstance(layer, nn.Linear):
        takes, got, unit = layer.in_features, shape[-1], "values"
    else:
        takes, got, unit = layer.in_channels, shape[1] if len(shape) > 1 else None, "channels"
    if got is None or got == takes:
        return SHAPE_FIX + also, ""
    size = "×".join(map(str, data_shape))
    if which == "layer" or transformed:
        gets = f"it gets {got}"
    elif unit == "values" and len(data_shape) > 1 and got == math.prod(data_shape):
        gets = f"the data gives {size} = {got}"
    else:
        gets = f"the data gives {got} (examples of shape {size})"
    why = f"The model's {which} {name!r} ({type(layer).__name__}) takes {takes} {unit}; {gets}."
    return f"make the {which} {name!r} take {got} {unit} (nn.{type(layer).__name__}({got}, ...)){also}", why


def engine_pass(config: TrainConfig, model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor) -> None:
    """One clipped sum of ``inputs`` by the engine the run's workers will use, at the run's precision.

    That is the microbatch engine with microbatch_size, else the config's
    engine (fast or vmap), on the model behind any fixed feature map, as the
    workers run it; with augmentations_per_example K, on K views of each
    example (here K copies). User-level runs clip each user's rows in the workers'
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
            views = config.augmentations_per_example
            if views != 1:
                inputs = inputs.unsqueeze(1).expand(-1, views, *inputs.shape[1:]).contiguous()
            clipped_sum(config.engine, gradient_model, weights, inputs, labels, 1.0, DRY_RUN_EXAMPLES, loss_fn,
                        augmentations=views, precision=config.precision)


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
    if train.label_shape != test.label_shape:
        return f"training labels have shape {list(train.label_shape)}, test labels {list(test.label_shape)}"
    kinds = [("floating-point" if floating else "integer") for floating in
             (train.input_floating, test.input_floating, train.label_floating, test.label_floating)]
    return (f"training features are {kinds[0]} and labels {kinds[2]}; test features are {kinds[1]} and labels "
            f"{kinds[3]}")


def _failure(what: str, error: BaseException, fix: str, why: str = "") -> str:
    """One paragraph: what failed, where in the user's code (file:line) when it failed there, the error, why in
    the data's terms (when known), the fix."""
    frame = _users_frame(error)
    place = f" at {frame.filename}:{frame.lineno} (in {frame.name})" if frame is not None else ""
    lines = str(error).strip().splitlines()
    reason = f"{type(error).__name__}: {lines[0] if lines else ''}".rstrip(": ")
    return f"{what} failed{place}: {reason}. {why + ' ' if why else ''}No budget was reserved; {fix}"


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
