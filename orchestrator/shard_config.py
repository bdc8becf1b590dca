"""The `shards`, `on_shard_loss` and `shard_timeout` config keys: parsing and what shard mode refuses."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from fractions import Fraction
from typing import Any

from orchestrator import checks
from orchestrator.errors import UsageError
from workers import ShardSpec

SHARD_LOSS_POLICIES = ("wait", "skip")
DEFAULT_ON_SHARD_LOSS = "wait"
DEFAULT_SHARD_TIMEOUT = 300.0
_EXAMPLE = '[{ dataset = "mnist", part = 0, parts = 3, resources = { "silo-a" = 1 }, workers = 1 }, ...]'


def shard_tables(value: Any, datasets: tuple[str, ...], default_dataset: Any) -> list:
    """The `shards` list as tables for ShardSpec to check, each with its dataset (by default the config's).

    Refuses what is not a list of tables, keys a shard does not declare, and
    datasets other than ``datasets`` or a Parquet table (the config parses
    a table with `parse_spec`); ShardSpec checks the rest.
    """
    if value is None or value == [] or value == ():
        return []
    if isinstance(value, tuple):
        value = list(value)
    if not isinstance(value, list) or not all(isinstance(table, (Mapping, ShardSpec)) for table in value):
        raise UsageError(f"shards must be a list of tables, e.g. {_EXAMPLE} (got {value!r})")
    keys = list(ShardSpec.__pydantic_fields__)
    tables = []
    for index, table in enumerate(value):
        if isinstance(table, ShardSpec):
            table = dataclasses.asdict(table)
        unknown = set(table) - set(keys)
        if unknown:
            raise UsageError(f"shards[{index}] has unknown key(s) {checks.unknown_names(unknown, keys)}; "
                             f"valid keys: {', '.join(sorted(keys))}")
        dataset = table.get("dataset", default_dataset)
        if isinstance(dataset, Mapping) and dataset.get("format") == "parquet" and not dataset.get("train_parts"):
            # Its silo's own Parquet files, gathered on its node by batches planned ahead (plan_ahead_steps).
            dataset = dict(dataset)
        else:
            dataset = checks.one_of(f"shards[{index}].dataset", dataset, datasets)
        tables.append({**table, "dataset": dataset})
    return tables


def check_shards(shards: tuple[ShardSpec, ...]) -> tuple[ShardSpec, ...]:
    """Refuse a part outside its parts, and two shards that would hold the same example.

    An example in two shards would be sampled at twice the rate q that the
    accountant assumes.
    """
    for index, shard in enumerate(shards):
        if shard.part >= shard.parts:
            raise UsageError(f"shards[{index}].part must be in 0..{shard.parts - 1} for parts = {shard.parts} "
                             f"(got {shard.part})")
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


def check_shard_mode(values: Mapping[str, Any], shards: tuple[ShardSpec, ...]) -> int | None:
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
