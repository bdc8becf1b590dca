"""What the ledger accepts: the names, numbers and states a request may hold, and the checks that refuse the rest.

The store, the server and the command line check every value here, once, with one wording.
"""

from __future__ import annotations

import math
import re

from accounting.ledger.errors import InvalidArgument
from accounting.ledger.scheduling import PRIORITY_RANGE, SchedulingPolicy

NAME_LENGTH = (1, 128)
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*\Z")
MAX_PLAN_RECORDS = 1000
# Distinct mechanisms (sampling rate, noise multiplier, sensitivity factor) in one plan. Each new one costs an
# RDP curve (milliseconds of CPU, up to some 0.2 s at a small noise multiplier), so the cap bounds what one
# request can make a server compute; a noise schedule changing sigma every epoch for 100 epochs fits.
MAX_PLAN_MECHANISMS = 100
# Jobs of one pre-registered plan: a grid of a few hundred trials, or daily retrains for years, fits.
MAX_PLAN_JOBS = 2000
MAX_SEQUENCE = 2**63 - 1
MAX_STEPS = 2**63 - 1  # a row index or count: what a database integer holds
# Steps of one plan in total, so of one reservation and one commit. A long DP-SGD job is 10**4 to 10**6 steps
# (100 epochs of 60,000 rows at batch 256 is 23,400); the bound keeps every count, sum and reply inside int64.
MAX_PLAN_STEPS = 10**7
# Steps one budget composes in all, its commits together: 10**5 plans of the most steps. Its work is bounded apart
# (past caches.PLD_MAX_STEPS its PLD is not composed; the RDP filter is a closed form at any count), so this bounds
# the count: every sum a status or reply holds stays far inside int64.
MAX_BUDGET_STEPS = 10**12
HISTORY_LIMIT = (1, 100_000)
# Below a millisecond a duration is a typo or an attack on the arithmetic (5e-324 s divides to infinity).
MIN_SECONDS = 1e-3
MAX_LEASE_SECONDS = 30 * 24 * 3600.0
# A DPF-T block unlocks over at most ten years; DPF-N over at most a million arriving jobs.
UNLOCK_SECONDS_RANGE = (MIN_SECONDS, 10 * 365 * 24 * 3600.0)
UNLOCK_JOBS_RANGE = (1, 1_000_000)
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


def check_integer(name: str, value: object, least: int, most: int) -> int:
    """An integer in [`least`, `most`] (not a bool), named `name` in the error."""
    if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= most:
        raise InvalidArgument(f"{name} must be an integer in [{least}, {most}] (got {value!r})")
    return value


def check_steps(value: object) -> int:
    """Steps of one commit: an integer in [1, MAX_PLAN_STEPS]."""
    return check_integer("steps", value, 1, MAX_PLAN_STEPS)


def check_plan_steps(steps: int) -> int:
    """A plan's (and so a reservation's) steps in total: at most MAX_PLAN_STEPS."""
    if steps > MAX_PLAN_STEPS:
        raise InvalidArgument(
            f"planned events may hold at most {MAX_PLAN_STEPS} steps in total (got {steps}); split the job into "
            "several reservations"
        )
    return steps


def check_sequence(value: object) -> int:
    """A commit's sequence number: an integer in [0, 2**63 - 1], unique per reservation."""
    return check_integer("sequence", value, 0, MAX_SEQUENCE)


def check_lease_seconds(value: object) -> float | None:
    """A reservation's lease: None or 0 for none, else seconds in [MIN_SECONDS, MAX_LEASE_SECONDS]."""
    if value is None:
        return None
    seconds = _finite("lease_seconds", value)
    if seconds == 0.0:
        return None
    if not MIN_SECONDS <= seconds <= MAX_LEASE_SECONDS:
        raise InvalidArgument(
            f"lease_seconds must be in [{MIN_SECONDS:g}, {MAX_LEASE_SECONDS:g}] or 0 for no lease (got {seconds:g}); "
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


def check_max_wait_seconds(value: object) -> float | None:
    """How long a queued job may wait (seconds); None waits until admitted or cancelled."""
    if value is None:
        return None
    seconds = _finite("max_wait_seconds", value)
    if not MIN_SECONDS <= seconds <= MAX_WAIT_SECONDS:
        raise InvalidArgument(
            f"max_wait_seconds must be in [{MIN_SECONDS:g}, {MAX_WAIT_SECONDS:g}] (got {seconds!r}); leave it out "
            "to wait until admitted or cancelled"
        )
    return seconds


def check_priority(value: object) -> int:
    """A queued job's priority: higher is served first, within PRIORITY_RANGE."""
    return check_integer("priority", value, *PRIORITY_RANGE)


def check_queue_state(value: object) -> str | None:
    """A queued job's state filter: one of QUEUE_STATES, or None for any."""
    return _state_filter("queued job state", value, QUEUE_STATES)


def check_scheduling(value: object) -> SchedulingPolicy:
    """A dataset's scheduling policy, from its dict (SchedulingPolicy.to_dict) or itself, with `unlock_seconds`
    in UNLOCK_SECONDS_RANGE and `unlock_jobs` in UNLOCK_JOBS_RANGE when given."""
    try:
        policy = value if isinstance(value, SchedulingPolicy) else SchedulingPolicy.from_dict(value)
    except (KeyError, TypeError, ValueError) as error:
        raise InvalidArgument(f"scheduling: {error}") from None
    if policy.unlock_jobs is not None:
        check_integer("scheduling unlock_jobs", policy.unlock_jobs, *UNLOCK_JOBS_RANGE)
    if policy.unlock_seconds is not None:
        least, most = UNLOCK_SECONDS_RANGE
        if not least <= _finite("scheduling unlock_seconds", policy.unlock_seconds) <= most:
            raise InvalidArgument(
                f"scheduling unlock_seconds must be in [{least:g}, {most:g}] (got {policy.unlock_seconds!r}); "
                "give the time over which a block unlocks, e.g. 86400 for a day"
            )
    return policy


def check_history_limit(value: object) -> int:
    """How many history entries to return: an integer in HISTORY_LIMIT."""
    return check_integer("history limit", value, *HISTORY_LIMIT)


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
    return None if value is None else check_integer("rows per person", value, 1, MAX_STEPS)
