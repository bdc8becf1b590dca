"""The config's sections: one pydantic model each, every key declared once with its type, default, range and meaning.

A sub-table (the optimizer, the schedules, adaptive clipping, a shard,
``evaluate_every``) is a record whose fields are declared once too
(orchestrator/table.py), and is checked, documented and given its JSON
Schema from them; a validator before it only reads a name as the table of
that name (``"adam"``). A key that names something a parser knows (a
dataset, a model, a loss) is checked by that parser, which words the error
as the rest of the command line does.
The keys are flat in TOML (``sigma`` is not ``privacy.sigma``): a section
is how the references group them and where its keys are declared.
"""

from __future__ import annotations

import dataclasses
import os
from functools import partial
from typing import Annotated, Any, ClassVar, Literal, Mapping

from typing_extensions import TypedDict

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from accounting.accountants import ACCOUNTANTS
from accounting.lazy import LazyModule
from accounting.matrix_mechanisms import MECHANISMS, SAMPLERS
from orchestrator.adaptive_clipping import AdaptiveClipping
from orchestrator.config.fields import key, table_text, value_type
from orchestrator.errors import UsageError
from orchestrator.schedules import LR_SCHEDULES, NOISE_SCHEDULES, LearningRateSchedule, NoiseSchedule
from orchestrator.shard_config import (
    DEFAULT_ON_SHARD_LOSS,
    DEFAULT_SHARD_TIMEOUT,
    SHARD_LOSS_POLICIES,
    check_shards,
    shard_tables,
)
from orchestrator.table import table
from workers import ShardSpec, names, pretrained_spec

# Where a step's clipped sums are added up, noised and stepped on: see orchestrator/collective.py.
AGGREGATIONS = ("auto", "driver", "collective")

# The workers' modules load torch: the keys are declared and documented without them (`dpfleet init`, the help,
# the schema), and they load when a config is first checked.
clipping = LazyModule("workers.clipping")
sources = LazyModule("workers.sources")
tasks = LazyModule("workers.tasks")

ACCOUNTANT_NAMES = tuple(ACCOUNTANTS)
CHECK_DATA_LEVELS = ("strict", "lenient", "basic", "full")
PRIVACY_UNITS = ("example", "user")
TARGET_EPSILON_BASES = ("accountant", "filter")
OPTIMIZERS = ("sgd", "momentum", "adam", "adamw")
_OPTIMIZER_PARAMETERS = {
    "sgd": {"weight_decay"},
    "momentum": {"momentum", "nesterov", "weight_decay"},
    "adam": {"betas", "eps", "weight_decay"},
    "adamw": {"betas", "eps", "weight_decay"},
}


_UNIT = Annotated[float, Field(ge=0, lt=1)]
_MOMENTUM = 0.9  # torch's SGD has no momentum by default; the `momentum` optimizer has this


@table
class OptimizerConfig:
    """Which torch optimizer post-processes the noisy mean gradient, and the parameters given it (none: torch's)."""

    name: Literal[OPTIMIZERS] = Field("sgd", description="The torch optimizer.")
    momentum: float | None = key(None, "momentum: the momentum factor.", shown_default=f"{_MOMENTUM:g}",
                                      ge=0, lt=1)
    nesterov: bool | None = Field(None, strict=True, description="momentum: Nesterov momentum.")
    betas: tuple[_UNIT, _UNIT] | None = key(
        None, "adam, adamw: the two moments' decay rates.", valid="two numbers in [0, 1)")
    eps: float | None = Field(None, ge=0, description="adam, adamw: added to the denominator.")
    weight_decay: float | None = Field(None, ge=0, description="L2 penalty (adamw: decoupled weight decay).")

    @field_validator("betas", mode="wrap")
    @classmethod
    def _betas(cls, value: Any, handler: Any) -> Any:
        # The pair's errors name one item of it; the key's range is said for the pair.
        try:
            return handler(value)
        except ValidationError:
            raise UsageError(f"optimizer.betas must be two numbers in [0, 1) (got {value!r})") from None

    @model_validator(mode="after")
    def _parameters_of_the_optimizer(self) -> OptimizerConfig:
        unknown = set(self.parameters) - _OPTIMIZER_PARAMETERS[self.name]
        if unknown:
            allowed = ", ".join(sorted(_OPTIMIZER_PARAMETERS[self.name]))
            raise UsageError(f"optimizer {self.name!r} takes {allowed}; unknown: {', '.join(sorted(unknown))}")
        if self.name == "momentum" and self.momentum is None:
            object.__setattr__(self, "momentum", _MOMENTUM)  # the record is frozen to its readers
        return self

    @property
    def parameters(self) -> dict[str, Any]:
        """The parameters given, by name, as the optimizer takes them."""
        return {name: getattr(self, name) for name in type(self).__pydantic_fields__
                if name != "name" and getattr(self, name) is not None}


# "Exactly one of the two" is not a field's range: the schema says it by the table's size.
@partial(table, json_schema_extra={"minProperties": 1, "maxProperties": 1})
class EvaluateEvery:
    """How often the test split is evaluated: every ``steps`` steps, or every ``epochs`` epochs (one is set)."""

    steps: int | None = Field(None, ge=1, description="Evaluate every this many steps.")
    epochs: float | None = Field(None, gt=0, description="Evaluate every this many epochs.")


