"""A sub-table checked alone, by the declaration and with the errors that check it in a whole config."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from orchestrator.adaptive_clipping import AdaptiveClipping
from orchestrator.config.problems import config_error
from orchestrator.config.sections import SECTIONS, EvaluateEvery, OptimizerConfig
from orchestrator.schedules import LearningRateSchedule, NoiseSchedule


def checked_key(name: str, value: Any) -> Any:
    """One config key's checked value; a UsageError names every problem, as ``build_config`` would."""
    section = next(section for section in SECTIONS if name in section.model_fields)
    try:
        return getattr(section.model_validate({name: value}), name)
    except ValidationError as error:
        raise config_error(error) from None


def parse_adaptive_clipping(value: Any) -> AdaptiveClipping | None:
    """The ``adaptive_clipping`` key: a table, true (the defaults), or false or None (off)."""
    return checked_key("adaptive_clipping", value)


def parse_noise_schedule(value: Any) -> NoiseSchedule:
    """The ``noise_schedule`` key: a kind's name, or a table of the kind and its parameters."""
    return checked_key("noise_schedule", value)


def parse_lr_schedule(value: Any) -> LearningRateSchedule:
    """The ``lr_schedule`` key: a kind's name, or a table of the kind and its parameters."""
    return checked_key("lr_schedule", value)


def parse_optimizer(value: Any) -> OptimizerConfig:
    """The ``optimizer`` key: a name, or a table of the name and the parameters that optimizer takes."""
    return checked_key("optimizer", value)


def parse_evaluate_every(value: Any) -> EvaluateEvery | None:
    """The ``evaluate_every`` key: ``{ steps = n }`` or ``{ epochs = e }``, or None (every epoch)."""
    return checked_key("evaluate_every", value)
