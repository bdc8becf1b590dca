"""`dpfleet data`: write datasets into the file formats training reads, and check a config's data by its rules.

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
    check = commands.add_parser(
        "check",
        help="list the rows of a config's data that break the rules a run checks (for the data's owner: NOT private)",
        description="Reads every row of the config's training and test data (with shards, each shard's table) on "
                    "this machine and checks the rules dpfleet train checks before a run: the files' schema, "
                    "examples of one size, no null, finite features, integer labels in 0..num_classes-1 (the "
                    "dataset's num_classes, else the model's output width). For each file, column and rule it "
                    "prints how many rows break it and the first ones with their values. It reads private rows "
                    "and prints them: run it as the data's owner, on the data's machine; it reserves no budget "
                    "and trains nothing. Exit status 0 when every row keeps the rules, 1 when some row breaks one "
                    "(or a file cannot be read), 2 on a bad config or flag.",
    )
    check.add_argument("--config", required=True, help="TOML file of the run whose data to check")
    check.add_argument("--split", choices=("train", "test"), help="check this split only (default: both)")
    check.add_argument("--shard", help="with shards: check this shard's table only (its index in the config)")
    check.add_argument("--rows", default=20, help="rows listed per file, column and rule (default 20)")
    check.set_defaults(handler="orchestrator.cli.data:run_check")
