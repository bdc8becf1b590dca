"""DP event records: what ran, described as data.

A training step of DP-SGD is a Poisson-sampled Gaussian mechanism. A run is a
composition of such mechanisms, possibly with different parameters (noise
schedules, sensitivity changes). The trainer emits these records, the ledger
stores them (as versioned JSON), and every accountant interprets the same
records. Nothing here knows about models, Ray or any particular accountant.
"""

from __future__ import annotations

import json
import math
import numbers
from fractions import Fraction
from dataclasses import dataclass, replace
from typing import ClassVar, Iterable, Sequence, Union

from accounting.lazy import LazyModule

# Only to_dp_event needs dp-accounting, whose import is heavy (see accounting.lazy).
dp_accounting = LazyModule("dp_accounting")

SCHEMA_NAME = "dpfleet.events"
SCHEMA_VERSION = 1


class EventError(ValueError):
    """An event record has a value outside its valid range."""


def _check_finite(name: str, value: float) -> float:
    # A number, not text that reads as one: events arrive as JSON from clients of the ledger.
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise EventError(f"{name} must be a number (got {value!r})")
    value = float(value)
    if not math.isfinite(value):
        raise EventError(f"{name} must be a finite number (got {value!r})")
    return value


@dataclass(frozen=True)
class SampledGaussian:
    """`steps` steps of a Gaussian sum query on a Poisson-sampled batch.

    Each example joins a step independently with probability `sampling_rate`;
    the sum of per-example contributions, each of L2 norm at most C, gets
    Gaussian noise of standard deviation `noise_multiplier` * C. A
    `sensitivity_factor` k > 1 says one example can move the sum by k*C (for
    example 2 with microbatches), which accountants treat as a noise
    multiplier of `noise_multiplier / k`.
    """

    # The record's kind in its dict, and the fields its dict adds after the four above, in constructor order.
    KIND: ClassVar[str] = "sampled_gaussian"
    EXTRA_FIELDS: ClassVar[tuple[str, ...]] = ()

    sampling_rate: float
    noise_multiplier: float
    steps: int
    sensitivity_factor: float = 1.0

    def __post_init__(self) -> None:
        rate = _check_finite("sampling_rate", self.sampling_rate)
        if not 0.0 < rate <= 1.0:
            raise EventError(f"sampling_rate must be in (0, 1] (got {rate!r})")
        sigma = _check_finite("noise_multiplier", self.noise_multiplier)
        if sigma <= 0.0:
            raise EventError(f"noise_multiplier must be > 0 (got {sigma!r})")
        steps = self.steps
        if isinstance(steps, bool) or not isinstance(steps, (int, float)) or not math.isfinite(steps) \
                or int(steps) != steps or steps < 0:
            raise EventError(f"steps must be an integer >= 0 (got {steps!r})")
        factor = _check_finite("sensitivity_factor", self.sensitivity_factor)
        if factor <= 0.0:
            raise EventError(f"sensitivity_factor must be > 0 (got {factor!r})")
        object.__setattr__(self, "sampling_rate", rate)
        object.__setattr__(self, "noise_multiplier", sigma)
        object.__setattr__(self, "steps", int(self.steps))
        object.__setattr__(self, "sensitivity_factor", factor)

    @property
    def effective_noise_multiplier(self) -> float:
        """Noise standard deviation in units of one example's largest effect on the sum."""
        return self.noise_multiplier / self.sensitivity_factor

    @property
    def mechanism_key(self) -> tuple[float, ...]:
        """The per-step mechanism, as the ledger keys it: (sampling rate, noise multiplier, sensitivity factor)."""
        return (self.sampling_rate, self.noise_multiplier, self.sensitivity_factor)

    def with_steps(self, steps: int) -> "SampledGaussian":
        """The same mechanism run for a different number of steps (a record of the same kind)."""
        return replace(self, steps=steps)

    def with_sensitivity(self, sensitivity_factor: float) -> "SampledGaussian":
        """The same mechanism with a different sensitivity factor (a record of the same kind)."""
        return replace(self, sensitivity_factor=sensitivity_factor)

    def same_mechanism(self, other: "SampledGaussian") -> bool:
        """True when both records describe the same per-step mechanism: same kind, key and `EXTRA_FIELDS`."""
        return (type(self) is type(other) and self.mechanism_key == other.mechanism_key
                and all(getattr(self, field) == getattr(other, field) for field in self.EXTRA_FIELDS))

    def to_dict(self) -> dict:
        """A JSON-ready dict, `EXTRA_FIELDS` after the four common ones; floats keep their exact value through json."""
        return {
            "kind": self.KIND,
            "sampling_rate": self.sampling_rate,
            "noise_multiplier": self.noise_multiplier,
            "steps": self.steps,
            "sensitivity_factor": self.sensitivity_factor,
            **{field: getattr(self, field) for field in self.EXTRA_FIELDS},
        }

    @classmethod
    def from_dict(cls, data: dict) -> "SampledGaussian":
        """Inverse of `to_dict`; refuses unknown kinds and missing fields (`KIND` and `EXTRA_FIELDS` say which)."""
        if data.get("kind") != cls.KIND:
            raise EventError(f"unknown event kind {data.get('kind')!r}; expected {cls.KIND!r}")
        try:
            return cls(data["sampling_rate"], data["noise_multiplier"], data["steps"],
                       data.get("sensitivity_factor", 1.0), *(data[field] for field in cls.EXTRA_FIELDS))
        except KeyError as missing:
            raise EventError(f"event is missing the field {missing}") from None

    def to_dp_event(self) -> dp_accounting.DpEvent:
        """The equivalent dp-accounting event (sensitivity folded into the noise)."""
        step = dp_accounting.PoissonSampledDpEvent(
            self.sampling_rate, dp_accounting.GaussianDpEvent(self.effective_noise_multiplier)
        )
        return dp_accounting.SelfComposedDpEvent(step, self.steps)


