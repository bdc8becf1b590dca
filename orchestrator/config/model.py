"""TrainConfig: the sections composed into one flat, frozen record, and the rules that tie keys of several together.

TrainConfig inherits every section, so that a key is read as
``config.sigma`` wherever it is declared and the TOML stays flat. Composing
by fields (``config.privacy.clip_norm``) would nest the TOML or need a
mapping from flat keys to sections, and would change every reader of the
config; the sections stay the unit of declaration and documentation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Mapping

from pydantic import model_validator

from accounting.lazy import LazyModule
from accounting.matrix_mechanisms import sampler_refusal
from orchestrator.config.sections import (
    SECTIONS,
    DataSection,
    LedgerSection,
    ModelSection,
    OptimisationSection,
    PrivacySection,
    RunSection,
    SamplingSection,
)
from orchestrator.errors import UsageError
from orchestrator.shard_config import check_shard_mode
from workers import pretrained_spec

sources = LazyModule("workers.sources")
silo_identity = LazyModule("workers.secure_aggregation.identity")


# pydantic lists an heir's fields from its last base to its first: the sections go in reverse, so that the
# fields (and the order they are checked in) are the sections' order, and `shards` sees the dataset.
class TrainConfig(LedgerSection, RunSection, OptimisationSection, PrivacySection, SamplingSection, ModelSection,
                  DataSection):
    """Everything a DP-SGD run needs; units are per-example unless stated."""

    @model_validator(mode="after")
    def _keys_fit_together(self) -> TrainConfig:
        problems = []
        for check in KEY_RULES:
            try:
                check(self)
            except UsageError as error:
                problems.append(error)
        if problems:
            raise KeyProblems(problems)
        return self

    def to_dict(self) -> dict:
        """A JSON-ready dict of every key, as config.json holds it and `build_config` reads it back."""
        data = {name: _plain(getattr(self, name)) for name in type(self).model_fields}
        data["optimizer"] = {"name": self.optimizer.name, **dict(self.optimizer.parameters)}
        if self.layer_clip_norms is not None:
            data["layer_clip_norms"] = dict(self.layer_clip_norms.groups)
        if self.evaluate_every is not None:
            data["evaluate_every"] = {key: value for key, value in data["evaluate_every"].items() if value is not None}
        return data


class KeyProblems(UsageError):
    """Every rule between keys that a config breaks, each a UsageError of its own."""

    def __init__(self, problems: list[UsageError]) -> None:
        super().__init__("\n".join(map(str, problems)), "\n".join(problem.with_values for problem in problems))
        self.problems = problems


def _plain(value: Any) -> Any:
    """A value with its records as dicts, as ``dataclasses.asdict`` gives them (tuples stay tuples)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    if isinstance(value, Mapping):
        return {name: _plain(item) for name, item in value.items()}
    return value


def _settle(config: TrainConfig, **values: Any) -> None:
    """Give keys that other keys decide their value, during validation (the record is frozen to its readers)."""
    config.__dict__.update(values)


def _given(config: TrainConfig) -> dict[str, Any]:
    """The keys the config's source gave, with their checked values."""
    return {name: getattr(config, name) for name in config.model_fields_set}


def _one_length(config: TrainConfig) -> None:
    if (config.epochs is None) == (config.steps is None):
        raise UsageError("give exactly one of epochs (> 0) or steps (integer >= 1)")


def _one_noise(config: TrainConfig) -> None:
    if (config.noise_multiplier is None) == (config.target_epsilon is None):
        raise UsageError("give exactly one of noise_multiplier (> 0) or target_epsilon (> 0)")
    if config.target_epsilon_basis == "filter" and config.target_epsilon is None:
        raise UsageError('target_epsilon_basis = "filter" sets how σ meets target_epsilon; give target_epsilon '
                         "instead of noise_multiplier, or leave target_epsilon_basis out")


def _shard_mode(config: TrainConfig) -> None:
    """With shards, the shards' workers are the run's workers; refuse what shard mode cannot do."""
    workers = check_shard_mode(_given(config), config.shards)
    if workers is not None:
        _settle(config, workers=workers)


