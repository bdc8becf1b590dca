"""Budget arithmetic of the privacy ledger: pure functions over event records.

No storage and no network here. The store and the gRPC service call these.

Admission. Each dataset keeps a running RDP tally of everything committed or
reserved-but-unrun, and the `AdmissionRule` it was created with: an RDP
filter (Feldman & Zrnic 2021) at K orders fixed at creation, with the
(epsilon, delta) conversion of each order taken at delta/K. A reservation is
admitted when, at one of those orders at least, the RDP of (tally + the
job's plan) converts to an epsilon within the budget; a commit only when the
committed steps plus its block still do. A union bound over the K orders
makes every sequence of jobs, however adaptively chosen, (budget, delta)-DP
(the theorem and its proof are in docs/ledger.md). A reserve costs O(orders),
not O(history). RDP composes by addition, so the tally is a sum; it is kept
in exact integers (see `RdpTally`) so that adding a plan and later
subtracting its unrun part leaves no floating drift, and nothing needs
recomputing when the store is reopened.

Safe rounding. Every per-step Renyi divergence is rounded up to a multiple of
2**-60 nats; a sum is converted back to a float rounded up; and a total fits a
budget only with a relative margin of `ADMISSION_MARGIN`, which covers the
last-bit error of the RDP-to-epsilon conversion. Each step can only make the
ledger refuse something at the exact edge, never admit something over it.

Reports. `spent_epsilon_filter` is what the filter counts against the
committed events: the epsilon its rule gives them; `reserved_epsilon` what
the reservations add to it, and `remaining_epsilon` the budget minus the
filter's epsilon of committed + reserved, which is the view admission uses,
so spent_filter + reserved + remaining = budget. `spent_epsilon` is the PLD
epsilon of the committed events as if every job had been fixed in advance
(non-adaptive: tight, but no guarantee when jobs depend on earlier results),
or, for a caller that would rather not wait the 0.1-1 s the PLD of newly
committed events takes, their RDP epsilon over the whole order grid until
the PLD figure is ready (`spent_epsilon_accountant` says which);
`spent_epsilon_rdp` is that non-adaptive RDP epsilon.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import hmac
import json
import math
import multiprocessing
import os
import re
import secrets
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field, replace
from decimal import ROUND_CEILING, ROUND_FLOOR, Context, Decimal
from typing import Callable, Iterator, Protocol

import numpy as np

from accounting.accountants import RDP_ORDERS, compute_epsilon, epsilon_from_rdp, get_accountant, rdp_vector
from accounting.events import Composition, EventError, EventsLike, SampledGaussian, as_composition, group_events
from accounting.ledger.scheduling import PRIORITY_RANGE, SchedulingPolicy

# Renyi divergences are tallied in integer units of 2**-60 nats: exact under
# addition and subtraction, and finer than any float we would compare.
_UNIT_BITS = 60
_UNITS_PER_NAT = 2**_UNIT_BITS

# Relative margin a total must clear below the budget; covers the few-ulp
# error of the RDP-to-epsilon conversion (about 1e-15) by a wide factor.
ADMISSION_MARGIN = 1e-9

NAME_LENGTH = (1, 128)
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*\Z")
MAX_PLAN_RECORDS = 1000
# Distinct mechanisms (sampling rate, noise multiplier, sensitivity factor) in one plan. Each new one costs an
# RDP curve (80-400 ms of CPU), so the cap bounds what one request can make a server compute; a noise schedule
# changing sigma every epoch for 100 epochs fits.
MAX_PLAN_MECHANISMS = 100
MAX_SEQUENCE = 2**63 - 1
MAX_STEPS = 2**63 - 1
HISTORY_LIMIT = (1, 100_000)
MAX_LEASE_SECONDS = 30 * 24 * 3600.0
MAX_BLOCKS_PER_JOB = 1000
# The ranges the ledger takes, in the one place the store, the service and the command line check them.
# Past them the arithmetic leaves floats (an ε of 1e-300 divides by zero, 1e300 overflows) and no real
# budget or mechanism lives there; docs/ledger.md gives them.
EPSILON_RANGE = (1e-6, 1e4)  # a budget's, a block's or a quota's ε, inclusive
DELTA_RANGE = (1e-20, 0.1)  # a budget's δ, inclusive; δ/K per order must stay a normal float
NOISE_MULTIPLIER_RANGE = (1e-3, 1e4)  # σ, and σ over the sensitivity factor, of a planned event, inclusive

ACTIVE = "active"
RELEASED = "released"
RESERVATION_STATES = (ACTIVE, RELEASED)
# A queued job waits, then is admitted (it holds a reservation), cancelled, or gives up at its deadline.
QUEUED = "queued"
ADMITTED = "admitted"
CANCELLED = "cancelled"
TIMED_OUT = "timed_out"
QUEUE_STATES = (QUEUED, ADMITTED, CANCELLED, TIMED_OUT)
MAX_WAIT_SECONDS = 365 * 24 * 3600.0

EXAMPLE = "example"
USER = "user"
PRIVACY_UNITS = (EXAMPLE, USER)

ADMIN_ACTOR = "admin"
LOCAL_TENANT = "local"


class LedgerError(Exception):
    """Base of every error the ledger reports; each subclass maps to one gRPC status code."""


class InvalidArgument(LedgerError):
    """A request value is outside its valid range (gRPC INVALID_ARGUMENT)."""


class NotFound(LedgerError):
    """An admin named a tenant, dataset or reservation that does not exist (gRPC NOT_FOUND)."""


class AlreadyExists(LedgerError):
    """A tenant or dataset of that name exists already (gRPC ALREADY_EXISTS)."""


class FailedPrecondition(LedgerError):
    """The request is well formed but the ledger's state does not allow it (gRPC FAILED_PRECONDITION)."""


class PermissionDenied(LedgerError):
    """The caller may not do this, or may not see the thing named (gRPC PERMISSION_DENIED)."""


class Unauthenticated(LedgerError):
    """No token, or a token the ledger does not know (gRPC UNAUTHENTICATED)."""


class LedgerUnavailable(LedgerError):
    """The remote ledger did not answer in time or could not be reached (gRPC UNAVAILABLE)."""


class RateLimited(LedgerError):
    """Too many costly requests, or failed authentications, in a short time (gRPC RESOURCE_EXHAUSTED).

    `retry_after_seconds` is when the request would be let through, if nothing else arrives before it.
    """

    def __init__(self, message: str, retry_after_seconds: float) -> None:
        self.retry_after_seconds = retry_after_seconds
        super().__init__(message)


class BudgetExceeded(LedgerError):
    """A job does not fit the dataset's budget (gRPC RESOURCE_EXHAUSTED).

    `remaining_epsilon` is the budget minus the RDP epsilon of what is
    committed and reserved; `needed_epsilon` is how much the job would add to
    that RDP epsilon. Both at the dataset's `delta`.
    """

    def __init__(
        self, dataset: str, remaining_epsilon: float, needed_epsilon: float, delta: float, budget: str | None = None
    ) -> None:
        self.dataset = dataset
        self.remaining_epsilon = remaining_epsilon
        self.needed_epsilon = needed_epsilon
        self.delta = delta
        # Which budget refused: the dataset's, a block's, or a tenant's quota on either.
        self.budget = budget or f"dataset {dataset!r}"
        shown_remaining, shown_needed = _shown_shortfall(remaining_epsilon, needed_epsilon)
        super().__init__(
            f"{self.budget} has ε {shown_remaining} left at δ={delta:g}; this job needs ε {shown_needed}. "
            "Run fewer steps or more noise, release reservations that are no longer needed "
            "(dpfleet ledger jobs, dpfleet ledger release), or ask an admin to raise the budget"
        )


def _shown_shortfall(remaining: float, needed: float) -> tuple[str, str]:
    """Remaining rounded down and needed rounded up, to two significant digits of the smaller."""
    smallest = min((value for value in (remaining, needed) if 0.0 < value < math.inf), default=1.0)
    quantum = Decimal(10) ** -min(12, max(2, 1 - math.floor(math.log10(smallest))))

    def shown(value: float, rounding: str) -> str:
        if not math.isfinite(value):
            return "inf"
        # repr: the shortest decimal that reads back as this float, so 0.31 shows as 0.31.
        return str(Decimal(repr(value)).quantize(quantum, rounding=rounding, context=Context(prec=400)))

    return shown(remaining, ROUND_FLOOR), shown(needed, ROUND_CEILING)


# ---------------------------------------------------------------- validation


def check_name(kind: str, value: object) -> str:
    """A tenant or dataset name, job id or reservation id.

    1 to 128 letters, digits, '.', '_' or '-', starting with a letter or digit.

    `kind` names the thing in the error, e.g. "dataset name".
    """
    if not isinstance(value, str) or not (NAME_LENGTH[0] <= len(value) <= NAME_LENGTH[1]) or not _NAME.match(value):
        if isinstance(value, str) and len(value) > 40:
            shown = f"{value[:40]!r}... ({len(value)} characters)"
        else:
            shown = repr(value)
        raise InvalidArgument(
            f"{kind} must be {NAME_LENGTH[0]} to {NAME_LENGTH[1]} characters of letters, digits, "
            f"'.', '_' or '-', starting with a letter or digit (got {shown})"
        )
    return value


