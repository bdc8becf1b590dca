"""Per-example clipping throughput, side by side: `python -m bench.throughput [--json] [--device cpu|cuda] [--repeats N]`.

For each model, on one fixed batch and the same torch thread count, it times
one training step of every variant, alternating the variants within each
repeat, and reports the median samples/s over the repeats:

- non-private SGD (forward, backward, SGD step);
- Opacus 1.6 with per-sample-gradient hooks, and with ghost clipping (a
  bench-only extra: ``pip install opacus==1.6.0``; skipped when missing);
- dpfleet in process: the clipped sum by the fast engine and by the vmap
  engine, then Gaussian noise from torch's generator and the SGD step;
- dpfleet over Ray with 1 and with 2 gradient workers of 1 thread each (the
  MNIST models and ResNet-18-GN, whose workers open the same synthetic
  images as a ``module:function`` dataset), with the driver of ``dpfleet
  train``: secure noise drawn ahead on a background thread, the sums of a
  node's workers added on their node, the noisy mean written into the
  model's flat gradient buffer. On CUDA the two workers share the one GPU
  (half each) and the driver uses the GPU too. For these rows the report
  adds where a step's time goes: the driver's own seconds (what the
  workers wait for), of which its wait for the noise, the slowest worker's
  seconds in its call, and the driver's wait for the sums. A third Ray row,
  ``ray 1, fast noise``, draws the fast (not secure) noise the in-process
  row draws, so the two compare like for like.

Models: ``gdp_cnn`` and ``lenet5`` at batch 256 on MNIST; torchvision's
ResNet-18 with GroupNorm at batch 64 on synthetic 3x32x32 images; a small
transformer text classifier, a GRU text classifier and a weight-tied GRU language model at batch 128 on
synthetic tokens (Opacus runs the GRU as its ``DPGRU``, the replacement its
``ModuleValidator.fix`` makes; dpfleet the user's ``nn.GRU``). Peak memory of a
ResNet-18-GN step at batch 64 is measured per variant in a fresh process:
peak resident set on the CPU (also given above the resident set after
set-up), peak allocated memory on CUDA. ``--json`` writes the figures to
bench/results/throughput.json (throughput-cuda.json for ``--device cuda``).
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from orchestrator.aggregation import NodeAggregation
from orchestrator.noise import GaussianNoise, NoiseFeed, TorchGaussianNoise, driver_threads, noisy_mean_gradient
from workers.actor import retain_freed_memory
from workers.engines import clipped_sum
from workers.models import bind_flat_views, build_model, flat_parameters

RESULTS_DIR = Path(__file__).resolve().parent / "results"
NOISE_MULTIPLIER = 1.0
CLIP_NORM = 1.0
LEARNING_RATE = 0.05
MNIST_EXAMPLES = 10_000
MEMORY_MODEL = "resnet18_gn"
MEMORY_STEPS = 3


def group_norm(channels: int) -> nn.GroupNorm:
    """GroupNorm(min(32, C), C): the usual replacement of a batch norm over C channels."""
    return nn.GroupNorm(min(32, channels), channels)


def resnet18_gn(num_classes: int = 10) -> nn.Module:
    """torchvision's ResNet-18 with ``group_norm`` in place of every batch norm."""
    import torchvision

    return torchvision.models.resnet18(num_classes=num_classes, norm_layer=group_norm)


