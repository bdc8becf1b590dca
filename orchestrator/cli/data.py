"""What `dpfleet data ...` does (its parser is in ``orchestrator.cli.data_parser``): reading a dataset loads torch."""

from __future__ import annotations

import argparse
import os

from orchestrator import checks
from orchestrator.errors import UsageError
from workers.data import load_split
from workers.sources import SPLITS, write_parquet_shards

_EXPORT_BATCH = 10_000


def run_export(args: argparse.Namespace) -> int:
    """Export both splits, then print the `dataset` table that trains on them."""
    shards = checks.integer_at_least("--shards", args.shards, 1)
    directory = args.directory if "://" in args.directory else os.path.abspath(args.directory)
    shape = None
    for split in SPLITS:
        inputs, labels = load_split(args.name, split, args.data_root)
        if shards > len(labels):
            raise UsageError(f"--shards must be at most {len(labels)}, the {split} split's size (got {shards})")
        shape = list(inputs.shape[1:])
        features, labels = inputs.numpy(), labels.numpy()
        batches = ((features[start:start + _EXPORT_BATCH], labels[start:start + _EXPORT_BATCH])
                   for start in range(0, len(labels), _EXPORT_BATCH))
        paths = write_parquet_shards(f"{directory}/{split}", batches, len(labels), shards, args.compression)
        print(f"{args.name} {split}: {len(labels)} examples in {len(paths)} files under {directory}/{split}")
    print("train on them with:")
    print(f'[dataset]\nformat = "parquet"\ntrain = "{directory}/train"\ntest = "{directory}/test"\n'
          f'features = "features"\nlabel = "label"\nshape = {shape}\nname = "{args.name}"')
    return 0