def _chosen_blocks(config: TrainConfig) -> None:
    """The blocks as names (a range { from, to } takes every block whose name sorts between), and their rows.

    ISO dates sort as time does, so a range of dates is the days between.
    """
    spec, value = config.dataset, config.blocks
    known = list(spec.get("blocks", {})) if isinstance(spec, dict) else []
    if not value:
        if known and "train" not in spec:
            raise UsageError(
                f"the dataset is made of blocks ({', '.join(known)}); choose the run's with blocks = [...] or "
                'blocks = { from = "...", to = "..." }'
            )
        return
    if isinstance(value, dict):
        chosen = [name for name in sorted(known) if value["from"] <= name <= value["to"]]
        if not chosen:
            raise UsageError(
                f"no block of the dataset lies between {value['from']!r} and {value['to']!r} "
                f"(its blocks: {', '.join(known) or 'none'})"
            )
    else:
        chosen = list(value)
    if config.shards:
        # Each shard reads its own dataset, so the blocks charged would not be the rows the run reads.
        raise UsageError("blocks is not supported with shards; train on blocks of one Parquet dataset without shards")
    try:
        _settle(config, dataset=sources.select_blocks(spec if isinstance(spec, dict) else {}, chosen),
                blocks=tuple(chosen))
    except ValueError as error:
        raise UsageError(f"blocks: {error}") from None


def _privacy_unit(config: TrainConfig) -> None:
    """Refuse keys about people (user level, or a rows-per-person bound) that do not fit together, and say why."""
    user_keys = {"user_id": config.user_id, "synthetic_users": config.synthetic_users,
                 "max_examples_per_user": config.max_examples_per_user, "local_steps": config.local_steps,
                 "local_learning_rate": config.local_learning_rate}
    if config.privacy_unit == "example":
        given = [name for name, value in user_keys.items() if value is not None]
        people = config.user_id is not None or config.synthetic_users is not None
        if not given or (config.max_examples_per_user is not None and people
                         and set(given) <= {"user_id", "synthetic_users", "max_examples_per_user"}):
            _people_keys(config)
            return
        raise UsageError(f"{', '.join(given)} apply to user-level privacy; add privacy_unit = \"user\", or at "
                         "example level give max_examples_per_user with user_id or synthetic_users to bound each "
                         "person's rows (local_steps needs user level), or remove them")
    _people_keys(config)
    if (config.local_steps is None) != (config.local_learning_rate is None):
        raise UsageError("DP-FedAvg needs both local_steps (>= 1) and local_learning_rate (> 0); give both or neither")
    clashing = [name for name, value in (("shards", config.shards), ("microbatch_size", config.microbatch_size),
                                         ("adaptive_clipping", config.adaptive_clipping),
                                         ("layer_clip_norms", config.layer_clip_norms)) if value]
    if clashing:
        raise UsageError(f"privacy_unit = \"user\" clips each user's gradient whole with a fixed norm over one "
                         f"dataset; it cannot be combined with {', '.join(clashing)}")


def _people_keys(config: TrainConfig) -> None:
    """Exactly one of user_id and synthetic_users names the people, when any key about people is given."""
    if config.privacy_unit == "example" and config.max_examples_per_user is None:
        return
    if (config.user_id is None) == (config.synthetic_users is None):
        raise UsageError("naming each row's person needs exactly one of user_id (the column naming each row's "
                         "person) or synthetic_users (a number of users to assign the rows to)")
    if config.privacy_unit == "example" and config.shards:
        raise UsageError("max_examples_per_user at example level reads the people of one dataset; it cannot be "
                         "combined with shards")


def _people_not_features(config: TrainConfig) -> None:
    """A table's user_id column names each row's person: it is no feature, unless the dataset's features name it."""
    spec = config.dataset
    if config.user_id is None or not isinstance(spec, dict) or spec.get("format") not in ("parquet", "csv") \
            or "features" in spec or config.user_id in spec.get("exclude_columns", []):
        return
    _settle(config, dataset={**spec, "exclude_columns": [*spec.get("exclude_columns", []), config.user_id]})


def _lenient_rows(config: TrainConfig) -> None:
    """check_data = "lenient" marks the table's spec so that every reader of it drops the same invalid rows."""
    spec, lenient = config.dataset, config.check_data == "lenient"
    if isinstance(spec, dict) and (lenient or "drop_invalid_rows" in spec):
        _settle(config, dataset={**{key: value for key, value in spec.items() if key != "drop_invalid_rows"},
                                 **({"drop_invalid_rows": True} if lenient else {})})
    if not lenient:
        return
    refused = [reason for reason, present in (
        ("a dataset other than a csv, parquet, npy or npz table",
         not isinstance(spec, dict) or spec.get("format") not in sources.LENIENT_FORMATS),
        ("shards", config.shards), ("blocks", config.blocks), ("plan_ahead_steps", _planned_by_key(config)),
        ("people's rows (privacy_unit = \"user\", user_id, synthetic_users, max_examples_per_user)",
         config.privacy_unit == "user" or config.user_id is not None or config.synthetic_users is not None
         or config.max_examples_per_user is not None)) if present]
    if refused:
        raise UsageError(f'check_data = "lenient" drops invalid rows of one table as the driver and every worker read '
                         f'it; it cannot be combined with {", ".join(refused)}: use check_data = "strict" and fix or '
                         "drop the rows it names")


