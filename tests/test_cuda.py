"""The GPU paths: both clipping engines, a gradient worker actor and a training run on CUDA.

Skipped where torch sees no CUDA GPU (CI has none); run them on a GPU host
with `pytest tests/test_cuda.py`. The engines run in IEEE float32 on the GPU
(``workers.clipping.ieee_float32``), so they must agree with the CPU to the
same 1e-5 relative as the CPU engines agree with each other.
"""

import io

import numpy as np
import pytest
import ray
import torch
from scipy import stats

from accounting.accountants import get_accountant
from accounting.events import SampledGaussian
from bench.throughput import CASES
from orchestrator.config import build_config
from orchestrator.noise import GRADIENT_NOISE, TorchGaussianNoise
from orchestrator.trainer import Trainer
from reference import relative_error
from workers.actor import GradientWorkerActor
from workers.engines import clipped_sum
from workers.keys import SecretKey
from workers.data import load_split
from workers.models import build_model, flat_parameters

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CI has none; run on a GPU host)"),
    pytest.mark.filterwarnings("ignore:There is a performance drop"),
]

TOLERANCE = 1e-5
CUDA = torch.device("cuda")


def median_clip_norm(model, flat, inputs, labels):
    """The median per-example gradient norm on the CPU, so that about half of the examples are clipped."""
    _, norms = clipped_sum("vmap", model, flat, inputs, labels, 1e9, len(labels), return_norms=True)
    return torch.stack([values.double() ** 2 for values in norms.values()]).sum(0).sqrt().median().item()


@pytest.mark.parametrize("name", sorted(CASES))
def test_both_engines_on_the_gpu_give_the_cpu_clipped_sum(name):
    case = CASES[name]
    torch.manual_seed(3)
    model = case.build().train()
    inputs, labels = case.data(torch.Generator().manual_seed(3))
    inputs, labels = inputs[:8], labels[:8]
    flat = flat_parameters(model)
    clip_norm = median_clip_norm(model, flat, inputs, labels)
    expected = clipped_sum("vmap", model, flat, inputs, labels, clip_norm, 8).double()

    model.to(CUDA)
    for engine in ("fast", "vmap"):
        actual = clipped_sum(engine, model, flat.to(CUDA), inputs.to(CUDA), labels.to(CUDA), clip_norm, 8)
        assert actual.device.type == "cuda" and actual.dtype == torch.float32
        assert relative_error(actual.cpu(), expected) < TOLERANCE, engine


def test_each_clipped_example_on_the_gpu_stays_within_the_clip_norm():
    """The bound the noise is calibrated to: no example contributes more than C (to float32 rounding)."""
    case = CASES["resnet18_gn"]
    torch.manual_seed(4)
    model = case.build().train().to(CUDA)
    inputs, labels = case.data(torch.Generator().manual_seed(4))
    flat = flat_parameters(model)
    clip_norm = 1e-3  # far below every gradient norm: every example is scaled down to exactly C
    contributions = [
        clipped_sum("fast", model, flat, inputs[i : i + 1].to(CUDA), labels[i : i + 1].to(CUDA), clip_norm, 1)
        for i in range(16)
    ]
    ratios = torch.stack([contribution.double().norm() for contribution in contributions]) / clip_norm
    assert ratios.max().item() <= 1 + TOLERANCE and ratios.min().item() >= 1 - TOLERANCE


def test_the_drivers_secure_noise_on_the_gpu_is_gaussian_and_only_its_key_replays_it():
    draws, std, key = 1_000_000, 1.95, (GRADIENT_NOISE, 3)
    run_key = SecretKey.fresh()
    noise = TorchGaussianNoise(run_key, device=CUDA)
    values = noise.draw(draws, std, key)
    assert values.device.type == "cuda" and values.dtype == torch.float64
    sample = values.cpu().numpy()
    assert abs(sample.mean()) < 4 * std / np.sqrt(draws)
    assert sample.std() == pytest.approx(std, rel=4 / np.sqrt(2 * draws))
    assert stats.kstest(sample / std, "norm").pvalue > 1e-3
    # Within the driver, the same key draws the same vector; a resumed run's new key draws fresh noise.
    assert torch.equal(TorchGaussianNoise(run_key, device=CUDA).draw(draws, std, key), values)
    assert not torch.equal(TorchGaussianNoise(device=CUDA).draw(draws, std, key), values)


def test_a_gpu_worker_actor_returns_the_cpu_sum(tmp_path):
    ray.init(address="local", num_cpus=2, num_gpus=1, include_dashboard=False, log_to_driver=False)
    try:
        worker = GradientWorkerActor.options(num_cpus=1, num_gpus=1).remote("gdp_cnn", "mnist", 600, 64)
        assert ray.get(worker.device_name.remote()) == "cuda"
        torch.manual_seed(0)
        model = build_model("gdp_cnn")
        weights = flat_parameters(model).numpy()
        chosen = np.random.default_rng(0).choice(600, size=100, replace=False)
        summed = ray.get(worker.clipped_grad_sum.remote(weights, chosen, 0.1))
    finally:
        ray.shutdown()
    images, labels = load_split("mnist", "train")
    index = torch.from_numpy(chosen)
    expected = clipped_sum("vmap", model, torch.from_numpy(weights), images[index], labels[index], 0.1, 100)
    assert summed.dtype == np.float32 and summed.shape == weights.shape
    assert relative_error(torch.tensor(summed), expected.double()) < TOLERANCE


def test_two_workers_sharing_one_gpu_train_and_report_their_epsilon(tmp_path):
    config = build_config(dict(
        dataset="mnist", model="gdp_cnn", workers=2, gpus_per_worker=0.5, epochs=1, batch_size=100,
        train_subset=6000, noise_multiplier=0.4, clip_norm=1.0, learning_rate=3.0, max_physical_batch=128,
        seed=13, run_dir=str(tmp_path / "run"),
    ))
    log = io.StringIO()
    trainer = Trainer(config, show_progress=False, out=log)
    summary = trainer.run()
    assert "gradient workers on cuda, cuda" in log.getvalue()
    # The driver's noise, noisy mean and optimizer step ran on the GPU too.
    assert isinstance(trainer.noise, TorchGaussianNoise) and trainer.flat_weights.device.type == "cuda"
    assert summary["test_accuracy"] >= 0.85
    assert summary["epsilon"] == get_accountant("pld").epsilon(SampledGaussian(100 / 6000, 0.4, 60), 1e-5)
