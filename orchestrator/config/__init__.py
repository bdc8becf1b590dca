"""The training config: one pydantic model per section, read from TOML and command-line overrides, checked before Ray starts."""

from orchestrator.config.derived import (
    check_against_data,
    check_people_within_bound,
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
from orchestrator.config.fields import key
from orchestrator.config.loading import build_config, load_config, read_toml
from orchestrator.config.model import GROUPS, KEYS, TrainConfig, replaced, section_of
from orchestrator.config.sections import (
    CHECK_DATA_LEVELS,
    OPTIMIZERS,
    PRIVACY_UNITS,
    SECTIONS,
    DataSection,
    EvaluateEvery,
    LedgerSection,
    ModelSection,
    OptimisationSection,
    OptimizerConfig,
    PrivacySection,
    RunSection,
    SamplingSection,
)

__all__ = [
    "CHECK_DATA_LEVELS", "GROUPS", "KEYS", "OPTIMIZERS", "PRIVACY_UNITS", "SECTIONS",
    "DataSection", "EvaluateEvery", "KeyDocumentation", "LedgerSection", "ModelSection", "OptimisationSection",
    "OptimizerConfig", "PrivacySection", "RunSection", "SamplingSection", "TrainConfig",
    "build_config", "check_against_data", "check_people_within_bound", "documented_keys", "expected_batch_size",
    "json_schema", "key", "load_config", "read_toml", "replaced", "rows_per_person", "sampled_unit_count",
    "sampling_rate", "section_of", "test_set_size", "toml_literal", "total_steps", "training_set_size", "user_spec",
]