class Section(BaseModel):
    """A group of config keys: frozen, and no key it does not declare."""

    # The schemas are built on first use: `dpfleet init` and the help read only the declarations.
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False, arbitrary_types_allowed=True,
                              defer_build=True)
    title: ClassVar[str]

    @field_validator("*", mode="before")
    @classmethod
    def _whole_number_text(cls, value: Any, info: ValidationInfo) -> Any:
        # A flag's value is text: "2.0" or "1e3" is a whole number, as 2.0 is in TOML.
        if isinstance(value, str) and value_type(cls.model_fields[info.field_name]) is int:
            try:
                number = float(value)
            except ValueError:
                return value
            if number.is_integer():
                return int(number)
        return value


def _usage(error: ValueError) -> UsageError:
    """A parser's ValueError as the UsageError the command line reports, keeping its quoted-values form."""
    return UsageError(str(error), getattr(error, "with_values", None))


def _path(name: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise UsageError(f"{name} must be a non-empty path (got {value!r})")
    return os.path.expanduser(value)


_PATH = {"type": "string", "minLength": 1}


def _name_or_function(known: tuple[str, ...]) -> dict:
    """A key that is a built-in's name or a ``package.module:function`` reference."""
    return {"anyOf": [{"enum": list(known)}, {"type": "string", "pattern": "^[^:]+:[^:]+$"}]}


def _named_table(name: str, value: Any, name_key: str) -> Any:
    """A sub-table given by its kind's name alone (``"cosine"``) as the table of that name; a table as it is."""
    if isinstance(value, str):
        return {name_key: value}
    if not (isinstance(value, Mapping) or dataclasses.is_dataclass(value)):
        raise UsageError(f"{name} must be a {name_key} name or a table with a {name_key!r} key (got {value!r})")
    return value


# `from` is a Python keyword: the range is a table of two names, not a record with attributes.
BlockRange = TypedDict("BlockRange", {"from": str, "to": str})
"""A range of blocks by name, ``{ from = "2026-11-01", to = "2026-11-07" }``: every block whose name sorts between."""
BlockRange.__pydantic_config__ = ConfigDict(extra="forbid")


class DataSection(Section):
    """Where the training and test examples come from, and how much of them the run uses."""

    title: ClassVar[str] = "data"
    dataset: str | dict = key(
        "mnist",
        "The training and test data: a built-in dataset, a function returning (train, test) map-style "
        "datasets, or files (see docs/training.md, Data).",
        kind="string or table",
        valid='`"mnist"`, `"fashion-mnist"`, `"package.module:function"`, or a table '
              '`{ format = "parquet" | "csv" | "npy" | "npz" | "imagefolder", train, test, ... }`',
        schema={"anyOf": [{"type": "string"}, {"type": "object", "required": ["format"], "properties": {
            "format": {"enum": ["parquet", "csv", "npy", "npz", "imagefolder"]}}}]},
    )
    train_subset: int | None = key(
        None, "Train on the first n examples only (for quick runs): N = n.",
        valid="1 ≤ train_subset ≤ the training split's size", shown_default="all", ge=1,
    )
    test_subset: int | None = key(None, "Evaluate on the first n test examples only.", shown_default="all", ge=1)
    data_root: str | None = key(
        None, "The built-in datasets' cache (also `DPFLEET_DATA`).",
        valid="a non-empty path", shown_default="`~/.cache/dpfleet`", schema=_PATH,
    )
    check_data: Literal[CHECK_DATA_LEVELS] = key(
        "strict",
        "Before any budget is reserved or worker started, check the data files. `strict`: the files' metadata "
        "and a scan (missing files or columns, wrong types, empty files, examples of the wrong size) and every "
        "value: NaN or infinite features, nulls, and integer labels outside 0..num_classes-1 (num_classes from "
        "the dataset, else the model's output width) are refused, naming the file, column and rule but no row "
        "(`dpfleet data check` lists the rows for the data's owner). `lenient`: the metadata and the scan, then "
        "rows with a NaN or infinite value or a label outside the classes take no part in training or evaluation "
        "(each row by its own values; N counts every row of the files, and how many are dropped is printed only "
        "with --show-values); a csv, parquet, npy or npz table at example level only. `basic`: the metadata and "
        "the scan only. `full`: the same as `strict` (its former name).",
    )

    plan_ahead_steps: int | Literal["auto", "off"] | None = key(
        None,
        "Read Parquet training rows as batches planned this many steps ahead: each window's samples are gathered "
        "by Ray Data in one sequential pass over the files (each row group read at most once a window) into a "
        "folder only the run's user can enter, deleted once its steps ran; the next window is gathered while "
        "this one trains. `auto`: windows of about 256 MiB of rows, at most 1000 steps. Fast whatever the "
        "row-group size; read row by row, each sampled row costs the decoding of its row group (fast only for "
        "`dpfleet data export` files). Left out, it is `auto` for every Parquet shard, and for a Parquet dataset "
        "at example level on a local Ray or a Ray of one node (on a cluster, give it where the workers share "
        "the driver's `TMPDIR`). With `off`, or where planned batches do not apply (privacy_unit = \"user\", "
        "blocks that select rows within files, aggregation = \"collective\", check_data = \"lenient\", a "
        "correlated mechanism), rows are read one by one and a run on Parquet says why in its log; a number or "
        "`auto` given there is refused. A Parquet shard cannot be `off`: each silo's workers plan and gather "
        "their own samples on their own node. Under aggregation = \"auto\", planned batches keep the run on the "
        "driver path (the log says so where the model's size would choose the collective path); `off` lets it "
        "choose.",
        kind='integer, "auto" or "off"', valid="≥ 1, `auto` or `off`",
        shown_default="`auto` where planned batches apply",
    )

    @field_validator("plan_ahead_steps", mode="plain")
    @classmethod
    def _plan_ahead_steps(cls, value: Any) -> int | str | None:
        if value is None or value in ("auto", "off") \
                or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            return value
        raise UsageError(f'plan_ahead_steps must be a whole number >= 1, "auto" or "off" (got {value!r})')

    @field_validator("dataset", mode="plain")
    @classmethod
    def _dataset(cls, value: Any) -> str | dict:
        try:
            return sources.parse_spec(value)
        except ValueError as error:
            raise _usage(error) from None

    @field_validator("data_root", mode="plain")
    @classmethod
    def _data_root(cls, value: Any) -> str | None:
        return None if value is None else _path("data_root", value)


class ModelSection(Section):
    """The network, the loss it is trained on, its test metrics and its augmentations."""

    title: ClassVar[str] = "model and task"
    model: str | dict = key(
        "gdp_cnn",
        "The model: a built-in one, a function returning an `nn.Module` (no BatchNorm), or a pretrained Hugging "
        "Face model from a local folder, `{ hf = \"PATH\", task = ... }` (docs/fine-tuning.md); its task decides "
        "the loss. `num_labels` sets a classifier's classes.",
        kind="string or table",
        valid='`"gdp_cnn"`, `"opacus_cnn"`, `"lenet5"`, `"package.module:function"`, or '
              '`{ hf = "PATH", task = "sequence-classification" | "causal-lm" | "token-classification" }`',
        schema={"anyOf": [_name_or_function(names.MODEL_NAMES),
                          {"type": "object", "required": ["hf", "task"], "properties": {
                              "hf": {"type": "string"}, "task": {"enum": list(pretrained_spec.TASKS)},
                              "num_labels": {"type": "integer", "minimum": 2}}}]},
    )
    adapter: dict | None = key(
        None,
        "A LoRA adapter for a pretrained `model`, through peft: only its factors (and a classifier's new head) "
        "are trained, clipped and noised; the frozen base never enters the clipped vector. Left out, every "
        "parameter is trained (full fine-tuning).",
        kind="table", shown_default="none (full fine-tuning)",
        valid='`{ kind = "lora", r = 8, alpha = 16, dropout = 0.0, target_modules = ["q_proj", "v_proj"] }`',
        schema={"type": "object", "required": ["kind", "target_modules"], "properties": {
            "kind": {"enum": ["lora"]}, "r": {"type": "integer", "minimum": 1}, "alpha": {"type": "number"},
            "dropout": {"type": "number"}, "target_modules": {"type": "array", "items": {"type": "string"}}}},
    )
    loss: str = key(
        "cross_entropy",
        "The per-example loss. `token_cross_entropy` takes logits [B, T, V] against tokens [B, T] and ignores "
        "-100; a function takes (outputs, labels).",
        valid='`"cross_entropy"`, `"mse"`, `"bce_with_logits"`, `"token_cross_entropy"`, or '
              '`"package.module:function"`',
        schema=_name_or_function(names.LOSS_NAMES),
    )
    # Declared after `loss`: its default is the loss's task's first metric.
    metrics: tuple[str, ...] = key(
        None, "Test metrics fitting the loss's task, computed with torchmetrics. The first is plotted.",
        kind="list of strings",
        valid='`"accuracy"`, `"top5_accuracy"`, `"auroc"` (classification); `"accuracy"`, `"auroc"` (binary); '
              '`"mse"`, `"mae"` (regression)',
        shown_default="the task's first metric", validate_default=True,
        schema={"type": "array", "items": {"type": "string"}, "minItems": 1},
    )
    train_transforms: tuple[dict, ...] = key(
        (),
        "torchvision v2 transforms applied in the worker to each sampled example on its own. "
        "MixUp and CutMix mix examples and are refused.",
        kind="list of tables", valid='`[{ name = "RandomCrop", size = 28, padding = 2 }, ...]`', shown_default="none",
        schema={"type": "array", "items": {"type": "object", "required": ["name"]}},
    )
    augmentations_per_example: int = key(
        1,
        "Augmentation multiplicity (De et al. 2022): each sampled example's gradient is the mean over K views "
        "drawn by `train_transforms`, and that mean is clipped to C, so the sensitivity stays C. Not with "
        "`microbatch_size`. The fast engine hands such steps to the vmap engine.",
        valid="≥ 1; above 1 needs `train_transforms`", ge=1,
    )

    @field_validator("model", mode="plain")
    @classmethod
    def _model(cls, value: Any) -> str | dict:
        if isinstance(value, Mapping):
            try:
                return pretrained_spec.parse_model_table(value)
            except ValueError as error:
                raise _usage(error) from None
        if not isinstance(value, str) or not (value in names.MODEL_NAMES or ":" in value):
            raise UsageError(
                f"model must be one of {', '.join(names.MODEL_NAMES)}, 'package.module:function', or a table "
                f"{{ hf = \"PATH\", task = \"...\" }} (got {value!r})"
            )
        return value

    @field_validator("adapter", mode="plain")
    @classmethod
    def _adapter(cls, value: Any) -> dict | None:
        try:
            return pretrained_spec.parse_adapter(value)
        except ValueError as error:
            raise _usage(error) from None

    @property
    def model_spec(self) -> str | dict:
        """What a worker builds the model from (``workers.models.build_model``): ``model``, with the ``adapter``
        folded into a pretrained model's table."""
        if isinstance(self.model, str):
            return self.model
        return {**self.model, "adapter": self.adapter}

    @field_validator("loss", mode="plain")
    @classmethod
    def _loss(cls, value: Any) -> str:
        if not isinstance(value, str):
            raise UsageError(f"loss must be a name or 'package.module:function' (got {value!r})")
        if value not in names.LOSS_NAMES:
            try:
                tasks.build_loss(value)
            except ValueError as error:
                raise _usage(error) from None
        return value

    @field_validator("metrics", mode="plain")
    @classmethod
    def _metrics(cls, value: Any, info: ValidationInfo) -> tuple[str, ...]:
        if isinstance(value, tuple):
            value = list(value)
        if value is not None and not (isinstance(value, list) and value and all(isinstance(v, str) for v in value)):
            raise UsageError(f'metrics must be a non-empty list of names, e.g. ["accuracy", "auroc"] (got {value!r})')
        if "loss" not in info.data:
            return tuple(value or ())  # the loss is refused, and the metrics are checked against it once it is not
        try:
            return names.check_metrics(info.data["loss"], value)
        except ValueError as error:
            raise _usage(error) from None

    @field_validator("train_transforms", mode="plain")
    @classmethod
    def _train_transforms(cls, value: Any) -> tuple[dict, ...]:
        if isinstance(value, tuple):
            value = list(value)
        if not isinstance(value, list):
            raise UsageError(f'train_transforms must be a list of tables, e.g. [{{ name = "RandomHorizontalFlip" }}] '
                             f"(got {value!r})")
        try:
            if value:
                tasks.build_transform(value)
        except ValueError as error:
            raise _usage(error) from None
        return tuple(dict(step) for step in value)


class SamplingSection(Section):
    """What one unit of protection is, and how the units are Poisson-sampled into steps."""

    title: ClassVar[str] = "sampling"
    batch_size: int = key(
        250, "The *expected* batch size: each example joins a step with probability q = batch_size / N.",
        valid="1 ≤ batch_size ≤ N", ge=1,
    )
    sampler: Literal[SAMPLERS] = key(
        "poisson",
        "How each step's batch is drawn: `poisson` (each example independently with probability q; DP-SGD), "
        "`fixed-order` (the data shuffled once with the run's key, then `batch_size` examples a step in that "
        "order every epoch, or with shards each silo's own examples a slice a step; no amplification: for "
        "`dp-ftrl` and `band-mf`, and data that cannot be sampled) or "
        "`cyclic-poisson` (`band-mf` only: the data split into `band_width` groups, step t Poisson-samples group "
        "t mod b at rate b·batch_size/N). A sampler the `mechanism` is not accounted for is refused.",
    )
    shards: tuple[ShardSpec, ...] = key(
        (), "Training data that stays on its nodes and is Poisson-sampled there (see docs/training.md, Shards).",
        kind="list of tables",
        valid=f"a list of {table_text(ShardSpec)}; `dataset` is by default the config's, `part` < `parts`, "
              "and shards may not overlap",
        shown_default="none",
    )
    on_shard_loss: Literal[SHARD_LOSS_POLICIES] = key(
        DEFAULT_ON_SHARD_LOSS,
        "With shards, what a step does while a shard is lost: wait for its replacement, or run without it.",
    )
    shard_timeout: float = key(
        DEFAULT_SHARD_TIMEOUT,
        "With shards, seconds a shard's resources may be missing before the run stops at a checkpoint (exit "
        "status 5).", gt=0,
    )
    secure_aggregation: bool = key(
        False,
        "With shards, each silo sends the driver only its clipped sum in fixed point plus pairwise masks that "
        "cancel in the total, so no one learns one silo's sum (see docs/silos.md); a silo lost in a step counts "
        "as zero for that step.", strict=True,
    )
    mask_share_threshold: int | None = key(
        None,
        "With secure_aggregation, how many silos' shares rebuild a dropped silo's masking key or a survivor's "
        "self-mask: a step survives up to (silos − threshold) dropouts, and a driver that follows the protocol "
        "learns only the survivors' total while it colludes with up to threshold − 1 silos (docs/silos.md).",
        valid="a majority: ⌊shards / 2⌋ + 1 ≤ threshold ≤ the number of shards",
        shown_default="⌊shards / 2⌋ + 1", ge=2,
    )
    noise_placement: Literal["driver", "silos"] = key(
        "driver",
        "With secure_aggregation, who adds the noise: `\"driver\"` adds Gaussian noise of std σ·C to the "
        "unmasked total (the driver sees the silos' un-noised total and is trusted for the noise); `\"silos\"`: "
        "each silo adds a discrete Gaussian share of std σ·C before masking, so the total the driver unmasks is "
        "already noisy and one honest silo's share carries the target alone (see docs/silos.md).",
    )
    privacy_unit: Literal[PRIVACY_UNITS] = key(
        "example",
        "What one unit of protection is. Under `\"user\"`, users are Poisson-sampled (`batch_size` is then the "
        "expected number of users a step), each sampled user gives one clipped gradient of its mean loss, and ε "
        "protects each person, however many rows it owns. Not with shards, microbatches, adaptive clipping or "
        "`layer_clip_norms`.",
    )
    user_id: str | None = key(
        None, "Under `privacy_unit = \"user\"`, the Parquet or CSV column naming each row's person.",
        valid="a column name", shown_default="none", schema={"type": "string", "minLength": 1},
    )
    synthetic_users: int | None = key(
        None,
        "Under `privacy_unit = \"user\"`, assign the rows to this many synthetic users instead (skewed: 1 to 300 "
        "rows each, a fixed assignment); for built-in datasets and tests.",
        valid="≥ 1, at most the training examples", shown_default="none", ge=1,
    )
    max_examples_per_user: int | None = key(
        None,
        "Under `privacy_unit = \"user\"`, a sampled user gives at most this many of its rows a step, drawn at random "
        "each time. At example level, with `user_id` or `synthetic_users`, a bound on every person's rows, checked "
        "against the data before training: the summary's `user_epsilon` and a ledger dataset with a user-level "
        "budget then count each person by group privacy over that many rows.",
        shown_default="all its rows", ge=1,
    )

    @field_validator("shards", mode="before")
    @classmethod
    def _shard_tables(cls, value: Any, info: ValidationInfo) -> list:
        # A shard without a dataset reads the config's (a refused dataset is reported by its own key).
        tables = shard_tables(value, sources.BUILTINS, info.data.get("dataset", "mnist"))
        try:
            return [{**table, "dataset": sources.parse_spec(table["dataset"])} if isinstance(table["dataset"], dict)
                    else table for table in tables]
        except ValueError as error:
            raise _usage(error) from None

    @field_validator("shards", mode="after")
    @classmethod
    def _shards(cls, value: tuple[ShardSpec, ...]) -> tuple[ShardSpec, ...]:
        return check_shards(value)

    @field_validator("user_id", mode="plain")
    @classmethod
    def _user_id(cls, value: Any) -> str | None:
        if value is not None and (not isinstance(value, str) or not value):
            raise UsageError(f"user_id must be a column name (got {value!r})")
        return value


class PrivacySection(Section):
    """The noise, the clipping and how ε is computed."""

    title: ClassVar[str] = "privacy"
    noise_multiplier: float | None = key(
        None, "σ: the noise standard deviation over the clip norm.",
        shown_default="none: give exactly one of `noise_multiplier` and `target_epsilon`", gt=0,
    )
    target_epsilon: float | None = key(
        None, "The ε to meet at `delta`; σ is then the smallest that meets it, by the run's accountant.",
        shown_default="none: give exactly one of `noise_multiplier` and `target_epsilon`", gt=0,
    )
    target_epsilon_basis: Literal[TARGET_EPSILON_BASES] = key(
        "accountant",
        "Which ε `target_epsilon` sets: the run's `accountant`'s (what it reports), or `filter`: the RDP-filter ε "
        "the ledger charges the job (at each charged budget's orders and δ; the largest when it names several "
        "blocks), so that the charge is the target. The ledger is read before planning.",
    )
    clip_norm: float = key(1.0, "C: the per-example L2 bound.", gt=0)
    mechanism: Literal[MECHANISMS] = key(
        "dp-sgd",
        "How the noise is made: `dp-sgd` (independent each step), `band-mf` (banded matrix factorization: "
        "noise correlated over `band_width` steps, the strategy optimised for the run's steps) or `dp-ftrl` "
        "(tree aggregation). See docs/mechanisms.md. Correlated noise needs `sampler` = `fixed-order` or "
        "(`band-mf`) `cyclic-poisson` (with shards, `fixed-order`: each silo takes its own examples in a fixed "
        "order), a constant `noise_schedule` and the driver's aggregation; not with microbatches, adaptive "
        "clipping or privacy_unit = \"user\".",
    )
    band_width: int = key(
        1, "`band-mf`: b, the steps over which noise is correlated (the driver keeps b noise vectors). 1 is "
        "DP-SGD's noise.", valid="1 ≤ band_width ≤ the steps of one epoch (`fixed-order`) or ≤ N / batch_size",
        ge=1,
    )
    tree_restart: bool = key(
        True, "`dp-ftrl`: a new tree every epoch (Kairouz et al. 2021), so that each epoch costs one leaf's "
        "sensitivity; off, one tree spans the run and an example's epochs add up in the nodes they share.",
        strict=True,
    )
    tree_completion: bool = key(
        False, "`dp-ftrl`: the last step of each tree releases the root's sum (the tree padded with zero leaves to "
        "a power of two), so the prefix carried over a restart has one node's noise.", strict=True,
    )
    noise_schedule: NoiseSchedule = key(
        NoiseSchedule(),
        "σ held constant over blocks of `every` steps (default one epoch) and changed between them: "
        "exponential σ·decay^k, step σ·decay^⌊k/step_size⌋, linear from σ to σ·final_ratio. "
        "The reported ε is the exact composition of the blocks.",
        kind="string or table",
        valid=f"a kind's name, or {table_text(NoiseSchedule)}", shown_default='`"constant"`',
    )
    secure_noise: bool = key(
        True,
        "Each noise value is the sum of four float64 Gaussian draws, against the floating-point attack "
        "on Gaussian sampling.", strict=True,
    )
    delta: float = key(1e-5, "The δ at which ε is reported and charged.", gt=0, lt=1)
    accountant: Literal[ACCOUNTANT_NAMES] = key(
        "pld",
        "How ε is computed: PLD (rigorous, tightest), RDP (rigorous) or GDP (approximate, never used for budgets).",
    )
    seed: int | None = key(
        None, "Fixes sampling and noise, for tests only: the run prints `seeded: not for production use`.",
        shown_default="none (OS entropy)", ge=0,
    )
    microbatch_size: int | None = key(
        None,
        "Clip groups of about k examples instead of single examples; ε then uses sensitivity factor 2. "
        "Not with shards or `layer_clip_norms`.",
        shown_default="none", ge=1,
    )
    adaptive_clipping: AdaptiveClipping | None = key(
        None,
        "The clip norm follows a target quantile of the gradient norms, moved each step by a noisy count "
        "that is accounted together with the gradient. Not with shards or `layer_clip_norms`.",
        kind="boolean or table",
        valid=f"`true`, or {table_text(AdaptiveClipping)}", shown_default="off",
    )
    # Declared as the table it is given as; checked, it is a workers.clipping.LayerClipNorms (which loads torch).
    layer_clip_norms: dict[str, Annotated[float, Field(gt=0)]] | None = key(
        None,
        "Per-layer clipping: each group of parameters is clipped to its own norm; the noise is scaled to the "
        "root of the sum of their squares. Every trainable parameter needs a prefix.",
        kind="table", valid='`{ "conv1" = 0.5, "fc" = 1.0 }`: parameter-name prefix = clip norm (> 0)',
        shown_default="none", min_length=1,
    )

    @field_validator("noise_schedule", mode="before", json_schema_input_type=Literal[NOISE_SCHEDULES] | NoiseSchedule)
    @classmethod
    def _noise_schedule(cls, value: Any) -> Any:
        return _named_table("noise_schedule", value, "kind")

    @field_validator("adaptive_clipping", mode="before", json_schema_input_type=bool | AdaptiveClipping)
    @classmethod
    def _adaptive_clipping(cls, value: Any) -> Any:
        if value is None or value is False:
            return None
        if value is True:
            return {}
        if not isinstance(value, (Mapping, AdaptiveClipping)):
            raise UsageError(f"adaptive_clipping must be a table or true/false (got {value!r})")
        return value

    @field_validator("layer_clip_norms", mode="before")
    @classmethod
    def _layer_clip_norm_table(cls, value: Any) -> Any:
        if value is None or isinstance(value, clipping.LayerClipNorms):
            return None if value is None else dict(value.groups)
        if not isinstance(value, Mapping) or not value:
            raise UsageError(
                f"layer_clip_norms must be a table of parameter-name prefix = clip norm, e.g. "
                f'{{ "0" = 1.0, "7" = 0.5 }} (got {value!r})'
            )
        return {str(prefix): norm for prefix, norm in value.items()}

    @field_validator("layer_clip_norms", mode="after")
    @classmethod
    def _layer_clip_norms(cls, value: dict[str, float] | None) -> Any:
        return None if value is None else clipping.LayerClipNorms(tuple(value.items()))


class OptimisationSection(Section):
    """What steps on the noisy mean gradient (post-processing: no privacy cost), and DP-FedAvg's local steps."""

    title: ClassVar[str] = "optimisation"
    optimizer: OptimizerConfig = key(
        OptimizerConfig(),
        "The torch optimizer that steps on the noisy mean gradient (post-processing: no privacy cost).",
        kind="string or table",
        valid=f"a name, or {table_text(OptimizerConfig)}: "
              + "; ".join(f"`{name}` takes {', '.join(f'`{p}`' for p in sorted(parameters))}"
                          for name, parameters in _OPTIMIZER_PARAMETERS.items()),
        shown_default='`"sgd"`',
    )
    learning_rate: float = key(0.1, "The optimizer's step size.", gt=0)
    ema_decay: float | None = key(
        None,
        "Parameter averaging: the driver keeps an exponential moving average of the weights (decay warmed up "
        "as min(decay, (1 + t) / (10 + t)) at step t; on the collective path each rank keeps that of its slice), "
        "evaluates it instead of the weights, and saves it with the checkpoints (post-processing: no privacy "
        "cost).",
        shown_default="off", gt=0, lt=1,
    )
    lr_schedule: LearningRateSchedule = key(
        LearningRateSchedule(), "How the learning rate changes per step (post-processing: no privacy cost).",
        kind="string or table",
        valid=f"a kind's name, or {table_text(LearningRateSchedule)}", shown_default='`"constant"`',
    )
    local_steps: int | None = key(
        None,
        "DP-FedAvg: each sampled user takes this many local SGD steps on its own rows in the worker, and its "
        "model delta, clipped to `clip_norm`, replaces its gradient; the noisy mean delta is applied by `optimizer` "
        "at `learning_rate` (the server's). Needs `privacy_unit = \"user\"` and `local_learning_rate`.",
        shown_default="off (one clipped gradient a user)", ge=1,
    )
    local_learning_rate: float | None = key(
        None, "DP-FedAvg: the learning rate of each user's local SGD steps.", shown_default="none", gt=0,
    )

    @field_validator("optimizer", mode="before", json_schema_input_type=Literal[OPTIMIZERS] | OptimizerConfig)
    @classmethod
    def _optimizer(cls, value: Any) -> Any:
        return _named_table("optimizer", value, "name")

    @field_validator("lr_schedule", mode="before", json_schema_input_type=Literal[LR_SCHEDULES] | LearningRateSchedule)
    @classmethod
    def _lr_schedule(cls, value: Any) -> Any:
        return _named_table("lr_schedule", value, "kind")


class RunSection(Section):
    """How long the run is, how often it evaluates and checkpoints, and the workers that compute its gradients."""

    title: ClassVar[str] = "run"
    epochs: float | None = key(
        None, "Run length in passes over the data: steps = ceil(epochs · N / batch_size).",
        shown_default="none: give exactly one of `epochs` and `steps`", gt=0,
    )
    steps: int | None = key(
        None, "Run length in steps.", shown_default="none: give exactly one of `epochs` and `steps`", ge=1,
    )
    evaluate_every: EvaluateEvery | None = key(
        None, "Also evaluate within epochs; the workers evaluate the test split in parts and return only sums.",
        kind="table", valid=f"one key of {table_text(EvaluateEvery)}", shown_default="every epoch",
    )
    early_stopping_patience: int | None = key(
        None,
        "Stop the run once this many evaluations in a row (at the evaluation points `evaluate_every` sets) have not "
        "improved `early_stopping_metric` on the test split; the steps not run are released to the ledger, never "
        "charged, and the summary says the run stopped early. The test split must be public or held out from the "
        "private training data: the decision reads it (docs/training.md).",
        shown_default="off", ge=1,
    )
    early_stopping_metric: str = key(
        "loss",
        "The test metric early stopping watches: `loss` or one of `metrics`. Loss, mse and mae improve "
        "downwards, the others upwards.",
        valid="`\"loss\"` or a name in `metrics`",
    )
    early_stopping_min_delta: float = key(
        0.0, "How much `early_stopping_metric` must beat its best so far to count as an improvement.", ge=0,
    )
    workers: int = key(2, "Gradient worker actors. With `shards`, the sum of the shards' `workers`.", ge=1)
    aggregation: Literal[AGGREGATIONS] = key(
        "auto",
        "Where each step's clipped sums are added up, noised and stepped on: `driver` (the driver receives every "
        "node's sum, adds the noise once and runs the optimizer) or `collective` (the workers form a "
        "torch.distributed group, gloo on CPUs and NCCL on GPUs, reduce-scatter their sums, each noises and "
        "steps its own slice of the coordinates, and they all-gather the weights; the driver sends and receives "
        "only scalars, the step's sample shares and the slices' noise keys). `auto` picks `collective` from "
        "2 workers and 2M parameters x workers, as measured (orchestrator/collective.py, AUTO_COLLECTIVE_FROM), "
        "for a config it runs, else `driver`. The collective path assumes the workers trust each other: each "
        "sees the un-noised total of its slice.",
    )
    cpus_per_worker: int = key(1, "CPUs each worker asks Ray for; also its torch threads.", ge=1)
    gpus_per_worker: float = key(
        0.0, "GPUs each worker asks Ray for, e.g. 0.5 for two workers on one GPU (`examples/mnist_gpu.toml`).", ge=0,
    )
    max_physical_batch: int = key(
        128, "Examples whose gradients a worker processes at once (a memory bound, not a privacy parameter).", ge=1,
    )
    engine: Literal[names.ENGINE_NAMES] = key(
        "fast",
        "The per-example clipping engine: `fast` (per-layer rules: ghost norms and book-keeping, checked "
        "against autograd on each model) or `vmap` (the torch.func reference).",
    )
    precision: Literal[names.PRECISIONS] = key(
        "fp32",
        "What the workers' forward and backward passes compute in: `fp32`, or `bf16` (bfloat16 autocast). Under "
        "`bf16` each example's gradient is cast to float32 before its norm and its clipping, and the sums, the "
        "noise and the optimizer stay float32, so one example still moves the sum by at most C (the fast engine "
        "casts each layer's recorded input and output gradient to float32 before its rules take norms and sums "
        "from them). Not with microbatch_size, shards, privacy_unit = \"user\" or aggregation = \"collective\".",
    )
    run_dir: str = key(
        "runs/latest", "Where config.json, metrics.jsonl, summary.json, curves.png and the checkpoints go.",
        valid="a non-empty path", schema=_PATH,
    )
    checkpoint_every: int = key(
        0, "Also checkpoint every n steps (0: only at each epoch's end, which is always done).", ge=0,
    )

    @field_validator("evaluate_every", mode="before")
    @classmethod
    def _evaluate_every(cls, value: Any) -> Any:
        if isinstance(value, Mapping) and len(value) != 1:
            raise UsageError(f"evaluate_every must be {{ steps = n }} or {{ epochs = e }} (got {value!r})")
        return value

    @field_validator("run_dir", mode="plain")
    @classmethod
    def _run_dir(cls, value: Any) -> str:
        return _path("run_dir", value)


class LedgerSection(Section):
    """Which ledger charges the run, on which dataset and blocks, and how often."""

    title: ClassVar[str] = "ledger"
    ledger: str | None = key(
        None,
        "The privacy ledger server, or servers of one PostgreSQL ledger (a call one does not answer goes to the "
        "next); `--ledger` overrides it, and `DPFLEET_LEDGER` stands in when neither is given.",
        valid='`"HOST:PORT"`, or several separated by commas', shown_default="the embedded ledger",
        schema={"type": "string", "pattern": r"^[^,]+:\d+(\s*,\s*[^,]+:\d+)*$"},
    )
    dataset_name: str | None = key(
        None, "The dataset's name in the ledger (also `--dataset-name`).",
        valid="1 to 128 characters", schema={"type": "string", "minLength": 1, "maxLength": 128},
        shown_default="the dataset's name (a table's `name`, else its train location), with characters a ledger "
                      "name cannot hold replaced by `-`",
    )
    dataset_budget_epsilon: float = key(
        10.0, "The ε budget given to a dataset the embedded ledger has not seen, at the run's `delta`.", gt=0,
    )
    dataset_plan_share: float = key(
        0.0, "The share of that budget (ε and δ alike) a dataset the embedded ledger has not seen sets aside as "
             "its plan pool, which pre-registered plans (`dpfleet tune`, `dpfleet ledger plan register`) are "
             "charged their PLD ε from; the filter admits single jobs within the rest (docs/ledger.md).",
        ge=0, le=0.99,
    )
    # The names a range stands for are the dataset's, so TrainConfig settles a range into names.
    blocks: tuple[str, ...] | BlockRange = key(
        (),
        "The blocks of a Parquet dataset with `blocks` that the run trains on: it reads only the rows they "
        "declare, samples at batch_size / their row count, and the ledger charges each of them in full; each "
        "block's declaration must be the one the ledger holds (see docs/ledger.md, Blocks). Not with shards.",
        kind="list of strings, or table",
        valid='`["2026-11-01", ...]`, or `{ from = "2026-11-01", to = "2026-11-07" }` (names between, inclusive)',
        shown_default="none: the dataset as a whole",
        schema={"uniqueItems": True},  # pydantic has no unique-items constraint; it holds for the list form only
    )
    commit_every: int | None = key(
        None,
        "Steps per ledger charge; each block is charged before it runs. A run that stops for good keeps the block "
        "its steps were in and any the charge clock charged ahead of them (docs/ledger.md).",
        shown_default="100 steps, or 1% of the run's steps where that is more", ge=1,
    )
    commit_interval: float | None = key(
        None,
        "Seconds between ledger charges. Blocks are charged on a clock that starts with the first step and keeps a "
        "pace fixed before it, whatever the steps are doing, so commit times say nothing about the batches; a "
        "block's steps wait for its charge. A block's wall time is a good value: a shorter interval charges blocks "
        "ahead of the steps (a resume runs them without charging again), a longer one makes the steps wait.",
        shown_default="a block's steps at 1.25 times a worker's clipping of made-up examples, timed before the "
                      "run (docs/ledger.md)",
        gt=0,
    )
    ledger_timeout: float = key(
        300.0, "Seconds to wait out a ledger outage before stopping at a checkpoint (exit status 4).", gt=0,
    )
    ledger_lease: float | None = key(
        None,
        "Seconds the job's reservation lasts without a charge; each charge renews it. A job that stops charging "
        "loses its unrun steps, and a charge after that is refused.",
        valid="> 0, several times a block's wall time", shown_default="no lease: the reservation holds until released",
        gt=0,
    )

    @field_validator("ledger", mode="plain")
    @classmethod
    def _ledger(cls, value: Any) -> str | None:
        if value is None:
            return None
        for address in str(value).split(","):
            host, _, port = address.strip().rpartition(":")
            if not (isinstance(value, str) and host and port.isdigit() and 0 < int(port) < 65536):
                raise UsageError(
                    f"ledger must be HOST:PORT with a port in 1..65535, or several separated by commas (got {value!r})"
                )
        return value

    @field_validator("dataset_name", mode="plain")
    @classmethod
    def _dataset_name(cls, value: Any) -> str | None:
        if value is not None and not (isinstance(value, str) and 0 < len(value) <= 128):
            raise UsageError(f"dataset_name must be a name of 1 to 128 characters (got {value!r})")
        return value

    @field_validator("blocks", mode="before")
    @classmethod
    def _blocks(cls, value: Any) -> tuple[str, ...] | dict:
        if value is None:  # a run's config.json writes "no blocks" as []
            return ()
        if isinstance(value, Mapping):
            if set(value) != BlockRange.__required_keys__ or not all(isinstance(end, str) for end in value.values()):
                raise UsageError(f'blocks as a range is a table {{ from = "NAME", to = "NAME" }} (got {value!r})')
            return dict(value)
        if not (isinstance(value, (list, tuple)) and all(isinstance(name, str) for name in value)):
            raise UsageError(f'blocks must be a list of block names or a table {{ from, to }} (got {value!r})')
        if len(set(value)) != len(value):
            raise UsageError(f"blocks must name each block once (got {list(value)!r})")
        return tuple(value)


SECTIONS: tuple[type[Section], ...] = (
    DataSection, ModelSection, SamplingSection, PrivacySection, OptimisationSection, RunSection, LedgerSection,
)
"""The sections, in the order the references and ``dpfleet init`` list them."""
