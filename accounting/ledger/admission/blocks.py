"""Where a block's rows are: what a block may declare, and when two declarations keep rows (or people) apart."""

from __future__ import annotations

import json
import re

from accounting.ledger.errors import InvalidArgument
from accounting.ledger.validation import MAX_STEPS, USER, check_integer

# What a block may declare about its rows. `files` says where they are read from; at most one selector says which
# of those rows (a row range, a partition value, or, by user id, a hash bucket or a range of ids) are the block's.
BLOCK_FILES = "files"
BLOCK_SELECTORS = ("rows", "partition", "user_hash", "user_range")
USER_SELECTORS = ("user_hash", "user_range")
MAX_BLOCK_FILES = 1000
MAX_HASH_BUCKETS = 2**20
# A block's content identity (see workers.fingerprints.block_identity): each of its files' SHA-256 and row count,
# in the order the files are read, and on a per-person dataset the user id column and a keyed digest per person.
# The people are bounded so that a declaration stays within one request (17 bytes a person).
BLOCK_IDENTITY = "identity"
MAX_IDENTITY_FILES = 10_000
MAX_IDENTITY_PEOPLE = 100_000
MAX_FILE_ROWS = 2**48
# A dataset's content is recorded in-process (its first use in the embedded ledger), so it bounds only the entry.
MAX_DATASET_FILES = 1_000_000
_FILE_DIGEST = re.compile(r"[0-9a-f]{64}")
_PERSON_DIGEST = re.compile(r"[0-9a-f]{16}")
_BLOCK_DATA_HELP = (
    'a block declares where its rows are: {"files": ["LOCATION", ...]} and/or one of {"rows": [FIRST, STOP]}, '
    '{"partition": {"column": "COLUMN", "value": VALUE}}, {"user_hash": {"buckets": B, "bucket": I}} or '
    '{"user_range": [FIRST_ID, STOP_ID]} (dpfleet ledger block add --files/--rows/--partition/--user-hash/'
    "--user-range)"
)


def _half_open(name: str, value: object) -> list[int]:
    if not (isinstance(value, (list, tuple)) and len(value) == 2):
        raise InvalidArgument(f"{name} must be [FIRST, STOP], a half-open range of integers (got {value!r})")
    first = check_integer(f"{name} first", value[0], 0, MAX_STEPS)
    stop = check_integer(f"{name} stop", value[1], 1, MAX_STEPS)
    if stop <= first:
        raise InvalidArgument(f"{name} must have FIRST < STOP (got [{first}, {stop}])")
    return [first, stop]