def _early_stopping(config: TrainConfig) -> None:
    if config.early_stopping_metric != "loss" and config.early_stopping_metric not in config.metrics:
        raise UsageError(f"early_stopping_metric must be \"loss\" or one of the run's metrics "
                         f"({', '.join(config.metrics)}) (got {config.early_stopping_metric!r}); add it to metrics "
                         "or choose one of them")


def _pretrained(config: TrainConfig) -> None:
    if isinstance(config.model, str):
        if config.adapter is not None:
            raise UsageError("adapter adds LoRA factors to a pretrained model: set model = { hf = \"PATH\", task = "
                             "\"...\" }, or leave adapter out")
        return
    task = config.model["task"]
    loss = pretrained_spec.loss_of_task(task)
    if "loss" not in config.model_fields_set:
        _settle(config, loss=loss)
    elif config.loss != loss:
        raise UsageError(f"a pretrained model of task {task!r} trains on loss = \"{loss}\" (got {config.loss!r}): "
                         "leave loss out, or set it to that")


def _precision(config: TrainConfig) -> None:
    if config.precision == "fp32":
        return
    refused = [reason for reason, present in (
        ("microbatch_size", config.microbatch_size), ("shards", config.shards),
        ('privacy_unit = "user"', config.privacy_unit == "user"),
        ('aggregation = "collective"', config.aggregation == "collective")) if present]
    if refused:
        raise UsageError(f'precision = "{config.precision}" cannot be combined with {"; ".join(refused)}: change '
                         'those, or set precision = "fp32"')


def _augmentations(config: TrainConfig) -> None:
    if config.augmentations_per_example == 1:
        return
    if not config.train_transforms:
        raise UsageError(f"augmentations_per_example = {config.augmentations_per_example} needs train_transforms "
                         "to draw the views from; without them every view is the same example")
    if config.microbatch_size:
        raise UsageError("augmentations_per_example clips each example's mean gradient over its views; "
                         "it cannot be combined with microbatch_size")
    if config.privacy_unit == "user":
        raise UsageError("augmentations_per_example averages one example's views; with privacy_unit = \"user\" "
                         "a user's rows are combined instead: leave augmentations_per_example at 1")


def _layer_clipping(config: TrainConfig) -> None:
    if config.layer_clip_norms is not None and (config.microbatch_size or config.adaptive_clipping):
        raise UsageError("layer_clip_norms clips single examples with fixed norms; "
                         "it cannot be combined with microbatch_size or adaptive_clipping")


def collective_refusals(config: TrainConfig, planned: bool | None = None) -> list[str]:
    """What in `config` the collective path cannot run, each with its reason (empty: it runs the config).

    `planned`: whether the run reads planned batches; None, as far as the
    config alone says (plan_ahead_steps given, or Parquet shards).
    """
    if planned is None:
        planned = _planned_by_key(config) or bool(_parquet_shards(config))
    return [reason for reason, present in (
        ("planned batches (plan_ahead_steps, or Parquet shards, which are read only through them; they are the "
         "driver path's)", planned),
        ('on_shard_loss = "skip" (the group has a rank per shard worker; a run stops when one is lost and is '
         'resumed from its checkpoint)', bool(config.shards) and config.on_shard_loss == "skip"),
        ("secure_aggregation (the ranks reduce-scatter plain sums; masked silo sums go through the driver path)",
         config.secure_aggregation),
        (f'mechanism = "{config.mechanism}" (correlated noise is kept and added at the driver)',
         config.mechanism != "dp-sgd"))
        if present]


def _aggregation(config: TrainConfig) -> None:
    refused = collective_refusals(config) if config.aggregation == "collective" else []
    if refused:
        raise UsageError(f'aggregation = "collective" does not run {"; ".join(refused)}; use aggregation = '
                         '"driver" (or "auto"), or remove them')


def _parquet_shards(config: TrainConfig) -> list[int]:
    """The indices of the shards whose dataset is a Parquet table (a shard's other datasets are built-in names)."""
    return [index for index, shard in enumerate(config.shards) if isinstance(shard.dataset, Mapping)]


