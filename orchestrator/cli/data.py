"""`dpfleet data`: write datasets into the file formats training reads."""

from __future__ import annotations

import argparse
import os

from orchestrator import checks
from orchestrator.errors import UsageError
from workers.data import DATASETS, load_split
from workers.sources import SPLITS, write_parquet_shards

EXPORT_FORMATS = ("parquet",)
COMPRESSIONS = ("none", "snappy", "zstd")
_EXPORT_BATCH = 10_000


def add_data_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `data` (with `data export`) on the top-level subcommands."""
    data = subparsers.add_parser("data", help="write datasets into the file formats training reads")
    commands = data.add_subparsers(dest="data_command", required=True, parser_class=type(data))
    export = commands.add_parser(
        "export",
        help="write a built-in dataset's train and test splits as Parquet shards",
        description="Writes DIR/train/part-*.parquet and DIR/test/part-*.parquet: a fixed-size list column "
                    "'features' (float32 pixels/255, flattened) and an int64 column 'label'.",
    )
    export.add_argument("name", choices=sorted(DATASETS), help="built-in dataset")
    export.add_argument("directory", metavar="DIR", help="where to write (a local path or a filesystem URL)")
    export.add_argument("--format", default="parquet", choices=EXPORT_FORMATS, help="file format")
    export.add_argument("--shards", default=4, help="files per split (default 4)")
    export.add_argument("--compression", default="none", choices=COMPRESSIONS,
                        help="Parquet codec: none reads fastest, zstd is about 10x smaller for MNIST (default none)")
    export.add_argument("--data-root", help="the built-in datasets' cache (default: DPFLEET_DATA or ~/.cache/dpfleet)")
    export.set_defaults(handler=run_export)


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
