"""Sharded training data: which examples a shard holds, and the one function that reads them on a worker.

A shard is a part of a data source that lives on one node (or silo) and never
leaves it. Its workers split it into contiguous ranges, one each, and read
only their own range.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from workers.data import load_split
from workers.sampling import part_bounds


@dataclass(frozen=True)
class ShardSpec:
    """One shard: contiguous part ``part`` of ``parts`` of ``dataset``'s training split.

    ``resources`` are the Ray custom resources its workers need (so they run
    only on the nodes that hold the data, e.g. ``{"silo-a": 1}``); ``workers``
    is how many gradient workers split the shard between them.
    """

    dataset: str
    part: int = 0
    parts: int = 1
    resources: Mapping[str, float] = field(default_factory=dict)
    workers: int = 1


def worker_bounds(source_size: int, shard: ShardSpec, worker_index: int) -> tuple[int, int]:
    """[start, stop) in the data source of worker ``worker_index``'s examples of ``shard``.

    The shard is part ``shard.part`` of the source; its workers tile it in
    contiguous ranges, so every example of the shard is in exactly one worker.
    """
    shard_start, shard_stop = part_bounds(source_size, shard.part, shard.parts)
    start, stop = part_bounds(shard_stop - shard_start, worker_index, shard.workers)
    return shard_start + start, shard_start + stop


def load_shard_examples(
    shard: ShardSpec, worker_index: int, data_root: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, labels) of worker ``worker_index``'s range of ``shard``, read from this node's storage.

    Every read of a shard's training data goes through here, so changing
    where shards come from is a change to this function alone.
    """
    images, labels = load_split(shard.dataset, "train", data_root)
    start, stop = worker_bounds(len(labels), shard, worker_index)
    # clone() so the rest of the split can be freed.
    return images[start:stop].clone(), labels[start:stop].clone()
