"""A dataset's identity: a digest of every byte of its training files, so that a resume on other data is refused.

A checkpoint records it (``orchestrator.binding``). Every byte is read:
an identity made of sizes, times and sampled byte ranges can be kept while
the rows change, since a file's modification time is set back by anyone
who may write the file (``os.utime``). The digest is SHA-256, the fastest
hash on processors with SHA instructions (1.3 GB/s a core on the 2-core
x86_64 VM, against BLAKE2b's 0.6 to 0.76), over each file's path, size,
modification time and content. It holds no value in the clear; whoever
reads it can confirm a guess at the data only by guessing every byte of
every file and each file's modification time to the nanosecond.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping

from workers.sources import PARQUET_SUFFIXES, _files_at, _parquet_file, canonical_user_id, read_column, spec_name

# Bytes read at a time: large enough that the hash, not the calls, sets the pace; small enough to stay cheap.
READ_BYTES = 8 << 20
_SUFFIXES = {"parquet": PARQUET_SUFFIXES, "csv": (".csv",)}
# A person's keyed digest keeps 8 bytes: two of a million people share one with odds of 3e-8, and a shared digest
# only ever refuses a block.
PERSON_DIGEST_BYTES = 8


def _locations(train) -> list[str]:
    """The training split's locations, whatever shape the spec gives them (a path, a list, a table of paths)."""
    if isinstance(train, str):
        return [train]
    if isinstance(train, Mapping):
        return [location for value in train.values() for location in _locations(value)]
    return [location for value in train for location in _locations(value)]


def file_digest(filesystem, path: str) -> bytes:
    """SHA-256 of one file's every byte, read in READ_BYTES pieces."""
    digest = hashlib.sha256()
    with filesystem.open_input_stream(path) as stream:
        while piece := stream.read(READ_BYTES):
            digest.update(piece)
    return digest.digest()


def _training_files(spec: Mapping) -> tuple:
    """The filesystem and the sorted paths of a file dataset's training files."""
    # A dataset of blocks trains on the blocks a run chose (its "train"), else on all of them.
    train = spec["train"] if "train" in spec else list(spec["blocks"].values())
    return _files_at(_locations(train), _SUFFIXES.get(spec["format"], ("",)))


def file_digests(spec: str | Mapping) -> list[str] | None:
    """SHA-256 of each training file's bytes alone (hex, in path order): what the data is wherever it is kept.

    What an embedded ledger's first-use registration records for a
    dataset, so that the same files under another name or in another
    folder are known (``Ledger.create_dataset``'s ``content``). None for a
    built-in or ``module:function`` dataset, whose name says what it is.
    Costs one read of the training files; dataset_identity takes what it
    gives, so that a run reads them once for both.
    """
    if isinstance(spec, str):
        return None
    filesystem, paths = _training_files(spec)
    return [file_digest(filesystem, path).hex() for path in paths]


def dataset_identity(spec: str | Mapping, content: list[str] | None = None) -> dict:
    """Who the training data is: its source, format, file count and a digest of its training files.

    A built-in dataset is named (its files are checked against their SHA-256
    when loaded); a ``module:function`` dataset is named only, since its rows
    are not files. For files, ``content`` is SHA-256 over every training
    file's path, size, modification time and every byte: any change of a
    row changes it, and so does touching a file, which is the safe side to
    err on. Costs one read of the training files: about 12 s for 10 GB in
    the page cache on the 2-core x86_64 VM (docs/threat-model.md). With
    `content`, the files' SHA-256s as ``file_digests(spec)`` gave them, the
    bytes are not read again.
    """
    if isinstance(spec, str):
        return {"source": spec}
    file_format = spec["format"]
    filesystem, paths = _training_files(spec)
    digests = [bytes.fromhex(digest) for digest in content] if content is not None else None
    combined = hashlib.sha256()
    for index, info in enumerate(filesystem.get_file_info(paths)):
        digest = digests[index] if digests is not None else file_digest(filesystem, info.path)
        combined.update(info.path.encode() + b"\0" + info.size.to_bytes(8, "big")
                        + (info.mtime_ns or 0).to_bytes(8, "big") + digest)
    return {"source": spec_name(spec), "format": file_format, "files": len(paths), "content": combined.hexdigest()}


def block_identity(files: list[str], user_id: str | None, salt: str) -> dict:
    """What a block of a Parquet dataset holds, whatever its files are called: the identity its declaration carries.

    ``files`` are the block's declared locations (sorted, as declared);
    ``files`` of the result are each file's SHA-256 (of its bytes only, so
    a link, a URL or a copy is the same file) and row count, in the order
    the files are read. With ``user_id`` (a per-person dataset), also that
    column's name and ``people``: per person the first PERSON_DIGEST_BYTES
    of HMAC-SHA-256 of the canonical id (``canonical_user_id``, so 7, 7.0 and
    "7" are one person) under a key made from ``salt`` (the dataset's
    tenant/name), sorted. Costs one read of every byte, as dataset_identity.
    """
    filesystem, paths = _files_at(list(files), PARQUET_SUFFIXES)
    identity: dict = {"files": [
        [file_digest(filesystem, path).hex(), _parquet_file(filesystem, path).metadata.num_rows] for path in paths
    ]}
    if user_id is not None:
        key = hashlib.sha256(b"dpfleet people of " + salt.encode()).digest()
        ids = read_column({"format": "parquet", "train": list(files)}, "train", user_id)
        identity["user_id"] = user_id
        identity["people"] = sorted({
            hmac.new(key, canonical_user_id(person).encode(), hashlib.sha256).digest()[:PERSON_DIGEST_BYTES].hex()
            for person in ids
        })
    return identity