def check_block_data(value: object, privacy_unit: str) -> dict:
    """A block's declaration of where its rows are, in canonical form; refused when it cannot bound its data.

    `files` (locations, each a file or a folder) and at most one selector:
    `rows` [first, stop) of those rows in the order they are read,
    `partition` {column, value}, `user_hash` {buckets, bucket} (the rows of
    the people whose id hashes to that bucket, see workers.users) or
    `user_range` [first, stop) of integer user ids. On a dataset whose
    privacy unit is 'user' the selector must be a user one: blocks then
    partition people, not rows.
    """
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise InvalidArgument(f"block data must be a JSON object; {_BLOCK_DATA_HELP} (got {value!r})") from None
    if not isinstance(value, dict) or not value:
        raise InvalidArgument(f"{_BLOCK_DATA_HELP} (got {value!r})")
    unknown = set(value) - {BLOCK_FILES, BLOCK_IDENTITY, *BLOCK_SELECTORS}
    selectors = [key for key in BLOCK_SELECTORS if key in value]
    if unknown or len(selectors) > 1:
        raise InvalidArgument(
            f"{_BLOCK_DATA_HELP}; at most one selector and the files' identity (got {', '.join(sorted(value))})"
        )
    data: dict = {}
    if BLOCK_FILES in value:
        files = value[BLOCK_FILES]
        if not (isinstance(files, (list, tuple)) and 0 < len(files) <= MAX_BLOCK_FILES
                and all(isinstance(location, str) and location.strip() for location in files)):
            raise InvalidArgument(
                f"block data files must be 1 to {MAX_BLOCK_FILES} non-empty locations (got {files!r})"
            )
        data[BLOCK_FILES] = sorted({_plain_location(location) for location in files})
    selector = selectors[0] if selectors else None
    if selector == "rows":
        data["rows"] = _half_open("block data rows", value["rows"])
    elif selector == "user_range":
        data["user_range"] = _half_open("block data user_range", value["user_range"])
    elif selector == "partition":
        partition = value["partition"]
        if not (isinstance(partition, dict) and set(partition) == {"column", "value"}
                and isinstance(partition["column"], str) and partition["column"]
                and isinstance(partition["value"], (str, int)) and not isinstance(partition["value"], bool)):
            raise InvalidArgument(
                f'block data partition must be {{"column": "COLUMN", "value": VALUE}}, VALUE a string or an '
                f"integer (got {partition!r})"
            )
        # As text: a column's values are compared as text when the rows are read, so 7 and "7" are one partition.
        data["partition"] = {"column": partition["column"], "value": str(partition["value"])}
    elif selector == "user_hash":
        bucketing = value["user_hash"]
        if not (isinstance(bucketing, dict) and set(bucketing) == {"buckets", "bucket"}):
            raise InvalidArgument(f'block data user_hash must be {{"buckets": B, "bucket": I}} (got {bucketing!r})')
        buckets = check_integer("block data user_hash buckets", bucketing["buckets"], 1, MAX_HASH_BUCKETS)
        bucket = check_integer("block data user_hash bucket", bucketing["bucket"], 0, buckets - 1)
        data["user_hash"] = {"buckets": buckets, "bucket": bucket}
    if privacy_unit == USER and selector not in USER_SELECTORS:
        raise InvalidArgument(
            "the dataset's budget is per person (privacy unit 'user'), so its blocks must partition people, not "
            "rows: declare each block by user id, --user-hash BUCKET/BUCKETS or --user-range FIRST:STOP"
        )
    if not data:
        raise InvalidArgument(f"{_BLOCK_DATA_HELP} (got {value!r})")
    if BLOCK_FILES in data:
        data[BLOCK_IDENTITY] = _check_identity(value.get(BLOCK_IDENTITY), privacy_unit)
    elif BLOCK_IDENTITY in value:
        raise InvalidArgument("block data identity describes the block's files: declare them with files")
    return data


def _check_identity(identity: object, privacy_unit: str) -> dict:
    """A block's content identity in canonical form; refused when missing or malformed.

    Files are named by what they hold, not where they are, so that a link,
    a URL or a copy of a block's file is known for the same rows.
    """
    how = ("dpfleet ledger block add computes it from the files; a training run from its [dataset.blocks] "
           "(workers.fingerprints.block_identity)")
    if not isinstance(identity, dict) or not set(identity) <= {"files", "user_id", "people"}:
        people = ', "user_id": COLUMN, "people": [DIGEST, ...]' if privacy_unit == USER else ""
        raise InvalidArgument(
            f'block data files need the files\' identity {{"files": [[SHA256, ROWS], ...]{people}}}: {how} '
            f"(got {sorted(identity) if isinstance(identity, dict) else type(identity).__name__})"
        )
    files = identity.get("files")
    if not (isinstance(files, list) and 0 < len(files) <= MAX_IDENTITY_FILES and all(
            isinstance(file, (list, tuple)) and len(file) == 2 and isinstance(file[0], str)
            and _FILE_DIGEST.fullmatch(file[0]) for file in files)):
        raise InvalidArgument(
            f"block data identity files must be 1 to {MAX_IDENTITY_FILES} [SHA256, ROWS] pairs, SHA256 64 lowercase "
            f"hex digits, in the order the files are read; {how}"
        )
    canonical_identity: dict = {"files": [
        [digest, check_integer("block data identity file rows", rows, 0, MAX_FILE_ROWS)] for digest, rows in files
    ]}
    if privacy_unit != USER:
        if set(identity) != {"files"}:
            raise InvalidArgument("block data identity names people only on a dataset whose privacy unit is 'user'")
        return canonical_identity
    user_id, people = identity.get("user_id"), identity.get("people")
    if not (isinstance(user_id, str) and user_id and isinstance(people, list)
            and 0 < len(people) <= MAX_IDENTITY_PEOPLE
            and all(isinstance(person, str) and _PERSON_DIGEST.fullmatch(person) for person in people)):
        raise InvalidArgument(
            "on a per-person dataset a block's identity names its people: user_id (the column naming each row's "
            f"person) and people (1 to {MAX_IDENTITY_PEOPLE} keyed digests, 16 lowercase hex digits each); a "
            f"block of more people is declared as several blocks; {how}"
        )
    return {**canonical_identity, "user_id": user_id, "people": sorted(set(people))}