class TextClassifier(nn.Module):
    """A small transformer text classifier: token and position embeddings, encoder layers, mean pool, head.

    Takes token ids [B, sequence_length] (0 is padding) and returns logits
    [B, classes]. Dropout is off so that every engine computes the same
    gradients; positions are an Embedding fed [B, T] ids, so every parameter
    sees the examples along dimension 0.
    """

    def __init__(
        self, vocab_size: int = 5000, sequence_length: int = 32, width: int = 128, heads: int = 4,
        layers: int = 2, classes: int = 4,
    ) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, width, padding_idx=0)
        self.positions = nn.Embedding(sequence_length, width)
        layer = nn.TransformerEncoderLayer(width, heads, dim_feedforward=2 * width, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits [B, classes] for token ids [B, T]."""
        positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        hidden = self.encoder(self.tokens(tokens) + self.positions(positions))
        return self.head(self.norm(hidden.mean(1)))


class GRUTextClassifier(nn.Module):
    """A GRU text classifier: token embedding, one batch-first ``nn.GRU`` layer, a linear head on its last state.

    Takes token ids [B, T] (0 is padding) and returns logits [B, classes].
    """

    def __init__(self, vocab_size: int = 5000, width: int = 128, hidden: int = 128, classes: int = 4) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, width, padding_idx=0)
        self.gru = nn.GRU(width, hidden, batch_first=True)
        self.head = nn.Linear(hidden, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits [B, classes] for token ids [B, T]."""
        _, final = self.gru(self.tokens(tokens))
        return self.head(final[-1])


class TiedGRULanguageModel(GRUTextClassifier):
    """A weight-tied language model: ``GRUTextClassifier``'s embedding and GRU, logits ``h @ E^T`` over the vocabulary.

    The output layer is the embedding matrix used directly in forward, so
    dpfleet's fast engine sends it to the vmap engine (a rule would not see
    the head's share of the embedding's gradient).
    """

    def __init__(self, vocab_size: int = 5000, width: int = 128) -> None:
        super().__init__(vocab_size, width, width)
        del self.head

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits [B, vocab_size] for token ids [B, T]."""
        _, final = self.gru(self.tokens(tokens))
        return final[-1] @ self.tokens.weight.T


@dataclass(frozen=True)
class Case:
    """One benchmarked model: how to build it and its data, the batch size, and what Ray workers open.

    ``timed_steps`` steps make one timing, so that a timing of a fast model
    is long enough to read; ``vmap_physical_batch`` bounds the vmap engine's
    memory. ``ray_specs`` is the (model, dataset) spec pair a gradient
    worker opens, None where the model is not run over Ray.
    """

    build: Callable[[], nn.Module]
    data: Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]]
    batch_size: int
    vmap_physical_batch: int
    ray_specs: tuple[str, str] | None
    timed_steps: int


def _mnist(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    from workers.data import load_split

    images, labels = load_split("mnist", "train")
    return images[:MNIST_EXAMPLES].clone(), labels[:MNIST_EXAMPLES].clone()


def _images(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(1024, 3, 32, 32, generator=generator), torch.randint(0, 10, (1024,), generator=generator)


def synthetic_images() -> tuple[torch.utils.data.Dataset, torch.utils.data.Dataset]:
    """ResNet-18-GN's images as a ``module:function`` dataset for Ray workers: (train, test), the Setting's examples."""
    images = torch.utils.data.TensorDataset(*_images(torch.Generator().manual_seed(0)))
    return images, images


def _tokens(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(1, 5000, (1024, 32), generator=generator), torch.randint(0, 4, (1024,), generator=generator)


CASES = {
    "gdp_cnn": Case(lambda: build_model("gdp_cnn"), _mnist, 256, 256, ("gdp_cnn", "mnist"), 4),
    "lenet5": Case(lambda: build_model("lenet5"), _mnist, 256, 256, ("lenet5", "mnist"), 4),
    # vmap holds one 11M-entry gradient per example: 16 at a time keeps it under 1 GB.
    "resnet18_gn": Case(resnet18_gn, _images, 64, 16,
                        ("bench.throughput:resnet18_gn", "bench.throughput:synthetic_images"), 1),
    "transformer": Case(TextClassifier, _tokens, 128, 128, None, 1),
    "gru": Case(GRUTextClassifier, _tokens, 128, 128, None, 1),
    "tied_gru_lm": Case(TiedGRULanguageModel, _tokens, 128, 32, None, 1),
}


class Setting:
    """A model's fixed data, batch and device, shared by all its variants."""

    def __init__(self, name: str, device: torch.device, seed: int = 0) -> None:
        self.name = name
        self.case = CASES[name]
        self.device = device
        generator = torch.Generator().manual_seed(seed)
        self.inputs, self.labels = self.case.data(generator)
        self.indices = torch.randperm(len(self.labels), generator=generator)[: self.case.batch_size]
        self.batch_inputs = self.inputs[self.indices].to(device)
        self.batch_labels = self.labels[self.indices].to(device)
        self.initial = self.case.build()

    def model(self, device: torch.device | None = None) -> nn.Module:
        """A fresh copy of the model on ``device`` (default: the setting's), same initial weights for every variant."""
        return copy.deepcopy(self.initial).to(device or self.device).train()


def autograd_step(optimizer: torch.optim.Optimizer, loss: Callable[[], torch.Tensor]) -> Callable[[], None]:
    """A training step by plain autograd: clear the gradients, backpropagate ``loss()``, let ``optimizer`` step."""

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss().backward()
        optimizer.step()

    return step


def non_private(setting: Setting) -> Callable[[], None]:
    """One SGD step on the mean loss."""
    model = setting.model()
    return autograd_step(torch.optim.SGD(model.parameters(), lr=LEARNING_RATE),
                         lambda: F.cross_entropy(model(setting.batch_inputs), setting.batch_labels))


def opacus_variant(mode: str) -> Callable[[Setting], Callable[[], None]]:
    """One DP-SGD step of Opacus in ``grad_sample_mode`` ``mode`` ('hooks' or 'ghost')."""

    def make(setting: Setting) -> Callable[[], None]:
        from opacus import PrivacyEngine
        from opacus.validators import ModuleValidator

        model = ModuleValidator.fix(setting.model())
        # Opacus' backward hooks refuse in-place operations on a hooked module's output.
        for module in model.modules():
            if isinstance(module, nn.ReLU):
                module.inplace = False
            if type(module).__name__ == "BasicBlock":
                module.forward = _out_of_place_residual(module)
        optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
        loader = torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(setting.batch_inputs, setting.batch_labels),
            batch_size=setting.case.batch_size,
        )
        private = PrivacyEngine().make_private(
            module=model, optimizer=optimizer, data_loader=loader, criterion=nn.CrossEntropyLoss(),
            noise_multiplier=NOISE_MULTIPLIER, max_grad_norm=CLIP_NORM, poisson_sampling=False,
            grad_sample_mode=mode,
        )
        model, optimizer = private[0], private[1]
        criterion = private[2] if mode == "ghost" else nn.CrossEntropyLoss()
        return autograd_step(optimizer, lambda: criterion(model(setting.batch_inputs), setting.batch_labels))

    return make


