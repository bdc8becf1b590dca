"""What binds a checkpoint to its run, so that a resume continues that run and no other.

A checkpoint records the run's binding: the config keys that change what is
sampled, trained or accounted (data, model and task, run length, privacy,
optimizer, shards, privacy unit, and the ledger keys that decide what is
charged), the training data's identity (``workers.fingerprints``; with
shards, each silo's, taken on the silo's node) with N, and the ledger
reservation charged. A resume recomputes it and is refused,
naming every difference, when it is not the same. Keys that only say where
or how fast the run goes (workers, engine, the ledger's address, timeouts,
the run directory) may change between a run and its resume.
"""

from __future__ import annotations

import json
from typing import Any

from orchestrator.config import TrainConfig

# The config keys a resume may change: they move the work around, never what is sampled, trained or charged.
UNBOUND_KEYS = frozenset({
    "workers", "cpus_per_worker", "gpus_per_worker", "max_physical_batch", "engine",
    "run_dir", "checkpoint_every", "data_root", "check_data",
    "ledger", "ledger_timeout", "ledger_lease", "dataset_budget_epsilon", "dataset_plan_share",
    "on_shard_loss", "shard_timeout",
    "early_stopping_patience", "early_stopping_metric", "early_stopping_min_delta",
})


def bound_config(config: TrainConfig) -> dict[str, Any]:
    """The config's keys that a resume must keep, as JSON values."""
    return json.loads(json.dumps({key: value for key, value in config.to_dict().items() if key not in UNBOUND_KEYS},
                                 sort_keys=True))


def run_binding(config: dict[str, Any], dataset: dict[str, Any], units: int, reservation: dict | None) -> dict:
    """A run's binding: its bound config keys, its data's identity with N (`units`), and its reservation.

    `reservation` is the ledger's {"id", "dataset"} once the run has one, else None.
    """
    return {"config": config, "dataset": {**dataset, "units": units}, "reservation": reservation}


def _shown(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def _differences(what: str, before: dict, now: dict) -> list[str]:
    """One phrase per key whose value differs; a table under a key in both (a silo's identity) is compared key by
    key, so that the phrase names the silo and what of its data changed."""
    differences = []
    for key in sorted(set(before) | set(now)):
        old, new = before.get(key), now.get(key)
        if isinstance(old, dict) and isinstance(new, dict):
            differences.extend(_differences(f"{what} {key}", old, new))
        elif old != new:
            differences.append(f"{what} {key}: {_shown(old)} in the checkpoint, {_shown(new)} now")
    return differences


def binding_differences(recorded: dict, current: dict) -> list[str]:
    """Each difference between a checkpoint's binding and the run's now, one phrase each (empty when none)."""
    differences = []
    for part, what in (("config", "config key"), ("dataset", "dataset")):
        differences.extend(_differences(what, recorded.get(part, {}), current.get(part, {})))
    before, now = recorded.get("reservation"), current.get("reservation")
    if before is not None and now is not None and before != now:
        differences.append(f"ledger reservation: {_shown(before)} in the checkpoint, {_shown(now)} now")
    return differences