def check_dataset_content(content: object) -> list[str]:
    """A dataset's content identity, as its first-use registration gives it: its training files' SHA-256s, sorted.

    1 to MAX_DATASET_FILES digests of 64 lowercase hex digits, each the
    SHA-256 of one file's bytes (workers.fingerprints.file_digests), so
    that the same rows in another folder or under another name are known.
    """
    if not (isinstance(content, (list, tuple)) and 0 < len(content) <= MAX_DATASET_FILES
            and all(isinstance(digest, str) and _FILE_DIGEST.fullmatch(digest) for digest in content)):
        raise InvalidArgument(
            f"a dataset's content must be 1 to {MAX_DATASET_FILES} SHA-256s of its files, 64 lowercase hex digits "
            "each (workers.fingerprints.file_digests computes them)"
        )
    return sorted(set(content))


def _plain_location(location: str) -> str:
    """One spelling per place, so that "d/" and "d" compare equal; a spelling that hides its place is refused.

    The text of a location is a second line of defence only (a link or a
    copy is another spelling of the same rows; the identity catches those):
    a local path must be absolute, `file:///PATH` is PATH, and no location
    may hold a '.' or '..' part or an empty one ('//').
    """
    location = location.strip()
    if location.startswith("file://"):
        if not location.startswith("file:///"):
            raise InvalidArgument(f"block data files: a file:// URL names a local path, file:///PATH (got "
                                  f"{location!r}); give the absolute path")
        location = location[len("file://"):]
    scheme, separator, path = location.partition("://")
    if not separator:
        scheme, path = "", location
        if not path.startswith("/"):
            raise InvalidArgument(f"block data files must be absolute paths or URLs (got {location!r}); give "
                                  "the absolute path, as dpfleet ledger block add and a training config do")
        path = path[1:]
    parts = path.rstrip("/").split("/") if path.rstrip("/") else []
    if any(part in ("", ".", "..") for part in parts):
        raise InvalidArgument(f"block data files must name each place one way, without '.', '..' or '//' parts "
                              f"(got {location!r}); give the path as the filesystem resolves it")
    return f"{scheme}://{'/'.join(parts)}" if separator else "/" + "/".join(parts)


def _location_contains(outer: str, inner: str) -> bool:
    return inner == outer or inner.startswith(outer.rstrip("/") + "/")


def _ranges_meet(first: list[int], second: list[int]) -> bool:
    return first[0] < second[1] and second[0] < first[1]