def _out_of_place_residual(block: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """torchvision's BasicBlock.forward with ``out + identity`` in place of ``out += identity``."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        identity = x if block.downsample is None else block.downsample(x)
        out = block.relu(block.bn1(block.conv1(x)))
        return block.relu(block.bn2(block.conv2(out)) + identity)

    return forward


class DriverUpdate:
    """The trainer's side of a DP-SGD step: noise once on the clipped sum, average over ``batch_size``, SGD step.

    The weights and the gradient are ``model``'s flat views of its
    trainable parameters (``bind_flat_views``), as in ``dpfleet train``;
    the noise comes from torch's generator on the model's device, drawn
    within the step.
    """

    def __init__(self, model: nn.Module, batch_size: int) -> None:
        self.model = model
        self.batch_size = batch_size
        self.flat, self.gradient = bind_flat_views(self.model)
        self.optimizer = torch.optim.SGD([p for p in self.model.parameters() if p.requires_grad], lr=LEARNING_RATE)
        self.generator = torch.Generator(self.flat.device).manual_seed(1)

    def apply(self, summed: torch.Tensor) -> None:
        """Add N(0, (σC)²) to the clipped sum, divide by the batch size into the gradient, and step."""
        noise = torch.randn(summed.shape, generator=self.generator, device=self.generator.device)
        noisy = summed.to(noise.device).add_(noise, alpha=NOISE_MULTIPLIER * CLIP_NORM)
        torch.div(noisy, self.batch_size, out=self.gradient)
        self.optimizer.step()


def in_process(engine: str) -> Callable[[Setting], Callable[[], None]]:
    """One DP-SGD step with dpfleet's ``engine`` computing the clipped sum in this process."""

    def make(setting: Setting) -> Callable[[], None]:
        driver = DriverUpdate(setting.model(), setting.case.batch_size)
        physical = setting.case.batch_size if engine == "fast" else setting.case.vmap_physical_batch

        def step() -> None:
            selected = setting.inputs[setting.indices].to(setting.device)
            summed = clipped_sum(engine, driver.model, driver.flat, selected,
                                 setting.labels[setting.indices].to(setting.device), CLIP_NORM, physical)
            driver.apply(summed)

        return step

    return make


def clipped_sum_only(setting: Setting) -> Callable[[], None]:
    """The fast engine's clipped sum alone: what a gradient worker holds, without the driver's update."""
    model = setting.model()
    flat = flat_parameters(model)

    def step() -> None:
        clipped_sum("fast", model, flat, setting.batch_inputs, setting.batch_labels, CLIP_NORM,
                    setting.case.batch_size)

    return step


class RayStep:
    """One DP-SGD step over Ray gradient workers with ``dpfleet train``'s driver, timing where each step goes.

    Secure noise (OS entropy) is drawn a step ahead on a background thread;
    the sums come back one per node (read in place on the driver's own);
    the noisy mean goes straight into the model's flat gradient buffer. On
    CUDA the driver's model, noise and optimizer are on the GPU. ``times``
    holds, per step, (driver's own, of which waiting for the noise, slowest
    worker, wait for the sums) in seconds.
    """

    def __init__(self, setting: Setting, actors: list, secure_noise: bool = True) -> None:
        import ray

        self.setting, self.actors = setting, dict(enumerate(actors))
        self.model = setting.model()
        self.weights, self.gradient = bind_flat_views(self.model)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=LEARNING_RATE)
        noise = (TorchGaussianNoise(device=setting.device, secure=secure_noise) if setting.device.type == "cuda"
                 else GaussianNoise(secure=secure_noise))
        self.noise = NoiseFeed(noise, self.weights.numel())
        self.arithmetic = ThreadPoolExecutor(driver_threads())
        self.aggregation = NodeAggregation()
        self.nodes = dict(zip(self.actors, ray.get([actor.node_id.remote() for actor in actors])))
        self.aggregation.place(self.actors, self.nodes)
        self.step_index = 0
        self.times: list[tuple[float, float, float, float]] = []

    def __call__(self) -> None:
        import ray

        started, step = time.perf_counter(), self.step_index
        self.noise.request(step)
        self.noise.request(step + 1)
        weights = ray.put(self.weights.cpu().numpy())
        shares = np.array_split(self.setting.indices.numpy(), len(self.actors))
        calls = {index: (share, CLIP_NORM) for index, share in zip(self.actors, shares, strict=True)}
        gathered = self.aggregation.gather(self.aggregation.run(self.actors, self.nodes, "clipped_grad_sum", weights,
                                                                calls, {}))
        noise_started = time.perf_counter()
        unit_noise = self.noise.take(step)
        noise_wait = time.perf_counter() - noise_started
        noisy_mean_gradient(gathered.parts, unit_noise, NOISE_MULTIPLIER * CLIP_NORM, self.setting.case.batch_size,
                            self.gradient, self.arithmetic)
        self.optimizer.step()
        _synchronize(self.setting.device)
        wall = time.perf_counter() - started
        self.times.append((wall - gathered.wait_seconds, noise_wait, gathered.slowest_worker_seconds,
                           gathered.wait_seconds))
        self.step_index += 1


