"""What `dpfleet data ...` does (its parser is in ``orchestrator.cli.data_parser``): reading a dataset loads torch."""

from __future__ import annotations

import argparse
import os
from collections import defaultdict

from orchestrator import checks, release
from orchestrator.config import load_config
from orchestrator.errors import UsageError
from orchestrator.preflight import build_checked_model, dry_run, label_classes
from workers.data import load_split
from workers.pretrained import load_tokenizer
from workers.pretrained_spec import PAD_INPUT, check_folder
from workers.sources import PARQUET_SUFFIXES, SPLITS, DataError, RuleBreach, check_source, spec_name, \
    write_parquet_shards
from workers.text import read_text_table, token_table, write_token_table

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


def run_tokenize(args: argparse.Namespace) -> int:
    """Tokenize raw text into a Parquet file of token ids and labels that a pretrained model trains on; print the
    output's path, its number of examples and the dataset table that reads it.

    For the data's owner, on the machine that holds the text: besides the
    number of examples it prints only how many were cut to --max-length
    and the numbers given to text labels, never a row.
    """
    max_length = checks.integer_at_least("--max-length", args.max_length, 1)
    output = os.path.abspath(args.output)
    if not output.endswith(PARQUET_SUFFIXES):
        raise UsageError(f"OUTPUT must be a Parquet file ending in {' or '.join(PARQUET_SUFFIXES)} (got {args.output!r})")
    if output == os.path.abspath(args.input):
        raise UsageError("OUTPUT is INPUT: write the token ids to another file")
    try:
        check_folder(args.model)
        tokenizer = load_tokenizer(args.model)
        tokenized = token_table(read_text_table(args.input, args.split, args.text_column), tokenizer, args.task,
                                max_length, args.text_column, args.label_column)
    except ValueError as error:
        raise UsageError(str(error)) from None
    write_token_table(tokenized.table, output)
    examples = tokenized.table.num_rows
    labels = {"sequence-classification": "label, a class per example",
              "token-classification": f"label, a class per token ({max_length}, -100 where a token does not count)",
              "causal-lm": f"label, the next token ({max_length}, -100 at the last position and at padding)"}
    print(release.line("tokenize_written", path=output, examples=examples, task=args.task, max_length=max_length,
                       pad=PAD_INPUT, labels=labels[args.task]))
    # The data's owner runs this command, on the data's machine: the counts and label names are theirs to see.
    if tokenized.truncated:
        print(release.line("tokenize_truncated", shown=True, truncated=tokenized.truncated, examples=examples,
                           max_length=max_length))
    if tokenized.label_names is not None:
        names = ", ".join(f"{index} = {name!r}" for index, name in enumerate(tokenized.label_names))
        print(release.line("tokenize_label_names", shown=True, names=names, count=len(tokenized.label_names)))
    test = "TEST.parquet"
    print(release.line("tokenize_dataset", table=f'format = "parquet", train = "{output}", test = "{test}", '
                                                 'features = "input_ids", label = "label"', test=test))
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
