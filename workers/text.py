"""Raw text into the token-id tables a pretrained model trains on (``dpfleet data tokenize``).

A table of text (``read_text_table``: one example per line of a .txt file,
a .jsonl, .csv or .parquet file, or a folder that ``datasets``'
``save_to_disk`` wrote) becomes, through the model folder's tokenizer
(``token_table``), a table that ``workers.sources`` reads with
``features = "input_ids"``: ``input_ids``, each example's token ids cut to
``max_length`` and padded with PAD_INPUT, and ``label``, as the task takes
it:

- ``sequence-classification``: one class per example, from the label
  column; text labels are numbered in sorted order;
- ``token-classification``: one class per token: the text is a list of
  words (or words split on white space), the label column one label per
  word; a word's first token takes its label, its other tokens and the
  special tokens IGNORED_LABEL;
- ``causal-lm``: the next token at each position (``next_token_labels``).

An ``id`` or ``user_id`` column is kept as it is, so that predictions name
their rows and ``privacy_unit = "user"`` finds each row's person. What
comes back besides the table is counts and the label names: never a row.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.json as pa_json
import pyarrow.parquet as pq
import torch

from workers.pretrained import next_token_labels
from workers.pretrained_spec import IGNORED_LABEL, PAD_INPUT, TASKS
from workers.sources import PARQUET_ROW_GROUP_ROWS, PARQUET_SUFFIXES

TEXT_SUFFIXES = (".txt", ".jsonl", ".csv", *PARQUET_SUFFIXES)
KEPT_COLUMNS = ("id", "user_id")
"""Columns copied from the text table as they are: a row's name and its person."""


@dataclass(frozen=True)
class TokenTable:
    """A tokenized table and what is known of it without its rows.

    ``table`` holds ``input_ids`` (fixed-size lists of ``max_length``
    int64), ``label`` and the KEPT_COLUMNS the text had; ``truncated``
    counts the examples cut to ``max_length``; ``label_names`` are text
    labels in the order of their numbers (None where labels were numbers
    or the task has none).
    """

    table: pa.Table
    truncated: int
    label_names: tuple[str, ...] | None


# --- reading ----------------------------------------------------------------------


def read_text_table(path: str, split: str = "train", text_column: str = "text") -> pa.Table:
    """The examples at ``path`` as a table: a .txt file's non-blank lines as ``text_column``, a .jsonl, .csv or
    Parquet file's columns, or the ``split`` of a folder that ``datasets``' ``save_to_disk`` wrote (a Dataset, or
    a DatasetDict of splits). Raises ValueError naming what is wrong with the input."""
    if os.path.isdir(path):
        return _saved_dataset(path, split)
    if not os.path.isfile(path):
        raise ValueError(f"{path}: no such file or folder")
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in TEXT_SUFFIXES:
        raise ValueError(f"{path}: give a {', '.join(TEXT_SUFFIXES)} file, or a folder that datasets' save_to_disk "
                         "wrote")
    try:
        if suffix == ".txt":
            with open(path, encoding="utf-8") as handle:
                return pa.table({text_column: [line.rstrip("\r\n") for line in handle if line.strip()]})
        if suffix == ".jsonl":
            return pa_json.read_json(path)
        if suffix == ".csv":
            return pa_csv.read_csv(path)
        return pq.read_table(path)
    except (pa.ArrowInvalid, UnicodeDecodeError) as error:
        # The reader's message may quote a row: only where the file breaks its format is named.
        raise ValueError(f"{path}: not readable as {suffix[1:]} ({type(error).__name__}); check the file's "
                         "format") from None


def _saved_dataset(path: str, split: str) -> pa.Table:
    try:
        import datasets
    except ModuleNotFoundError as error:
        raise ValueError("reading a datasets folder needs datasets: pip install 'dpfleet[hf]'") from error
    datasets.disable_progress_bars()
    try:
        saved = datasets.load_from_disk(path)
    except FileNotFoundError:
        raise ValueError(f"{path}: a folder, but not one that datasets' save_to_disk wrote; give that folder or "
                         f"a {', '.join(TEXT_SUFFIXES)} file") from None
    if isinstance(saved, datasets.DatasetDict):
        if split not in saved:
            raise ValueError(f"{path} holds the splits {', '.join(saved)}; choose one with --split (got {split!r})")
        saved = saved[split]
    return saved.with_format("arrow")[:]


# --- tokenizing -------------------------------------------------------------------


def token_table(table: pa.Table, tokenizer, task: str, max_length: int, text_column: str = "text",
                label_column: str = "label") -> TokenTable:
    """``table``'s examples tokenized by ``tokenizer`` for ``task`` (one of TASKS), each cut to ``max_length``
    tokens (its special tokens kept) and padded. Raises ValueError naming the column and the rule an input
    breaks, with how many examples break it, never which."""
    if task not in TASKS:
        raise ValueError(f"the task must be one of {', '.join(TASKS)} (got {task!r})")
    if not table.num_rows:
        raise ValueError("the input holds no examples")
    words = task == "token-classification"
    if words and not tokenizer.is_fast:
        raise ValueError("token-classification aligns each word's label with its tokens, which needs a fast "
                         "tokenizer: save the model folder's tokenizer with tokenizer.json (a PreTrainedTokenizerFast)")
    texts = _texts(table, text_column, words)
    ids, word_ids, truncated = _encodings(tokenizer, texts, words, max_length)
    padded = np.full((len(ids), max_length), PAD_INPUT, dtype=np.int64)
    for row, tokens in enumerate(ids):
        padded[row, :len(tokens)] = tokens
    label_names = None
    if task == "causal-lm":
        labels = _fixed_lists(next_token_labels(torch.from_numpy(padded)).numpy())
    else:
        values, label_names = _label_values(table, label_column, words)
        labels = pa.array(values, pa.int64()) if not words else _fixed_lists(_token_labels(values, word_ids, texts,
                                                                                           max_length))
    columns = {"input_ids": _fixed_lists(padded), "label": labels}
    columns.update({name: table.column(name) for name in KEPT_COLUMNS if name in table.column_names})
    return TokenTable(pa.table(columns), truncated, label_names)