def over_ray(workers: int, secure_noise: bool = True) -> Callable[[Setting], Callable[[], None]]:
    """One DP-SGD step with the clipped sum split over ``workers`` Ray gradient workers (1 thread each)."""

    def make(setting: Setting) -> Callable[[], None]:
        return RayStep(setting, _ray_workers(setting)[:workers], secure_noise)

    return make


_ACTORS: dict[str, list] = {}


def _ray_workers(setting: Setting) -> list:
    import ray

    from workers.actor import GradientWorkerActor

    if setting.name not in _ACTORS:
        for actors in _ACTORS.values():
            for actor in actors:
                ray.kill(actor)
        _ACTORS.clear()
        model_spec, dataset_spec = setting.case.ray_specs
        subset = MNIST_EXAMPLES if dataset_spec == "mnist" else None
        _ACTORS[setting.name] = [
            GradientWorkerActor.options(num_cpus=1, num_gpus=0.5 if setting.device.type == "cuda" else 0).remote(
                model_spec, dataset_spec, subset, setting.case.batch_size, threads=1, engine="fast"
            )
            for _ in range(2)
        ]
        ray.get([actor.ping.remote() for actor in _ACTORS[setting.name]])
    return _ACTORS[setting.name]


VARIANTS: dict[str, Callable[[Setting], Callable[[], None]]] = {
    "non-private": non_private,
    "opacus hooks": opacus_variant("hooks"),
    "opacus ghost": opacus_variant("ghost"),
    "dpfleet fast": in_process("fast"),
    "dpfleet vmap": in_process("vmap"),
    "ray 1 worker": over_ray(1),
    "ray 1, fast noise": over_ray(1, secure_noise=False),
    "ray 2 workers": over_ray(2),
}


