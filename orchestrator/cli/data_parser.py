"""`dpfleet data`: write datasets into the file formats training reads (built-in datasets, tokenized text), and check
a config's data by its rules.

This is the parser only: it loads none of the data modules (torch,
torchvision), which `orchestrator.cli.data` loads when a command runs.
"""

from __future__ import annotations

import argparse

from workers.pretrained_spec import TASKS

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
    tokenize = commands.add_parser(
        "tokenize",
        help="turn raw text into token-id Parquet with a model folder's tokenizer (for the data's owner)",
        description="Reads INPUT (a .txt file of one example per line, a .jsonl, .csv or .parquet file, or a folder "
                    "that datasets' save_to_disk wrote) and writes OUTPUT, a Parquet file that model = { hf, task } "
                    "trains on with features = \"input_ids\": input_ids, each example's token ids (the model "
                    "folder's tokenizer, special tokens included) cut to --max-length and padded with -1, and label: "
                    "the class of each example (sequence-classification; text labels are numbered in sorted order), "
                    "one class per token (token-classification: the text is a list of words, or words split on "
                    "white space, with one label per word; a word's first token takes its label, its other tokens "
                    "-100), or the next token (causal-lm, -100 at the last position and at padding). An id or "
                    "user_id column is kept. It reads private text and prints counts, the output's path and, for "
                    "text labels, their numbers: never a row. Exit status 0 when written, 2 on a bad input or flag.",
    )
    tokenize.add_argument("input", metavar="INPUT", help="a .txt, .jsonl, .csv or .parquet file, or a datasets folder")
    tokenize.add_argument("output", metavar="OUTPUT", help="the Parquet file to write")
    tokenize.add_argument("--model", required=True, help="the model folder (model.hf) whose tokenizer to use")
    tokenize.add_argument("--task", required=True, choices=tuple(TASKS), help="the task the model trains on")
    tokenize.add_argument("--text-column", default="text",
                          help="the column of text (of lists of words for token-classification; default text)")
    tokenize.add_argument("--label-column", default="label",
                          help="the column of labels for a classification task (default label)")
    tokenize.add_argument("--max-length", default=128, help="tokens per example: longer ones are cut (default 128)")
    tokenize.add_argument("--split", default="train", help="the split of a datasets folder of several (default train)")
    tokenize.set_defaults(handler="orchestrator.cli.data:run_tokenize")