def _planned_by_key(config: TrainConfig) -> bool:
    """Whether plan_ahead_steps was given as a number of steps or "auto"."""
    return config.plan_ahead_steps not in (None, "off")


def planned_batches_refusals(config: TrainConfig) -> list[str]:
    """What in `config` keeps batches planned ahead from reading its training rows, one phrase each (empty: none).

    Planned batches read a Parquet table of examples, gathered for the driver
    path, or every shard's own Parquet files on its silo's node.
    """
    if config.shards:
        return [] if len(_parquet_shards(config)) == len(config.shards) else ["shards that are not Parquet tables"]
    spec = config.dataset
    parquet = isinstance(spec, Mapping) and spec.get("format") == "parquet"
    return [reason for reason, present in (
        ("a dataset that is not a Parquet table", not parquet),
        ("blocks that select rows of their files", parquet and bool(spec.get("train_parts"))),
        ('privacy_unit = "user"', config.privacy_unit == "user"),
        ('aggregation = "collective"', config.aggregation == "collective"),
        ('check_data = "lenient"', config.check_data == "lenient"),
        (f'mechanism = "{config.mechanism}"', config.mechanism != "dp-sgd")) if present]


def planned_batch_steps(config: TrainConfig) -> int | str | None:
    """How far ahead the run plans its batches (a number of steps or "auto"), or None: it reads rows one by one.

    plan_ahead_steps as given ("off" is None); left out, "auto" wherever
    planned batches can read the training rows (`planned_batches_refusals`),
    which Parquet shards always can. The driver path on a Ray of several
    nodes reads rows one by one unless the key is given
    (`orchestrator.planned_windows.run_planned_batches`).
    """
    if config.plan_ahead_steps is not None:
        return None if config.plan_ahead_steps == "off" else config.plan_ahead_steps
    return None if planned_batches_refusals(config) else "auto"


def _planned_batches(config: TrainConfig) -> None:
    parquet_shards = _parquet_shards(config)
    if parquet_shards:
        if len(parquet_shards) < len(config.shards):
            raise UsageError(f"shards[{parquet_shards[0]}] reads Parquet files, which a silo reads only through "
                             "batches planned ahead, and the others do not: give every shard a parquet dataset "
                             "(or the config's), or none")
        if config.plan_ahead_steps == "off":
            raise UsageError("a Parquet shard's silo reads its files only through batches planned ahead: leave "
                             "plan_ahead_steps out, or set it to \"auto\" or a number of steps")
        return
    if not _planned_by_key(config):
        return
    if config.shards:
        raise UsageError("with shards, plan_ahead_steps gathers each silo's own Parquet files: give every shard "
                         "a parquet dataset (or the config's), or leave plan_ahead_steps out")
    if not isinstance(config.dataset, Mapping) or config.dataset.get("format") != "parquet" \
            or config.dataset.get("train_parts"):
        raise UsageError("plan_ahead_steps gathers Parquet training files: give a parquet dataset without blocks, "
                         "or leave plan_ahead_steps out")
    if config.privacy_unit == "user":
        raise UsageError("plan_ahead_steps plans a sample of examples: it cannot be combined with "
                         "privacy_unit = \"user\"; leave plan_ahead_steps out")


