"""A job's plan: its checks, what a dataset is charged for it, and the algebra of event compositions."""

from __future__ import annotations

import json
import re

from accounting.events import (
    Composition, EventError, EventsLike, SampledGaussian, as_composition, event_of, group_events,
)
from accounting.ledger.caches import is_curve_cached
from accounting.ledger.errors import FailedPrecondition, InvalidArgument
from accounting.ledger.validation import (
    MAX_PLAN_MECHANISMS, MAX_PLAN_RECORDS, NOISE_MULTIPLIER_RANGE, USER, check_plan_steps,
)


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
    check_plan_steps(composition.steps)
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
    steps_by_mechanism: dict[tuple[float, ...], int] = {}
    for event in as_composition(composition).events:
        steps_by_mechanism[event.mechanism_key] = steps_by_mechanism.get(event.mechanism_key, 0) + event.steps
    return Composition(
        tuple(event_of(mechanism, steps) for mechanism, steps in sorted(steps_by_mechanism.items()))
    )


def _mechanism_of_record(record: dict) -> tuple[float, ...]:
    # As the record's event's `mechanism`: a Skellam record adds its rounding ratio.
    extra = (record["rounding_ratio"],) if record.get("kind") == "sampled_skellam" else ()
    return (record["sampling_rate"], record["noise_multiplier"], record.get("sensitivity_factor", 1.0), *extra)


def _record_prefix(event: SampledGaussian) -> str:
    """How a canonical stored composition writes `event`'s record (Composition.to_json) up to its step count."""
    record = json.dumps(event.with_steps(1).to_dict(), sort_keys=True)
    return record[:record.rindex('"steps": ') + len('"steps": ')]


_STEPS = re.compile(r'"steps": (\d+)')


def stored_steps(stored: str) -> int:
    """The steps in all of a budget's committed events as stored (canonical JSON), read without parsing them."""
    return sum(map(int, _STEPS.findall(stored)))


def committed_json_with(stored: str, block: Composition) -> str:
    """A budget's committed events as stored (canonical JSON) with `block` added, as stored.

    Equal to `canonical(Composition.from_json(stored).then(block)).to_json()`
    (a test holds them equal), without parsing or writing a record per
    mechanism when each of the block's mechanisms has one: its step count is
    rewritten in place in the text, found by the record's exact text before
    it (once in the canonical text the store writes). So a commit's cost does
    not grow with the mechanisms a budget has seen; a new mechanism's first
    commit rebuilds the text once.
    """
    spliced = stored
    for event in block.events:
        prefix = _record_prefix(event)
        start = spliced.find(prefix)
        if start < 0 or spliced.find(prefix, start + 1) >= 0:  # a new mechanism, or a list never written so
            break
        digits = start + len(prefix)
        end = spliced.index("}", digits)
        spliced = f"{spliced[:digits]}{int(spliced[digits:end]) + event.steps}{spliced[end:]}"
    else:
        return spliced
    data = json.loads(stored)
    records = data.get("events", [])
    by_mechanism = {_mechanism_of_record(record): record for record in records}
    if len(by_mechanism) != len(records):  # not canonical (never written so): the general way
        return canonical(Composition.from_json(stored).then(block)).to_json()
    for event in block.events:
        record = by_mechanism.get(event.mechanism_key)
        if record is None:
            records.append(event.to_dict())
            by_mechanism[_mechanism_of_record(records[-1])] = records[-1]
        else:
            record["steps"] += event.steps
    data["events"] = sorted(records, key=_mechanism_of_record)
    return json.dumps(data, sort_keys=True)


def mechanisms_of(events: EventsLike) -> set[tuple[float, ...]]:
    """The distinct mechanisms (sampling rate, noise multiplier, sensitivity factor[, rounding ratio]) of a
    composition (each event's `mechanism`)."""
    return {event.mechanism_key for event in as_composition(events).events}


def uncached_mechanisms(events: EventsLike) -> int:
    """How many of a composition's mechanisms have no cached RDP curve: what admitting it would compute."""
    return sum(not is_curve_cached(mechanism) for mechanism in mechanisms_of(events))
