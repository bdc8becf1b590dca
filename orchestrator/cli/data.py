"""What `dpfleet data ...` does (its parser is in ``orchestrator.cli.data_parser``): reading a dataset loads torch."""

from __future__ import annotations

import argparse
import os
from collections import defaultdict

from orchestrator import checks
from orchestrator.config import load_config
from orchestrator.errors import UsageError
from orchestrator.preflight import build_checked_model, dry_run, label_classes
from workers.data import load_split
from workers.sources import SPLITS, DataError, RuleBreach, check_source, spec_name, write_parquet_shards

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


def run_check(args: argparse.Namespace) -> int:
    """Check every row of a config's data against the rules a run checks; print each rule's rows, count and values.

    For the data's owner, on the machine that holds the data: what it prints
    comes from private rows. It reserves nothing and starts no worker. Exit
    status 1 when a row breaks a rule or a file is unreadable, 0 when none.
    """
    most = checks.integer_at_least("--rows", args.rows, 1)
    try:
        config = load_config(args.config, {})
    except UsageError as error:
        raise UsageError(error.with_values) from None  # the owner's own command: the rows may be named
    tables = _checked_tables(config, args.shard)
    print("dpfleet data check prints rows of the data, how many break each rule and their values: NOT private, for "
          "the data's owner. It reserves no budget and trains nothing.")
    model = build_checked_model(config)
    width = dry_run(config, model, print)
    failed = False
    for name, spec in tables:
        spec = {key: value for key, value in spec.items() if key != "drop_invalid_rows"}
        try:
            classes = label_classes(spec, config.loss, model, width)
        except DataError as error:
            print(f"{name}: {error.with_values}")
            failed = True
            continue
        for split in [args.split] if args.split else SPLITS:
            failed |= _check_split(name, spec, split, classes, most)
    return 1 if failed else 0


def _checked_tables(config, shard: int | None) -> list[tuple[str, dict]]:
    """(name, table) of each dataset the config trains on that is a table: its dataset, or with shards each
    shard's (only shard `shard` when given). The built-ins are verified by digest when they load."""
    if not config.shards:
        if shard is not None:
            raise UsageError("--shard picks one of the config's shards, and the config has none; leave it out")
        found = [("dataset", config.dataset)]
    else:
        indices = range(len(config.shards)) if shard is None else [
            checks.integer_in_range("--shard", shard, 0, len(config.shards) - 1)]
        found = [(f"shard {index}", config.shards[index].dataset) for index in indices]
    tables = [(name, spec) for name, spec in found if isinstance(spec, dict)]
    if not tables:
        raise UsageError(f"the config trains on {', '.join(spec_name(spec) for _, spec in found)}, which is not a "
                         "table of files (a built-in dataset is verified by its digest when it loads); there is "
                         "nothing to check")
    return tables


def _check_split(name: str, spec: dict, split: str, num_classes: int | None, most: int) -> bool:
    """Print how many rows of one split break a rule and, per file, column and rule, their count and the first
    `most` rows with their values; True when some row breaks one (or a file is unreadable)."""
    breaches: dict[tuple[str, str, str], list[RuleBreach]] = defaultdict(list)
    try:
        rows = check_source(spec, split, True, num_classes,
                            lambda breach: breaches[(breach.path, breach.column, breach.rule)].append(breach))
    except DataError as error:
        print(f"{name} {split}: {error.with_values}")
        return True
    broken = {(path, int(row)) for (path, _, _), found in breaches.items() for breach in found for row in breach.rows}
    print(f"{name} {split}: {len(broken)} of {rows} rows break a rule")
    for (path, column, rule), found in breaches.items():
        count = sum(len(breach.rows) for breach in found)
        listed = [f"row {row} ({breach.value(position)})" for breach in found
                  for position, row in enumerate(breach.rows[:most])][:most]
        print(f"  {path}: column {column!r}: {rule}: {count} row(s): {', '.join(listed)}"
              f"{', ...' if count > most else ''}; {found[0].fix}")
    return bool(broken)