def _finite(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgument(f"{name} must be a number (got {value!r})")
    value = float(value)
    if not math.isfinite(value):
        raise InvalidArgument(f"{name} must be a finite number (got {value!r})")
    return value


def check_budget_epsilon(value: object, name: str = "budget epsilon") -> float:
    """A budget epsilon (of a dataset, block or quota, named `name` in the error): a number in EPSILON_RANGE."""
    epsilon = _finite(name, value)
    if not EPSILON_RANGE[0] <= epsilon <= EPSILON_RANGE[1]:
        raise InvalidArgument(
            f"{name} must be in [{EPSILON_RANGE[0]:g}, {EPSILON_RANGE[1]:g}] (got {epsilon:g}); a budget is "
            "usually between 0.1 and 10"
        )
    return epsilon


def check_delta(value: object) -> float:
    """A budget delta: a number in DELTA_RANGE, and below 1/(dataset size) (see `delta_warning`)."""
    delta = _finite("delta", value)
    if not DELTA_RANGE[0] <= delta <= DELTA_RANGE[1]:
        raise InvalidArgument(
            f"delta must be in [{DELTA_RANGE[0]:g}, {DELTA_RANGE[1]:g}] (got {delta:g}); choose it below "
            "1/(dataset size), e.g. 1e-5 for 60,000 rows"
        )
    return delta


def delta_warning(delta: float, dataset_size: int | None) -> str | None:
    """A warning when a budget's delta is above 1/N for a dataset of N rows (or people); None when it is not,
    or N is not known. A delta of 1/N allows releasing one row in the clear."""
    if dataset_size is None or delta <= 1.0 / dataset_size:
        return None
    return (
        f"delta {delta:g} is above 1/N = {1.0 / dataset_size:.3g} for a dataset of {dataset_size} rows: a mechanism "
        "may then reveal a row outright with that probability; choose delta below 1/N (1/(10 N) is common)"
    )


def _integer(name: str, value: object, least: int, most: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= most:
        raise InvalidArgument(f"{name} must be an integer in [{least}, {most}] (got {value!r})")
    return value


def check_steps(value: object) -> int:
    """Steps of one commit: an integer >= 1."""
    return _integer("steps", value, 1, MAX_STEPS)


def check_sequence(value: object) -> int:
    """A commit's sequence number: an integer in [0, 2**63 - 1], unique per reservation."""
    return _integer("sequence", value, 0, MAX_SEQUENCE)


def check_lease_seconds(value: object) -> float | None:
    """A reservation's lease: None or 0 for none, else seconds in (0, MAX_LEASE_SECONDS]."""
    if value is None:
        return None
    seconds = _finite("lease_seconds", value)
    if seconds == 0.0:
        return None
    if not 0.0 < seconds <= MAX_LEASE_SECONDS:
        raise InvalidArgument(
            f"lease_seconds must be in (0, {MAX_LEASE_SECONDS:g}] or 0 for no lease (got {seconds:g}); "
            "choose more than the time between two commits of the job"
        )
    return seconds


def check_block_names(value: object) -> tuple[str, ...]:
    """The blocks a job names: distinct block names, or () for the dataset as a whole."""
    if value is None:
        return ()
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise InvalidArgument(f"blocks must be a list of block names (got {value!r})")
    names = tuple(check_name("block name", name) for name in value)
    if len(set(names)) != len(names):
        raise InvalidArgument(f"blocks must name each block once (got {list(names)!r})")
    if len(names) > MAX_BLOCKS_PER_JOB:
        raise InvalidArgument(f"a job may name at most {MAX_BLOCKS_PER_JOB} blocks (got {len(names)})")
    return names


# ------------------------------------------------------- where a block's rows are

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
    first = _integer(f"{name} first", value[0], 0, MAX_STEPS)
    stop = _integer(f"{name} stop", value[1], 1, MAX_STEPS)
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
        buckets = _integer("block data user_hash buckets", bucketing["buckets"], 1, MAX_HASH_BUCKETS)
        data["user_hash"] = {
            "buckets": buckets, "bucket": _integer("block data user_hash bucket", bucketing["bucket"], 0, buckets - 1)
        }
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


def check_max_wait_seconds(value: object) -> float | None:
    """How long a queued job may wait (seconds); None waits until admitted or cancelled."""
    if value is None:
        return None
    seconds = _finite("max_wait_seconds", value)
    if not 0 < seconds <= MAX_WAIT_SECONDS:
        raise InvalidArgument(
            f"max_wait_seconds must be in (0, {MAX_WAIT_SECONDS:g}] (got {seconds!r}); leave it out to wait until "
            "admitted or cancelled"
        )
    return seconds


def check_priority(value: object) -> int:
    """A queued job's priority: higher is served first, within PRIORITY_RANGE."""
    return _integer("priority", value, *PRIORITY_RANGE)


def check_queue_state(value: object) -> str | None:
    """A queued job's state filter: one of QUEUE_STATES, or None for any."""
    return _state_filter("queued job state", value, QUEUE_STATES)


def check_scheduling(value: object) -> SchedulingPolicy:
    """A dataset's scheduling policy, from its dict (SchedulingPolicy.to_dict) or itself."""
    try:
        return value if isinstance(value, SchedulingPolicy) else SchedulingPolicy.from_dict(value)
    except (KeyError, TypeError, ValueError) as error:
        raise InvalidArgument(f"scheduling: {error}") from None


def check_history_limit(value: object) -> int:
    """How many history entries to return: an integer in HISTORY_LIMIT."""
    return _integer("history limit", value, *HISTORY_LIMIT)


def check_state(value: object) -> str | None:
    """A reservation state filter: None (any), 'active' or 'released'."""
    return _state_filter("job state", value, RESERVATION_STATES)


def _state_filter(kind: str, value: object, states: tuple[str, ...]) -> str | None:
    if value is not None and value not in states:
        raise InvalidArgument(f"{kind} must be one of {', '.join(states)} (got {value!r})")
    return value


def check_privacy_unit(value: object) -> str:
    """A privacy unit: 'example' (one row is protected) or 'user' (one person, all its rows)."""
    if value not in PRIVACY_UNITS:
        raise InvalidArgument(f"privacy unit must be one of {', '.join(PRIVACY_UNITS)} (got {value!r})")
    return value


def check_rows_per_person(value: object) -> int | None:
    """A bound on each person's rows (None: no bound given)."""
    return None if value is None else _integer("rows per person", value, 1, MAX_STEPS)


def charged_plan(
    dataset: str, dataset_unit: str, job_unit: str, planned: Composition, rows_per_person: int | None
) -> Composition:
    """The events a dataset of `dataset_unit` is charged for a job whose `planned` events protect `job_unit`.

    Same unit: the plan itself. An example-level job on a user-level dataset
    is charged the group-privacy bound for people of at most
    `rows_per_person` rows (`group_events`), and refused without that bound.
    A user-level job on an example-level dataset is refused: its events
    bound a person, and the job must send events that bound one row
    (dpfleet train does: the sampled Gaussian at sensitivity factor 2).
    """
    if dataset_unit == job_unit:
        return planned
    if dataset_unit == USER:
        if rows_per_person is None:
            raise FailedPrecondition(
                f"dataset {dataset!r} has a user-level budget (privacy unit 'user') and this example-level job does "
                "not bound how many rows one person has; train with privacy_unit = \"user\", or give "
                "max_examples_per_user (with user_id or synthetic_users) so the ledger can charge the group-privacy "
                "bound for people of that many rows"
            )
        return group_events(planned, rows_per_person)
    raise FailedPrecondition(
        f"dataset {dataset!r} has an example-level budget (privacy unit 'example'); a user-level job's events bound "
        "one person, not one row: reserve the events that bound one row (a user-level dpfleet train sends them: "
        "the sampled Gaussian over people at sensitivity factor 2), or use a dataset created with --privacy-unit user"
    )


def check_plan(planned: EventsLike) -> Composition:
    """A job's planned events: at least one step, at most MAX_PLAN_RECORDS distinct records."""
    try:
        composition = as_composition(planned)
    except EventError as error:
        raise InvalidArgument(f"planned events: {error}") from None
    if composition.steps == 0:
        raise InvalidArgument("planned events must hold at least one step (got none)")
    if any(event.steps > MAX_STEPS for event in composition.events):
        raise InvalidArgument(f"planned events may hold at most {MAX_STEPS} steps per record")
    least, most = NOISE_MULTIPLIER_RANGE
    for event in composition.events:
        # Past these the accountants' arithmetic overflows or divides by zero.
        if not all(least <= sigma <= most for sigma in (event.noise_multiplier, event.effective_noise_multiplier)):
            raise InvalidArgument(
                f"planned events: noise_multiplier, and noise_multiplier / sensitivity_factor, must be in "
                f"[{least:g}, {most:g}] (got {event.noise_multiplier:g} and {event.effective_noise_multiplier:g})"
            )
    if len(composition.events) > MAX_PLAN_RECORDS:
        raise InvalidArgument(
            f"planned events may hold at most {MAX_PLAN_RECORDS} records after merging equal neighbours "
            f"(got {len(composition.events)}); group steps of the same mechanism together"
        )
    mechanisms = len(mechanisms_of(composition))
    if mechanisms > MAX_PLAN_MECHANISMS:
        raise InvalidArgument(
            f"planned events may use at most {MAX_PLAN_MECHANISMS} distinct mechanisms (sampling rate, noise "
            f"multiplier, sensitivity factor) (got {mechanisms}); change sigma less often (a longer "
            "noise_schedule.every) or split the job"
        )
    return composition


def parse_plan(text: object) -> Composition:
    """A job's planned events from their versioned JSON (Composition.to_json)."""
    if not isinstance(text, str):
        raise InvalidArgument(f"planned events must be a JSON string (got {type(text).__name__})")
    try:
        composition = Composition.from_json(text)
    except (EventError, TypeError, AttributeError, ValueError, OverflowError, RecursionError) as error:
        # OverflowError: events.py turns an infinite "steps" into an int before range-checking it.
        raise InvalidArgument(f"planned events: {error}") from None
    return check_plan(composition)


# ------------------------------------------------------------ event algebra


def split_steps(composition: Composition, steps: int) -> tuple[Composition, Composition]:
    """The first `steps` steps of a composition and the rest, in the composition's order."""
    try:
        return as_composition(composition).split(steps)
    except EventError as error:
        raise InvalidArgument(str(error)) from None


def canonical(composition: EventsLike) -> Composition:
    """The same multiset of steps, one record per mechanism in a fixed order.

    Composition of DP mechanisms does not depend on their order, so a
    dataset's committed events can be kept in this bounded form however many
    jobs interleave on it.
    """
    steps_by_mechanism: dict[tuple[float, float, float], int] = {}
    for event in as_composition(composition).events:
        key = (event.sampling_rate, event.noise_multiplier, event.sensitivity_factor)
        steps_by_mechanism[key] = steps_by_mechanism.get(key, 0) + event.steps
    return Composition(
        tuple(
            SampledGaussian(rate, sigma, steps, factor)
            for (rate, sigma, factor), steps in sorted(steps_by_mechanism.items())
        )
    )


class CurveNotCached(Exception):
    """An RDP curve was needed where only cached ones may be used (under the store's write lock).

    Not a LedgerError: the store catches it, computes `mechanism`'s curve with no lock held and runs the change
    again.
    """

    def __init__(self, mechanism: tuple[float, float, float]) -> None:
        self.mechanism = mechanism
        super().__init__(f"the RDP curve of mechanism {mechanism} is not cached")


_CURVE_MODE = threading.local()


@contextlib.contextmanager
def rdp_curves_cached_only() -> Iterator[None]:
    """Within this block, on this thread, a mechanism whose RDP curve is not cached raises CurveNotCached.

    The store wraps the body of its write transactions in it, so that no
    80-400 ms curve computation ever holds the lock that every other
    tenant's commit waits for.
    """
    previous = getattr(_CURVE_MODE, "cached_only", False)
    _CURVE_MODE.cached_only = True
    try:
        yield
    finally:
        _CURVE_MODE.cached_only = previous


def mechanisms_of(events: EventsLike) -> set[tuple[float, float, float]]:
    """The distinct mechanisms (sampling rate, noise multiplier, sensitivity factor) of a composition."""
    return {
        (event.sampling_rate, event.noise_multiplier, event.sensitivity_factor)
        for event in as_composition(events).events
    }


def uncached_mechanisms(events: EventsLike) -> int:
    """How many of a composition's mechanisms have no cached RDP curve: what admitting it would compute."""
    return sum(_step_curve.peek(*mechanism) is None for mechanism in mechanisms_of(events))


def compute_curve(mechanism: tuple[float, float, float]) -> None:
    """Compute and cache one mechanism's RDP curve (outside any lock; concurrent askers share one computation)."""
    _step_curve(*mechanism)


def _step_units(
    sampling_rate: float, noise_multiplier: float, sensitivity_factor: float
) -> tuple[tuple[int, ...], tuple[bool, ...]]:
    """`_computed_step_units`, cached; see `rdp_curves_cached_only`."""
    if getattr(_CURVE_MODE, "cached_only", False):
        curve = _step_curve.peek(sampling_rate, noise_multiplier, sensitivity_factor)
        if curve is None:
            raise CurveNotCached((sampling_rate, noise_multiplier, sensitivity_factor))
        return curve
    return _step_curve(sampling_rate, noise_multiplier, sensitivity_factor)


def _computed_step_units(
    sampling_rate: float, noise_multiplier: float, sensitivity_factor: float
) -> tuple[tuple[int, ...], tuple[bool, ...]]:
    """Per-order RDP of one step in units, rounded up, and which orders are unbounded."""
    divergences = rdp_vector(SampledGaussian(sampling_rate, noise_multiplier, 1, sensitivity_factor))
    units = []
    unbounded = []
    for divergence in divergences:
        scaled = float(divergence) * _UNITS_PER_NAT  # exact: a power-of-two scaling
        if math.isfinite(scaled):
            units.append(max(0, math.ceil(scaled)))
            unbounded.append(False)
        else:
            # dp-accounting reports inf (or gives up) at orders it cannot bound.
            units.append(0)
            unbounded.append(True)
    return tuple(units), tuple(unbounded)


@dataclass(frozen=True)
class RdpTally:
    """Renyi divergences at every order of RDP_ORDERS, summed exactly.

    `units[i]` is the divergence at order i in units of 2**-60 nats (each
    step rounded up); `unbounded_steps[i]` counts the steps whose divergence
    at order i is unbounded, which makes the total infinite there. The tally
    of a composition is linear in its steps, so the tally of the first k
    steps plus the tally of the rest equals the tally of the whole, exactly.
    """

    units: tuple[int, ...]
    unbounded_steps: tuple[int, ...]

    @classmethod
    def zero(cls) -> "RdpTally":
        """The tally of no events."""
        return cls((0,) * len(RDP_ORDERS), (0,) * len(RDP_ORDERS))

    @classmethod
    def of(cls, events: EventsLike) -> "RdpTally":
        """The tally of a composition (one dp-accounting call per distinct mechanism, cached)."""
        units = [0] * len(RDP_ORDERS)
        unbounded = [0] * len(RDP_ORDERS)
        for event in as_composition(events).events:
            step_units, step_unbounded = _step_units(
                event.sampling_rate, event.noise_multiplier, event.sensitivity_factor
            )
            for order, (unit, infinite) in enumerate(zip(step_units, step_unbounded)):
                units[order] += event.steps * unit
                unbounded[order] += event.steps if infinite else 0
        return cls(tuple(units), tuple(unbounded))

    def __add__(self, other: "RdpTally") -> "RdpTally":
        return RdpTally(
            tuple(a + b for a, b in zip(self.units, other.units)),
            tuple(a + b for a, b in zip(self.unbounded_steps, other.unbounded_steps)),
        )

    def __sub__(self, other: "RdpTally") -> "RdpTally":
        units = tuple(a - b for a, b in zip(self.units, other.units))
        unbounded = tuple(a - b for a, b in zip(self.unbounded_steps, other.unbounded_steps))
        if min(units) < 0 or min(unbounded) < 0:
            raise ValueError("cannot take from an RDP tally more than was added to it; the ledger file is inconsistent")
        return RdpTally(units, unbounded)

    def divergences(self) -> np.ndarray:
        """The per-order Renyi divergences in nats, each rounded up to the next float."""
        return np.array(
            [
                math.inf if infinite else (math.nextafter(units / _UNITS_PER_NAT, math.inf) if units else 0.0)
                for units, infinite in zip(self.units, self.unbounded_steps)
            ],
            dtype=np.float64,
        )

    def epsilon(self, delta: float) -> float:
        """RDP epsilon at `delta` (best order of RDP_ORDERS)."""
        return epsilon_from_rdp(self.divergences(), delta, warn=False)

    def to_json(self) -> str:
        """Exact JSON (integers of any size)."""
        return json.dumps({"units": list(self.units), "unbounded_steps": list(self.unbounded_steps)})

    @classmethod
    def from_json(cls, text: str) -> "RdpTally":
        """Inverse of `to_json`; refuses a tally over a different order grid."""
        data = json.loads(text)
        if len(data["units"]) != len(RDP_ORDERS) or len(data["unbounded_steps"]) != len(RDP_ORDERS):
            raise ValueError(
                f"stored RDP tally has {len(data['units'])} orders but this dpfleet uses {len(RDP_ORDERS)}; "
                "open the ledger with the dpfleet version that wrote it"
            )
        return cls(tuple(data["units"]), tuple(data["unbounded_steps"]))


# ------------------------------------------------------------ admission rule

FILTER_RULE = "rdp-filter"
# Orders a new dataset's filter watches: around the order where a budget of Gaussian-like steps is used best.
FILTER_ORDER_COUNT = 3
# The orders sit at (alpha* - 1) times these factors; alpha* is that best order.
_FILTER_ORDER_FACTORS = (0.5, 1.0, 2.0)
# dp-accounting converts RDP to (epsilon, delta) only above this order (it returns inf at and below it).
_LOWEST_CONVERTIBLE_ORDER = 1.01


def _order_index(order: float) -> int:
    matches = np.flatnonzero(RDP_ORDERS == order)
    if len(matches) != 1 or order <= _LOWEST_CONVERTIBLE_ORDER:
        raise ValueError(
            f"filter order {order!r} is not an order of the RDP grid above {_LOWEST_CONVERTIBLE_ORDER} "
            "(accounting.accountants.RDP_ORDERS); the ledger file was written by another dpfleet version"
        )
    return int(matches[0])


def order_epsilon(order: float, divergence: float, delta: float) -> float:
    """The epsilon at `delta` of a mechanism whose Renyi divergence at `order` is `divergence` (nats).

    dp-accounting's conversion at that one order (Canonne, Kamath and
    Steinke 2020, Proposition 12); inf when the divergence is unbounded.
    """
    if not math.isfinite(divergence):
        return math.inf
    epsilon, _ = compute_epsilon([order], [divergence], delta)
    return float(epsilon)


@dataclass(frozen=True)
class AdmissionRule:
    """How a dataset admits jobs: an RDP filter at fixed `orders`, with delta split evenly between them.

    Fixed when the dataset is created, from its budget alone (never from
    the jobs), and recorded with it. A job fits when, at one of the orders
    at least, the tally converts to an epsilon within the budget at
    `delta_per_order` = delta / K. Under that rule any sequence of jobs,
    each chosen after seeing the results of the earlier ones, is
    (budget, delta)-DP: at each order alone the rule is a Renyi filter
    (Feldman & Zrnic 2021), and a union bound over the K orders adds their
    delta/K (docs/ledger.md states and proves it).
    """

    orders: tuple[float, ...]
    delta: float
    name: str = FILTER_RULE

    def __post_init__(self) -> None:
        if self.name != FILTER_RULE:
            raise ValueError(f"unknown admission rule {self.name!r}; this dpfleet knows {FILTER_RULE!r}")
        if not self.orders or len(set(self.orders)) != len(self.orders):
            raise ValueError(f"an RDP filter needs one or more distinct orders (got {self.orders!r})")
        for order in self.orders:
            _order_index(order)

    @classmethod
    def for_budget(cls, budget_epsilon: float, delta: float) -> "AdmissionRule":
        """The rule of a new dataset with budget (`budget_epsilon`, `delta`).

        For Gaussian steps of total zCDP rho, the RDP epsilon rho * alpha +
        log(1/d) / (alpha - 1) is least at alpha* - 1 = sqrt(log(1/d) / rho);
        solving for the rho that fills the budget at d = delta / K gives
        alpha*. The filter watches the grid orders nearest (alpha* - 1) * 1/2,
        * 1 and * 2: subsampled steps with little noise are used best a
        little below alpha*, many small budgets a little above.
        """
        log_inverse_delta = math.log(FILTER_ORDER_COUNT / delta)
        best_minus_one = math.sqrt(log_inverse_delta) / (
            math.sqrt(log_inverse_delta + budget_epsilon) - math.sqrt(log_inverse_delta)
        )
        candidates = RDP_ORDERS[RDP_ORDERS > _LOWEST_CONVERTIBLE_ORDER]
        orders = sorted(
            {
                float(candidates[np.argmin(np.abs(np.log(candidates - 1.0) - math.log(best_minus_one * factor)))])
                for factor in _FILTER_ORDER_FACTORS
            }
        )
        return cls(tuple(orders), delta)

    @property
    def delta_per_order(self) -> float:
        """The delta each order's conversion is taken at: delta / K."""
        return self.delta / len(self.orders)

    def order_epsilons(self, tally: RdpTally) -> tuple[float, ...]:
        """Per order of the rule, the epsilon at delta / K of the tally's divergence there."""
        divergences = tally.divergences()
        return tuple(
            order_epsilon(order, float(divergences[_order_index(order)]), self.delta_per_order)
            for order in self.orders
        )

    def epsilon(self, tally: RdpTally) -> float:
        """The filter's epsilon of a tally: the least of `order_epsilons`; it fits a budget when one order does."""
        return min(self.order_epsilons(tally))

    def order_divergences(self, tally: RdpTally) -> tuple[float, ...]:
        """Per order of the rule, the tally's Renyi divergence (nats, rounded up; inf where unbounded)."""
        divergences = tally.divergences()
        return tuple(float(divergences[_order_index(order)]) for order in self.orders)

    def capacities(self, budget_epsilon: float) -> tuple[float, ...]:
        """Per order of the rule, the divergence (nats) at which its epsilon at delta / K reaches `budget_epsilon`.

        Inverts eps_k(rho) = rho + log(1 - 1/a) - log(a * delta / K) / (a - 1),
        which is linear in rho. What a scheduler compares demands with;
        admission itself stays `check_admission`.
        """
        return tuple(
            budget_epsilon - math.log1p(-1.0 / order) + math.log(order * self.delta_per_order) / (order - 1.0)
            for order in self.orders
        )

    def to_dict(self) -> dict:
        """JSON-ready dict, as stored with the dataset and in its history."""
        return {
            "rule": self.name,
            "orders": list(self.orders),
            "delta": self.delta,
            "delta_per_order": self.delta_per_order,
        }

    @classmethod
    def from_dict(cls, data: dict) -> "AdmissionRule":
        """Inverse of `to_dict`."""
        return cls(tuple(float(order) for order in data["orders"]), float(data["delta"]), data["rule"])


# ------------------------------------------------------------------ budgets


def fits_budget(epsilon: float, budget_epsilon: float) -> bool:
    """True when `epsilon` is below `budget_epsilon` by the safety margin (so equality is refused)."""
    return epsilon * (1.0 + ADMISSION_MARGIN) <= budget_epsilon


@dataclass(frozen=True)
class BudgetCheck:
    """One budget's answer to a job: does held + planned pass its filter, and by how much.

    `budget` says which budget ("dataset 'mnist'", "block 'd1' of dataset
    'mnist'", "tenant 'b''s quota on ..."); epsilons are the filter's, at
    `delta`: `held_epsilon` of what is committed and reserved now,
    `needed_epsilon` what the job adds to it, `remaining_epsilon` the budget
    minus held (what is left now); `held_after_epsilon` that of held +
    planned and `remaining_after_epsilon` the budget minus it (what would be
    left; negative when the job does not fit).
    """

    budget: str
    budget_epsilon: float
    delta: float
    held_epsilon: float
    held_after_epsilon: float
    needed_epsilon: float
    remaining_epsilon: float
    remaining_after_epsilon: float
    fits: bool

    def refusal(self, dataset: str) -> BudgetExceeded:
        """The BudgetExceeded this check stands for, on `dataset` as the caller names it."""
        return BudgetExceeded(dataset, self.remaining_epsilon, self.needed_epsilon, self.delta, self.budget)

    def to_dict(self) -> dict:
        """JSON-ready dict."""
        return {
            "budget": self.budget,
            "budget_epsilon": self.budget_epsilon,
            "delta": self.delta,
            "held_epsilon": self.held_epsilon,
            "held_after_epsilon": self.held_after_epsilon,
            "needed_epsilon": self.needed_epsilon,
            "remaining_epsilon": self.remaining_epsilon,
            "remaining_after_epsilon": self.remaining_after_epsilon,
            "fits": self.fits,
        }


def assess_admission(
    budget: str, rule: AdmissionRule, budget_epsilon: float, held: RdpTally, planned: RdpTally
) -> BudgetCheck:
    """Whether held + planned passes the filter `rule` within `budget_epsilon`, with the figures (see BudgetCheck)."""
    total_epsilon = rule.epsilon(held + planned)
    held_epsilon = rule.epsilon(held)
    return BudgetCheck(
        budget=budget,
        budget_epsilon=budget_epsilon,
        delta=rule.delta,
        held_epsilon=held_epsilon,
        held_after_epsilon=total_epsilon,
        needed_epsilon=total_epsilon - held_epsilon,
        remaining_epsilon=max(0.0, budget_epsilon - held_epsilon),
        remaining_after_epsilon=budget_epsilon - total_epsilon,
        fits=fits_budget(total_epsilon, budget_epsilon),
    )


def check_admission(
    dataset: str, rule: AdmissionRule, budget_epsilon: float, held: RdpTally, planned: RdpTally,
    budget: str | None = None,
) -> float:
    """Return the filter's epsilon of held + planned, or raise BudgetExceeded if it does not fit the budget.

    `held` is the tally of committed and reserved steps on the budget (the
    dataset's, a block's or a tenant's quota: `budget` says which, in
    words); `planned` the tally of the job asking for a reservation.
    """
    check = assess_admission(budget or f"dataset {dataset!r}", rule, budget_epsilon, held, planned)
    if not check.fits:
        raise check.refusal(dataset)
    return check.held_after_epsilon


@dataclass(frozen=True)
class FitReport:
    """A dry run of a reservation: `fits` when every budget the job would be charged to admits it.

    `checks` has one BudgetCheck per budget: the dataset's or each named
    block's, then the caller's quota on each where one is set.
    """

    dataset: str
    blocks: tuple[str, ...]
    checks: tuple[BudgetCheck, ...]

    @property
    def fits(self) -> bool:
        """True when every budget admits the job."""
        return all(check.fits for check in self.checks)

    def to_dict(self) -> dict:
        """JSON-ready dict (the `dpfleet ledger fits --json` shape)."""
        return {
            "dataset": self.dataset,
            "blocks": list(self.blocks),
            "fits": self.fits,
            "checks": [check.to_dict() for check in self.checks],
        }


def check_new_budget(dataset: str, rule: AdmissionRule, budget_epsilon: float, held: RdpTally) -> float:
    """A new budget for a dataset; refused when it would not cover what is committed and reserved."""
    budget_epsilon = check_budget_epsilon(budget_epsilon)
    held_epsilon = rule.epsilon(held)
    if not fits_budget(held_epsilon, budget_epsilon):
        raise FailedPrecondition(
            f"dataset {dataset!r} already has ε {held_epsilon:.6g} committed or reserved at δ={rule.delta:g}; "
            f"a budget of ε {budget_epsilon:g} would not cover it. Choose a budget above {held_epsilon:.6g}, "
            "or release reservations first"
        )
    return budget_epsilon


@dataclass(frozen=True)
class BudgetFigures:
    """A dataset's budget in epsilon at its delta (see the module docstring for each figure).

    `spent_epsilon_accountant` says which accountant gave `spent_epsilon`:
    "pld", or "rdp" when the caller chose not to wait for the PLD figure.
    """

    spent_epsilon: float
    spent_epsilon_rdp: float
    spent_epsilon_filter: float
    reserved_epsilon: float
    remaining_epsilon: float
    spent_epsilon_accountant: str


def shared_cache(maxsize: int) -> Callable[[Callable], Callable]:
    """A least-recently-used cache of `maxsize` results, like functools.lru_cache, computed once per arguments.

    Callers that ask for arguments already being computed wait for that
    computation rather than start their own; if it raises, each of them
    gets the error and the next call tries again. The cached function's
    `start(*args)` asks without waiting: see `start` below.
    """

    def decorate(function: Callable) -> Callable:
        results: OrderedDict = OrderedDict()
        computing: dict[tuple, Future] = {}
        lock = threading.Lock()
        in_background: list[Future] = []

        def claim(args: tuple, background: bool = False) -> tuple[Future | None, bool]:
            # The result's future, and whether the caller must compute it; for a background computation,
            # None when the last one is still running.
            with lock:
                if args in results:
                    results.move_to_end(args)
                    done: Future = Future()
                    done.set_result(results[args])
                    return done, False
                pending = computing.get(args)
                if pending is not None:
                    return pending, False
                if background and in_background and not in_background[0].done():
                    return None, False
                pending = computing[args] = Future()
                if background:
                    in_background[:] = [pending]
                return pending, True

        def compute(args: tuple, pending: Future) -> None:
            try:
                value = function(*args)
            except BaseException as error:
                with lock:
                    del computing[args]
                pending.set_exception(error)
                return
            with lock:
                del computing[args]
                results[args] = value
                if len(results) > maxsize:
                    results.popitem(last=False)
            pending.set_result(value)

        @functools.wraps(function)
        def cached(*args: object) -> object:
            pending, owner = claim(args)
            if owner:
                compute(args, pending)
            return pending.result()

        def start(*args: object) -> Future | None:
            """The result's future without waiting: done when cached, pending while some caller computes it.

            Otherwise the computation starts on a background thread and its
            future is returned, unless an earlier background computation is
            still running: then None, and nothing starts. One background
            thread at most, so callers that never wait cannot pile up work.
            """
            pending, owner = claim(args, background=True)
            if owner:
                threading.Thread(target=compute, args=(args, pending), name="dpfleet-cache", daemon=True).start()
            return pending

        def peek(*args: object) -> object | None:
            """The cached result, or None when it is not cached (nothing is computed)."""
            with lock:
                if args not in results:
                    return None
                results.move_to_end(args)
                return results[args]

        cached.start = start
        cached.peek = peek
        return cached

    return decorate


# The processes RDP curves are computed in, once a server asked for them (compute_curves_in_processes).
_CURVE_PROCESSES: list[ProcessPoolExecutor] = []
_CURVE_PROCESSES_LOCK = threading.Lock()


def compute_curves_in_processes(workers: int) -> None:
    """From now on compute RDP curves in `workers` processes of their own (once per process; later calls keep
    the first pool).

    A curve is 80-400 ms of Python that holds the GIL; computed in a request
    thread it slows every other request of the server, however short. In a
    process of its own it costs the server only the wait for its result.
    """
    with _CURVE_PROCESSES_LOCK:
        if not _CURVE_PROCESSES:
            # Spawned, not forked: the server's gRPC threads do not survive a fork.
            processes = ProcessPoolExecutor(
                max_workers=workers, mp_context=multiprocessing.get_context("spawn"),
                initializer=_end_with_parent, initargs=(os.getpid(),),
            )
            # Started and importing this module now (seconds on a busy machine), not on a request's deadline.
            for started in [processes.submit(_curve_process_ready) for _ in range(workers)]:
                started.result()
            _CURVE_PROCESSES.append(processes)


def _end_with_parent(parent_pid: int) -> None:
    """In a curve process: exit once the server that started it is gone, even by kill -9."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="dpfleet-curve-parent", daemon=True).start()


def _curve_process_ready() -> bool:
    """Nothing: unpickling it makes a curve process import this module."""
    return True


def _curve_anywhere(
    sampling_rate: float, noise_multiplier: float, sensitivity_factor: float
) -> tuple[tuple[int, ...], tuple[bool, ...]]:
    """`_computed_step_units` in the curve processes when there are some, else in this thread."""
    if _CURVE_PROCESSES:
        try:
            return _CURVE_PROCESSES[0].submit(
                _computed_step_units, sampling_rate, noise_multiplier, sensitivity_factor
            ).result()
        except BrokenProcessPool:
            pass  # a worker died (killed, out of memory): the answer is the same computed here
    return _computed_step_units(sampling_rate, noise_multiplier, sensitivity_factor)


# 80-400 ms of dp-accounting per mechanism; threads asking for the same one at once share the computation.
_step_curve = shared_cache(maxsize=4096)(_curve_anywhere)


@shared_cache(maxsize=1024)
def _spent_pld_epsilon(committed_events: Composition, delta: float) -> float:
    # The PLD of a long composition takes 0.1-1 s; a dataset's committed events change only on commit,
    # and statuses asking at once after a commit wait for one computation.
    return get_accountant("pld").epsilon(committed_events, delta)


@functools.lru_cache(maxsize=1024)
def _rdp_figures(
    budget_epsilon: float, rule: AdmissionRule, committed_events: Composition, held: RdpTally
) -> BudgetFigures:
    committed = RdpTally.of(committed_events)
    spent_rdp = committed.epsilon(rule.delta)
    spent_filter = rule.epsilon(committed)
    held_filter = rule.epsilon(held)
    return BudgetFigures(
        spent_epsilon=spent_rdp,
        spent_epsilon_rdp=spent_rdp,
        spent_epsilon_filter=spent_filter,
        reserved_epsilon=max(0.0, held_filter - spent_filter),
        remaining_epsilon=max(0.0, budget_epsilon - held_filter),
        spent_epsilon_accountant="rdp",
    )


def budget_figures(
    budget_epsilon: float,
    rule: AdmissionRule,
    committed_events: Composition,
    held: RdpTally,
    pld_may_be_pending: bool = False,
) -> BudgetFigures:
    """Spent (filter, and non-adaptive PLD and RDP), reserved and remaining epsilon of one dataset.

    `committed_events` are the dataset's committed steps; `held` the tally
    of committed and reserved-unrun steps; `rule` the dataset's admission
    rule. Cached: a status of an unchanged dataset costs no accounting. The
    PLD epsilon of newly committed events takes 0.1-1 s; with
    `pld_may_be_pending` a caller gets the figures at once, with the
    non-adaptive RDP bound as `spent_epsilon` (labelled "rdp") until the PLD
    figure, started in the background, is ready.
    """
    figures = _rdp_figures(budget_epsilon, rule, committed_events, held)
    if not pld_may_be_pending:
        spent_pld = _spent_pld_epsilon(committed_events, rule.delta)
    else:
        pending = _spent_pld_epsilon.start(committed_events, rule.delta)
        if pending is None or not pending.done() or pending.exception() is not None:
            return figures
        spent_pld = pending.result()
    return replace(figures, spent_epsilon=spent_pld, spent_epsilon_accountant="pld")


# ----------------------------------------------------------- who is asking


@dataclass(frozen=True)
class Caller:
    """Who makes a request: `actor` is written to the history; `tenant` owns bare dataset names.

    An admin sees and changes every tenant's datasets; a tenant only its own.
    """

    actor: str
    tenant: str | None
    admin: bool = False
    # The key id of the token the caller authenticated with (None: no token, as the embedded ledger's admin).
    key_id: str | None = None


def tenant_caller(tenant: str) -> Caller:
    """A tenant acting on its own datasets."""
    return Caller(actor=tenant, tenant=tenant)


ADMIN = Caller(actor=ADMIN_ACTOR, tenant=None, admin=True)
# Who releases a reservation whose lease ran out, in the history.
LEASE_EXPIRY = Caller(actor="ledger (lease expired)", tenant=None, admin=True)
# Who admits a queued job, and who takes one out of the queue at its deadline, in the history.
QUEUE_ADMISSION = Caller(actor="ledger (queue)", tenant=None, admin=True)
QUEUE_TIMEOUT = Caller(actor="ledger (queue deadline)", tenant=None, admin=True)


@dataclass(frozen=True)
class DatasetRef:
    """A dataset's full name: the tenant that owns it and its name within that tenant."""

    tenant: str
    name: str


def no_access(reference: str) -> PermissionDenied:
    """The one error for a dataset that is someone else's or does not exist (existence is never revealed)."""
    return PermissionDenied(
        f"no dataset {reference!r} that this token may use; a tenant sees only its own datasets "
        "(dpfleet ledger status lists them)"
    )


def no_reservation(reservation_id: str) -> PermissionDenied:
    """The one error for a reservation that is someone else's or does not exist."""
    return PermissionDenied(
        f"no reservation {reservation_id!r} that this token may use (dpfleet ledger jobs lists yours)"
    )


def resolve_dataset(caller: Caller, reference: object, shared: bool = False) -> DatasetRef:
    """The dataset a caller means by `reference`: 'name' in its own tenant, or 'tenant/name'.

    A tenant naming another tenant's dataset gets PermissionDenied, unless
    `shared`: then the store lets it through only where the tenant holds a
    quota there. An admin with no tenant of its own must write 'tenant/name'.
    """
    if not isinstance(reference, str):
        raise InvalidArgument(f"dataset must be a name (got {reference!r})")
    tenant, slash, name = reference.rpartition("/")
    if slash:
        check_name("tenant name", tenant)
    check_name("dataset name", name)
    if not slash:
        if caller.tenant is None:
            raise InvalidArgument(
                f"the admin owns no datasets; name a tenant's dataset as TENANT/NAME (got {reference!r})"
            )
        tenant = caller.tenant
    if not caller.admin and tenant != caller.tenant and not shared:
        raise no_access(reference)
    return DatasetRef(tenant, name)


def display_name(caller: Caller, dataset: DatasetRef) -> str:
    """A dataset's name as the caller writes it: bare in its own tenant, 'tenant/name' otherwise."""
    return dataset.name if dataset.tenant == caller.tenant else f"{dataset.tenant}/{dataset.name}"


# ------------------------------------------------------------------ tokens

_TOKEN_PREFIX = "dpf"
_SCRYPT = {"n": 2**14, "r": 8, "p": 1, "dklen": 32}


def new_token() -> tuple[str, str]:
    """A fresh tenant token and its key id: (key_id, token). The token is shown once and never stored."""
    key_id = secrets.token_hex(8)
    return key_id, f"{_TOKEN_PREFIX}_{key_id}_{secrets.token_urlsafe(32)}"


def token_key_id(token: str) -> str:
    """The key id a tenant token starts with, used to find its salted hash."""
    prefix, _, rest = token.partition("_")
    key_id, _, secret = rest.partition("_")
    if prefix != _TOKEN_PREFIX or len(key_id) != 16 or not secret:
        raise Unauthenticated(
            "the token is not a dpfleet ledger token; use the token printed by dpfleet ledger tenant create"
        )
    return key_id


def token_digest(token: str) -> bytes:
    """The SHA-256 digest of a token, as stored (schema version 7 on).

    No salt, no slow hash and no server key: a ledger token carries 256
    random bits, so its digest cannot be inverted or looked up in a table,
    and a wrong token costs one fast hash. A key held by every server (HMAC)
    would protect only guessable tokens, and would be one more secret to
    hand out and rotate. Admin tokens given to a server are stored the same
    way, so they must be random too (`check_admin_token`).
    """
    return hashlib.sha256(token.encode()).digest()


def admin_key_id(token: str) -> str:
    """The key id of an admin token: its own for a dpfleet token, else one taken from its digest."""
    try:
        return token_key_id(token)
    except Unauthenticated:
        return "adm" + token_digest(token).hex()[:13]


def hash_token(token: str, salt: bytes) -> bytes:
    """Salted scrypt hash of a token, as stored before schema version 7 (checked once, then replaced)."""
    return hashlib.scrypt(token.encode(), salt=salt, **_SCRYPT)


def token_matches(token: str, salt: bytes, stored_hash: bytes) -> bool:
    """True when `token` hashes to `stored_hash` under `salt` (constant-time comparison)."""
    return hmac.compare_digest(hash_token(token, salt), stored_hash)


# ---------------------------------------------------------------- records


@dataclass(frozen=True)
class TenantCreated:
    """A new token, shown this once and stored only as its digest: a new tenant's, a tenant's rotated one, or
    (tenant None) a rotated admin token."""

    tenant: str | None
    token: str

    def to_dict(self) -> dict:
        """JSON-ready dict."""
        return {"tenant": self.tenant, "token": self.token}


@dataclass(frozen=True)
class Reservation:
    """A job's hold on a dataset: its planned events and how many of their steps are committed.

    With a lease (`lease_seconds`), the hold ends at `expires_at` (UTC, ISO
    8601) unless a commit renews it first; `lease_expired` says the
    reservation was released that way. `blocks` are the dataset's blocks the
    job is charged to, every one of them in full; () for the dataset itself.
    """

    reservation_id: str
    dataset: str
    job_id: str
    state: str
    planned: Composition
    committed_steps: int
    created_at: str
    released_at: str | None = None
    lease_seconds: float | None = None
    expires_at: str | None = None
    lease_expired: bool = False
    blocks: tuple[str, ...] = ()

    @property
    def planned_steps(self) -> int:
        """Steps in the plan."""
        return self.planned.steps

    @property
    def unrun_steps(self) -> int:
        """Planned steps still held: not committed, and the reservation not released."""
        return self.planned.steps - self.committed_steps if self.state == ACTIVE else 0

    def to_dict(self) -> dict:
        """JSON-ready dict."""
        return {
            "reservation_id": self.reservation_id,
            "dataset": self.dataset,
            "job_id": self.job_id,
            "state": self.state,
            "planned_steps": self.planned_steps,
            "committed_steps": self.committed_steps,
            "unrun_steps": self.unrun_steps,
            "planned_events": self.planned.to_dict(),
            "created_at": self.created_at,
            "released_at": self.released_at,
            "lease_seconds": self.lease_seconds,
            "expires_at": self.expires_at,
            "lease_expired": self.lease_expired,
            "blocks": list(self.blocks),
        }


@dataclass(frozen=True)
class QueuedJob:
    """A job waiting for budget on a dataset, or what became of it.

    `state` is one of QUEUE_STATES; once admitted, `reservation_id` is the
    reservation it holds. While queued, `position` (1 = next) and `reason`
    say where it stands under the dataset's policy; `deadline` (UTC, ISO
    8601) is when it gives up waiting, None to wait until admitted or
    cancelled.
    """

    queue_id: str
    dataset: str
    job_id: str
    state: str
    planned: Composition
    priority: int
    created_at: str
    deadline: str | None = None
    position: int = 0
    reason: str = ""
    reservation_id: str | None = None
    ended_at: str | None = None
    lease_seconds: float | None = None

    def to_dict(self) -> dict:
        """JSON-ready dict."""
        return {
            "queue_id": self.queue_id,
            "dataset": self.dataset,
            "job_id": self.job_id,
            "state": self.state,
            "planned_steps": self.planned.steps,
            "priority": self.priority,
            "created_at": self.created_at,
            "deadline": self.deadline,
            "position": self.position,
            "reason": self.reason,
            "reservation_id": self.reservation_id,
            "ended_at": self.ended_at,
            "lease_seconds": self.lease_seconds,
        }


@dataclass(frozen=True)
class CommitResult:
    """What one commit charged; a retry with the same sequence returns the same result."""

    reservation_id: str
    sequence: int
    steps: int
    committed_steps: int
    planned_steps: int

    @property
    def unrun_steps(self) -> int:
        """Planned steps not committed yet after this commit."""
        return self.planned_steps - self.committed_steps

    def to_dict(self) -> dict:
        """JSON-ready dict."""
        return {
            "reservation_id": self.reservation_id,
            "sequence": self.sequence,
            "steps": self.steps,
            "committed_steps": self.committed_steps,
            "planned_steps": self.planned_steps,
        }


@dataclass(frozen=True)
class BlockStatus:
    """One block of a dataset: its own (epsilon, delta) budget and filter, and the figures of its tally.

    The figures mean what they mean for a dataset (see DatasetStatus).
    """

    name: str
    budget_epsilon: float
    delta: float
    admission: AdmissionRule
    spent_epsilon: float
    spent_epsilon_rdp: float
    spent_epsilon_filter: float
    reserved_epsilon: float
    remaining_epsilon: float
    spent_epsilon_accountant: str = "pld"
    data: dict | None = None

    def to_dict(self) -> dict:
        """JSON-ready dict; `data` is where its rows are (None: a block added before blocks declared it)."""
        return {"name": self.name, **budget_dict(self), "data": self.data}


def budget_dict(status: "BlockStatus | DatasetStatus") -> dict:
    """The budget and figures a dataset's or a block's status share, as JSON-ready dict entries."""
    return {
        "budget_epsilon": status.budget_epsilon,
        "delta": status.delta,
        "admission": status.admission.to_dict(),
        "spent_epsilon_filter": status.spent_epsilon_filter,
        "spent_epsilon": status.spent_epsilon,
        "spent_epsilon_accountant": status.spent_epsilon_accountant,
        "spent_epsilon_rdp": status.spent_epsilon_rdp,
        "reserved_epsilon": status.reserved_epsilon,
        "remaining_epsilon": status.remaining_epsilon,
    }


@dataclass(frozen=True)
class QuotaStatus:
    """A tenant's quota on a dataset (`block` None) or one of its blocks, and the tenant's use of it.

    The quota is an extra RDP filter at its own orders on the tenant's own
    tally, beside the budget's filter. `quota_epsilon` is at the budget's
    delta; `spent_epsilon_filter` + `reserved_epsilon` + `remaining_epsilon`
    = `quota_epsilon`, in the quota's filter epsilon. `inherited` marks a
    quota set on the dataset that applies to this block.
    """

    tenant: str
    block: str | None
    quota_epsilon: float
    admission: AdmissionRule
    spent_epsilon_filter: float
    reserved_epsilon: float
    remaining_epsilon: float
    inherited: bool = False

    def to_dict(self) -> dict:
        """JSON-ready dict."""
        return {
            "tenant": self.tenant,
            "block": self.block,
            "quota_epsilon": self.quota_epsilon,
            "admission": self.admission.to_dict(),
            "spent_epsilon_filter": self.spent_epsilon_filter,
            "reserved_epsilon": self.reserved_epsilon,
            "remaining_epsilon": self.remaining_epsilon,
            "inherited": self.inherited,
        }


def quota_status(
    tenant: str, block: str | None, quota_epsilon: float, rule: AdmissionRule, committed_events: Composition,
    held: RdpTally, inherited: bool = False,
) -> QuotaStatus:
    """A tenant's quota figures from its committed events and its tally on the budget (filter epsilons only)."""
    figures = _rdp_figures(quota_epsilon, rule, committed_events, held)
    return QuotaStatus(
        tenant, block, quota_epsilon, rule, figures.spent_epsilon_filter, figures.reserved_epsilon,
        figures.remaining_epsilon, inherited,
    )


@dataclass(frozen=True)
class DatasetStatus:
    """A dataset's budget and where it went, in epsilon at `delta`.

    `admission` is the rule the dataset admits jobs by; `spent_epsilon_filter`
    what that rule counts against the committed steps, and
    spent_epsilon_filter + reserved_epsilon + remaining_epsilon = budget.
    `spent_epsilon` (PLD) and `spent_epsilon_rdp` are the epsilon of the same
    steps as if every job had been fixed in advance: non-adaptive figures,
    tighter, not what the guarantee rests on.
    `jobs` are the reservations still active (holding budget) that the
    caller may see: a tenant sees only its own;
    `released_jobs` counts the finished ones (dpfleet ledger jobs lists them).
    `blocks` are the dataset's blocks, each with its own budget; `quotas`
    the tenants' quotas on the dataset and its blocks (a tenant sees its own).
    `spent_epsilon_accountant` is "pld", or "rdp" while the PLD figure of
    new commits is computed for a caller that chose not to wait for it.
    `privacy_unit` is what one unit of protection is: a row ('example') or a
    person with all its rows ('user'); every epsilon is per that unit.
    `scheduling` is how its queue is served; `queued_jobs` counts the jobs waiting.
    """

    name: str
    tenant: str
    budget_epsilon: float
    delta: float
    admission: AdmissionRule
    spent_epsilon: float
    spent_epsilon_rdp: float
    spent_epsilon_filter: float
    reserved_epsilon: float
    remaining_epsilon: float
    jobs: tuple[Reservation, ...] = ()
    released_jobs: int = 0
    spent_epsilon_accountant: str = "pld"
    privacy_unit: str = EXAMPLE
    blocks: tuple[BlockStatus, ...] = ()
    quotas: tuple[QuotaStatus, ...] = ()
    scheduling: SchedulingPolicy = SchedulingPolicy()
    queued_jobs: int = 0

    def to_dict(self) -> dict:
        """JSON-ready dict (the `dpfleet ledger status --json` shape)."""
        return {
            "name": self.name,
            "tenant": self.tenant,
            "privacy_unit": self.privacy_unit,
            **budget_dict(self),
            "jobs": [job.to_dict() for job in self.jobs],
            "released_jobs": self.released_jobs,
            "blocks": [block.to_dict() for block in self.blocks],
            "quotas": [quota.to_dict() for quota in self.quotas],
            "scheduling": self.scheduling.to_dict(),
            "queued_jobs": self.queued_jobs,
        }


@dataclass(frozen=True)
class HistoryEntry:
    """One change to the ledger: when (UTC, ISO 8601), who, what, on which dataset, and the details."""

    entry_id: int
    at: str
    actor: str
    action: str
    dataset: str | None
    details: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        """JSON-ready dict."""
        return {
            "entry_id": self.entry_id,
            "at": self.at,
            "actor": self.actor,
            "action": self.action,
            "dataset": self.dataset,
            "details": self.details,
        }


# ------------------------------------------------------------ verification


def history_hash(
    previous_hash: str,
    entry_id: int,
    at: str,
    actor: str,
    action: str,
    tenant: str | None,
    dataset_id: int | None,
    details_json: str,
    key: bytes | None = None,
) -> str:
    """The hash a history entry carries: HMAC-SHA-256 (hex) under the history `key` over the previous entry's hash
    and every stored field.

    The first entry's previous hash is "". Editing, removing or reordering
    an entry changes every hash after it, and without the key nobody can
    compute the hashes of a rewritten history. `key` None gives the plain
    SHA-256 of files from before schema version 9, which only the migration
    that keys them reads.
    """
    payload = json.dumps(
        [previous_hash, entry_id, at, actor, action, tenant, dataset_id, details_json],
        ensure_ascii=True,
        separators=(",", ":"),
    ).encode()
    if key is None:
        return hashlib.sha256(payload).hexdigest()
    return hmac.new(key, payload, hashlib.sha256).hexdigest()


@dataclass(frozen=True)
class StoredEntry:
    """A history entry as the store holds it, with `details_json` the stored text, for `verify`."""

    entry_id: int
    at: str
    actor: str
    action: str
    tenant: str | None
    dataset_id: int | None
    details_json: str
    previous_hash: str
    entry_hash: str


@dataclass(frozen=True)
class StoredDataset:
    """What a dataset's row holds now, for `verify` to compare with the replay of its history."""

    dataset_id: int
    name: str
    budget_epsilon: float
    delta: float
    admission: AdmissionRule
    held: RdpTally
    committed_events: Composition
    block_of: int | None = None
    block: str | None = None
    data: dict | None = None


@dataclass(frozen=True)
class StoredTenantUse:
    """A tenant's tally on one budget (a dataset or a block) and its quota there, if any, for `verify`."""

    budget_id: int
    tenant: str
    quota_epsilon: float | None
    quota_rule: AdmissionRule | None
    held: RdpTally
    committed_events: Composition


@dataclass(frozen=True)
class Finding:
    """One thing `verify` found wrong: the history entry (None: the dataset's row), its dataset, and what."""

    entry_id: int | None
    dataset: str | None
    problem: str
    # What the finding is about when it is no history entry: a table's row, or the signed head.
    row: str = "dataset row"

    def __str__(self) -> str:
        where = f"entry {self.entry_id}" if self.entry_id is not None else self.row
        return f"{where}{f' of dataset {self.dataset}' if self.dataset else ''}: {self.problem}"

    def to_dict(self) -> dict:
        """JSON-ready dict."""
        return {"entry_id": self.entry_id, "dataset": self.dataset, "problem": self.problem}


ANCHOR_ACTION = "anchor_history"


def chain_findings(
    entries: list[StoredEntry], dataset_names: dict[int, str], key: bytes | None = None
) -> list[Finding]:
    """Every entry whose previous hash or own hash does not match the chain under the history `key`, oldest first.

    An edited entry shows as a wrong hash at that entry; a removed one as a
    wrong previous hash at the entry after it. What the migration that keyed
    an older file found wrong in its unkeyed chain (recorded in its
    `anchor_history` entry) is reported again at that entry.
    """
    findings = []
    previous = ""
    for entry in entries:
        if entry.action == ANCHOR_ACTION:
            unkeyed = json.loads(entry.details_json).get("unkeyed_chain_findings") or []
            findings += [
                Finding(entry.entry_id, None, f"before the history was keyed, its unkeyed chain had: {problem}")
                for problem in unkeyed
            ]
        dataset = dataset_names.get(entry.dataset_id) if entry.dataset_id is not None else None
        if entry.previous_hash != previous:
            findings.append(
                Finding(entry.entry_id, dataset, "its previous hash is not the hash of the entry before it")
            )
        expected = history_hash(
            entry.previous_hash, entry.entry_id, entry.at, entry.actor, entry.action, entry.tenant,
            entry.dataset_id, entry.details_json, key,
        )
        if entry.entry_hash != expected:
            findings.append(Finding(entry.entry_id, dataset, "its fields do not match its hash (the row was edited)"))
        previous = entry.entry_hash
    return findings


HEAD_SCHEMA = "dpfleet.ledger_head"


@dataclass(frozen=True)
class SignedHead:
    """The history's head as `dpfleet ledger head` prints it: how many entries, the last one's hash, when (UTC).

    `signature` is an HMAC-SHA-256 under the history key. An HMAC, not a
    public-key signature: whoever checks it holds the key (the operator
    running `verify --head`), which is also who can make one.
    """

    entries: int
    head_hash: str
    at: str
    signature: str

    def to_dict(self) -> dict:
        """JSON-ready dict (the head file)."""
        return {"schema": HEAD_SCHEMA, "entries": self.entries, "head_hash": self.head_hash, "at": self.at,
                "signature": self.signature}

    @classmethod
    def from_dict(cls, data: object) -> "SignedHead":
        """Inverse of `to_dict`; InvalidArgument for anything else."""
        if not isinstance(data, dict) or data.get("schema") != HEAD_SCHEMA:
            raise InvalidArgument(f"a head file is the JSON object dpfleet ledger head prints (schema {HEAD_SCHEMA})")
        entries, head_hash, at, signature = (data.get(name) for name in ("entries", "head_hash", "at", "signature"))
        if isinstance(entries, bool) or not isinstance(entries, int) or entries < 0 or not all(
            isinstance(value, str) for value in (head_hash, at, signature)
        ):
            raise InvalidArgument("a head file needs entries (an integer >= 0), and head_hash, at and signature "
                                  "(strings); use the file dpfleet ledger head printed, unedited")
        return cls(entries, head_hash, at, signature)


def _head_signature(key: bytes, entries: int, head_hash: str, at: str) -> str:
    # A 4-item list never reads as the 8-item list an entry's hash is taken over.
    payload = json.dumps([HEAD_SCHEMA, entries, head_hash, at], ensure_ascii=True, separators=(",", ":"))
    return hmac.new(key, payload.encode(), hashlib.sha256).hexdigest()


def sign_head(key: bytes, entries: int, head_hash: str, at: str) -> SignedHead:
    """The head of a history of `entries` entries whose last hash is `head_hash`, signed at `at` with `key`."""
    return SignedHead(entries, head_hash, at, _head_signature(key, entries, head_hash, at))


def head_findings(key: bytes, head: SignedHead, entries: list[StoredEntry]) -> list[Finding]:
    """What shows that `entries` do not extend a head recorded earlier: a cut tail, or a rewritten history."""
    if not hmac.compare_digest(head.signature, _head_signature(key, head.entries, head.head_hash, head.at)):
        return [Finding(None, None, "its signature does not match the history key: it was edited, or signed with "
                                    "another key", row="head file")]
    if len(entries) < head.entries:
        return [Finding(None, None, f"the history has {len(entries)} entries; at {head.at} it had {head.entries}: "
                                    "entries were cut from its tail", row="signed head")]
    if head.entries and entries[head.entries - 1].entry_hash != head.head_hash:
        return [Finding(entries[head.entries - 1].entry_id, None,
                        f"its hash is not the head hash signed at {head.at}: the history was rewritten")]
    return []


@dataclass(frozen=True)
class StoredReservation:
    """A row of the reservations table, for `verify` to compare with the replay of its history."""

    reservation_id: str
    dataset_id: int
    tenant: str
    job_id: str
    planned: Composition
    committed_steps: int
    state: str
    lease_seconds: float | None
    lease_expired: bool
    blocks: tuple[str, ...]


@dataclass(frozen=True)
class StoredCommit:
    """A row of the commits table: a reservation's commit of `steps` under `sequence`, reaching `committed_steps`."""

    reservation_id: str
    sequence: int
    steps: int
    committed_steps: int


@dataclass(frozen=True)
class StoredTenant:
    """A row of the tenants table: its token's key id and a digest of its salt and token hash (None: no token)."""

    name: str
    key_id: str | None
    token_digest: str | None


def stored_token_digest(salt: bytes | None, token_hash: bytes | None) -> str | None:
    """What a tenant's token entries record of its stored salt and hash, so `verify` sees them swapped.

    None for a tenant without a token (revoked); the salt is None for a token stored by its digest.
    """
    if token_hash is None:
        return None
    return hashlib.sha256(bytes(salt or b"") + bytes(token_hash)).hexdigest()


def job_findings(
    entries: list[StoredEntry], reservations: list[StoredReservation], commits: list[StoredCommit]
) -> list[Finding]:
    """Replay every reservation and commit from the history and compare them with the tables' rows."""
    replayed: dict[str, dict] = {}
    replayed_commits = set()
    for entry in entries:
        if entry.action not in _JOB_ACTIONS:
            continue
        details = json.loads(entry.details_json)
        if entry.action == "reserve":
            replayed[details["reservation_id"]] = {
                "dataset_id": entry.dataset_id, "tenant": entry.tenant, "job_id": details["job_id"],
                "planned": Composition.from_dict(details["planned_events"]), "committed_steps": 0, "state": ACTIVE,
                "lease_seconds": details.get("lease_seconds"), "lease_expired": False,
                "blocks": tuple(details.get("blocks") or ()),
            }
        elif details["reservation_id"] in replayed:
            job = replayed[details["reservation_id"]]
            if entry.action == "commit":
                steps = Composition.from_dict(details["events"]).steps
                job["committed_steps"] += steps
                replayed_commits.add(
                    StoredCommit(details["reservation_id"], details["sequence"], steps, job["committed_steps"])
                )
            else:
                job["state"], job["lease_expired"] = RELEASED, entry.action == "expire"
    findings = []
    stored = {reservation.reservation_id: reservation for reservation in reservations}
    for reservation_id in sorted(set(stored) | set(replayed)):
        row, job = stored.get(reservation_id), replayed.get(reservation_id)
        if row is None or job is None:
            findings.append(_unpaired(reservation_id, job is None, "reservation"))
            continue
        differing = [name for name, value in job.items() if getattr(row, name) != value]
        if differing:
            findings.append(Finding(None, None, f"{reservation_id}: its row differs from what its history replays "
                                                f"to in {', '.join(differing)}", row="reservation"))
    for commit in sorted(set(commits) ^ replayed_commits, key=lambda c: (c.reservation_id, c.sequence, c.steps)):
        where = "has a row but no history entry" if commit in set(commits) else "is in the history but has no row"
        findings.append(Finding(None, None, f"sequence {commit.sequence} of {commit.reservation_id} ({commit.steps} "
                                            f"steps) {where}", row="commit"))
    return findings


def _unpaired(name: str, row_only: bool, kind: str) -> Finding:
    """The finding for a `kind` row that its history does not replay to (`row_only`), or history without its row."""
    where = "has a row but no history" if row_only else "is in the history but has no row"
    return Finding(None, None, f"{name} {where}", row=kind)


def tenant_findings(entries: list[StoredEntry], tenants: list[StoredTenant]) -> list[Finding]:
    """Compare the tenants table with the history: every tenant, its token's key id and digest.

    A tenant's token is the one its last `create_tenant`, `rotate_token` or
    `revoke_token` entry names (a revoked tenant has none).
    """
    created = {}
    for entry in entries:
        if entry.action in ("create_tenant", "rotate_token", "revoke_token"):
            details = json.loads(entry.details_json)
            if details.get("tenant") is None:  # an admin token's rotation or revocation
                continue
            if entry.action == "revoke_token":
                details = {**details, "key_id": None, "token_digest": None}
            created[details["tenant"]] = details if entry.action == "create_tenant" else {
                **created.get(details["tenant"], {}), **details}
    findings = []
    stored = {tenant.name: tenant for tenant in tenants}
    for name in sorted(set(stored) | set(created)):
        row, details = stored.get(name), created.get(name)
        if row is None or details is None:
            findings.append(_unpaired(name, details is None, "tenant"))
        elif row.key_id != details.get("key_id") or (
            "token_digest" in details and row.token_digest != details["token_digest"]
        ):
            findings.append(Finding(None, None, f"{name}: its token is not the one its history records (a token "
                                                "was swapped in the table)", row="tenant"))
    return findings


class _Replay:
    """A budget's state rebuilt from its history, entry by entry, noting each departure from the rules.

    The budget is a dataset's or a block's (`recorded_held` finds the
    filter epsilon the reserve entry recorded for it), or a tenant's use of
    one (`quota`: its quota, set on the budget itself or on the dataset the
    block belongs to; nothing is checked while none is set).
    """

    def __init__(self, dataset: str, recorded_held: Callable[[dict], float | None] | None = None,
                 quota: bool = False) -> None:
        self.dataset = dataset
        self.recorded_held = recorded_held or (lambda details: None)
        self.quota = quota
        self.findings: list[Finding] = []
        self.budget_epsilon: float | None = None
        self.delta: float | None = None
        self.admission: AdmissionRule | None = None
        # A tenant's quota set on the dataset applies to each of its blocks that has none of its own.
        self.dataset_quota: tuple[float, AdmissionRule] | None = None
        self.held = RdpTally.zero()
        self.committed = Composition()
        self.plans: dict[str, Composition] = {}
        self.committed_steps: dict[str, int] = {}

    def note(self, entry: StoredEntry, problem: str) -> None:
        self.findings.append(Finding(entry.entry_id, self.dataset, problem))

    def note_structure(self, entry: StoredEntry, problem: str) -> None:
        # A tenant's use replays the same jobs as its budget, whose replay reports how they fit together.
        if not self.quota:
            self.note(entry, problem)

    def limit(self) -> tuple[float, AdmissionRule | None] | None:
        if self.budget_epsilon is not None:
            return self.budget_epsilon, self.admission
        return self.dataset_quota

    def fits(self, epsilon_of: Callable[[RdpTally], float], tally: RdpTally) -> tuple[bool, float]:
        epsilon = epsilon_of(tally)
        return fits_budget(epsilon, self.limit()[0]), epsilon

    def admission_epsilon(self, tally: RdpTally) -> float:
        # Before a file had filters (schema version 2) a job was admitted by the RDP epsilon over the whole grid.
        rule = self.limit()[1]
        return rule.epsilon(tally) if rule is not None else tally.epsilon(self.delta)

    def apply(self, entry: StoredEntry, from_dataset: bool = False) -> None:
        self.apply_details(entry, entry.action, json.loads(entry.details_json), from_dataset)

    def apply_details(
        self, entry: StoredEntry | HistoryEntry, action: str, details: dict, from_dataset: bool = False
    ) -> None:
        if action in ("create_dataset", "add_block"):
            self.budget_epsilon, self.delta = float(details["epsilon"]), float(details["delta"])
            if "admission" in details:
                self.admission = AdmissionRule.from_dict(details["admission"])
        elif action == "set_quota" and from_dataset:
            self.dataset_quota = (float(details["epsilon"]), AdmissionRule.from_dict(details["admission"]))
        elif action == "set_quota":
            self.budget_epsilon = float(details["epsilon"])
            self.admission = AdmissionRule.from_dict(details["admission"])
        elif action == "adopt_admission_rule":
            self.admission = AdmissionRule.from_dict(details["admission"])
        elif action == "raise_budget":
            self.budget_epsilon = float(details["to"])
        elif action == "reserve":
            self.reserve(entry, details)
        elif action == "commit":
            self.commit(entry, details)
        elif action in ("release", "expire"):
            self.release(entry, details)

    def reserve(self, entry: StoredEntry, details: dict) -> None:
        planned = Composition.from_dict(details["planned_events"])
        if "job_events" in details:
            job_events = Composition.from_dict(details["job_events"])
            if group_events(job_events, details["rows_per_person"]) != planned:
                self.note_structure(entry, f"charges events that are not the group-privacy bound of its job's "
                                           f"events for {details['rows_per_person']} rows per person")
        if self.limit() is not None:
            admitted, epsilon = self.fits(self.admission_epsilon, self.held + RdpTally.of(planned))
            if not admitted:
                self.note(entry, f"admitted a job to ε {epsilon:.6g} over the {self.kind} ε {self.limit()[0]:g}")
            recorded = self.recorded_held(details)
            if recorded is not None and recorded != epsilon:
                self.note(entry, f"records ε {recorded!r} held after admission; its events give {epsilon!r}")
        self.plans[details["reservation_id"]] = planned
        self.committed_steps[details["reservation_id"]] = 0
        self.held = self.held + RdpTally.of(planned)

    @property
    def kind(self) -> str:
        return "quota" if self.quota else "budget"

    def commit(self, entry: StoredEntry, details: dict) -> None:
        reservation_id = details["reservation_id"]
        block = Composition.from_dict(details["events"])
        if reservation_id not in self.plans:
            self.note_structure(entry, f"commits to reservation {reservation_id}, which is not active in the replay")
            return
        _, unrun = split_steps(self.plans[reservation_id], self.committed_steps[reservation_id])
        if block.steps > unrun.steps or split_steps(unrun, block.steps)[0] != block:
            self.note_structure(
                entry, f"charges events that are not the next {block.steps} planned steps of {reservation_id}"
            )
        limit = self.limit()
        if limit is not None and limit[1] is not None:
            admitted, epsilon = self.fits(limit[1].epsilon, RdpTally.of(self.committed.then(block)))
            if not admitted:
                self.note(entry, f"commits to filter ε {epsilon:.6g}, over the {self.kind} ε {limit[0]:g}")
        self.committed = canonical(self.committed.then(block))
        self.committed_steps[reservation_id] += block.steps

    def release(self, entry: StoredEntry, details: dict) -> None:
        reservation_id = details["reservation_id"]
        if reservation_id not in self.plans:
            self.note_structure(entry, f"releases reservation {reservation_id}, which is not active in the replay")
            return
        plan = self.plans.pop(reservation_id)
        committed_steps = self.committed_steps.pop(reservation_id)
        if (details["committed_steps"], details["freed_steps"]) != (committed_steps, plan.steps - committed_steps):
            self.note_structure(
                entry,
                f"records {details['committed_steps']} committed and {details['freed_steps']} freed steps of "
                f"{reservation_id}; its commits give {committed_steps} and {plan.steps - committed_steps}",
            )
        self.held = self.held - RdpTally.of(split_steps(plan, committed_steps)[1])


@dataclass(frozen=True)
class Verification:
    """What `verify` checked and found: keep `head_hash` elsewhere to notice a history rewritten from the start."""

    entries: int
    datasets: int
    head_hash: str
    findings: tuple[Finding, ...]

    def to_dict(self) -> dict:
        """JSON-ready dict (the `dpfleet ledger verify --json` shape)."""
        return {
            "entries": self.entries,
            "datasets": self.datasets,
            "head_hash": self.head_hash,
            "findings": [finding.to_dict() for finding in self.findings],
        }


_JOB_ACTIONS = ("reserve", "commit", "release", "expire")
_QUEUE_ACTIONS = ("enqueue", "reserve", "cancel_queued", "queue_timeout")


def _budgets_of(entry: StoredEntry, block_ids: dict[tuple[int, str], int]) -> list[int]:
    """The budgets (dataset or block rows) an entry is about: a job's entries name the blocks it is charged to."""
    if entry.action in _JOB_ACTIONS:
        blocks = json.loads(entry.details_json).get("blocks") or ()
        if blocks:
            return [block_ids.get((entry.dataset_id, block), -1) for block in blocks]
    return [entry.dataset_id] if entry.dataset_id is not None else []


def verify_history(
    entries: list[StoredEntry],
    datasets: list[StoredDataset],
    uses: list[StoredTenantUse] = (),
    *,
    key: bytes | None = None,
    reservations: list[StoredReservation] = (),
    commits: list[StoredCommit] = (),
    tenants: list[StoredTenant] = (),
    head: SignedHead | None = None,
) -> Verification:
    """Check the hash chain of every entry under the history `key`, then replay each dataset's, block's and
    tenant use's history, and every reservation, commit and tenant, against the tables' rows.

    `datasets` holds the blocks too (their `block_of` names the dataset
    they belong to); `uses` each tenant's tally and quota on a budget.
    With `head` (a head signed earlier), also check that the history still
    extends it: the one check that sees a tail cut together with the rows
    it changed.
    """
    names = {dataset.dataset_id: dataset.name for dataset in datasets}
    findings = chain_findings(entries, names, key)
    if head is not None:
        findings += head_findings(key, head, entries)
    block_ids = {(row.block_of, row.block): row.dataset_id for row in datasets if row.block_of is not None}
    by_budget: dict[int, list[StoredEntry]] = {}
    for entry in entries:
        for budget_id in _budgets_of(entry, block_ids):
            by_budget.setdefault(budget_id, []).append(entry)
    for dataset in datasets:
        findings += replay_findings(dataset, [entry for entry in by_budget.get(dataset.dataset_id, ())
                                              if entry.action != "set_quota"])
    for budget_id in sorted(set(by_budget) - set(names)):
        findings.append(Finding(by_budget[budget_id][0].entry_id, None, "it is about a dataset or block that has no "
                                                                        "row (the row was removed)"))
    findings += queue_findings(entries, names)
    findings += unit_findings(entries, datasets)
    parent = {row.dataset_id: row.block_of for row in datasets}
    for use in uses:
        findings += use_findings(use, names.get(use.budget_id, str(use.budget_id)), by_budget.get(use.budget_id, []),
                                 by_budget.get(parent.get(use.budget_id), []))
    try:
        findings += job_findings(entries, reservations, commits)
    except (KeyError, TypeError, ValueError, EventError) as error:
        findings.append(Finding(None, None, f"the history's jobs cannot be replayed ({type(error).__name__}: {error})",
                                row="reservations"))
    findings += tenant_findings(entries, tenants)
    return Verification(len(entries), len(datasets), entries[-1].entry_hash if entries else "", tuple(findings))


def unit_findings(entries: list[StoredEntry], datasets: list[StoredDataset]) -> list[Finding]:
    """Replay, per privacy unit (a row, or a person), what every committed step that could touch it spent.

    A unit of block b could be touched by the dataset's own jobs (they read
    every row), by b's jobs, and by the jobs of every block whose declaration
    (as the history records it) may share units with b's
    (`block_data_overlap`). The ε of that union of committed steps is the
    least, over the filters that watched any of them (the dataset's and those
    blocks'), of the filter's ε; it must fit the dataset's budget. Also finds
    a block row whose declaration is not the one its history records.
    """
    rows = {row.dataset_id: row for row in datasets}
    block_ids = {(row.block_of, row.block): row.dataset_id for row in datasets if row.block_of is not None}
    unit: dict[int, str] = {}
    budget: dict[int, float] = {}
    declared: dict[int, dict | None] = {}
    committed: dict[int, Composition] = {}
    findings = []
    for entry in entries:
        if entry.action not in ("create_dataset", "raise_budget", "add_block", "commit"):
            continue
        try:
            details = json.loads(entry.details_json)
            if entry.action == "create_dataset":
                unit[entry.dataset_id] = details.get("privacy_unit", EXAMPLE)
                budget[entry.dataset_id] = float(details["epsilon"])
            elif entry.action == "raise_budget":
                budget[entry.dataset_id] = float(details["to"])
            elif entry.action == "add_block":
                declared[entry.dataset_id] = details.get("data")
            else:
                events = Composition.from_dict(details["events"])
                charged = [block_ids.get((entry.dataset_id, block), -1) for block in details.get("blocks") or ()]
                for budget_id in charged or [entry.dataset_id]:
                    committed[budget_id] = canonical(committed.get(budget_id, Composition()).then(events))
        except (KeyError, TypeError, ValueError, EventError) as error:
            name = rows[entry.dataset_id].name if entry.dataset_id in rows else None
            findings.append(Finding(entry.entry_id, name, f"its details cannot be replayed ({type(error).__name__}: "
                                                          f"{error})"))
    for dataset in datasets:
        if dataset.block_of is not None or dataset.dataset_id not in budget:
            continue
        privacy_unit = unit.get(dataset.dataset_id, EXAMPLE)
        blocks = [row for row in datasets if row.block_of == dataset.dataset_id]
        for block in blocks:
            if block.data != declared.get(block.dataset_id):
                findings.append(Finding(None, block.name, "the row's block data is not what its history declares"))
            sharing = [
                other for other in blocks if other is not block and block_data_overlap(
                    declared.get(block.dataset_id), declared.get(other.dataset_id), privacy_unit) is not None
            ]
            spent = committed.get(dataset.dataset_id, Composition())
            for row in [block, *sharing]:
                spent = spent.then(committed.get(row.dataset_id, Composition()))
            if spent.steps == 0:
                continue
            tally = RdpTally.of(canonical(spent))
            epsilon = min(rule.epsilon(tally) for rule in [dataset.admission, block.admission,
                                                           *(row.admission for row in sharing)])
            if not fits_budget(epsilon, budget[dataset.dataset_id]):
                also = f" and in {', '.join(repr(row.block) for row in sharing)}" if sharing else ""
                findings.append(Finding(
                    None, dataset.name,
                    f"one {'person' if privacy_unit == USER else 'row'} in block {block.block!r}{also} could have "
                    f"spent ε {epsilon:.6g}, over the dataset's budget ε {budget[dataset.dataset_id]:g}",
                ))
    return findings


def queue_findings(entries: list[StoredEntry], dataset_names: dict[int, str]) -> list[Finding]:
    """Replay the queues: a job leaves one (admitted by a `reserve` with its `queue_id`, cancelled or timed
    out) only while it waits there, and is admitted with the plan and blocks it queued with."""
    waiting: dict[tuple[int | None, str], dict] = {}
    findings = []
    for entry in entries:
        details = json.loads(entry.details_json) if entry.action in _QUEUE_ACTIONS else {}
        if entry.action == "enqueue":
            waiting[(entry.dataset_id, details["queue_id"])] = details
        elif "queue_id" in details:
            queued = waiting.pop((entry.dataset_id, details["queue_id"]), None)
            where = dataset_names.get(entry.dataset_id, str(entry.dataset_id))
            if queued is None:
                findings.append(Finding(entry.entry_id, where, f"takes queued job {details['queue_id']} out of "
                                                               "the queue, where the replay does not have it"))
            elif entry.action == "reserve" and (
                (queued["planned_events"], queued.get("blocks") or []) !=
                (details["planned_events"], details.get("blocks") or [])
            ):
                findings.append(Finding(entry.entry_id, where, f"admits queued job {details['queue_id']} with a "
                                                               "plan or blocks other than it queued with"))
    return findings


def use_findings(
    use: StoredTenantUse, budget_name: str, entries: list[StoredEntry], dataset_entries: list[StoredEntry]
) -> list[Finding]:
    """Replay a tenant's use of one budget: its jobs' admissions and commits against its quota, and its tally.

    `entries` are the budget's history; `dataset_entries` that of the
    dataset a block belongs to (a quota set there applies to the block).
    """
    replay = _Replay(f"{budget_name} (tenant {use.tenant})", quota=True)
    quota_on_dataset = {entry.entry_id for entry in dataset_entries if entry.action == "set_quota"}
    mine = sorted(
        (entry for entry in [*entries, *(e for e in dataset_entries if e.entry_id in quota_on_dataset)]
         if entry.tenant == use.tenant and (entry.action in _JOB_ACTIONS or entry.action == "set_quota")),
        key=lambda entry: entry.entry_id,
    )
    for entry in mine:
        try:
            replay.apply(entry, from_dataset=entry.entry_id in quota_on_dataset)
        except (KeyError, TypeError, ValueError, EventError) as error:
            replay.note(entry, f"its details cannot be replayed ({type(error).__name__}: {error})")
    findings = replay.findings
    if use.quota_epsilon is None and replay.budget_epsilon is None and replay.dataset_quota is None:
        return findings  # no quota: the tally limits nothing, and the budget's replay checks the jobs
    for what, replayed, stored in (
        ("quota ε", replay.budget_epsilon, use.quota_epsilon),
        ("RDP tally of committed and reserved steps", replay.held, use.held),
        ("set of committed events", canonical(replay.committed), use.committed_events),
    ):
        if replayed != stored:
            findings.append(Finding(None, replay.dataset, f"the tenant's {what} is not what its history replays to"))
    return findings


def replay_findings(dataset: StoredDataset, entries: list[StoredEntry]) -> list[Finding]:
    """Replay one dataset's history from its events and check every admission, commit and release.

    Each reservation must have fitted the rule in force when it was made,
    each commit must charge the next planned steps and keep the committed
    steps within the filter, each release must free what was unrun; at the
    end the replayed RDP tally, committed events, budget and rule must be
    what the dataset's row holds.
    """
    if dataset.block is None:
        def recorded(details: dict) -> float | None:
            return details.get("held_epsilon_filter", details.get("held_epsilon_rdp"))
    else:
        def recorded(details: dict) -> float | None:
            return details.get("held_epsilon_filter_by_block", {}).get(dataset.block)
    replay = _Replay(dataset.name, recorded)
    for entry in entries:
        try:
            replay.apply(entry)
        except (KeyError, TypeError, ValueError, EventError) as error:
            replay.note(entry, f"its details cannot be replayed ({type(error).__name__}: {error})")
    findings = replay.findings
    for what, replayed, stored in (
        ("budget ε", replay.budget_epsilon, dataset.budget_epsilon),
        ("admission rule", replay.admission, dataset.admission),
        ("RDP tally of committed and reserved steps", replay.held, dataset.held),
        ("set of committed events", canonical(replay.committed), dataset.committed_events),
    ):
        if replayed != stored:
            findings.append(Finding(None, dataset.name, f"the row's {what} is not what its history replays to"))
    return findings


@dataclass(frozen=True)
class BurnDownPoint:
    """A dataset's figures (ε at its δ, see `budget_figures`) just after one change to it, at `at` (UTC)."""

    at: str
    action: str
    budget_epsilon: float
    spent_epsilon_filter: float
    reserved_epsilon: float
    remaining_epsilon: float

    def to_dict(self) -> dict:
        """JSON-ready dict."""
        return {
            "at": self.at,
            "action": self.action,
            "budget_epsilon": self.budget_epsilon,
            "spent_epsilon_filter": self.spent_epsilon_filter,
            "reserved_epsilon": self.reserved_epsilon,
            "remaining_epsilon": self.remaining_epsilon,
        }


def burn_down(entries: list[HistoryEntry]) -> list[BurnDownPoint]:
    """A dataset's budget over time: its figures after each change, replayed from its whole history, oldest first.

    `entries` must start at the dataset's creation (ValueError otherwise).
    The figures are those a status gives at that moment: spent (filter),
    reserved and remaining add up to the budget, so the last point equals
    the dataset's status now.
    """
    if not entries or entries[0].action != "create_dataset":
        raise ValueError("a burn-down replays a dataset's history from its creation; the first entry is not it")
    replay = _Replay(entries[0].dataset or "")
    points = []
    for entry in entries:
        if entry.action in ("add_block", "set_quota") or entry.details.get("blocks"):
            continue  # a block's budget, a tenant's quota or a job on blocks: not the dataset's own budget
        replay.apply_details(entry, entry.action, entry.details)
        spent_filter = replay.admission_epsilon(RdpTally.of(replay.committed))
        held_filter = replay.admission_epsilon(replay.held)
        points.append(
            BurnDownPoint(
                at=entry.at,
                action=entry.action,
                budget_epsilon=replay.budget_epsilon,
                spent_epsilon_filter=spent_filter,
                reserved_epsilon=max(0.0, held_filter - spent_filter),
                remaining_epsilon=max(0.0, replay.budget_epsilon - held_filter),
            )
        )
    return points


class PrivacyLedger(Protocol):
    """What the embedded `Ledger` and the `RemoteLedger` both offer; the trainer uses either.

    Datasets are named 'name' within the caller's tenant or 'tenant/name'
    (admins). Every method raises a LedgerError subclass on refusal.
    """

    def create_tenant(self, tenant: str) -> TenantCreated:
        """Create a tenant and return its token (admin only)."""

    def rotate_token(self, tenant: str | None = None) -> TenantCreated:
        """Replace a tenant's token (None: the caller's admin token) with a new one, returned once."""

    def revoke_token(self, tenant: str | None = None, key_id: str | None = None) -> str:
        """Revoke a tenant's token, or the admin token of `key_id` (admin only); the revoked key id."""

    def create_dataset(
        self, dataset: str, epsilon: float, delta: float, privacy_unit: str = EXAMPLE,
        scheduling: SchedulingPolicy | dict | None = None,
    ) -> DatasetStatus:
        """Create a dataset with a budget of (epsilon, delta) per `privacy_unit` ('example' or 'user')."""

    def raise_budget(self, dataset: str, epsilon: float) -> DatasetStatus:
        """Set a dataset's budget epsilon (admin only; never below what is committed and reserved)."""

    def get_budget(self, dataset: str, pld_may_be_pending: bool = False) -> DatasetStatus:
        """One dataset's budget, spending and active jobs (see `budget_figures` for `pld_may_be_pending`)."""

    def list_datasets(self, pld_may_be_pending: bool = False) -> list[DatasetStatus]:
        """Every dataset the caller may see."""

    def list_jobs(self, dataset: str | None = None, state: str | None = None) -> list[Reservation]:
        """Reservations on the caller's datasets, oldest first, optionally of one dataset or state."""

    def reserve(
        self, dataset: str, job_id: str, planned: EventsLike, lease_seconds: float | None = None,
        privacy_unit: str = EXAMPLE, rows_per_person: int | None = None, blocks: tuple[str, ...] | list[str] = (),
    ) -> Reservation:
        """Hold budget for a job's planned events, or raise BudgetExceeded; with a lease of `lease_seconds`.

        `privacy_unit` is what the events protect; `rows_per_person` bounds
        each person's rows for an example-level job (see `charged_plan`).
        With `blocks`, the job is charged in full to each of those blocks, all or nothing.
        """

    def add_block(
        self, dataset: str, block: str, epsilon: float, delta: float | None = None, data: dict | str | None = None
    ) -> DatasetStatus:
        """Add a block with its own (epsilon, delta) budget, bound to the rows `data` declares (owner or admin)."""

    def set_quota(self, dataset: str, tenant: str, epsilon: float, block: str | None = None) -> DatasetStatus:
        """Give a tenant a quota on a dataset or one of its blocks (admin only)."""

    def fits(
        self, dataset: str, planned: EventsLike, blocks: tuple[str, ...] | list[str] = (),
        privacy_unit: str = EXAMPLE, rows_per_person: int | None = None,
    ) -> FitReport:
        """Whether a job would be admitted now, what it would cost and what would remain; reserves nothing."""

    def commit(self, reservation_id: str, steps: int, sequence: int) -> CommitResult:
        """Charge the next `steps` planned steps and renew the lease; the same `sequence` twice charges once."""

    def release(self, reservation_id: str) -> Reservation:
        """Free the reservation's unrun steps; what was committed stays spent."""

    def enqueue(
        self, dataset: str, job_id: str, planned: EventsLike, lease_seconds: float | None = None, priority: int = 0,
        max_wait_seconds: float | None = None, privacy_unit: str = EXAMPLE, rows_per_person: int | None = None,
        blocks: tuple[str, ...] = (),
    ) -> QueuedJob:
        """Queue a job for budget; the dataset's scheduling policy admits it (as a reservation) when it fits."""

    def queued_job(self, queue_id: str) -> QueuedJob:
        """A queued job as it stands now: waiting (position and reason), admitted, cancelled or timed out."""

    def cancel_queued(self, queue_id: str) -> QueuedJob:
        """Take a waiting job out of the queue."""

    def list_queued(self, dataset: str | None = None, state: str | None = QUEUED) -> list[QueuedJob]:
        """Queued jobs on the caller's datasets (waiting ones by default; None: any state)."""

    def history(self, dataset: str | None = None, limit: int = 1000) -> list[HistoryEntry]:
        """The newest `limit` changes the caller may see, oldest first."""

    def close(self) -> None:
        """Release files or channels."""