def _texts(table: pa.Table, column: str, words: bool) -> list:
    """The text of each example: a string, or for a task of words, a list of words (a string split on white space)."""
    if column not in table.column_names:
        raise ValueError(f"no text column {column!r} (columns: {', '.join(table.column_names)}); name it with "
                         "--text-column")
    kind = table.schema.field(column).type
    listed = pa.types.is_list(kind) or pa.types.is_large_list(kind)
    textual = pa.types.is_string(kind) or pa.types.is_large_string(kind)
    if not (textual or (words and listed and pa.types.is_string(kind.value_type))):
        held = "text, or a list of words" if words else "text"
        raise ValueError(f"column {column!r} has type {kind}; it must hold {held}")
    values = table.column(column).to_pylist()
    missing = sum(value is None or (listed and None in value) for value in values)
    if missing:
        raise ValueError(f"column {column!r}: {missing} example(s) have no text (null); fill or drop them")
    return [value.split() if words and not listed else value for value in values]


def _encodings(tokenizer, texts: list, words: bool, max_length: int) \
        -> tuple[list[list[int]], list[list[int | None]] | None, int]:
    """Each text's token ids, cut to ``max_length`` with its special tokens kept; each token's word (for words);
    and how many texts were cut. A text that fills ``max_length + 1`` tokens was cut: it alone is encoded again."""
    encoded = tokenizer(texts, truncation=True, max_length=max_length + 1, is_split_into_words=words)
    ids = list(encoded["input_ids"])
    word_ids = [encoded.word_ids(row) for row in range(len(texts))] if words else None
    cut = [row for row, tokens in enumerate(ids) if len(tokens) > max_length]
    if cut:
        again = tokenizer([texts[row] for row in cut], truncation=True, max_length=max_length,
                          is_split_into_words=words)
        for position, row in enumerate(cut):
            ids[row] = again["input_ids"][position]
            if words:
                word_ids[row] = again.word_ids(position)
    return ids, word_ids, len(cut)


def _label_values(table: pa.Table, column: str, words: bool) -> tuple[list, tuple[str, ...] | None]:
    """Each example's label (for words, its list of labels) as integers, and the names of text labels, numbered in
    sorted order."""
    if column not in table.column_names:
        raise ValueError(f"no label column {column!r} (columns: {', '.join(table.column_names)}); name it with "
                         "--label-column")
    kind = table.schema.field(column).type
    listed = pa.types.is_list(kind) or pa.types.is_large_list(kind)
    element = kind.value_type if listed else kind
    if words != listed or not (pa.types.is_integer(element) or pa.types.is_string(element)
                               or pa.types.is_large_string(element)):
        held = "a list of labels per example, one per word" if words else "one label per example"
        raise ValueError(f"column {column!r} has type {kind}; it must hold {held}: integers (classes from 0) or "
                         "text")
    values = table.column(column).to_pylist()
    missing = sum(value is None or (listed and None in value) for value in values)
    if missing:
        raise ValueError(f"column {column!r}: {missing} example(s) have no label (null); fill or drop them")
    if pa.types.is_integer(element):
        return values, None
    names = tuple(sorted({label for value in values for label in (value if listed else [value])}))
    number = {name: index for index, name in enumerate(names)}
    return [[number[label] for label in value] if listed else number[value] for value in values], names


def _token_labels(labels: Sequence[Sequence[int]], word_ids: list[list[int | None]], texts: list[list[str]],
                  max_length: int) -> np.ndarray:
    """[rows, max_length]: each word's label at its first token, IGNORED_LABEL at its other tokens, at special
    tokens and at padding."""
    unequal = sum(len(row_labels) != len(row_words) for row_labels, row_words in zip(labels, texts))
    if unequal:
        raise ValueError(f"{unequal} example(s) have another number of labels than words; give one label per word")
    aligned = np.full((len(labels), max_length), IGNORED_LABEL, dtype=np.int64)
    for row, (row_labels, words) in enumerate(zip(labels, word_ids)):
        previous = None
        for position, word in enumerate(words):
            if word is not None and word != previous:
                aligned[row, position] = row_labels[word]
            previous = word
    return aligned


def _fixed_lists(rows: np.ndarray) -> pa.FixedSizeListArray:
    """[rows, length] int64 as a column of fixed-size lists whose values are never null."""
    element = pa.field("element", pa.int64(), nullable=False)
    return pa.FixedSizeListArray.from_arrays(pa.array(np.ascontiguousarray(rows, dtype=np.int64).ravel()),
                                             type=pa.list_(element, rows.shape[1]))


def write_token_table(table: pa.Table, path: str) -> None:
    """Write a tokenized table as Parquet for training: uncompressed, in small row groups (as ``dpfleet data
    export`` writes), its folder made where it is missing."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    pq.write_table(table, path, row_group_size=PARQUET_ROW_GROUP_ROWS, compression="none", use_dictionary=False)
