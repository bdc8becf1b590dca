"""Where a block's rows are: what a block may declare, and when two declarations keep rows (or people) apart."""

from __future__ import annotations

import json

from accounting.ledger.errors import InvalidArgument
from accounting.ledger.validation import MAX_STEPS, USER, check_integer

# What a block may declare about its rows. `files` says where they are read from; at most one selector says which
# of those rows (a row range, a partition value, or, by user id, a hash bucket or a range of ids) are the block's.
BLOCK_FILES = "files"
BLOCK_SELECTORS = ("rows", "partition", "user_hash", "user_range")
USER_SELECTORS = ("user_hash", "user_range")
MAX_BLOCK_FILES = 1000
MAX_HASH_BUCKETS = 2**20
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
    unknown = set(value) - {BLOCK_FILES, *BLOCK_SELECTORS}
    selectors = [key for key in BLOCK_SELECTORS if key in value]
    if unknown or len(selectors) > 1:
        raise InvalidArgument(
            f"{_BLOCK_DATA_HELP}; at most one selector (got {', '.join(sorted(value))})"
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
    return data


def _plain_location(location: str) -> str:
    # One spelling per place, so that "d/" and "d" compare equal.
    return location.strip().rstrip("/") or "/"


def _location_contains(outer: str, inner: str) -> bool:
    return inner == outer or inner.startswith(outer.rstrip("/") + "/")


def _ranges_meet(first: list[int], second: list[int]) -> bool:
    return first[0] < second[1] and second[0] < first[1]


def block_data_overlap(first: dict | None, second: dict | None, privacy_unit: str) -> str | None:
    """Why two blocks' declarations may share a privacy unit (a row, or a person), or None when they cannot.

    None only when disjointness follows from the declarations alone: user
    selectors of the same kind that select different people; on an
    example-level dataset also files of which neither holds the other, or
    the same files with row ranges that do not meet or partitions of one
    column with different values. A block without a declaration (added
    before blocks declared their data) may share anything.
    """
    if first is None or second is None:
        return "a block added before blocks declared their data may hold any of the dataset's rows"
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
        shared = [(a, b) for a in files_a for b in files_b if _location_contains(a, b) or _location_contains(b, a)]
        if not shared:
            return None
        if files_a != files_b:
            return f"location {shared[0][0]} and location {shared[0][1]} hold the same rows"
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
    return "both declare the same rows" if first == second else "their declarations cannot be shown disjoint"
