"""The `shards`, `on_shard_loss` and `shard_timeout` config keys: parsing and what shard mode refuses."""

from __future__ import annotations

from collections.abc import Mapping
from fractions import Fraction
from typing import Any

from accounting.lazy import LazyModule
from orchestrator import checks
from orchestrator.errors import UsageError

# workers.shards loads torch; the config keys are documented without it (see accounting.lazy).
worker_shards = LazyModule("workers.shards")

SHARD_LOSS_POLICIES = ("wait", "skip")
DEFAULT_ON_SHARD_LOSS = "wait"
DEFAULT_SHARD_TIMEOUT = 300.0
_SHARD_KEYS = {"dataset", "part", "parts", "resources", "workers"}
_EXAMPLE = '[{ dataset = "mnist", part = 0, parts = 3, resources = { "silo-a" = 1 }, workers = 1 }, ...]'


def parse_shards(value: Any, datasets: tuple[str, ...], default_dataset: Any) -> tuple[worker_shards.ShardSpec, ...]:
    """The `shards` list as ShardSpecs; none means the unsharded, driver-sampled run.

    Refuses two shards that would hold the same example: it would be sampled
    at twice the rate q that the accountant assumes.
    """
    if value is None or value == []:
        return ()
    if not isinstance(value, (list, tuple)) or not all(isinstance(table, Mapping) for table in value):
        raise UsageError(f"shards must be a list of tables, e.g. {_EXAMPLE} (got {value!r})")
    shards = tuple(_shard(index, table, datasets, default_dataset) for index, table in enumerate(value))
    for first in range(len(shards)):
        for second in range(first + 1, len(shards)):
            a, b = shards[first], shards[second]
            if a.dataset == b.dataset and (Fraction(a.part, a.parts) < Fraction(b.part + 1, b.parts)
                                           and Fraction(b.part, b.parts) < Fraction(a.part + 1, a.parts)):
                raise UsageError(
                    f"shards {first} and {second} overlap in {a.dataset!r} (part {a.part} of {a.parts} and part "
                    f"{b.part} of {b.parts}); an example in two shards would be sampled at twice the rate q the "
                    "accountant assumes: give each shard its own parts"
                )
    return shards


def _shard(index: int, table: Mapping, datasets: tuple[str, ...], default_dataset: Any) -> worker_shards.ShardSpec:
    unknown = set(table) - _SHARD_KEYS
    if unknown:
        raise UsageError(f"shards[{index}] has unknown key(s) {', '.join(sorted(unknown))}; "
                         f"valid keys: {', '.join(sorted(_SHARD_KEYS))}")
    dataset = checks.one_of(f"shards[{index}].dataset", table.get("dataset", default_dataset), datasets)
    parts = checks.integer_at_least(f"shards[{index}].parts", table.get("parts", 1), 1)
    part = checks.integer_at_least(f"shards[{index}].part", table.get("part", 0), 0)
    if part >= parts:
        raise UsageError(f"shards[{index}].part must be in 0..{parts - 1} for parts = {parts} (got {part})")
    resources = table.get("resources", {})
    if not isinstance(resources, Mapping):
        raise UsageError(f'shards[{index}].resources must be a table of Ray custom resources, e.g. {{ "silo-a" = 1 }} '
                         f"(got {resources!r})")
    resources = {str(name): checks.positive_number(f"shards[{index}].resources.{name}", amount)
                 for name, amount in resources.items()}
    workers = checks.integer_at_least(f"shards[{index}].workers", table.get("workers", 1), 1)
    return worker_shards.ShardSpec(dataset, part, parts, resources, workers)


def check_shard_mode(values: Mapping[str, Any], shards: tuple[worker_shards.ShardSpec, ...]) -> int | None:
    """Refuse what shard mode cannot do; return the run's worker count with shards (None without).

    Microbatches and adaptive clipping need the whole step's sample in one
    place (the driver assigns microbatches; the unclipped count is divided by
    the realised batch), and with shards no one sees it.
    """
    if not shards:
        for key, default in (("on_shard_loss", DEFAULT_ON_SHARD_LOSS), ("shard_timeout", DEFAULT_SHARD_TIMEOUT)):
            if values.get(key, default) != default:
                raise UsageError(f"{key} applies only to a config with shards; add shards or remove {key}")
        return None
    for key, reason in (
        ("microbatch_size", "the driver assigns each sampled example its microbatch"),
        ("adaptive_clipping", "it needs the step's realised batch in one place"),
        ("train_subset", "each shard's part sets its examples"),
    ):
        if values.get(key) not in (None, False):
            raise UsageError(f"{key} cannot be combined with shards ({reason}, and with shards the examples are "
                             f"sampled on their own nodes); remove {key} or shards")
    workers = sum(shard.workers for shard in shards)
    if values.get("workers") is not None and values["workers"] != workers:
        raise UsageError(f"with shards, each shard's workers set the run's workers ({workers} in all; got "
                         f"workers = {values['workers']!r}); remove workers or make it {workers}")
    return workers


def parse_on_shard_loss(value: Any) -> str:
    """What a step does when a shard's worker is lost: "wait" for it to be placed again, or "skip" the shard."""
    return checks.one_of("on_shard_loss", value, SHARD_LOSS_POLICIES)