CORRELATED_MECHANISMS = ("band-mf", "dp-ftrl")


@dataclass(frozen=True)
class CorrelatedGaussian(SampledGaussian):
    """`steps` participations of one example in a correlated-noise mechanism, each a sampled Gaussian by its reduction.

    A matrix mechanism (``accounting.matrix_mechanisms``) releases C·x + z
    over the whole run. Its privacy is that of a sampled Gaussian per
    participation of one example, which is what every accountant computes
    from the inherited fields:

    - ``band-mf`` with cyclic Poisson sampling over `band_width` groups
      (Choquette-Choo et al. 2023, "(Amplified) Banded Matrix
      Factorization"): each example's group is used every b steps and
      Poisson-samples it at rate b·B/N; the run is DP-SGD at that rate for
      ceil(n / b) steps, with C's largest column norm as the sensitivity
      factor. With b = 1 it is DP-SGD exactly.
    - ``band-mf`` or ``dp-ftrl`` without sampling (fixed-order epochs,
      `sampling_rate` 1): the release is one Gaussian mechanism of
      sensitivity Δ; each participation adds its share of Δ² (for a banded C
      with separation >= b, the column norm; for a tree restarted every epoch,
      sqrt(levels)), and Gaussians compose by adding μ² = (Δ/σ)², exactly.

    `period` is the number of training steps between an example's
    participations (b, or one epoch's steps); `band_width` is b (band-mf) or
    the leaves of each tree (dp-ftrl).
    """

    KIND: ClassVar[str] = "correlated_gaussian"
    EXTRA_FIELDS: ClassVar[tuple[str, ...]] = ("mechanism", "band_width", "period")

    mechanism: str = "band-mf"
    band_width: int = 1
    period: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mechanism not in CORRELATED_MECHANISMS:
            raise EventError(f"mechanism must be one of {', '.join(CORRELATED_MECHANISMS)} (got {self.mechanism!r})")
        for name in ("band_width", "period"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise EventError(f"{name} must be an integer >= 1 (got {value!r})")
            object.__setattr__(self, name, int(value))


NOISE_PLACEMENTS = ("driver", "silos")


@dataclass(frozen=True)
class SampledSkellam(SampledGaussian):
    """`steps` steps of an integer sum of a Poisson-sampled batch with integer noise added in shares by silos.

    Each silo scales its clipped sum by s, rounds it to integers and adds its
    share of discrete Gaussian noise on the ring before secure aggregation
    masks it (``noise_placement = "silos"``); the driver only ever sees the
    noisy total. `noise_multiplier` is σ, the std over s·C of one honest
    silo's share, which is what the noise unknown to the driver and the
    silos colluding with it keeps whatever silos drop out (within the
    protocol's bounds); `rounding_ratio` r bounds √d / (s·C) for d
    coordinates, so one example moves the rounded sum by at most (k + r)·s·C.
    Its RDP is bounded by the Skellam mechanism's,
    ``accounting.skellam.sampled_skellam_rdp``; it has no PLD here, so every
    rigorous accountant reports that RDP bound.
    """

    KIND: ClassVar[str] = "sampled_skellam"
    EXTRA_FIELDS: ClassVar[tuple[str, ...]] = ("rounding_ratio",)

    rounding_ratio: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        ratio = _check_finite("rounding_ratio", self.rounding_ratio)
        if not 0.0 <= ratio <= 1.0:
            raise EventError(f"rounding_ratio must be in [0, 1] (got {ratio!r})")
        object.__setattr__(self, "rounding_ratio", ratio)

    @property
    def effective_noise_multiplier(self) -> float:
        """Noise std over one example's largest effect on the rounded sum, (k + r)·s·C."""
        return self.noise_multiplier / (self.sensitivity_factor + self.rounding_ratio)

    @property
    def noise_placement(self) -> str:
        """Where the noise is added: by the silos, in shares."""
        return "silos"

    @property
    def mechanism_key(self) -> tuple[float, ...]:
        """The per-step mechanism as the ledger keys it: (rate, sigma, sensitivity factor, rounding ratio)."""
        return (self.sampling_rate, self.noise_multiplier, self.sensitivity_factor, self.rounding_ratio)

    def to_dict(self) -> dict:
        """A JSON-ready dict; floats keep their exact value through json. It names the noise placement."""
        return {**super().to_dict(), "noise_placement": self.noise_placement}

    def to_dp_event(self):
        """Refused: dp-accounting knows no Skellam mechanism (``accounting.skellam`` accounts it)."""
        raise EventError("dp-accounting has no Skellam mechanism; its RDP is accounting.skellam's")


EVENT_KINDS = {"sampled_gaussian": SampledGaussian, "correlated_gaussian": CorrelatedGaussian,
               "sampled_skellam": SampledSkellam}


def event_of(mechanism: tuple[float, ...], steps: int) -> SampledGaussian:
    """The record of `steps` steps of `mechanism` (an event's `mechanism_key`): Skellam when it has 4 fields."""
    if len(mechanism) == 4:
        return SampledSkellam(mechanism[0], mechanism[1], steps, mechanism[2], mechanism[3])
    rate, sigma, factor = mechanism
    return SampledGaussian(rate, sigma, steps, factor)


def skellam_events(events: "EventsLike", rounding_ratio: float) -> "Composition":
    """The same steps with their noise added in shares by silos: each record as a `SampledSkellam`."""
    return Composition(tuple(
        SampledSkellam(event.sampling_rate, event.noise_multiplier, event.steps, event.sensitivity_factor,
                       rounding_ratio)
        for event in as_composition(events).events
    ))


def noise_placement(events: "EventsLike") -> str:
    """Where the noise of `events` is added: "silos" when every record is a `SampledSkellam`, else "driver"."""
    composition = as_composition(events)
    silos = [isinstance(event, SampledSkellam) for event in composition.events]
    return "silos" if silos and all(silos) else "driver"


def event_from_dict(data: dict) -> SampledGaussian:
    """The event record a dict describes, by its kind."""
    kind = data.get("kind") if isinstance(data, dict) else None
    if kind not in EVENT_KINDS:
        raise EventError(f"unknown event kind {kind!r}; expected one of {', '.join(EVENT_KINDS)}")
    return EVENT_KINDS[kind].from_dict(data)


@dataclass(frozen=True)
class Composition:
    """A sequence of mechanisms run one after another on the same dataset.

    Adjacent records of the same mechanism are merged, so a long run of one
    configuration stays one record however many times steps are appended.
    """

    events: tuple[SampledGaussian, ...] = ()

    def __post_init__(self) -> None:
        merged: list[SampledGaussian] = []
        for event in self.events:
            if not isinstance(event, SampledGaussian):
                raise EventError(f"a composition holds SampledGaussian records (got {type(event).__name__})")
            if event.steps == 0:
                continue
            if merged and merged[-1].same_mechanism(event):
                merged[-1] = merged[-1].with_steps(merged[-1].steps + event.steps)
            else:
                merged.append(event)
        object.__setattr__(self, "events", tuple(merged))

    @property
    def steps(self) -> int:
        """Total number of steps over all records."""
        return sum(event.steps for event in self.events)

    def split(self, steps: int) -> tuple["Composition", "Composition"]:
        """(the first `steps` steps, the rest), cutting a record in two where needed."""
        if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or not 0 <= steps <= self.steps:
            raise EventError(f"can split a composition of {self.steps} steps at 0..{self.steps} (got {steps!r})")
        first: list[SampledGaussian] = []
        rest: list[SampledGaussian] = []
        remaining = int(steps)
        for event in self.events:
            taken = min(remaining, event.steps)
            first.append(event.with_steps(taken))
            rest.append(event.with_steps(event.steps - taken))
            remaining -= taken
        return Composition(tuple(first)), Composition(tuple(rest))

    def then(self, other: "EventsLike") -> "Composition":
        """This composition followed by `other`."""
        return Composition(self.events + as_composition(other).events)

    def to_dict(self) -> dict:
        """A JSON-ready dict carrying the schema name and version."""
        return {
            "schema": SCHEMA_NAME,
            "version": SCHEMA_VERSION,
            "events": [event.to_dict() for event in self.events],
        }

    @classmethod
    def from_dict(cls, data: dict) -> "Composition":
        """Inverse of `to_dict`; refuses other schemas and newer versions."""
        if data.get("schema") != SCHEMA_NAME:
            raise EventError(f"not a dpfleet event list (schema {data.get('schema')!r})")
        version = data.get("version")
        if version != SCHEMA_VERSION:
            raise EventError(
                f"event schema version {version!r} is not supported; this dpfleet reads version {SCHEMA_VERSION}"
            )
        return cls(tuple(event_from_dict(item) for item in data.get("events", [])))

    def to_json(self) -> str:
        """Serialise exactly (Python floats round-trip through their repr)."""
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Composition":
        """Inverse of `to_json`."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise EventError(f"event list is not valid JSON: {error}") from None
        if not isinstance(data, dict):
            raise EventError("event list JSON must be an object")
        return cls.from_dict(data)

    def to_dp_event(self) -> dp_accounting.DpEvent:
        """The equivalent dp-accounting event."""
        return dp_accounting.ComposedDpEvent([event.to_dp_event() for event in self.events])


EventsLike = Union[SampledGaussian, Composition, Sequence[SampledGaussian]]


def group_sampling_rate(sampling_rate: float, group_size: int) -> float:
    """The chance that at least one of `group_size` rows joins a step, each with `sampling_rate`, rounded up."""
    rate = -math.expm1(group_size * math.log1p(-sampling_rate)) if sampling_rate < 1.0 else 1.0
    # Two ulps up cover the rounding of log1p and expm1, so the rate is never below the true one.
    return min(1.0, math.nextafter(math.nextafter(rate, 2.0), 2.0))


def group_events(events: "EventsLike", rows_per_person: int) -> "Composition":
    """Events that bound what one person with at most `rows_per_person` rows reveals, from example-level events.

    A step of `SampledGaussian(q, sigma, s)` samples each of the person's k
    rows independently with probability q, and the rows that join move the
    noisy sum by at most k*s*C together. Its output is the mixture, over the
    non-empty sets S of the person's rows, of the pairs N(0) against
    (1 - q')N(0) + q'N(mu_S), with q' = 1 - (1 - q)^k and |mu_S| <= k*s*C.
    Rényi and hockey-stick divergences are jointly convex, so the mixture's
    divergence is at most the largest pair's, and a sampled Gaussian's
    divergences grow with the shift: the step is bounded by
    `SampledGaussian(q', sigma, k*s)`, in both directions. With k = 1 the
    events are unchanged. See docs/privacy.md ("A person's rows at example
    level").
    """
    if isinstance(rows_per_person, bool) or not isinstance(rows_per_person, numbers.Integral) \
            or rows_per_person < 1:
        raise EventError(f"rows_per_person must be an integer >= 1 (got {rows_per_person!r})")
    composition = as_composition(events)
    if rows_per_person == 1:
        return composition
    # A Skellam step's bound grows with k just as a Gaussian's (its L2 sensitivity is (k + r)·s·C): its kind stays.
    return Composition(tuple(
        event_of((group_sampling_rate(event.sampling_rate, rows_per_person), event.noise_multiplier,
                  event.sensitivity_factor * rows_per_person, *event.mechanism_key[3:]), event.steps)
        for event in composition.events
    ))


def as_composition(events: EventsLike | Iterable[SampledGaussian]) -> Composition:
    """Accept one record, a list of records or a composition; return a composition."""
    if isinstance(events, Composition):
        return events
    if isinstance(events, SampledGaussian):
        return Composition((events,))
    return Composition(tuple(events))


def steps_for_epochs(epochs: float, dataset_size: int, batch_size: int) -> int:
    """Steps in `epochs` passes at expected batch `batch_size`: ceil(epochs * N / B)."""
    # Fraction(str(...)) keeps 15 * 60000 / 250 exactly 3600, not 3600.0000001.
    return math.ceil(Fraction(str(float(epochs))) * dataset_size / batch_size)