MEMORY_VARIANTS: dict[str, Callable[[Setting], Callable[[], None]]] = {
    **{name: VARIANTS[name] for name in ("non-private", "opacus hooks", "opacus ghost", "dpfleet fast", "dpfleet vmap")},
    "fast sum only": clipped_sum_only,
}


def _opacus_available() -> bool:
    return importlib.util.find_spec("opacus") is not None


def _variants_for(setting: Setting, device: torch.device) -> tuple[dict[str, Callable[[], None]], dict[str, str]]:
    """Build each variant's step (and run it once, which also warms it up); note those that cannot run."""
    steps, skipped = {}, {}
    for name, make in VARIANTS.items():
        if name.startswith("opacus") and not _opacus_available():
            skipped[name] = "opacus is not installed (pip install opacus==1.6.0)"
            continue
        if name.startswith("ray") and setting.case.ray_specs is None:
            skipped[name] = "not run over Ray (its workers would need the benchmark's tokens as a dataset spec)"
            continue
        try:
            step = make(setting)
            step()
        except Exception as error:  # noqa: BLE001 - a variant that cannot run is reported, not fatal
            skipped[name] = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
            continue
        steps[name] = step
    return steps, skipped


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(name: str, device: torch.device, repeats: int) -> dict:
    """Median samples/s of every variant for one model, the variants alternating within each repeat."""
    setting = Setting(name, device)
    steps, skipped = _variants_for(setting, device)
    seconds: dict[str, list[float]] = {variant: [] for variant in steps}
    for step in steps.values():
        if isinstance(step, RayStep):
            step.times.clear()  # the warm-up step's
    for _ in range(repeats):
        for variant, step in steps.items():
            _synchronize(device)
            start = time.perf_counter()
            for _ in range(setting.case.timed_steps):
                step()
            _synchronize(device)
            seconds[variant].append((time.perf_counter() - start) / setting.case.timed_steps)
    batch = setting.case.batch_size
    throughput = {variant: batch / statistics.median(times) for variant, times in seconds.items()}
    return {
        "model": name,
        "batch_size": batch,
        "samples_per_second": throughput,
        "step_seconds": {variant: times for variant, times in seconds.items()},
        "breakdown": {variant: breakdown(step.times) for variant, step in steps.items() if isinstance(step, RayStep)},
        "skipped": skipped,
    }


def breakdown(times: list[tuple[float, float, float, float]]) -> dict[str, float]:
    """Medians over steps of a RayStep's times, in seconds per step, and the driver's share of the step."""
    driver, noise, worker, wait = (statistics.median(column) for column in zip(*times))
    return {"driver_seconds_per_step": driver, "noise_wait_seconds_per_step": noise,
            "worker_seconds_per_step": worker, "wait_seconds_per_step": wait,
            "driver_share_of_step": driver / (driver + wait)}


