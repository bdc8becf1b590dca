"""Step time and peak memory of private fine-tuning, side by side: `python -m bench.fine_tuning [--json] [--model DIR]`.

On the model of examples/fine_tuning (a Llama-style decoder: hidden 128,
2 layers, vocabulary 2000, 64 positions, eager attention; randomly
initialised unless ``--model`` names a folder ``save_pretrained`` wrote)
and one fixed batch of full-length token sequences with next-token labels,
it times one training step of each variant, alternating the variants
within each repeat, and reports the median:

- non-private fine-tuning: forward, backward (plain autograd) and an SGD
  step of every parameter; non-private LoRA: the same with only the LoRA
  factors on q_proj and v_proj (r 8) trainable;
- dpfleet, DP LoRA and DP full fine-tuning: the fast engine's clipped sum,
  then the driver's Gaussian noise and SGD step (``DriverUpdate``), as one
  worker holding the whole batch computes it;
- Opacus 1.6's ghost clipping (``make_private(..., grad_sample_mode=
  "ghost")``; the ``bench`` extra), of every parameter and of the LoRA
  factors, on the same model (dpfleet's ``TokenModel`` around it) and batch.

Every variant runs dpfleet's model, so the same forward pass is timed.
Peak memory is measured per variant in a fresh process: the peak resident
set (VmHWM) over three steps after set-up, and that peak minus the
resident set after set-up (``memory_of_steps``), on the CPU; the maximum
allocated memory on CUDA (``--device cuda``). ``--json`` writes
bench/results/fine_tuning.json (fine_tuning-cuda.json on CUDA).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from bench.throughput import (CLIP_NORM, LEARNING_RATE, NOISE_MULTIPLIER, DriverUpdate, autograd_step,
                              memory_of_steps)
from workers.actor import retain_freed_memory
from workers.engines import clipped_sum
from workers.models import build_model
from workers.pretrained import next_token_labels
from workers.tasks import build_loss

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
LORA = {"kind": "lora", "r": 8, "alpha": 16, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}
BATCH_SIZE = 128
MEMORY_STEPS = 3


@dataclass(frozen=True)
class Setting:
    """The model folder, the device and one fixed batch: token ids [B, T] and their next-token labels."""

    folder: str
    device: torch.device
    ids: torch.Tensor
    labels: torch.Tensor

    @classmethod
    def of(cls, folder: str, device: torch.device, batch_size: int) -> Setting:
        """``batch_size`` sequences of uniformly drawn tokens that fill the model's positions (seed 0)."""
        with open(os.path.join(folder, "config.json")) as handle:
            config = json.load(handle)
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(2, config["vocab_size"], (batch_size, config["max_position_embeddings"]),
                            generator=generator)
        return cls(folder, device, ids.to(device), next_token_labels(ids).to(device))

    def model(self, lora: bool) -> nn.Module:
        """The model as dpfleet trains it: every parameter trainable, or with LoRA only the adapter's factors."""
        return build_model({"hf": self.folder, "task": "causal-lm", "adapter": LORA if lora else None}).to(
            self.device).train()


TOKEN_LOSS = build_loss("token_cross_entropy")


def non_private(lora: bool) -> Callable[[Setting], Callable[[], None]]:
    """One SGD step on the batch's mean token loss, by plain autograd."""

    def make(setting: Setting) -> Callable[[], None]:
        model = setting.model(lora)
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LEARNING_RATE)
        return autograd_step(optimizer, lambda: TOKEN_LOSS(model(setting.ids), setting.labels))

    return make


def dpfleet_fast(lora: bool) -> Callable[[Setting], Callable[[], None]]:
    """One DP-SGD step: the fast engine's clipped sum of the trainable parameters' gradients, noise, SGD step."""

    def make(setting: Setting) -> Callable[[], None]:
        driver = DriverUpdate(setting.model(lora), len(setting.ids))

        def step() -> None:
            summed = clipped_sum("fast", driver.model, driver.flat, setting.ids, setting.labels, CLIP_NORM,
                                 len(setting.ids), TOKEN_LOSS)
            driver.apply(summed)

        return step

    return make


