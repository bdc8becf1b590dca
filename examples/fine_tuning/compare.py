"""DP fine-tuning against DP training from scratch and non-private fine-tuning, on the private plays.

    python -m examples.fine_tuning.compare --out runs/fine-tuning [--tiny] [--epsilons 1 3 8] [--variants ...]

Run after ``examples.fine_tuning.pretrain`` with the same ``--out``: the
configs beside this file name their folders and files relative to it
(``pretrained/``, ``scratch/``, ``private/``), so the script trains from
there. For each variant (``lora.toml``: DP LoRA on q_proj and v_proj;
``full.toml``: DP full fine-tuning; ``scratch.toml``: DP training of the
same architecture from its random initialisation) and each ε, it runs
``dpfleet.train`` with ``target_epsilon`` = ε, through the embedded ledger
(``DPFLEET_HOME``; ``run.sh`` points it at ``OUT/home``). dpfleet has no
non-private mode (every run adds noise), so the non-private fine-tuning is
plain PyTorch here: the full model, the same optimizer, steps and batch
size as ``full.toml``, batches drawn uniformly.

Every model is scored by ``evaluate`` on the private test split: the mean
loss per predicted token (nats; its exp is the perplexity) and the token
accuracy. The table goes to stdout as Markdown, the figures to
``OUT/results.json``. ``--tiny`` runs two steps a run (for tests).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import time
import tomllib
from pathlib import Path

import torch

from workers.pretrained_spec import IGNORED_LABEL, PAD_INPUT

CONFIG_FOLDER = Path(__file__).resolve().parent
VARIANTS = {"lora": "DP LoRA", "full": "DP full fine-tuning", "scratch": "DP from scratch"}
EPSILONS = (1.0, 3.0, 8.0)
TINY = {"steps": 2, "batch_size": 16}
EVALUATION_BATCH = 256


def read_split(path: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [N, T] (padded with PAD_INPUT) and next-token labels [N, T] of a private split's Parquet file."""
    import numpy as np
    import pyarrow.parquet as pq

    table = pq.read_table(path, columns=["input_ids", "label"])
    return tuple(torch.from_numpy(np.stack(table.column(name).to_numpy(zero_copy_only=False)).astype(np.int64))
                 for name in ("input_ids", "label"))


def hf_inputs(ids: torch.Tensor, pad_token_id: int) -> dict[str, torch.Tensor]:
    """A transformers model's ``input_ids`` and ``attention_mask`` for token ids [N, T] padded (on the right) with
    PAD_INPUT, as dpfleet stores them."""
    present = ids != PAD_INPUT
    return {"input_ids": torch.where(present, ids, pad_token_id), "attention_mask": present.long()}