def resident_kib(field: str) -> int:
    """A VmRSS/VmHWM line of /proc/self/status, in KiB (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}; peak memory on the CPU needs Linux")


def memory_of_steps(step: Callable[[], None], steps: int, device: torch.device) -> dict:
    """Memory of ``steps`` calls of ``step`` after its set-up, in MB; run it in a fresh process.

    On the CPU: the resident set after set-up (``baseline_mb``), and its
    high-water mark over the steps (``peak_mb``: VmHWM, reset after set-up
    through /proc/self/clear_refs; getrusage's maximum would carry over the
    parent's through fork and exec). On CUDA: allocated memory and its
    maximum. ``step_mb`` is the peak minus the baseline.
    """
    if device.type == "cuda":
        torch.cuda.synchronize()
        baseline = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        Path("/proc/self/clear_refs").write_text("5")
        baseline = resident_kib("VmRSS") * 1024
    for _ in range(steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = resident_kib("VmHWM") * 1024
    return {"baseline_mb": baseline / 2**20, "peak_mb": peak / 2**20, "step_mb": (peak - baseline) / 2**20}


def _peak_memory_of(name: str, variant: str, device: torch.device) -> dict:
    """Run in a fresh process: memory of ``MEMORY_STEPS`` steps of one variant after set-up (``memory_of_steps``)."""
    return memory_of_steps(MEMORY_VARIANTS[variant](Setting(name, device)), MEMORY_STEPS, device)


def peak_memory(device: torch.device, threads: int) -> dict:
    """Peak memory of each in-process variant on ResNet-18-GN at batch 64, each in a fresh process."""
    results = {}
    for variant in MEMORY_VARIANTS:
        if variant.startswith("opacus") and not _opacus_available():
            continue
        completed = subprocess.run(
            [sys.executable, "-m", "bench.throughput", "--memory-probe", variant, "--device", device.type,
             "--threads", str(threads)],
            capture_output=True, text=True, check=False,
        )
        if completed.returncode != 0:
            results[variant] = {"error": completed.stderr.strip().splitlines()[-1:]}
            continue
        results[variant] = json.loads(completed.stdout.strip().splitlines()[-1])
    return results


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator and denominator else None


def summarise(result: dict) -> dict:
    """Ratios of each variant's samples/s to non-private SGD and to Opacus hooks, and of Ray to in-process."""
    rates = result["samples_per_second"]
    ratios = {
        variant: {"vs_non_private": _ratio(rate, rates.get("non-private")),
                  "vs_opacus_hooks": _ratio(rate, rates.get("opacus hooks"))}
        for variant, rate in rates.items()
    }
    for variant in ("ray 1 worker", "ray 1, fast noise"):
        ratios[variant] = {**ratios.get(variant, {}),
                           "vs_in_process": _ratio(rates.get(variant), rates.get("dpfleet fast"))}
    ratios["ray 2 workers"] = {**ratios.get("ray 2 workers", {}),
                               "vs_1_worker": _ratio(rates.get("ray 2 workers"), rates.get("ray 1 worker"))}
    return {variant: values for variant, values in ratios.items() if variant in rates}


def _format(value: float | None, suffix: str = "x") -> str:
    return "-" if value is None else f"{value:.2f}{suffix}"


def _device_label(device: torch.device) -> str:
    return f"cuda ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else device.type


def print_report(results: list[dict], memory: dict, threads: int, device: torch.device) -> None:
    """Print the throughput table (samples/s and ratios) and the memory table."""
    print(f"device {_device_label(device)}, {threads} torch thread(s) in process; medians of alternating repeats")
    header = f"{'model':12s} {'variant':17s} {'samples/s':>10s} {'vs non-priv':>12s} {'vs opacus':>10s} {'other':>16s}"
    print(header)
    print("-" * len(header))
    for result in results:
        for variant, rate in result["samples_per_second"].items():
            ratio = result["ratios"][variant]
            other = ""
            if "vs_in_process" in ratio:
                other = f"{_format(ratio['vs_in_process'])} in-proc"
            if "vs_1_worker" in ratio:
                other = f"{_format(ratio['vs_1_worker'])} 1 worker"
            print(f"{result['model']:12s} {variant:17s} {rate:10.1f} {_format(ratio['vs_non_private']):>12s} "
                  f"{_format(ratio['vs_opacus_hooks']):>10s} {other:>16s}")
        for variant, reason in result["skipped"].items():
            print(f"{result['model']:12s} {variant:17s} skipped: {reason}")
        for variant, figures in result["breakdown"].items():
            print(f"{result['model']:12s} {variant:17s} per step: driver "
                  f"{figures['driver_seconds_per_step'] * 1e3:.1f} ms ({figures['driver_share_of_step']:.0%} of the "
                  "step; waiting for noise "
                  f"{figures['noise_wait_seconds_per_step'] * 1e3:.1f} ms), slowest worker "
                  f"{figures['worker_seconds_per_step'] * 1e3:.1f} ms, wait for sums "
                  f"{figures['wait_seconds_per_step'] * 1e3:.1f} ms")
    if memory:
        print(f"\npeak memory, {MEMORY_MODEL} at batch {CASES[MEMORY_MODEL].batch_size} "
              f"({'peak RSS' if device.type == 'cpu' else 'max allocated'}; step = peak minus after set-up)")
        reference = memory.get("non-private", {})
        for variant, figures in memory.items():
            if "error" in figures:
                print(f"  {variant:17s} failed: {figures['error']}")
                continue
            print(f"  {variant:17s} peak {figures['peak_mb']:8.0f} MB ({_format(_ratio(figures['peak_mb'], reference.get('peak_mb')))})"
                  f"  step {figures['step_mb']:8.0f} MB ({_format(_ratio(figures['step_mb'], reference.get('step_mb')))})")


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print (and with --json, write) the results."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="also write bench/results/throughput.json")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--repeats", type=int, default=7, help="timed steps per variant, alternating (>= 5)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads in this process (Ray workers use 1)")
    parser.add_argument("--models", nargs="+", choices=sorted(CASES), default=list(CASES))
    parser.add_argument("--no-memory", action="store_true", help="skip the per-variant peak-memory processes")
    parser.add_argument("--memory-probe", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.repeats < 5:
        parser.error(f"--repeats must be >= 5 (got {args.repeats}); the figures are medians of at least 5 steps")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA GPU, and torch sees none")
    torch.set_num_threads(args.threads)
    # The gradient workers keep freed memory for reuse; every in-process variant runs on the same terms.
    retain_freed_memory()
    device = torch.device(args.device)
    # torch.func warns that attention has no batching rule; the vmap fallback is slower there, and says so here.
    warnings.filterwarnings("ignore", message="There is a performance drop")
    if args.memory_probe:
        print(json.dumps(_peak_memory_of(MEMORY_MODEL, args.memory_probe, device)))
        return 0
    needs_ray = any(CASES[name].ray_specs is not None for name in args.models)
    if needs_ray:
        import ray

        # Ray starts workers at niceness 15; on a shared machine they would then lose the CPU to
        # everything else while the in-process variants do not. Same niceness, same terms.
        os.environ["RAY_worker_niceness"] = str(os.nice(0))
        ray.init(address="local", num_cpus=2, num_gpus=1 if device.type == "cuda" else 0, include_dashboard=False,
                 log_to_driver=False)
    try:
        results = []
        for name in args.models:
            result = measure(name, device, args.repeats)
            result["ratios"] = summarise(result)
            results.append(result)
    finally:
        if needs_ray:
            ray.shutdown()
    memory = {} if args.no_memory or MEMORY_MODEL not in args.models else peak_memory(device, args.threads)
    print_report(results, memory, args.threads, device)
    if args.json:
        results_file = RESULTS_DIR / ("throughput.json" if device.type == "cpu" else f"throughput-{device.type}.json")
        RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        results_file.write_text(json.dumps({
            "device": _device_label(device),
            "threads": args.threads,
            "repeats": args.repeats,
            "load_average": os.getloadavg(),
            "models": results,
            "peak_memory": {"model": MEMORY_MODEL, "batch_size": CASES[MEMORY_MODEL].batch_size, "variants": memory},
        }, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