def opacus_ghost(lora: bool) -> Callable[[Setting], Callable[[], None]]:
    """One DP-SGD step of Opacus's ghost clipping: each sequence's loss the mean over its tokens, as dpfleet's."""

    def make(setting: Setting) -> Callable[[], None]:
        from opacus import PrivacyEngine

        model = setting.model(lora)
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LEARNING_RATE)
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(setting.ids, setting.labels),
                                             batch_size=len(setting.ids))
        model, optimizer, criterion, _ = PrivacyEngine().make_private(
            module=model, optimizer=optimizer, data_loader=loader, criterion=nn.CrossEntropyLoss(),
            noise_multiplier=NOISE_MULTIPLIER, max_grad_norm=CLIP_NORM, poisson_sampling=False,
            grad_sample_mode="ghost")

        def loss() -> torch.Tensor:
            logits = model(setting.ids)
            return criterion(logits.flatten(0, 1), setting.labels.flatten(), shape=logits.shape)

        return autograd_step(optimizer, loss)

    return make


VARIANTS: dict[str, Callable[[Setting], Callable[[], None]]] = {
    "non-private full": non_private(lora=False),
    "non-private LoRA": non_private(lora=True),
    "dpfleet DP full": dpfleet_fast(lora=False),
    "dpfleet DP LoRA": dpfleet_fast(lora=True),
    "opacus ghost full": opacus_ghost(lora=False),
    "opacus ghost LoRA": opacus_ghost(lora=True),
}
# Each variant's non-private counterpart (same trainable parameters) and its Opacus counterpart.
COUNTERPARTS = {
    "dpfleet DP full": ("non-private full", "opacus ghost full"),
    "dpfleet DP LoRA": ("non-private LoRA", "opacus ghost LoRA"),
    "opacus ghost full": ("non-private full", None),
    "opacus ghost LoRA": ("non-private LoRA", None),
}


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _usable(name: str) -> str | None:
    """Why a variant cannot run here, or None."""
    if name.startswith("opacus") and importlib.util.find_spec("opacus") is None:
        return "opacus is not installed (pip install opacus==1.6.0, the bench extra)"
    return None


def step_seconds(setting: Setting, repeats: int) -> tuple[dict[str, list[float]], dict[str, str]]:
    """Each variant's seconds per step over ``repeats`` rounds (the variants alternating in each), after one
    warm-up step; and the variants that could not run, with why."""
    steps, skipped = {}, {}
    for name, make in VARIANTS.items():
        reason = _usable(name)
        if reason is None:
            try:
                steps[name] = make(setting)
                steps[name]()
            except Exception as error:  # noqa: BLE001 - a variant that cannot run is reported, not fatal
                reason = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
        if reason is not None:
            skipped[name] = reason
            steps.pop(name, None)
    seconds: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            _synchronize(setting.device)
            started = time.perf_counter()
            step()
            _synchronize(setting.device)
            seconds[name].append(time.perf_counter() - started)
    return seconds, skipped


def peak_memory(folder: str, device: torch.device, batch_size: int, threads: int) -> dict[str, dict]:
    """Each variant's ``memory_of_steps`` over MEMORY_STEPS steps, each in a fresh process."""
    results = {}
    for name in VARIANTS:
        if _usable(name) is not None:
            continue
        completed = subprocess.run(
            [sys.executable, "-m", "bench.fine_tuning", "--memory-probe", name, "--model", folder, "--device",
             device.type, "--batch", str(batch_size), "--threads", str(threads)],
            capture_output=True, text=True, check=False)
        results[name] = (json.loads(completed.stdout.strip().splitlines()[-1]) if completed.returncode == 0
                         else {"error": completed.stderr.strip().splitlines()[-1:]})
    return results


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator and denominator else None


def summarise(seconds: dict[str, list[float]], memory: dict[str, dict]) -> dict[str, dict]:
    """Per variant: median ms per step, speed against its non-private counterpart and Opacus's (> 1: faster),
    peak MB and its ratio to the non-private counterpart's."""
    median = {name: statistics.median(times) for name, times in seconds.items()}
    peak = {name: figures.get("peak_mb") for name, figures in memory.items()}
    rows = {}
    for name, value in median.items():
        non_private_name, opacus_name = COUNTERPARTS.get(name, (None, None))
        rows[name] = {
            "step_ms": value * 1e3,
            "speed_vs_non_private": _ratio(median.get(non_private_name), value),
            "speed_vs_opacus_ghost": _ratio(median.get(opacus_name), value),
            "peak_mb": peak.get(name),
            "peak_vs_non_private": _ratio(peak.get(name), peak.get(non_private_name)),
            "step_mb": memory.get(name, {}).get("step_mb"),
        }
    return rows


