"""Training configuration: a TOML file plus command-line overrides, validated before Ray starts."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Mapping

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from accounting.accountants import ACCOUNTANTS
from accounting.lazy import LazyModule
from orchestrator import checks
from orchestrator.adaptive_clipping import AdaptiveClipping, parse_adaptive_clipping
from orchestrator.errors import UsageError
from orchestrator.shard_config import (
    DEFAULT_ON_SHARD_LOSS,
    DEFAULT_SHARD_TIMEOUT,
    check_shard_mode,
    parse_on_shard_loss,
    parse_shards,
)
from orchestrator.schedules import LearningRateSchedule, NoiseSchedule, parse_lr_schedule, parse_noise_schedule
from workers import names

# The workers' modules load torch: the keys are declared and documented without them (`dpfleet init`, the help),
# and they load when a config is first checked.
clipping = LazyModule("workers.clipping")
worker_shards = LazyModule("workers.shards")
sources = LazyModule("workers.sources")
tasks = LazyModule("workers.tasks")
users = LazyModule("workers.users")

CHECK_DATA_LEVELS = ("basic", "full")
PRIVACY_UNITS = ("example", "user")
OPTIMIZERS = ("sgd", "momentum", "adam", "adamw")
_OPTIMIZER_PARAMETERS = {
    "sgd": {"weight_decay"},
    "momentum": {"momentum", "nesterov", "weight_decay"},
    "adam": {"betas", "eps", "weight_decay"},
    "adamw": {"betas", "eps", "weight_decay"},
}


@dataclass(frozen=True)
class OptimizerConfig:
    """Which torch optimizer post-processes the noisy mean gradient, and its parameters."""

    name: str = "sgd"
    parameters: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class EvaluateEvery:
    """How often the test split is evaluated: every ``steps`` steps, or every ``epochs`` epochs (one is set)."""

    steps: int | None = None
    epochs: float | None = None


GROUPS = (
    "data", "model and task", "run length and evaluation", "privacy", "optimizer",
    "workers and clipping engine", "ledger", "run directory and checkpoints", "shards", "privacy unit",
)
"""The groups of config keys, in the order the references and ``dpfleet init`` list them."""


def key(default: Any, group: str, kind: str, valid: str, meaning: str, shown_default: str | None = None) -> Any:
    """A TrainConfig field with its documentation, the one source of the config reference and the starter config.

    ``kind`` is the key's TOML type, ``valid`` its range or choices,
    ``meaning`` what it does (Markdown), and ``shown_default`` the default as
    a person reads it, where the field's default value alone does not say it.
    """
    if group not in GROUPS:
        raise ValueError(f"group must be one of {', '.join(GROUPS)} (got {group!r})")
    documentation = {"group": group, "kind": kind, "valid": valid, "meaning": meaning, "default": shown_default}
    return field(default=default, metadata=documentation)


@dataclass(frozen=True)
class TrainConfig:
    """Everything a DP-SGD run needs; units are per-example unless stated."""

    dataset: str | Mapping[str, Any] = key(
        "mnist", "data", "string or table",
        '`"mnist"`, `"fashion-mnist"`, `"package.module:function"`, or a table '
        '`{ format = "parquet" | "csv" | "npy" | "npz" | "imagefolder", train, test, ... }`',
        "The training and test data: a built-in dataset, a function returning (train, test) map-style "
        "datasets, or files (see docs/training.md, Data).",
    )
    model: str = key(
        "gdp_cnn", "model and task", "string",
        '`"gdp_cnn"`, `"opacus_cnn"`, `"lenet5"`, or `"package.module:function"`',
        "The model: a built-in one, or a function returning an `nn.Module` (no BatchNorm).",
    )
    workers: int = key(
        2, "workers and clipping engine", "integer", "≥ 1",
        "Gradient worker actors. With `shards`, the sum of the shards' `workers`.",
    )
    cpus_per_worker: int = key(
        1, "workers and clipping engine", "integer", "≥ 1",
        "CPUs each worker asks Ray for; also its torch threads.",
    )
    gpus_per_worker: float = key(
        0.0, "workers and clipping engine", "number", "≥ 0",
        "GPUs each worker asks Ray for, e.g. 0.5 for two workers on one GPU (`examples/mnist_gpu.toml`).",
    )
    epochs: float | None = key(
        None, "run length and evaluation", "number", "> 0",
        "Run length in passes over the data: steps = ceil(epochs · N / batch_size).",
        "none: give exactly one of `epochs` and `steps`",
    )
    steps: int | None = key(
        None, "run length and evaluation", "integer", "≥ 1", "Run length in steps.",
        "none: give exactly one of `epochs` and `steps`",
    )
    batch_size: int = key(
        250, "privacy", "integer", "1 ≤ batch_size ≤ N",
        "The *expected* batch size: each example joins a step with probability q = batch_size / N.",
    )
    noise_multiplier: float | None = key(
        None, "privacy", "number", "> 0", "σ: the noise standard deviation over the clip norm.",
        "none: give exactly one of `noise_multiplier` and `target_epsilon`",
    )
    target_epsilon: float | None = key(
        None, "privacy", "number", "> 0",
        "The ε to meet at `delta`; σ is then the smallest that meets it, by the run's accountant.",
        "none: give exactly one of `noise_multiplier` and `target_epsilon`",
    )
    target_epsilon_basis: str = key(
        "accountant", "privacy", "string", '`"accountant"` or `"filter"`',
        "Which ε `target_epsilon` sets: the run's `accountant`'s (what it reports), or `filter`: the RDP-filter ε "
        "the ledger charges the job (at each charged budget's orders and δ; the largest when it names several "
        "blocks), so that the charge is the target. The ledger is read before planning.",
    )
    clip_norm: float = key(1.0, "privacy", "number", "> 0", "C: the per-example L2 bound.")
    optimizer: OptimizerConfig = key(
        OptimizerConfig(), "optimizer", "string or table",
        '`"sgd"`, or `{ name = "sgd" | "momentum" | "adam" | "adamw", ... }` with `momentum` (in [0, 1), '
        "default 0.9), `nesterov`, `betas` (two numbers in [0, 1)), `eps`, `weight_decay` (≥ 0)",
        "The torch optimizer that steps on the noisy mean gradient (post-processing: no privacy cost).",
        '`"sgd"`',
    )
    learning_rate: float = key(0.1, "optimizer", "number", "> 0", "The optimizer's step size.")
    ema_decay: float | None = key(
        None, "optimizer", "number", "in (0, 1)",
        "Parameter averaging: the driver keeps an exponential moving average of the weights (decay warmed up "
        "as min(decay, (1 + t) / (10 + t)) at step t), evaluates it instead of the weights, and saves it with "
        "the checkpoints (post-processing: no privacy cost).",
        "off",
    )
    lr_schedule: LearningRateSchedule = key(
        LearningRateSchedule(), "optimizer", "string or table",
        '`{ kind = "constant" | "cosine" | "step" | "exponential", gamma, step_size }`; '
        "`gamma` > 0 (default 1), `step_size` ≥ 1 (default 1)",
        "How the learning rate changes per step (post-processing: no privacy cost).",
        '`"constant"`',
    )
    noise_schedule: NoiseSchedule = key(
        NoiseSchedule(), "privacy", "string or table",
        '`{ kind = "constant" | "exponential" | "step" | "linear", decay, step_size, final_ratio, every }`; '
        "`decay` and `final_ratio` > 0 (default 1), `step_size` and `every` ≥ 1",
        "σ held constant over blocks of `every` steps (default one epoch) and changed between them: "
        "exponential σ·decay^k, step σ·decay^⌊k/step_size⌋, linear from σ to σ·final_ratio. "
        "The reported ε is the exact composition of the blocks.",
        '`"constant"`',
    )
    secure_noise: bool = key(
        True, "privacy", "boolean", "`true` or `false`",
        "Each noise value is the sum of four float64 Gaussian draws, against the floating-point attack "
        "on Gaussian sampling.",
    )
    delta: float = key(1e-5, "privacy", "number", "in (0, 1)", "The δ at which ε is reported and charged.")
    accountant: str = key(
        "pld", "privacy", "string", '`"pld"`, `"rdp"` or `"gdp"`',
        "How ε is computed: PLD (rigorous, tightest), RDP (rigorous) or GDP (approximate, never used for budgets).",
    )
    seed: int | None = key(
        None, "privacy", "integer", "≥ 0",
        "Fixes sampling and noise, for tests only: the run prints `seeded: not for production use`.",
        "none (OS entropy)",
    )
    run_dir: str = key(
        "runs/latest", "run directory and checkpoints", "string", "a non-empty path",
        "Where config.json, metrics.jsonl, summary.json, curves.png and the checkpoints go.",
    )
    max_physical_batch: int = key(
        128, "workers and clipping engine", "integer", "≥ 1",
        "Examples whose gradients a worker processes at once (a memory bound, not a privacy parameter).",
    )
    engine: str = key(
        "fast", "workers and clipping engine", "string", '`"fast"` or `"vmap"`',
        "The per-example clipping engine: `fast` (per-layer rules: ghost norms and book-keeping, checked "
        "against autograd on each model) or `vmap` (the torch.func reference).",
    )
    loss: str = key(
        "cross_entropy", "model and task", "string",
        '`"cross_entropy"`, `"mse"`, `"bce_with_logits"`, `"token_cross_entropy"`, or `"package.module:function"`',
        "The per-example loss. `token_cross_entropy` takes logits [B, T, V] against tokens [B, T] and ignores "
        "-100; a function takes (outputs, labels).",
    )
    metrics: tuple[str, ...] = key(
        ("accuracy",), "model and task", "list of strings",
        '`"accuracy"`, `"top5_accuracy"`, `"auroc"` (classification); `"accuracy"`, `"auroc"` (binary); '
        '`"mse"`, `"mae"` (regression)',
        "Test metrics fitting the loss's task, computed with torchmetrics. The first is plotted.",
        "the task's first metric",
    )
    train_transforms: tuple[Mapping[str, Any], ...] = key(
        (), "model and task", "list of tables", '`[{ name = "RandomCrop", size = 28, padding = 2 }, ...]`',
        "torchvision v2 transforms applied in the worker to each sampled example on its own. "
        "MixUp and CutMix mix examples and are refused.",
        "none",
    )
    augmentations_per_example: int = key(
        1, "model and task", "integer", "≥ 1; above 1 needs `train_transforms`",
        "Augmentation multiplicity (De et al. 2022): each sampled example's gradient is the mean over K views "
        "drawn by `train_transforms`, and that mean is clipped to C, so the sensitivity stays C. Not with "
        "`microbatch_size`. The fast engine hands such steps to the vmap engine.",
    )
    microbatch_size: int | None = key(
        None, "privacy", "integer", "≥ 1",
        "Clip groups of about k examples instead of single examples; ε then uses sensitivity factor 2. "
        "Not with shards or `layer_clip_norms`.",
        "none",
    )
    adaptive_clipping: AdaptiveClipping | None = key(
        None, "privacy", "boolean or table",
        '`true`, or `{ target_quantile, learning_rate, update = "geometric" | "linear", count_noise_multiplier }`; '
        "`target_quantile` in (0, 1) (default 0.5), `learning_rate` > 0 (default 0.2), "
        "`count_noise_multiplier` > 0 (default 10)",
        "The clip norm follows a target quantile of the gradient norms, moved each step by a noisy count "
        "that is accounted together with the gradient. Not with shards or `layer_clip_norms`.",
        "off",
    )
    layer_clip_norms: clipping.LayerClipNorms | None = key(
        None, "privacy", "table", '`{ "conv1" = 0.5, "fc" = 1.0 }`: parameter-name prefix = clip norm (> 0)',
        "Per-layer clipping: each group of parameters is clipped to its own norm; the noise is scaled to the "
        "root of the sum of their squares. Every trainable parameter needs a prefix.",
        "none",
    )
    checkpoint_every: int = key(
        0, "run directory and checkpoints", "integer", "≥ 0",
        "Also checkpoint every n steps (0: only at each epoch's end, which is always done).",
    )
    commit_every: int | None = key(
        None, "ledger", "integer", "≥ 1", "Steps per ledger charge; each block is charged before it runs.",
        "one epoch",
    )
    commit_interval: float = key(
        1.0, "ledger", "number", "> 0",
        "Seconds between ledger charges. Blocks are charged on this fixed clock from the run's start, whatever the "
        "steps are doing, so commit times say nothing about the batches; a block's steps wait for its charge. A "
        "block's wall time is a good value: a shorter interval charges blocks ahead of the steps (a resume runs "
        "them without charging again), a longer one makes the steps wait.",
    )
    ledger: str | None = key(
        None, "ledger", "string", '`"HOST:PORT"`, or several separated by commas',
        "The privacy ledger server, or servers of one PostgreSQL ledger (a call one does not answer goes to the "
        "next); `--ledger` overrides it, and `DPFLEET_LEDGER` stands in when neither is given.",
        "the embedded ledger",
    )
    blocks: tuple[str, ...] = key(
        (), "ledger", "list of strings, or table",
        '`["2026-11-01", ...]`, or `{ from = "2026-11-01", to = "2026-11-07" }` (names between, inclusive)',
        "The blocks of a Parquet dataset with `blocks` that the run trains on: it reads only the rows they "
        "declare, samples at batch_size / their row count, and the ledger charges each of them in full; each "
        "block's declaration must be the one the ledger holds (see docs/ledger.md, Blocks). Not with shards.",
        "none: the dataset as a whole",
    )
    dataset_name: str | None = key(
        None, "ledger", "string", "1 to 128 characters",
        "The dataset's name in the ledger (also `--dataset-name`).",
        "the dataset's name (a table's `name`, else its train location), with characters a ledger name cannot "
        "hold replaced by `-`",
    )
    ledger_timeout: float = key(
        300.0, "ledger", "number", "> 0",
        "Seconds to wait out a ledger outage before stopping at a checkpoint (exit status 4).",
    )
    ledger_lease: float | None = key(
        None, "ledger", "number", "> 0, several times a block's wall time",
        "Seconds the job's reservation lasts without a charge; each charge renews it. A job that stops charging "
        "loses its unrun steps, and a charge after that is refused.",
        "no lease: the reservation holds until released",
    )
    dataset_budget_epsilon: float = key(
        10.0, "ledger", "number", "> 0",
        "The ε budget given to a dataset the embedded ledger has not seen, at the run's `delta`.",
    )
    train_subset: int | None = key(
        None, "data", "integer", "1 ≤ train_subset ≤ the training split's size",
        "Train on the first n examples only (for quick runs): N = n.", "all",
    )
    test_subset: int | None = key(
        None, "data", "integer", "≥ 1", "Evaluate on the first n test examples only.", "all",
    )
    evaluate_every: EvaluateEvery | None = key(
        None, "run length and evaluation", "table", "`{ steps = n }` (n ≥ 1) or `{ epochs = e }` (e > 0)",
        "Also evaluate within epochs; the workers evaluate the test split in parts and return only sums.",
        "every epoch",
    )
    data_root: str | None = key(
        None, "data", "string", "a non-empty path",
        "The built-in datasets' cache (also `DPFLEET_DATA`).", "`~/.cache/dpfleet`",
    )
    check_data: str = key(
        "basic", "data", "string", '`"basic"` or `"full"`',
        "Before any budget is reserved or worker started, check the data files: `basic` from metadata and a scan "
        "(missing files or columns, wrong types, empty files, examples of the wrong size); `full` also every "
        "value (NaN, infinity, nulls, integer labels outside 0..num_classes-1).",
    )
    shards: tuple[worker_shards.ShardSpec, ...] = key(
        (), "shards", "list of tables",
        '`[{ dataset, part, parts, resources = { "silo-a" = 1 }, workers }, ...]`; shards may not overlap',
        "Training data that stays on its nodes and is Poisson-sampled there (see docs/training.md, Shards).",
        "none",
    )
    on_shard_loss: str = key(
        DEFAULT_ON_SHARD_LOSS, "shards", "string", '`"wait"` or `"skip"`',
        "With shards, what a step does while a shard is lost: wait for its replacement, or run without it.",
    )
    shard_timeout: float = key(
        DEFAULT_SHARD_TIMEOUT, "shards", "number", "> 0",
        "With shards, seconds a shard's resources may be missing before the run stops at a checkpoint (exit "
        "status 5).",
    )
    privacy_unit: str = key(
        "example", "privacy unit", "string", '`"example"` or `"user"`',
        "What one unit of protection is. Under `\"user\"`, users are Poisson-sampled (`batch_size` is then the "
        "expected number of users a step), each sampled user gives one clipped gradient of its mean loss, and ε "
        "protects each person, however many rows it owns. Not with shards, microbatches, adaptive clipping or "
        "`layer_clip_norms`.",
    )
    user_id: str | None = key(
        None, "privacy unit", "string", "a column name",
        "Under `privacy_unit = \"user\"`, the Parquet or CSV column naming each row's person.",
        "none",
    )
    synthetic_users: int | None = key(
        None, "privacy unit", "integer", "≥ 1, at most the training examples",
        "Under `privacy_unit = \"user\"`, assign the rows to this many synthetic users instead (skewed: 1 to 300 "
        "rows each, a fixed assignment); for built-in datasets and tests.",
        "none",
    )
    max_examples_per_user: int | None = key(
        None, "privacy unit", "integer", "≥ 1",
        "Under `privacy_unit = \"user\"`, a sampled user gives at most this many of its rows a step, drawn at random "
        "each time. At example level, with `user_id` or `synthetic_users`, a bound on every person's rows, checked "
        "against the data before training: the summary's `user_epsilon` and a ledger dataset with a user-level "
        "budget then count each person by group privacy over that many rows.",
        "all its rows",
    )
    local_steps: int | None = key(
        None, "privacy unit", "integer", "≥ 1",
        "DP-FedAvg: each sampled user takes this many local SGD steps on its own rows in the worker, and its "
        "model delta, clipped to `clip_norm`, replaces its gradient; the noisy mean delta is applied by `optimizer` "
        "at `learning_rate` (the server's). Needs `privacy_unit = \"user\"` and `local_learning_rate`.",
        "off (one clipped gradient a user)",
    )
    local_learning_rate: float | None = key(
        None, "privacy unit", "number", "> 0",
        "DP-FedAvg: the learning rate of each user's local SGD steps.",
        "none",
    )

    def to_dict(self) -> dict:
        """A JSON-ready dict of every key."""
        data = dataclasses.asdict(self)
        data["optimizer"] = {"name": self.optimizer.name, **dict(self.optimizer.parameters)}
        if self.layer_clip_norms is not None:
            data["layer_clip_norms"] = dict(self.layer_clip_norms.groups)
        if self.evaluate_every is not None:
            data["evaluate_every"] = {key: value for key, value in data["evaluate_every"].items() if value is not None}
        return data


@dataclass(frozen=True)
class KeyDocumentation:
    """One config key as the references show it: its TOML type, default, valid range and meaning (Markdown).

    ``literal`` is the default as a TOML value, or None where the default is
    not one (no value, or a value the key computes).
    """

    name: str
    group: str
    kind: str
    default: str
    valid: str
    meaning: str
    literal: str | None


def toml_literal(value: Any) -> str:
    """A scalar or list as it is written in TOML (``"mnist"``, ``true``, ``1e-05``, ``[]``)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_literal(item) for item in value) + "]"
    if isinstance(value, (int, float)):
        return repr(value)
    raise TypeError(f"no TOML literal for {value!r}; give the key a shown_default")


