"""The config's side of pretrained Hugging Face models: the ``model = { hf, task }`` and ``adapter`` tables, the
tasks, and the token layout, without torch or transformers (configs are checked before either loads).

``workers.pretrained`` builds the models these describe.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

PAD_INPUT = -1
"""The token id that marks a padding position in a pretrained model's inputs."""

IGNORED_LABEL = -100
"""The label of a position that does not count in the loss (torch's ``ignore_index``)."""

TASKS: dict[str, tuple[str, str]] = {
    "sequence-classification": ("AutoModelForSequenceClassification", "cross_entropy"),
    "token-classification": ("AutoModelForTokenClassification", "token_cross_entropy"),
    "causal-lm": ("AutoModelForCausalLM", "token_cross_entropy"),
}
"""Each task's ``transformers`` auto class and the dpfleet loss it trains on."""

PEFT_TASK_TYPES = {"sequence-classification": "SEQ_CLS", "token-classification": "TOKEN_CLS",
                    "causal-lm": "CAUSAL_LM"}
_MODEL_KEYS = {"hf", "task", "num_labels"}
_ADAPTER_KEYS = {"kind", "r", "alpha", "dropout", "target_modules"}


# --- the config's tables --------------------------------------------------------


def check_folder(path: str) -> None:
    """Raise ValueError unless ``path`` is a local folder holding a saved model's config.json: a hub name is
    refused with how to download it first."""
    if not os.path.isdir(path):
        name = os.path.relpath(path)  # a hub name, made absolute by parse_model_table, as the config gave it
        raise ValueError(
            f"model.hf = {name!r} is not a folder on this machine ({path}); dpfleet loads pretrained models from "
            "local folders only (workers never reach a hub): download it first, e.g. `hf download "
            f"{name} --local-dir ./{os.path.basename(path)}`, or in Python `AutoModel.from_pretrained({name!r})"
            f".save_pretrained('./{os.path.basename(path)}')` with its tokenizer, then set hf = "
            f"\"./{os.path.basename(path)}\"")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"model.hf = {path!r} holds no config.json: give the folder that save_pretrained wrote")


def parse_model_table(value: Mapping) -> dict:
    """A config's ``model = { hf = ..., task = ... }`` checked into a spec: the folder made absolute.

    Raises ValueError naming the bad key: an unknown key, a task not in
    ``TASKS``, a ``num_labels`` below 2. Whether the folder exists is asked
    where the model is built (``check_folder``), on the machine that builds it.
    """
    unknown = set(value) - _MODEL_KEYS
    if unknown:
        raise ValueError(f"a model table takes {', '.join(sorted(_MODEL_KEYS))}; unknown: {', '.join(sorted(unknown))}")
    path, task = value.get("hf"), value.get("task")
    if not isinstance(path, str) or not path:
        raise ValueError(f"model.hf must be the path of a local Hugging Face model folder (got {path!r})")
    if task not in TASKS:
        raise ValueError(f"model.task must be one of {', '.join(map(repr, TASKS))} (got {task!r})")
    spec = {"hf": os.path.abspath(path), "task": task}
    if "num_labels" in value:
        count = value["num_labels"]
        if task == "causal-lm" or isinstance(count, bool) or not isinstance(count, int) or count < 2:
            raise ValueError(f"model.num_labels is the number of classes (>= 2) of a classification task "
                             f"(got {count!r} for task {task!r})")
        spec["num_labels"] = count
    return spec


def parse_adapter(value: Any) -> dict | None:
    """A config's ``adapter`` table checked: ``kind = "lora"``, ``r`` >= 1, ``alpha`` > 0, ``dropout`` in [0, 1),
    ``target_modules`` a non-empty list of module names (peft's matching). None stays None."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ValueError(f"adapter must be a table such as {{ kind = \"lora\", r = 8, alpha = 16, target_modules = "
                         f"[\"q_proj\", \"v_proj\"] }} (got {value!r})")
    unknown = set(value) - _ADAPTER_KEYS
    if unknown:
        raise ValueError(f"adapter takes {', '.join(sorted(_ADAPTER_KEYS))}; unknown: {', '.join(sorted(unknown))}")
    if value.get("kind") != "lora":
        raise ValueError(f"adapter.kind must be \"lora\" (got {value.get('kind')!r})")
    adapter = {"kind": "lora", "r": value.get("r", 8), "alpha": value.get("alpha", 16),
               "dropout": value.get("dropout", 0.0), "target_modules": value.get("target_modules")}
    if isinstance(adapter["r"], bool) or not isinstance(adapter["r"], int) or adapter["r"] < 1:
        raise ValueError(f"adapter.r must be an integer >= 1 (got {adapter['r']!r})")
    if isinstance(adapter["alpha"], bool) or not isinstance(adapter["alpha"], (int, float)) or adapter["alpha"] <= 0:
        raise ValueError(f"adapter.alpha must be a number > 0 (got {adapter['alpha']!r})")
    if isinstance(adapter["dropout"], bool) or not isinstance(adapter["dropout"], (int, float)) \
            or not 0 <= adapter["dropout"] < 1:
        raise ValueError(f"adapter.dropout must be in [0, 1) (got {adapter['dropout']!r})")
    modules = adapter["target_modules"]
    if not (isinstance(modules, list) and modules and all(isinstance(name, str) and name for name in modules)):
        raise ValueError("adapter.target_modules must name the layers that get LoRA factors, e.g. [\"q_proj\", "
                         f"\"v_proj\"] for Llama or [\"c_attn\"] for GPT-2 (got {modules!r})")
    return adapter


def loss_of_task(task: str) -> str:
    """The dpfleet loss a pretrained model of ``task`` trains on."""
    return TASKS[task][1]


def describe_model(spec: str | Mapping) -> str:
    """A model spec in words for the run's start line: a name as given; a pretrained model's folder, task and what
    of it is trained (a LoRA adapter's factors only, or every parameter)."""
    if isinstance(spec, str):
        return spec
    adapter = spec.get("adapter")
    trained = ("full fine-tuning: every parameter trained" if adapter is None else
               f"LoRA r={adapter['r']}, alpha={adapter['alpha']:g} on {', '.join(adapter['target_modules'])}: "
               "only the adapter is trained, clipped and noised; the base is frozen")
    return f"{spec['hf']} ({spec['task']}; {trained})"