def _format(value: float | None, suffix: str = "x", digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}{suffix}"


def print_report(rows: dict[str, dict], skipped: dict[str, str], header: str) -> None:
    """The table of step times and peak memory, with each ratio against its counterparts."""
    print(header)
    title = (f"{'variant':18s} {'ms/step':>8s} {'speed vs non-priv':>17s} {'vs opacus ghost':>15s} "
             f"{'peak MB':>8s} {'peak vs non-priv':>16s} {'step MB':>8s}")
    print(title)
    print("-" * len(title))
    for name, row in rows.items():
        print(f"{name:18s} {row['step_ms']:8.1f} {_format(row['speed_vs_non_private']):>17s} "
              f"{_format(row['speed_vs_opacus_ghost']):>15s} {_format(row['peak_mb'], '', 0):>8s} "
              f"{_format(row['peak_vs_non_private']):>16s} {_format(row['step_mb'], '', 0):>8s}")
    for name, reason in skipped.items():
        print(f"{name:18s} skipped: {reason}")


def example_model(folder: str) -> str:
    """Save the example's model (examples/fine_tuning/pretrain.py's FULL setting, random weights, seed 0) in
    ``folder``; return it."""
    from transformers.utils import logging

    from examples.fine_tuning.pretrain import FULL, new_model

    logging.disable_progress_bar()
    new_model(FULL, FULL.vocab_size, seed=0).save_pretrained(folder)
    return folder


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print (and with --json, write) the results."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="also write bench/results/fine_tuning.json")
    parser.add_argument("--model", help="a causal-LM folder (default: the example's architecture, random weights)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--batch", type=int, default=BATCH_SIZE, help="sequences per step")
    parser.add_argument("--repeats", type=int, default=7, help="timed steps per variant, alternating (>= 5)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--no-memory", action="store_true", help="skip the per-variant peak-memory processes")
    parser.add_argument("--memory-probe", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.repeats < 5:
        parser.error(f"--repeats must be >= 5 (got {args.repeats}); the figures are medians of at least 5 steps")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA GPU, and torch sees none")
    torch.set_num_threads(args.threads)
    retain_freed_memory()  # as the gradient workers do; every variant runs on the same terms
    warnings.filterwarnings("ignore", message=".*(Secure RNG|full_backward_hook|performance drop).*")
    device = torch.device(args.device)
    if args.memory_probe:
        setting = Setting.of(args.model, device, args.batch)
        print(json.dumps(memory_of_steps(VARIANTS[args.memory_probe](setting), MEMORY_STEPS, device)))
        return 0
    with tempfile.TemporaryDirectory() as scratch:
        folder = args.model or example_model(scratch)
        setting = Setting.of(folder, device, args.batch)
        seconds, skipped = step_seconds(setting, args.repeats)
        memory = {} if args.no_memory else peak_memory(folder, device, args.batch, args.threads)
    rows = summarise(seconds, memory)
    where = f"cuda ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "cpu"
    print_report(rows, skipped, f"{where}, {args.threads} torch thread(s), batch {args.batch} x {setting.ids.shape[1]} tokens; median "
                                f"of {args.repeats} alternating steps; peak memory: "
                                f"{'peak RSS (VmHWM)' if device.type == 'cpu' else 'max allocated'}, fresh process")
    if args.json:
        os.makedirs(RESULTS_DIR, exist_ok=True)
        name = "fine_tuning.json" if device.type == "cpu" else f"fine_tuning-{device.type}.json"
        with open(os.path.join(RESULTS_DIR, name), "w") as out:
            json.dump({"date": datetime.date.today().isoformat(), "device": where, "threads": args.threads,
                       "batch_size": args.batch, "repeats": args.repeats, "load_average": os.getloadavg(),
                       "model": args.model or "examples/fine_tuning's architecture, random weights",
                       "variants": rows, "step_seconds": seconds, "memory": memory, "skipped": skipped},
                      out, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
