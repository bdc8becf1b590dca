"""The training config: one pydantic model per section, read from TOML and flags, checked before Ray starts."""

from orchestrator.config.derived import (
    expected_batch_size,
    rows_per_person,
    sampled_unit_count,
    sampling_rate,
    test_set_size,
    total_steps,
    training_set_size,
    user_spec,
)
from orchestrator.config.documentation import KeyDocumentation, documented_keys, json_schema, toml_literal
from orchestrator.config.loading import build_config, load_config, read_toml, replaced
from orchestrator.config.model import (
    GROUPS,
    KEYS,
    TrainConfig,
    collective_refusals,
    planned_batch_steps,
    planned_batches_refusals,
)
from orchestrator.config.sections import SECTIONS, EvaluateEvery, OptimizerConfig
from orchestrator.config.subtables import (
    checked_key,
    parse_adaptive_clipping,
    parse_evaluate_every,
    parse_lr_schedule,
    parse_noise_schedule,
    parse_optimizer,
)

__all__ = [
    "GROUPS", "KEYS", "SECTIONS", "EvaluateEvery", "KeyDocumentation", "OptimizerConfig", "TrainConfig",
    "build_config", "checked_key", "collective_refusals", "documented_keys", "expected_batch_size", "json_schema",
    "load_config", "parse_adaptive_clipping", "parse_evaluate_every", "parse_lr_schedule", "parse_noise_schedule",
    "parse_optimizer", "planned_batch_steps", "planned_batches_refusals", "read_toml", "replaced",
    "rows_per_person", "sampled_unit_count", "sampling_rate", "test_set_size", "toml_literal", "total_steps",
    "training_set_size", "user_spec",
]
