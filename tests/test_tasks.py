"""Losses and metrics by name, evaluation by the workers in parts, and a driver that loads no example."""

import numpy as np
import pytest
import ray
import torch
import torch.nn.functional as F
from torchmetrics.functional.classification import binary_auroc, multiclass_accuracy

import workers.data
from orchestrator.config import build_config
from orchestrator.errors import UsageError
from orchestrator.trainer import Trainer
from workers.actor import GradientWorker
from workers.vmap_engine import per_example_clipped_sum
from workers.data import load_split
from workers.engines import fast_clipped_sum
from workers.models import build_model, flat_parameters, load_flat_parameters
from workers.names import check_metrics
from workers.tasks import (
    LOSSES,
    build_loss,
    build_metric,
    build_transform,
    metric_inputs,
    token_cross_entropy,
    transform_each,
)


def test_losses_by_name_and_by_module_function():
    assert build_loss("cross_entropy") is F.cross_entropy
    assert build_loss("workers.tasks:token_cross_entropy") is token_cross_entropy
    with pytest.raises(ValueError, match="must be one of cross_entropy, mse, bce_with_logits"):
        build_loss("hinge")
    with pytest.raises(ValueError, match="has no function 'nothing'"):
        build_loss("workers.tasks:nothing")


def test_metrics_must_fit_the_task_of_the_loss():
    assert check_metrics("mse", None) == ("mse", "mae")
    assert check_metrics("bce_with_logits", None) == ("accuracy", "auroc")
    with pytest.raises(ValueError, match="'accuracy' do not fit a regression task"):
        check_metrics("mse", ["accuracy"])
    with pytest.raises(UsageError, match="'mae' do not fit a multiclass task"):
        build_config({"steps": 1, "noise_multiplier": 1.0, "metrics": ["mae"]})


@pytest.mark.parametrize("engine", ["fast", "vmap"])
@pytest.mark.parametrize("loss", ["mse", "bce_with_logits"])
def test_each_examples_loss_is_its_own_in_both_engines(engine, loss):
    """The clipped sum of a regression or binary loss equals a loop over examples of their own losses."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    inputs = torch.randn(7, 5)
    labels = torch.randint(0, 2, (7,)).float()
    weights = flat_parameters(model)
    loss_fn = LOSSES[loss]
    summed = (fast_clipped_sum if engine == "fast" else per_example_clipped_sum)(
        model, weights, inputs, labels, 0.3, 4, loss_fn)
    rows = []
    for example, label in zip(inputs, labels):
        model.zero_grad()
        loss_fn(model(example[None]), label[None]).backward()
        gradient = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        rows.append(gradient * min(1.0, 0.3 / gradient.norm().item()))
    torch.testing.assert_close(summed, torch.stack(rows).sum(0), rtol=1e-5, atol=1e-6)


def test_a_split_evaluated_in_two_parts_merges_to_the_whole():
    torch.manual_seed(1)
    worker = GradientWorker("gdp_cnn", "mnist", 100, 16)
    weights = flat_parameters(build_model("gdp_cnn")).numpy()
    parts = [worker.evaluate(weights, "test", start, stop, ("accuracy", "auroc")) for start, stop in ((0, 130), (130, 300))]
    merged = parts[0]["metrics"]
    for name, metric in parts[1]["metrics"].items():
        merged[name].merge_state(metric)
    whole = worker.evaluate(weights, "test", 0, 300, ("accuracy", "auroc"))

    images, labels = load_split("mnist", "test")
    model = build_model("gdp_cnn")
    load_flat_parameters(model, weights)
    with torch.no_grad():
        logits = model.eval()(images[:300])
    assert parts[0]["count"] + parts[1]["count"] == 300
    assert parts[0]["loss_sum"] + parts[1]["loss_sum"] == pytest.approx(
        F.cross_entropy(logits, labels[:300], reduction="sum").item(), rel=1e-5)
    expected_accuracy = multiclass_accuracy(logits, labels[:300], num_classes=10, average="micro").item()
    assert merged["accuracy"].compute().item() == pytest.approx(expected_accuracy)
    assert merged["auroc"].compute().item() == pytest.approx(whole["metrics"]["auroc"].compute().item(), abs=1e-6)


def test_binary_metrics_take_probabilities_from_logits():
    logits, labels = torch.tensor([[2.0], [-1.0], [0.5], [-3.0]]), torch.tensor([1.0, 0.0, 0.0, 1.0])
    metric = build_metric("auroc", "binary", logits)
    metric.update(*metric_inputs("binary", logits, labels))
    assert metric.compute().item() == pytest.approx(binary_auroc(torch.sigmoid(logits.reshape(-1)), labels.long()).item())


def test_the_driver_loads_no_example_for_training_or_evaluation(local_ray, tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the driver loaded a split")

    # Patched in this (the driver's) process only; the Ray workers load their own data.
    monkeypatch.setattr(workers.data, "load_split", refuse)
    config = build_config(dict(
        dataset="mnist", workers=2, steps=3, batch_size=60, train_subset=600, test_subset=300,
        noise_multiplier=1.1, seed=3, run_dir=str(tmp_path / "run"), metrics=["accuracy", "top5_accuracy"],
        evaluate_every={"steps": 2},
    ))
    trainer = Trainer(config, show_progress=False, non_private_train_loss=True)
    summary = trainer.run()
    assert 0.0 <= summary["test_accuracy"] <= summary["test_top5_accuracy"] <= 1.0
    assert np.isfinite(summary["test_loss"])
    assert [row["step"] for row in trainer.record.metrics] == [0, 2, 3]
    assert [row["epoch"] for row in trainer.record.metrics] == [0, 2 * 60 / 600, 1]
    assert all(np.isfinite(row["train_loss_non_private"]) for row in trainer.record.metrics)


def test_transforms_apply_to_each_example_on_its_own_and_examples_are_never_mixed():
    transform = build_transform([{"name": "RandomCrop", "size": 28, "padding": 4}])
    torch.manual_seed(4)
    inputs = torch.rand(1, 1, 28, 28).expand(64, 1, 28, 28)
    out = transform_each(transform, inputs)
    assert out.shape == inputs.shape
    # 64 copies of one image, each cropped at its own random offset: many different results.
    assert len({tuple(example.flatten().tolist()) for example in out}) > 10
    with pytest.raises(ValueError, match="MixUp mixes examples"):
        build_transform([{"name": "MixUp"}])
    with pytest.raises(UsageError, match=r"train_transforms\[0\]: 'Crop' is not a torchvision.transforms.v2"):
        build_config({"steps": 1, "noise_multiplier": 1.0, "train_transforms": [{"name": "Crop"}]})


def test_the_worker_clips_each_transformed_example():
    worker = GradientWorker("gdp_cnn", "mnist", 64, 16, train_transforms=[{"name": "RandomHorizontalFlip", "p": 1.0}])
    plain = GradientWorker("gdp_cnn", "mnist", 64, 16)
    plain.source.inputs = torch.flip(plain.source.inputs, dims=[3])
    weights = flat_parameters(build_model("gdp_cnn")).numpy()
    np.testing.assert_allclose(worker.clipped_grad_sum(weights, np.arange(10), 0.1),
                               plain.clipped_grad_sum(weights, np.arange(10), 0.1), rtol=0, atol=1e-6)