def _secure_aggregation(config: TrainConfig) -> None:
    """Secure aggregation is a protocol among silos, each one shard with one worker; settle its threshold."""
    if not config.secure_aggregation:
        if config.mask_share_threshold is not None:
            raise UsageError("mask_share_threshold applies only with secure_aggregation = true; "
                             "set secure_aggregation = true or remove mask_share_threshold")
        if any(shard.identity or shard.identity_key_file for shard in config.shards):
            raise UsageError("a shard's `identity` and `identity_key_file` sign secure aggregation's round keys; "
                             "set secure_aggregation = true or remove them")
        return
    if len(config.shards) < 2:
        raise UsageError("secure_aggregation hides each silo's sum among the others' and so runs only in silo mode "
                         f"with two or more shards (got {len(config.shards)}); add shards or remove "
                         "secure_aggregation")
    several = [index for index, shard in enumerate(config.shards) if shard.workers != 1]
    if several:
        raise UsageError(f"with secure_aggregation each shard's one worker is its silo's party in the protocol; "
                         f"shards {several} have more: give each shard workers = 1")
    silos, threshold = len(config.shards), config.mask_share_threshold
    if threshold is None:
        _settle(config, mask_share_threshold=silos // 2 + 1)
    elif not silos < 2 * threshold <= 2 * silos:
        raise UsageError(f"mask_share_threshold must be a majority of the {silos} silos, in {silos // 2 + 1}.."
                         f"{silos} (got {threshold}): with fewer, the driver could rebuild both a silo's masking key "
                         f"and its self-mask from two sets of answers; set it to {silos // 2 + 1} or more (a step "
                         "then survives silos − threshold dropouts)")
    registered = [shard.identity is not None for shard in config.shards]
    if any(registered) and not all(registered):
        raise UsageError(f"shards {[index for index, known in enumerate(registered) if not known]} have no "
                         "`identity` while the others have one: give every shard its silo's Ed25519 public key, "
                         "or none")
    keyless = [index for index, shard in enumerate(config.shards)
               if (shard.identity is None) != (shard.identity_key_file is None)]
    if keyless:
        raise UsageError(f"shards {keyless} give only one of `identity` and `identity_key_file`: a silo signs with "
                         "the private key on its node and the others check the public one; give both or neither")
    for index, shard in enumerate(config.shards):
        if shard.identity is not None:
            try:
                silo_identity.parse_identity(shard.identity)
            except ValueError as error:
                raise UsageError(f"shard {index}: {error}") from None


def _noise_placement(config: TrainConfig) -> None:
    """Noise in the silos' shares needs secure aggregation and one fixed clip norm."""
    if config.noise_placement == "driver":
        return
    if not config.secure_aggregation:
        raise UsageError('noise_placement = "silos" adds the noise in shares that only secure aggregation keeps '
                         'apart: set secure_aggregation = true, or noise_placement = "driver"')
    refused = [name for name, present in (
        ("adaptive_clipping (the ring's scale is fixed by C at start)", config.adaptive_clipping is not None),
        ("microbatch_size", config.microbatch_size is not None),
        ("local_steps", config.local_steps is not None),
        ('privacy_unit = "user"', config.privacy_unit == "user"),
        (f'mechanism = "{config.mechanism}"', config.mechanism != "dp-sgd")) if present]
    if refused:
        raise UsageError('noise_placement = "silos" adds Skellam noise to each silo\'s rounded clipped sum of a '
                         f"Poisson sample; it cannot be combined with {', '.join(refused)}")

def _mechanism(config: TrainConfig) -> None:
    """The sampler matches the mechanism's accounting; correlated noise runs only what its driver path supports."""
    refusal = sampler_refusal(config.mechanism, config.sampler)
    if refusal:
        raise UsageError(refusal)
    if config.mechanism != "band-mf" and config.band_width != 1:
        raise UsageError(f'band_width applies to mechanism = "band-mf" (got mechanism = "{config.mechanism}"); '
                         "leave band_width out")
    if config.mechanism == "dp-sgd":
        return
    if config.shards and config.sampler != "fixed-order":
        raise UsageError(f'with shards, mechanism = "{config.mechanism}" runs fixed-order participation: each silo '
                         "takes its own examples in a fixed order, one slice a step, which no silo needs to sample "
                         f'fairly against the others (got sampler = "{config.sampler}"); set sampler = "fixed-order"')
    refused = [reason for reason, present in (
        ("microbatch_size", config.microbatch_size),
        ("adaptive_clipping", config.adaptive_clipping), ('privacy_unit = "user"', config.privacy_unit == "user"),
        ("max_examples_per_user", config.max_examples_per_user is not None),
        ("a noise_schedule other than constant", config.noise_schedule.kind != "constant"),
        ('aggregation = "collective"', config.aggregation == "collective"),
        ("plan_ahead_steps without shards", _planned_by_key(config) and not config.shards)) if present]
    if refused:
        raise UsageError(f'mechanism = "{config.mechanism}" correlates one noise vector per step at the driver, '
                         f"with one σ over the run; it cannot be combined with {', '.join(refused)}")


KEY_RULES: tuple[Callable[[TrainConfig], None], ...] = (
    _one_length, _one_noise, _shard_mode, _chosen_blocks, _privacy_unit, _people_not_features, _lenient_rows,
    _early_stopping, _pretrained, _precision, _augmentations,
    _layer_clipping, _aggregation, _planned_batches, _secure_aggregation, _noise_placement, _mechanism,
)
"""The rules between keys, in the order their errors are listed; each raises UsageError."""

KEYS = frozenset(TrainConfig.model_fields)
"""Every config key."""

GROUPS = tuple(section.title for section in SECTIONS)
"""The groups of config keys (one a section), in the order the references and ``dpfleet init`` list them."""
