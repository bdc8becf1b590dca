"""bf16 against fp32: the per-example-gradient and clip step of the vmap engine, side by side in one run.

    python -m bench.precision [--device cpu|cuda] [--model gdp_cnn] [--batch 64] [--repeats 5] [--json]

Times ``per_example_clipped_sum`` (vmap engine: per-example gradients, their
float32 norms, clipping and the sum) on random MNIST-shaped examples, once
in float32 and once under bfloat16 autocast, alternating the two so that a
machine's load falls on both, and prints the median seconds per call and
the ratio fp32 / bf16 (above 1: bf16 is faster). Imports torch and the
workers' engine code only (no Ray), so it runs on any machine with torch.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from workers.models import build_model, flat_parameters, input_shape
from workers.vmap_engine import per_example_clipped_sum

RESULTS = Path(__file__).resolve().parent / "results"


def time_call(device: torch.device, function) -> float:
    """Seconds one call of ``function`` takes, waiting for the GPU's work where there is one."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    function()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


def measure(model_name: str, batch: int, repeats: int, device: torch.device) -> dict:
    """Median seconds per clipped sum at fp32 and at bf16 (after one warm-up call of each), and their ratio."""
    torch.manual_seed(0)
    model = build_model(model_name).to(device)
    weights = flat_parameters(model).to(device)
    inputs = torch.rand(batch, *input_shape(model_name), device=device)
    labels = torch.randint(0, 10, (batch,), device=device)

    def call(precision: str):
        return lambda: per_example_clipped_sum(model, weights, inputs, labels, 1.0, batch, precision=precision)

    seconds = {"fp32": [], "bf16": []}
    for precision in seconds:
        call(precision)()  # warm-up: first-call allocations and kernel choices
    for _ in range(repeats):
        for precision in seconds:
            seconds[precision].append(time_call(device, call(precision)))
    medians = {precision: statistics.median(values) for precision, values in seconds.items()}
    return {
        "model": model_name, "batch": batch, "repeats": repeats, "device": str(device),
        "fp32_seconds": medians["fp32"], "bf16_seconds": medians["bf16"],
        "fp32_over_bf16": medians["fp32"] / medians["bf16"],
        "fp32_examples_per_second": batch / medians["fp32"], "bf16_examples_per_second": batch / medians["bf16"],
    }


def machine(device: torch.device) -> str:
    """The machine in words: the GPU's name, else the CPU's architecture and core count."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.machine()} CPU, {torch.get_num_threads()} torch threads, {platform.system()}"


def main(argv: list[str]) -> int:
    """Measure, print the side-by-side row, and with --json write bench/results/precision[-cuda].json."""
    parser = argparse.ArgumentParser(prog="python -m bench.precision", description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--model", default="gdp_cnn")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="also write the figures to bench/results/")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device here", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    result = measure(args.model, args.batch, args.repeats, device)
    result |= {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d"), "machine": machine(device),
               "torch": torch.__version__, "command": "python -m bench.precision " + " ".join(argv)}
    print(f"{'precision':<10}{'s/call':>10}{'examples/s':>12}")
    for precision in ("fp32", "bf16"):
        print(f"{precision:<10}{result[f'{precision}_seconds']:>10.4f}{result[f'{precision}_examples_per_second']:>12.1f}")
    print(f"fp32/bf16 time ratio: {result['fp32_over_bf16']:.2f} ({args.model}, batch {args.batch}, {device}, "
          f"{result['machine']})")
    if args.json:
        name = "precision.json" if device.type == "cpu" else "precision-cuda.json"
        (RESULTS / name).write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