def documented_keys() -> tuple[KeyDocumentation, ...]:
    """Every config key with its documentation, group by group in ``GROUPS`` order, then in field order."""
    keys = []
    for item in dataclasses.fields(TrainConfig):
        documentation = item.metadata
        literal = None if documentation["default"] else toml_literal(item.default)
        keys.append(KeyDocumentation(item.name, documentation["group"], documentation["kind"],
                                     documentation["default"] or f"`{literal}`", documentation["valid"],
                                     documentation["meaning"], literal))
    return tuple(sorted(keys, key=lambda documented: GROUPS.index(documented.group)))


def _boolean(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise UsageError(f"{key} must be true or false (got {value!r})")
    return value


KEYS = {f.name for f in dataclasses.fields(TrainConfig)}


def _optimizer(value: Any) -> OptimizerConfig:
    if isinstance(value, str):
        value = {"name": value}
    if not isinstance(value, Mapping):
        raise UsageError(f"optimizer must be a name or a table with a 'name' key (got {value!r})")
    parameters = dict(value)
    name = checks.one_of("optimizer.name", parameters.pop("name", "sgd"), OPTIMIZERS)
    unknown = set(parameters) - _OPTIMIZER_PARAMETERS[name]
    if unknown:
        allowed = ", ".join(sorted(_OPTIMIZER_PARAMETERS[name]))
        raise UsageError(f"optimizer {name!r} takes {allowed}; unknown: {', '.join(sorted(unknown))}")
    for key, item in parameters.items():
        if key == "betas":
            if not (isinstance(item, list) and len(item) == 2):
                raise UsageError(f"optimizer.betas must be two numbers in [0, 1) (got {item!r})")
            for beta in item:
                if not 0.0 <= checks.non_negative_number("optimizer.betas", beta) < 1.0:
                    raise UsageError(f"optimizer.betas must be two numbers in [0, 1) (got {item!r})")
        elif key == "nesterov":
            if not isinstance(item, bool):
                raise UsageError(f"optimizer.nesterov must be true or false (got {item!r})")
        elif key == "momentum" and not 0.0 <= checks.non_negative_number("optimizer.momentum", item) < 1.0:
            raise UsageError(f"optimizer.momentum must be in [0, 1) (got {item!r})")
        else:
            checks.non_negative_number(f"optimizer.{key}", item)
    if name == "momentum":
        parameters.setdefault("momentum", 0.9)
    return OptimizerConfig(name, parameters)


def _optional(values: dict, key: str, check) -> Any:
    return None if values.get(key) is None else check(key, values[key])


def build_config(values: Mapping[str, Any]) -> TrainConfig:
    """Validate raw key/value pairs into a TrainConfig; the first bad key raises UsageError."""
    unknown = set(values) - KEYS
    if unknown:
        raise UsageError(
            f"unknown config key(s): {', '.join(sorted(unknown))}; valid keys: {', '.join(sorted(KEYS))}"
        )
    values = dict(values)
    if (values.get("epochs") is None) == (values.get("steps") is None):
        raise UsageError("give exactly one of epochs (> 0) or steps (integer >= 1)")
    if (values.get("noise_multiplier") is None) == (values.get("target_epsilon") is None):
        raise UsageError("give exactly one of noise_multiplier (> 0) or target_epsilon (> 0)")
    shards = parse_shards(values.get("shards"), sources.BUILTINS, values.get("dataset", "mnist"))
    shard_workers = check_shard_mode(values, shards)
    dataset, blocks = _dataset_blocks(_dataset(values.get("dataset", "mnist")), values.get("blocks"))
    if blocks and shards:
        # Each shard reads its own dataset, so the blocks charged would not be the rows the run reads.
        raise UsageError("blocks is not supported with shards; train on blocks of one Parquet dataset without shards")
    config = TrainConfig(
        dataset=dataset,
        blocks=blocks,
        model=_model_spec(values.get("model", "gdp_cnn")),
        workers=shard_workers or checks.integer_at_least("workers", values.get("workers", 2), 1),
        cpus_per_worker=checks.integer_at_least("cpus_per_worker", values.get("cpus_per_worker", 1), 1),
        gpus_per_worker=checks.non_negative_number("gpus_per_worker", values.get("gpus_per_worker", 0)),
        epochs=_optional(values, "epochs", checks.positive_number),
        steps=_optional(values, "steps", lambda key, v: checks.integer_at_least(key, v, 1)),
        batch_size=checks.integer_at_least("batch_size", values.get("batch_size", 250), 1),
        noise_multiplier=_optional(values, "noise_multiplier", checks.positive_number),
        target_epsilon=_optional(values, "target_epsilon", checks.positive_number),
        target_epsilon_basis=_target_epsilon_basis(values),
        clip_norm=checks.positive_number("clip_norm", values.get("clip_norm", 1.0)),
        optimizer=_optimizer(values.get("optimizer", "sgd")),
        learning_rate=checks.positive_number("learning_rate", values.get("learning_rate", 0.1)),
        lr_schedule=parse_lr_schedule(values.get("lr_schedule", "constant")),
        noise_schedule=parse_noise_schedule(values.get("noise_schedule", "constant")),
        secure_noise=_boolean("secure_noise", values.get("secure_noise", True)),
        delta=checks.open_unit_interval("delta", values.get("delta", 1e-5)),
        accountant=checks.one_of("accountant", values.get("accountant", "pld"), ACCOUNTANTS),
        seed=_optional(values, "seed", lambda key, v: checks.integer_at_least(key, v, 0)),
        run_dir=_path("run_dir", values.get("run_dir", "runs/latest")),
        max_physical_batch=checks.integer_at_least("max_physical_batch", values.get("max_physical_batch", 128), 1),
        engine=checks.one_of("engine", values.get("engine", "fast"), names.ENGINE_NAMES),
        loss=_loss(values.get("loss", "cross_entropy")),
        metrics=_metrics(values.get("loss", "cross_entropy"), values.get("metrics")),
        train_transforms=_train_transforms(values.get("train_transforms", [])),
        augmentations_per_example=checks.integer_at_least(
            "augmentations_per_example", values.get("augmentations_per_example", 1), 1),
        ema_decay=_optional(values, "ema_decay", checks.open_unit_interval),
        microbatch_size=_optional(values, "microbatch_size", lambda key, v: checks.integer_at_least(key, v, 1)),
        adaptive_clipping=parse_adaptive_clipping(values.get("adaptive_clipping")),
        layer_clip_norms=_layer_clip_norms(values.get("layer_clip_norms")),
        checkpoint_every=checks.integer_at_least("checkpoint_every", values.get("checkpoint_every", 0), 0),
        commit_every=_optional(values, "commit_every", lambda key, v: checks.integer_at_least(key, v, 1)),
        commit_interval=checks.positive_number("commit_interval", values.get("commit_interval", 1.0)),
        ledger=_optional(values, "ledger", _address),
        dataset_name=_optional(values, "dataset_name", _name),
        ledger_timeout=checks.positive_number("ledger_timeout", values.get("ledger_timeout", 300.0)),
        ledger_lease=_optional(values, "ledger_lease", checks.positive_number),
        dataset_budget_epsilon=checks.positive_number(
            "dataset_budget_epsilon", values.get("dataset_budget_epsilon", 10.0)
        ),
        train_subset=_optional(values, "train_subset", lambda key, v: checks.integer_at_least(key, v, 1)),
        test_subset=_optional(values, "test_subset", lambda key, v: checks.integer_at_least(key, v, 1)),
        evaluate_every=_evaluate_every(values.get("evaluate_every")),
        data_root=None if values.get("data_root") is None else _path("data_root", values["data_root"]),
        check_data=checks.one_of("check_data", values.get("check_data", "basic"), CHECK_DATA_LEVELS),
        shards=shards,
        on_shard_loss=parse_on_shard_loss(values.get("on_shard_loss", DEFAULT_ON_SHARD_LOSS)),
        shard_timeout=checks.positive_number("shard_timeout", values.get("shard_timeout", DEFAULT_SHARD_TIMEOUT)),
        privacy_unit=checks.one_of("privacy_unit", values.get("privacy_unit", "example"), PRIVACY_UNITS),
        user_id=_optional(values, "user_id", _column_name),
        synthetic_users=_optional(values, "synthetic_users", lambda key, v: checks.integer_at_least(key, v, 1)),
        max_examples_per_user=_optional(values, "max_examples_per_user",
                                        lambda key, v: checks.integer_at_least(key, v, 1)),
        local_steps=_optional(values, "local_steps", lambda key, v: checks.integer_at_least(key, v, 1)),
        local_learning_rate=_optional(values, "local_learning_rate", checks.positive_number),
    )
    _check_privacy_unit(config)
    check_people_within_bound(config)
    if not shards:
        # With shards, N is known once the workers report their sizes; the trainer checks it then.
        checks.batch_within_dataset("batch_size", config.batch_size, sampled_unit_count(config))
    if config.augmentations_per_example > 1 and not config.train_transforms:
        raise UsageError(f"augmentations_per_example = {config.augmentations_per_example} needs train_transforms "
                         "to draw the views from; without them every view is the same example")
    if config.augmentations_per_example > 1 and config.microbatch_size:
        raise UsageError("augmentations_per_example clips each example's mean gradient over its views; "
                         "it cannot be combined with microbatch_size")
    if config.augmentations_per_example > 1 and config.privacy_unit == "user":
        raise UsageError("augmentations_per_example averages one example's views; with privacy_unit = \"user\" "
                         "a user's rows are combined instead: leave augmentations_per_example at 1")
    if config.layer_clip_norms is not None and (config.microbatch_size or config.adaptive_clipping):
        raise UsageError("layer_clip_norms clips single examples with fixed norms; "
                         "it cannot be combined with microbatch_size or adaptive_clipping")
    return config


def _column_name(key: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise UsageError(f"{key} must be a column name (got {value!r})")
    return value


def _check_privacy_unit(config: TrainConfig) -> None:
    """Refuse keys about people (user level, or a rows-per-person bound) that do not fit together, and say why."""
    user_keys = {"user_id": config.user_id, "synthetic_users": config.synthetic_users,
                 "max_examples_per_user": config.max_examples_per_user, "local_steps": config.local_steps,
                 "local_learning_rate": config.local_learning_rate}
    if config.privacy_unit == "example":
        given = [name for name, value in user_keys.items() if value is not None]
        people = config.user_id is not None or config.synthetic_users is not None
        if not given or (config.max_examples_per_user is not None and people
                         and set(given) <= {"user_id", "synthetic_users", "max_examples_per_user"}):
            _check_people_keys(config)
            return
        raise UsageError(f"{', '.join(given)} apply to user-level privacy; add privacy_unit = \"user\", or at "
                         "example level give max_examples_per_user with user_id or synthetic_users to bound each "
                         "person's rows (local_steps needs user level), or remove them")
    _check_people_keys(config)
    if (config.local_steps is None) != (config.local_learning_rate is None):
        raise UsageError("DP-FedAvg needs both local_steps (>= 1) and local_learning_rate (> 0); give both or neither")
    clashing = [name for name, value in (("shards", config.shards), ("microbatch_size", config.microbatch_size),
                                         ("adaptive_clipping", config.adaptive_clipping),
                                         ("layer_clip_norms", config.layer_clip_norms)) if value]
    if clashing:
        raise UsageError(f"privacy_unit = \"user\" clips each user's gradient whole with a fixed norm over one "
                         f"dataset; it cannot be combined with {', '.join(clashing)}")


def _check_people_keys(config: TrainConfig) -> None:
    """Exactly one of user_id and synthetic_users names the people, when any key about people is given."""
    if config.privacy_unit == "example" and config.max_examples_per_user is None:
        return
    if (config.user_id is None) == (config.synthetic_users is None):
        raise UsageError("naming each row's person needs exactly one of user_id (the column naming each row's "
                         "person) or synthetic_users (a number of users to assign the rows to)")
    if config.privacy_unit == "example" and config.shards:
        raise UsageError("max_examples_per_user at example level reads the people of one dataset; it cannot be "
                         "combined with shards")


def check_people_within_bound(config: TrainConfig) -> None:
    """At example level with max_examples_per_user, refuse data in which a person owns more rows than that.

    Reads the people (the user_id column, or the synthetic assignment), never
    a feature or label. The refusal does not say how many rows the largest
    person owns, which is the data's and not the analyst's to know; its
    ``with_values`` does, for the data's owners (``--show-values``).
    """
    bound = rows_per_person(config)
    if bound is None:
        return
    try:
        largest = users.user_index(users.UserSpec(config.user_id, config.synthetic_users), config.dataset,
                             training_set_size(config)).largest_user()
    except (sources.DataError, ValueError) as error:
        raise UsageError(str(error), getattr(error, "with_values", None)) from None
    if largest > bound:
        # How many rows the largest person owns is the data's, not the analyst's: quoted only with --show-values.
        raise UsageError(
            f"max_examples_per_user = {bound} bounds every person's rows at example level, but a person owns more "
            f"rows of the training data; raise it, keep at most {bound} rows a person in the data, or train with "
            "privacy_unit = \"user\"",
            f"max_examples_per_user = {bound} bounds every person's rows at example level, but one person owns "
            f"{largest} rows of the training data; set it to at least {largest}, keep at most that many rows a "
            "person in the data, or train with privacy_unit = \"user\"",
        )


def rows_per_person(config: TrainConfig) -> int | None:
    """At example level, the bound max_examples_per_user puts on every person's rows; else None."""
    return config.max_examples_per_user if config.privacy_unit == "example" else None


def _dataset(value: Any) -> str | dict:
    try:
        return sources.parse_spec(value)
    except ValueError as error:
        raise UsageError(str(error)) from None


def _target_epsilon_basis(values: Mapping) -> str:
    basis = checks.one_of("target_epsilon_basis", values.get("target_epsilon_basis", "accountant"),
                          ("accountant", "filter"))
    if basis == "filter" and values.get("target_epsilon") is None:
        raise UsageError('target_epsilon_basis = "filter" sets how σ meets target_epsilon; give target_epsilon '
                         "instead of noise_multiplier, or leave target_epsilon_basis out")
    return basis


def _dataset_blocks(spec: str | dict, value: Any) -> tuple[str | dict, tuple[str, ...]]:
    """The spec a run reads and the blocks it names: a list of block names, or a range { from, to } of them.

    A range takes every block of the dataset whose name sorts between
    `from` and `to`, both included (ISO dates sort as time does).
    """
    known = list(spec.get("blocks", {})) if isinstance(spec, dict) else []
    if value is None or value == []:  # a run's config.json writes "no blocks" as []
        if known and "train" not in spec:
            raise UsageError(
                f"the dataset is made of blocks ({', '.join(known)}); choose the run's with blocks = [...] or "
                'blocks = { from = "...", to = "..." }'
            )
        return spec, ()
    if isinstance(value, Mapping):
        if set(value) != {"from", "to"} or not all(isinstance(value[end], str) for end in ("from", "to")):
            raise UsageError(f'blocks as a range is a table {{ from = "NAME", to = "NAME" }} (got {value!r})')
        chosen = [name for name in sorted(known) if value["from"] <= name <= value["to"]]
        if not chosen:
            raise UsageError(
                f"no block of the dataset lies between {value['from']!r} and {value['to']!r} "
                f"(its blocks: {', '.join(known) or 'none'})"
            )
    elif isinstance(value, list) and all(isinstance(name, str) for name in value):
        chosen = list(value)
    else:
        raise UsageError(f'blocks must be a list of block names or a table {{ from, to }} (got {value!r})')
    if len(set(chosen)) != len(chosen):
        raise UsageError(f"blocks must name each block once (got {chosen!r})")
    try:
        return sources.select_blocks(spec if isinstance(spec, dict) else {}, chosen), tuple(chosen)
    except ValueError as error:
        raise UsageError(f"blocks: {error}") from None


def _model_spec(value: Any) -> str:
    if not isinstance(value, str) or not (value in names.MODEL_NAMES or ":" in value):
        raise UsageError(
            f"model must be one of {', '.join(names.MODEL_NAMES)} or 'package.module:function' (got {value!r})"
        )
    return value


def _loss(value: Any) -> str:
    if not isinstance(value, str):
        raise UsageError(f"loss must be a name or 'package.module:function' (got {value!r})")
    if value in names.LOSS_NAMES:
        return value
    try:
        tasks.build_loss(value)
    except ValueError as error:
        raise UsageError(str(error)) from None
    return value


def _metrics(loss: Any, value: Any) -> tuple[str, ...]:
    if value is not None and not (isinstance(value, list) and value and all(isinstance(v, str) for v in value)):
        raise UsageError(f'metrics must be a non-empty list of names, e.g. ["accuracy", "auroc"] (got {value!r})')
    try:
        return names.check_metrics(str(loss), value)
    except ValueError as error:
        raise UsageError(str(error)) from None


def _evaluate_every(value: Any) -> EvaluateEvery | None:
    if value is None:
        return None
    if not (isinstance(value, Mapping) and len(value) == 1 and set(value) <= {"steps", "epochs"}):
        raise UsageError(f"evaluate_every must be {{ steps = n }} or {{ epochs = e }} (got {value!r})")
    if "steps" in value:
        return EvaluateEvery(steps=checks.integer_at_least("evaluate_every.steps", value["steps"], 1))
    return EvaluateEvery(epochs=checks.positive_number("evaluate_every.epochs", value["epochs"]))


def _train_transforms(value: Any) -> tuple[Mapping[str, Any], ...]:
    if not isinstance(value, list):
        raise UsageError(f'train_transforms must be a list of tables, e.g. [{{ name = "RandomHorizontalFlip" }}] '
                         f"(got {value!r})")
    try:
        if value:
            tasks.build_transform(value)
    except ValueError as error:
        raise UsageError(str(error)) from None
    return tuple(dict(step) for step in value)


def _layer_clip_norms(value: Any) -> clipping.LayerClipNorms | None:
    if value is None:
        return None
    if not isinstance(value, Mapping) or not value:
        raise UsageError(
            f"layer_clip_norms must be a table of parameter-name prefix = clip norm, e.g. "
            f'{{ "0" = 1.0, "7" = 0.5 }} (got {value!r})'
        )
    return clipping.LayerClipNorms(tuple(
        (str(prefix), checks.positive_number(f"layer_clip_norms.{prefix}", norm)) for prefix, norm in value.items()
    ))


def _address(key: str, value: Any) -> str:
    for address in str(value).split(","):
        host, _, port = address.strip().rpartition(":")
        if not (isinstance(value, str) and host and port.isdigit() and 0 < int(port) < 65536):
            raise UsageError(
                f"{key} must be HOST:PORT with a port in 1..65535, or several separated by commas (got {value!r})"
            )
    return value


def _name(key: str, value: Any) -> str:
    if not (isinstance(value, str) and 0 < len(value) <= 128):
        raise UsageError(f"{key} must be a name of 1 to 128 characters (got {value!r})")
    return value


def _path(key: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise UsageError(f"{key} must be a non-empty path (got {value!r})")
    return os.path.expanduser(value)


def training_set_size(config: TrainConfig) -> int:
    """N: the number of training examples the run samples from, from file metadata (no example is read).

    Unsharded configs only: a sharded config's N is the sum its workers report.
    """
    if config.shards:
        raise UsageError("a sharded config's N is the sum of its shards' sizes, which only their workers report; "
                         "pass the reported N as dataset_size")
    try:
        full = sources.source_size(config.dataset, "train")
    except ValueError as error:
        raise UsageError(str(error), getattr(error, "with_values", None)) from None
    if config.train_subset is not None and config.train_subset > full:
        raise UsageError(
            f"train_subset must be <= {full} for {sources.spec_name(config.dataset)} (got {config.train_subset})"
        )
    return config.train_subset or full


def sampled_unit_count(config: TrainConfig) -> int:
    """How many units the run Poisson-samples from: N examples, or under privacy_unit = "user" the users.

    Users come from the synthetic assignment, or from the ``user_id`` column
    (read whole, once, to count its distinct values; no feature or label is
    read). Like N, the count is treated as public.
    """
    if config.privacy_unit == "example":
        return training_set_size(config)
    try:
        return users.user_index(user_spec(config), config.dataset, training_set_size(config)).user_count
    except (sources.DataError, ValueError) as error:
        raise UsageError(str(error), getattr(error, "with_values", None)) from None


def user_spec(config: TrainConfig) -> users.UserSpec | None:
    """The workers' description of the run's users, or None at example level."""
    if config.privacy_unit == "example":
        return None
    return users.UserSpec(config.user_id, config.synthetic_users, config.max_examples_per_user, config.local_steps,
                    config.local_learning_rate, config.seed)


def test_set_size(config: TrainConfig) -> int:
    """The number of test examples each evaluation covers: the test split, or its first ``test_subset``."""
    full = sources.source_size(config.dataset, "test")
    return min(full, config.test_subset or full)


def sampling_rate(config: TrainConfig, dataset_size: int | None = None) -> float:
    """q = expected batch size / N, with N = `dataset_size` when given, else `sampled_unit_count(config)`."""
    return config.batch_size / (dataset_size or sampled_unit_count(config))


def total_steps(config: TrainConfig, dataset_size: int | None = None) -> int:
    """Planned steps: `steps`, or ceil(epochs * N / batch_size), with N as in `sampling_rate`."""
    from accounting.events import steps_for_epochs

    if config.steps is not None:
        return config.steps
    return steps_for_epochs(config.epochs, dataset_size or sampled_unit_count(config), config.batch_size)


def load_config(path: str | None, overrides: Mapping[str, Any]) -> TrainConfig:
    """Read a TOML file (if given), apply non-None overrides, validate everything."""
    values: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path, "rb") as handle:
                values = tomllib.load(handle)
        except FileNotFoundError:
            raise UsageError(f"config file {path!r} does not exist") from None
        except tomllib.TOMLDecodeError as error:
            raise UsageError(f"config file {path!r} is not valid TOML: {error}") from None
    for key, value in overrides.items():
        if value is None:
            continue
        values[key] = value
        # A length or noise given on the command line replaces the file's, whichever form it used.
        for pair in (("epochs", "steps"), ("noise_multiplier", "target_epsilon")):
            if key in pair:
                values.pop(pair[1 - pair.index(key)], None)
    return build_config(values)


def expected_batch_size(config: TrainConfig, dataset_size: int | None = None) -> float:
    """q * N, the divisor of the noisy sum (never the realised batch size), with N as in `sampling_rate`."""
    return sampling_rate(config, dataset_size) * (dataset_size or sampled_unit_count(config))

