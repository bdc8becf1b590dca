"""Sharded training data: which examples a shard holds, and the one function that reads them on a worker.

A shard is a part of a data source that lives on one node (or silo) and never
leaves it. Its workers split it into contiguous ranges, one each, and read
only their own range.
"""

from __future__ import annotations

import torch

from workers.data import load_split
from workers.sampling import part_bounds
from workers.shard_spec import ShardSpec


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
