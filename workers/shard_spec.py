"""What a shard is, declared once: its dataset, its part of it, the nodes that hold it and its workers.

Torch-free, so that the config checks, documents and writes the JSON Schema
of its ``shards`` tables from this declaration without loading torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import ConfigDict, Field
from pydantic.dataclasses import dataclass


def _dataset_may_be_left_out(schema: dict[str, Any]) -> None:
    # A shard without a dataset reads the config's: the table may leave out the one key the record needs.
    schema.pop("required", None)


@dataclass(frozen=True, config=ConfigDict(extra="forbid", allow_inf_nan=False,
                                          json_schema_extra=_dataset_may_be_left_out))
class ShardSpec:
    """One shard: contiguous part ``part`` of ``parts`` of ``dataset``'s training split.

    ``resources`` are the Ray custom resources its workers need (so they run
    only on the nodes that hold the data, e.g. ``{"silo-a": 1}``); ``workers``
    is how many gradient workers split the shard between them.
    """

    dataset: str | dict = Field(description="The built-in dataset the shard is a part of, or a Parquet table read "
                                            "through `plan_ahead_steps` (default: the config's `dataset`).")
    part: int = Field(0, ge=0, description="Which part of the training split, from 0 to `parts` - 1.")
    parts: int = Field(1, ge=1, description="How many equal, contiguous parts the training split is cut into.")
    resources: Mapping[str, Annotated[float, Field(gt=0)]] = Field(
        default_factory=dict, description="The Ray custom resources its workers need, e.g. `{ \"silo-a\" = 1 }`.")
    workers: int = Field(1, ge=1, description="How many gradient workers split the shard between them.")
    identity: str | None = Field(None, description="With secure_aggregation: the silo's long-term Ed25519 public "
                                 "key, 64 hex digits or a file holding them (every shard has one, or none does).")
    identity_key_file: str | None = Field(None, description="The path, on the silo's node, of its Ed25519 private "
                                          "key (PEM or raw 32 bytes); only the silo's worker reads it.")
