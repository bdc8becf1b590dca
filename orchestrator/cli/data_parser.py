"""`dpfleet data`: write datasets into the file formats training reads.

This is the parser only: it loads none of the data modules (torch,
torchvision), which `orchestrator.cli.data` loads when a command runs.
"""

from __future__ import annotations

import argparse

# The names of workers.data.DATASETS, which imports torchvision to define them; a test keeps the two equal.
BUILTIN_DATASETS = ("fashion-mnist", "mnist")
EXPORT_FORMATS = ("parquet",)
COMPRESSIONS = ("none", "snappy", "zstd")


def add_data_arguments(data: argparse.ArgumentParser) -> None:
    """The `data` commands and their arguments."""
    commands = data.add_subparsers(dest="data_command", required=True, parser_class=type(data))
    export = commands.add_parser(
        "export",
        help="write a built-in dataset's train and test splits as Parquet shards",
        description="Writes DIR/train/part-*.parquet and DIR/test/part-*.parquet: a fixed-size list column "
                    "'features' (float32 pixels/255, flattened) and an int64 column 'label'.",
    )
    export.add_argument("name", choices=BUILTIN_DATASETS, help="built-in dataset")
    export.add_argument("directory", metavar="DIR", help="where to write (a local path or a filesystem URL)")
    export.add_argument("--format", default="parquet", choices=EXPORT_FORMATS, help="file format")
    export.add_argument("--shards", default=4, help="files per split (default 4)")
    export.add_argument("--compression", default="none", choices=COMPRESSIONS,
                        help="Parquet codec: none reads fastest, zstd is about 10x smaller for MNIST (default none)")
    export.add_argument("--data-root", help="the built-in datasets' cache (default: DPFLEET_DATA or ~/.cache/dpfleet)")
    export.set_defaults(handler="orchestrator.cli.data:run_export")
