"""The config is declared once: every bad key is named at once, and the schema and flags agree with the checks."""

import json
import sys
from pathlib import Path

import jsonschema
import pytest
from pydantic import ValidationError

from orchestrator.cli import main
from orchestrator.config import KEYS, build_config, json_schema, load_config, replaced
from orchestrator.errors import UsageError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
SEVERAL_BAD_KEYS = """steps = 3
noise_multiplier = 1.0
batch_size = 0
delta = 2
accountant = "moments"
workers = 2.5
secure_noise = "yes"
optimizer = "rmsprop"
sigma = 1.0
"""
# Each bad key above, in the words the command line uses for it alone.
NAMED = [
    "unknown config key(s): sigma; docs/config-reference.md and `dpfleet train --help` list every key",
    "batch_size must be an integer >= 1 (got 0)",
    "delta must be in (0, 1) (got 2)",
    "accountant must be one of pld, rdp, gdp (got 'moments')",
    "workers must be a whole number (got 2.5)",
    "secure_noise must be true or false (got 'yes')",
    "optimizer.name must be one of sgd, momentum, adam, adamw (got 'rmsprop')",
]


def test_a_config_with_several_bad_keys_names_every_one_with_its_file(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text(SEVERAL_BAD_KEYS)
    with pytest.raises(UsageError) as refused:
        load_config(str(path), {"seed": "-1"})
    lines = str(refused.value).splitlines()
    assert lines[0] == f"{len(NAMED) + 1} problems in the config:"
    for message in NAMED:
        assert sum(line.startswith(f"  {message}") and line.endswith(f" (in {path})") for line in lines) == 1, message
    assert "  seed must be an integer >= 0 (got -1) (from --seed)" in lines  # an override names its flag


def test_the_command_line_prints_every_bad_key_and_exits_2(tmp_path, capsys):
    path = tmp_path / "job.toml"
    path.write_text(SEVERAL_BAD_KEYS)
    assert main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert all(message in err for message in NAMED) and "Traceback" not in err


def test_a_misspelt_key_gets_the_key_it_is_closest_to_and_exits_2(tmp_path, capsys):
    path = tmp_path / "job.toml"
    path.write_text("stepz = 3\nnoise_multiplier = 1.0\n[optimizer]\nname = \"adam\"\nbetaz = [0.9, 0.99]\n")
    assert main(["train", "--config", str(path)]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert f"  unknown config key(s): stepz (did you mean `steps`?); docs/config-reference.md and `dpfleet train " \
           f"--help` list every key (in {path})" in lines
    assert f"  optimizer takes name, momentum, nesterov, betas, eps, weight_decay; unknown: betaz (did you mean " \
           f"`betas`?) (in {path})" in lines


def test_every_rule_between_keys_that_a_config_breaks_is_named():
    with pytest.raises(UsageError) as refused:
        build_config({"noise_multiplier": 1.0, "target_epsilon_basis": "filter", "augmentations_per_example": 2,
                      "microbatch_size": 2, "layer_clip_norms": {"0": 1.0}})
    message = str(refused.value)
    for rule in ("give exactly one of epochs (> 0) or steps", 'target_epsilon_basis = "filter" sets how',
                 "augmentations_per_example = 2 needs train_transforms", "layer_clip_norms clips single examples"):
        assert rule in message, rule


def test_a_replaced_key_is_checked_again():
    config = build_config({"steps": 2, "noise_multiplier": 1.0, "train_subset": 100, "batch_size": 10})
    assert replaced(config, clip_norm=2.0).clip_norm == 2.0 and replaced(config, clip_norm=2.0) != config
    with pytest.raises(UsageError, match=r"clip_norm must be > 0 \(got -1\)"):
        replaced(config, clip_norm=-1.0)
    with pytest.raises(ValidationError, match="frozen"):
        config.clip_norm = 2.0


def test_the_schema_names_every_key_and_accepts_the_examples_and_refuses_what_the_checks_refuse(capsys):
    assert main(["config", "schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert schema == json.loads(json.dumps(json_schema()))
    assert set(schema["properties"]) == KEYS and schema["additionalProperties"] is False
    assert schema["properties"]["batch_size"]["minimum"] == 1 and schema["properties"]["batch_size"]["default"] == 250
    validator = jsonschema.Draft202012Validator(schema)
    for example in sorted(EXAMPLES.glob("*.toml")):
        values = tomllib.loads(example.read_text())
        assert not list(validator.iter_errors(values)), example.name
    refused = tomllib.loads(SEVERAL_BAD_KEYS)
    flagged = {error.path[0] if error.path else "sigma" for error in validator.iter_errors(refused)}
    assert flagged == {"sigma", "batch_size", "delta", "accountant", "workers", "secure_noise", "optimizer"}


def test_the_train_flags_take_their_range_from_the_keys_declaration(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    usage = " ".join(capsys.readouterr().out.split())
    assert "--workers WORKERS Gradient worker actors." in usage and "(≥ 1; overrides the config)" in usage


def test_every_bad_key_of_the_sub_tables_is_named_with_its_key_path_and_the_schema_refuses_them(tmp_path):
    values = {"steps": 3, "noise_multiplier": 1.0,
              "adaptive_clipping": {"target_quantile": 1.5, "update": "cosine", "speed": 1},
              "noise_schedule": {"kind": "exponential", "decay": -1, "every": 2.5},
              "optimizer": {"name": "adam", "betas": [0.9, 1.5], "eps": -1},
              "lr_schedule": "warmup", "evaluate_every": {"steps": 0}}
    path = tmp_path / "job.toml"
    with pytest.raises(UsageError) as refused:
        build_config(values, str(path))
    lines = str(refused.value).splitlines()
    named = ["adaptive_clipping.target_quantile must be in (0, 1) (got 1.5)",
             "adaptive_clipping.update must be one of geometric, linear (got 'cosine')",
             "adaptive_clipping takes target_quantile, learning_rate, update, count_noise_multiplier; unknown: speed",
             "noise_schedule.decay must be > 0 (got -1)", "noise_schedule.every must be a whole number (got 2.5)",
             "optimizer.betas must be two numbers in [0, 1) (got [0.9, 1.5])", "optimizer.eps must be >= 0 (got -1)",
             "lr_schedule.kind must be one of constant, cosine, step, exponential (got 'warmup')",
             "evaluate_every.steps must be an integer >= 1 (got 0)"]
    assert lines[0] == f"{len(named)} problems in the config:"
    assert sorted(lines[1:]) == sorted(f"  {message} (in {path})" for message in named)
    validator = jsonschema.Draft202012Validator(json_schema())
    flagged = {error.path[0] for error in validator.iter_errors(values)}
    assert flagged == {"adaptive_clipping", "noise_schedule", "optimizer", "lr_schedule", "evaluate_every"}
    assert not list(validator.iter_errors({"steps": 3, "noise_multiplier": 1.0, "adaptive_clipping": True,
                                            "optimizer": {"name": "momentum", "nesterov": True},
                                            "lr_schedule": "cosine", "evaluate_every": {"epochs": 0.5}}))


def test_a_sub_table_reads_its_defaults_from_its_declaration():
    config = build_config({"steps": 3, "noise_multiplier": 1.0, "adaptive_clipping": True, "optimizer": "momentum",
                           "noise_schedule": "exponential"})
    assert (config.adaptive_clipping.target_quantile, config.adaptive_clipping.count_noise_multiplier) == (0.5, 10.0)
    assert config.optimizer.parameters == {"momentum": 0.9} and config.noise_schedule.decay == 1.0
    assert build_config(json.loads(json.dumps(config.to_dict()))) == config  # as --resume reads config.json