def block_data_overlap(first: dict | None, second: dict | None, privacy_unit: str) -> str | None:
    """Why two blocks' declarations may share a privacy unit (a row, or a person), or None when they cannot.

    None only when disjointness follows from the declarations alone. When
    both name their people (a per-person dataset's identities), they are
    apart exactly when no person's digest is in both. Else: user selectors
    of the same kind that select different people; on an example-level
    dataset files of which neither holds the other, by location and by
    content (no file's digest in both), or the same files with row ranges
    that do not meet or partitions of one column with different values. A
    block without a declaration (added before blocks declared their data)
    may share anything.
    """
    if first is None or second is None:
        return "a block added before blocks declared their data may hold any of the dataset's rows"
    people = _people_overlap(first.get(BLOCK_IDENTITY), second.get(BLOCK_IDENTITY))
    if people is not None:
        return people or None
    if "user_hash" in first and "user_hash" in second:
        a, b = first["user_hash"], second["user_hash"]
        if a["buckets"] != b["buckets"]:
            return f"user hash buckets of {a['buckets']} and of {b['buckets']} select some people in both"
        return None if a["bucket"] != b["bucket"] else f"both hold the people of user hash bucket {a['bucket']}"
    if "user_range" in first and "user_range" in second:
        a, b = first["user_range"], second["user_range"]
        return f"user id ranges {a} and {b} meet" if _ranges_meet(a, b) else None
    if privacy_unit == USER:
        return "on a per-person budget only user id hash buckets or user id ranges of one kind keep people apart"
    files_a, files_b = first.get(BLOCK_FILES), second.get(BLOCK_FILES)
    if files_a is not None and files_b is not None:
        relations = [_locations_relation(files_a, files_b),
                     _contents_relation(first.get(BLOCK_IDENTITY), second.get(BLOCK_IDENTITY))]
        shared = next((relation for relation in relations if relation not in (_APART, _SAME)), None)
        if shared is not None:
            return shared
        if all(relation == _APART for relation in relations):
            return None
    elif files_a != files_b:
        return "one block reads given files and the other the dataset's own, which may hold the same rows"
    if "rows" in first and "rows" in second:
        a, b = first["rows"], second["rows"]
        return f"row ranges {a} and {b} of the same files meet" if _ranges_meet(a, b) else None
    if "partition" in first and "partition" in second:
        a, b = first["partition"], second["partition"]
        if a["column"] != b["column"]:
            return f"partitions by column {a['column']!r} and by column {b['column']!r} may share rows"
        return None if a["value"] != b["value"] else f"both are the rows whose {a['column']} is {a['value']!r}"
    if not any(selector in first or selector in second for selector in BLOCK_SELECTORS):
        return "both hold the same files, by their locations or by their contents"
    return "their declarations cannot be shown disjoint"


# How two blocks' files relate: no file in both, the same files in the same order, or (any other text) some shared.
_APART, _SAME = "apart", "same"


def _locations_relation(files_a: list[str], files_b: list[str]) -> str:
    shared = [(a, b) for a in files_a for b in files_b if _location_contains(a, b) or _location_contains(b, a)]
    if not shared:
        return _APART
    return _SAME if files_a == files_b else f"location {shared[0][0]} and location {shared[0][1]} hold the same rows"


def _contents_relation(first: dict | None, second: dict | None) -> str:
    # A block declared before identities were recorded is known by its locations only.
    if first is None or second is None:
        return _APART
    digests_a, digests_b = [file[0] for file in first["files"]], [file[0] for file in second["files"]]
    shared = set(digests_a) & set(digests_b)
    if not shared:
        return _APART
    # Row ranges count rows in reading order, so the same files in another order are other rows.
    return _SAME if digests_a == digests_b else f"a file of SHA-256 {min(shared)[:16]}… is in both"


def _people_overlap(first: dict | None, second: dict | None) -> str | None:
    """'' when both identities name their people and none is in both, a reason when some are, None when unknown."""
    if not (first and second and "people" in first and "people" in second):
        return None
    if first["user_id"] != second["user_id"]:
        return (f"one names people by column {first['user_id']!r}, the other by {second['user_id']!r}; the blocks "
                "of a dataset name people by one column")
    shared = set(first["people"]) & set(second["people"])
    return f"{len(shared)} people are in both (by their keyed digests)" if shared else ""