def evaluate(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """A causal LM's ``loss`` (mean negative log-likelihood per predicted token, in nats), ``perplexity`` (its exp)
    and ``token_accuracy`` (the share of predicted tokens that are its argmax) on ``ids`` [N, T] against ``labels``
    [N, T] (IGNORED_LABEL where no token is predicted). ``model`` is a transformers causal LM (or its peft model)."""
    model.eval()
    loss_sum, correct, counted = 0.0, 0, 0
    with torch.no_grad():
        for start in range(0, len(ids), EVALUATION_BATCH):
            logits = model(**hf_inputs(ids[start:start + EVALUATION_BATCH], model.config.pad_token_id)).logits
            targets = labels[start:start + EVALUATION_BATCH]
            kept = targets != IGNORED_LABEL
            loss_sum += torch.nn.functional.cross_entropy(logits[kept], targets[kept], reduction="sum").item()
            correct += (logits[kept].argmax(-1) == targets[kept]).sum().item()
            counted += kept.sum().item()
    loss = loss_sum / counted
    return {"loss": loss, "perplexity": math.exp(loss), "token_accuracy": correct / counted}


def causal_lm(folder: str):
    """The transformers causal LM saved in ``folder``, in float32 with eager attention, as dpfleet loads it."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, attn_implementation="eager",
                                                dtype=torch.float32)


def fine_tune_non_private(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor, steps: int,
                          batch_size: int, learning_rate: float, seed: int) -> torch.nn.Module:
    """``model`` (a transformers causal LM) trained without privacy: ``steps`` Adam steps on the mean token loss of
    ``batch_size`` examples drawn uniformly, without clipping or noise."""
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=learning_rate)
    model.train()
    for _ in range(steps):
        batch = torch.randint(len(ids), (batch_size,), generator=generator)
        logits = model(**hf_inputs(ids[batch], model.config.pad_token_id)).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels[batch].flatten(),
                                                 ignore_index=IGNORED_LABEL)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return model


def config_of(variant: str) -> Path:
    """The TOML config of a DP variant (a key of VARIANTS)."""
    return CONFIG_FOLDER / f"{variant}.toml"


def run_private(variant: str, epsilon: float, overrides: dict, test: tuple[torch.Tensor, torch.Tensor]) -> dict:
    """One dpfleet run of ``variant`` at ``target_epsilon`` = ``epsilon``, scored by ``evaluate``; its σ, steps,
    (ε, δ) and dpfleet's own test metrics beside."""
    import dpfleet

    started = time.perf_counter()
    result = dpfleet.train(config_of(variant), export=False, overwrite=True, target_epsilon=epsilon,
                           run_dir=f"runs/{variant}-eps{epsilon:g}", **overrides)
    seconds = time.perf_counter() - started
    scores = evaluate(dpfleet.load(result.run_dir), *test)
    return {**scores, "epsilon": result.epsilon, "delta": result.delta, "steps": result.summary["steps"],
            "noise_multiplier": result.summary["noise_multiplier"], "dpfleet_test_metrics": result.metrics,
            "seconds": seconds}


def run_non_private(overrides: dict, train: tuple[torch.Tensor, torch.Tensor],
                    test: tuple[torch.Tensor, torch.Tensor], seed: int) -> dict:
    """The non-private fine-tuning of the pretrained model with full.toml's optimizer, steps and batch size."""
    with open(config_of("full"), "rb") as handle:
        config = {**tomllib.load(handle), **overrides}
    started = time.perf_counter()
    model = fine_tune_non_private(causal_lm(config["model"]["hf"]), *train, config["steps"], config["batch_size"],
                                  config["learning_rate"], seed)
    return {**evaluate(model, *test), "steps": config["steps"], "batch_size": config["batch_size"],
            "seconds": time.perf_counter() - started}


def _cell(scores: dict | None) -> str:
    if scores is None:
        return "–"
    return f"{scores['loss']:.3f} ({scores['perplexity']:.1f}) / {scores['token_accuracy']:.1%}"


def markdown_table(results: dict) -> str:
    """The results as a Markdown table: a row per variant, a column per ε and one without privacy; each cell test
    loss (perplexity) / token accuracy."""
    epsilons = results["epsilons"]
    lines = ["| model | " + " | ".join(f"ε = {epsilon:g}" for epsilon in epsilons) + " | no privacy |",
             "|---" * (len(epsilons) + 2) + "|"]
    for variant, name in VARIANTS.items():
        runs = results["private"].get(variant)
        if runs:
            lines.append(f"| {name} | " + " | ".join(_cell(runs.get(f"{epsilon:g}")) for epsilon in epsilons) + " | – |")
    for key, name in (("non_private", "non-private fine-tuning"), ("pretrained", "pretrained, not fine-tuned"),
                      ("scratch", "random initialisation, not trained")):
        lines.append(f"| {name} | " + " | ".join("–" for _ in epsilons) + f" | {_cell(results[key])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Train and score every variant at every ε, print the table and write OUT/results.json."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="the folder pretrain.py wrote")
    parser.add_argument("--epsilons", type=float, nargs="+", default=list(EPSILONS))
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--tiny", action="store_true", help=f"every run {TINY['steps']} steps of {TINY['batch_size']}")
    parser.add_argument("--seed", type=int, default=0, help="the non-private run's batches")
    args = parser.parse_args(argv)
    import ray
    from transformers.utils import logging

    logging.disable_progress_bar()
    os.chdir(args.out)
    if not ray.is_initialized():  # one Ray for every run, rather than a start and a stop for each
        ray.init(address="local", num_cpus=max(2, os.cpu_count() or 1), include_dashboard=False, log_to_driver=False)
    overrides = dict(TINY) if args.tiny else {}
    train, test = read_split("private/train.parquet"), read_split("private/test.parquet")
    results = {
        "date": datetime.date.today().isoformat(), "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "command": "bash examples/fine_tuning/run.sh" + (" --tiny" if args.tiny else ""),
        "epsilons": args.epsilons, "train_examples": len(train[0]), "test_examples": len(test[0]),
        "pretrained": evaluate(causal_lm("pretrained"), *test), "scratch": evaluate(causal_lm("scratch"), *test),
        "non_private": run_non_private(overrides, train, test, args.seed), "private": {},
    }
    for variant in args.variants:
        for epsilon in args.epsilons:
            scores = run_private(variant, epsilon, overrides, test)
            results["private"].setdefault(variant, {})[f"{epsilon:g}"] = scores
            print(f"{VARIANTS[variant]} at ε = {epsilon:g}: test loss {scores['loss']:.3f}, token accuracy "
                  f"{scores['token_accuracy']:.1%} (σ {scores['noise_multiplier']:.3f}, {scores['steps']} steps, "
                  f"{scores['seconds']:.0f} s)", flush=True)
    results["load_average"] = os.getloadavg()
    Path("results.json").write_text(json.dumps(results, indent=2))
    print(markdown_table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
