"""A dataset's identity, cheap enough to take at every start of a run on large Parquet data.

A checkpoint records it so that a resume on other data is refused. Nothing
here is private: the identity holds locations, sizes, the schema and digests
of file metadata or of a few byte ranges, never a row's values in the clear.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

from workers.sources import PARQUET_SUFFIXES, _files_at, spec_name

# Byte ranges read from a file that is not Parquet: RANGES evenly spaced ones of RANGE_BYTES (the whole file if small).
RANGES = 16
RANGE_BYTES = 4096
# A folder of many small files (images) has every file's path and size taken, and the content of this many.
CONTENT_FILES = 256
_PARQUET_MAGIC = b"PAR1"
_SUFFIXES = {"parquet": PARQUET_SUFFIXES, "csv": (".csv",)}


def _locations(train) -> list[str]:
    """The training split's locations, whatever shape the spec gives them (a path, a list, a table of paths)."""
    if isinstance(train, str):
        return [train]
    if isinstance(train, Mapping):
        return [location for value in train.values() for location in _locations(value)]
    return [location for value in train for location in _locations(value)]


def parquet_footer(handle) -> bytes:
    """A Parquet file's footer (its schema, row groups, row counts and column statistics) as stored."""
    size = handle.size()
    if size < 12 or handle.read_at(4, size - 4) != _PARQUET_MAGIC:
        return b""
    length = int.from_bytes(handle.read_at(4, size - 8), "little")
    return handle.read_at(min(length, size - 8), size - 8 - min(length, size - 8))


def sampled_ranges(handle, ranges: int = RANGES, range_bytes: int = RANGE_BYTES) -> bytes:
    """`ranges` evenly spaced byte ranges of a file, first and last included; the whole file when it is small."""
    size = handle.size()
    if size <= ranges * range_bytes:
        return handle.read_at(size, 0)
    starts = [round(index * (size - range_bytes) / (ranges - 1)) for index in range(ranges)]
    return b"".join(handle.read_at(range_bytes, start) for start in starts)


def file_content(filesystem, path: str, parquet: bool) -> bytes:
    """What stands for one file's content: sampled byte ranges, and a Parquet file's footer."""
    with filesystem.open_input_file(path) as handle:
        return (parquet_footer(handle) if parquet else b"") + sampled_ranges(handle)


def dataset_identity(spec: str | Mapping) -> dict:
    """Who the training data is: its source, format, file count and a content fingerprint of its training files.

    A built-in dataset is named (its files are checked against their SHA-256
    when loaded); a ``module:function`` dataset is named only, since its rows
    are not files. For files, the fingerprint covers every training file's
    path, size and modification time, and sampled byte ranges of it (of
    CONTENT_FILES evenly spaced files when there are more) with, for
    Parquet, its footer (row counts, schema and column statistics of every
    row group). Rewriting, adding or removing a file changes it; so does
    touching one, which is the safe side to err on.
    """
    if isinstance(spec, str):
        return {"source": spec}
    file_format = spec["format"]
    # A dataset of blocks trains on the blocks a run chose (its "train"), else on all of them.
    train = spec["train"] if "train" in spec else list(spec["blocks"].values())
    filesystem, paths = _files_at(_locations(train), _SUFFIXES.get(file_format, ("",)))
    combined = hashlib.blake2b(digest_size=16)
    for info in filesystem.get_file_info(paths):
        combined.update(info.path.encode() + b"\0" + info.size.to_bytes(8, "big")
                        + (info.mtime_ns or 0).to_bytes(8, "big"))
    read = sorted({round(index * (len(paths) - 1) / max(1, CONTENT_FILES - 1)) for index in range(CONTENT_FILES)})
    for index in read if len(paths) > CONTENT_FILES else range(len(paths)):
        combined.update(hashlib.blake2b(file_content(filesystem, paths[index], file_format == "parquet"),
                                        digest_size=16).digest())
    return {"source": spec_name(spec), "format": file_format, "files": len(paths), "content": combined.hexdigest()}
