"""Augmentation multiplicity, the ScatterNet front ends and their per-worker cache, and parameter averaging."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from kymatio.scattering2d.frontend.torch_frontend import ScatteringTorch2D

from orchestrator.config import build_config
from orchestrator.errors import UsageError
from reference import per_example_gradients_by_loop
from workers.actor import GradientWorker
from workers.engines import ENGINES, clipped_sum
from workers.features import Scattering2d
from workers.models import build_model, flat_parameters
from workers.optimizers import ema_decay_at, update_ema
from workers.sources import open_source
from workers.tasks import augmented_views, build_transform

CROP = [{"name": "RandomCrop", "size": 28, "padding": 3}]


def clipped_view_means(model, flat_weights, views, labels, clip_norm):
    """Reference, in float64: each example's mean gradient over its K views, clipped to clip_norm; [n, P]."""
    count, augmentations = views.shape[:2]
    gradients = per_example_gradients_by_loop(model, flat_weights, views.flatten(0, 1),
                                              labels.repeat_interleave(augmentations))
    means = gradients.reshape(count, augmentations, -1).mean(1)
    return means * torch.clamp(clip_norm / means.norm(dim=1, keepdim=True), max=1.0), means.norm(dim=1)


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_each_example_contributes_its_clipped_mean_over_its_views_within_c(engine):
    torch.manual_seed(3)
    model = build_model("gdp_cnn")
    flat_weights = flat_parameters(model)
    images, labels = torch.rand(6, 1, 28, 28), torch.randint(0, 10, (6,))
    views = augmented_views(build_transform(CROP), images, 4)
    assert views.shape == (6, 4, 1, 28, 28)
    expected, mean_norms = clipped_view_means(model, flat_weights, views, labels, 1.0)
    clip_norm = mean_norms.median().item()
    expected, _ = clipped_view_means(model, flat_weights, views, labels, clip_norm)
    # Each example alone: its contribution is its clipped mean, and never longer than C.
    for index in range(6):
        alone = clipped_sum(engine, model, flat_weights, views[index : index + 1], labels[index : index + 1],
                            clip_norm, 2, augmentations=4)
        assert alone.double().norm() <= clip_norm * (1 + 1e-5)
        torch.testing.assert_close(alone.double(), expected[index], rtol=1e-4, atol=1e-7)
    together = clipped_sum(engine, model, flat_weights, views, labels, clip_norm, 4, augmentations=4)
    torch.testing.assert_close(together.double(), expected.sum(0), rtol=1e-4, atol=1e-6)
    # Clipping each view on its own would be a different (and here a larger) sum.
    per_view = clipped_sum(engine, model, flat_weights, views.flatten(0, 1), labels.repeat_interleave(4), clip_norm, 8)
    assert (per_view / 4 - together).norm() > 1e-3 * together.norm()


def test_the_worker_draws_k_views_per_example_and_needs_transforms_for_them():
    flip = [{"name": "RandomHorizontalFlip", "p": 1.0}]
    worker = GradientWorker("gdp_cnn", "mnist", 64, 16, train_transforms=flip, augmentations_per_example=3)
    plain = GradientWorker("gdp_cnn", "mnist", 64, 16)
    plain.source.inputs = torch.flip(plain.source.inputs, dims=[3])
    weights = flat_parameters(build_model("gdp_cnn")).numpy()
    # Three identical (flipped) views: their mean is the flipped example's own gradient.
    np.testing.assert_allclose(worker.clipped_grad_sum(weights, np.arange(8), 0.1),
                               plain.clipped_grad_sum(weights, np.arange(8), 0.1), rtol=0, atol=1e-6)
    assert "3 augmentations" in worker.engine_report()[0]
    with pytest.raises(ValueError, match="needs train_transforms"):
        GradientWorker("gdp_cnn", "mnist", 64, 16, augmentations_per_example=2)
    with pytest.raises(UsageError, match="needs train_transforms"):
        build_config({"steps": 1, "noise_multiplier": 1.0, "augmentations_per_example": 2})
    with pytest.raises(UsageError, match="microbatch_size"):
        build_config({"steps": 1, "noise_multiplier": 1.0, "augmentations_per_example": 2, "train_transforms": CROP,
                      "microbatch_size": 5})


@pytest.mark.parametrize(("shape", "channels"), [((28, 28), 1), ((32, 32), 3)])
def test_scattering_features_equal_kymatio(shape, channels):
    torch.manual_seed(5)
    images = torch.rand(4, channels, *shape)
    ours = Scattering2d(shape)(images)
    reference = ScatteringTorch2D(J=2, shape=shape, L=8)(images)  # [4, C, 81, H/4, W/4]
    assert ours.shape == (4, channels * 81, shape[0] // 4, shape[1] // 4)
    torch.testing.assert_close(ours, reference.reshape(ours.shape), rtol=0, atol=1e-6)
    # vmap (the vmap engine's per-example gradients) batches it to the same values.
    torch.testing.assert_close(torch.func.vmap(lambda image: Scattering2d(shape)(image[None])[0])(images), ours)


def test_a_worker_trains_the_scatternet_head_on_cached_features_with_the_whole_models_gradients():
    torch.manual_seed(6)
    model = build_model("scatternet_cnn")
    weights = flat_parameters(model)
    worker = GradientWorker("scatternet_cnn", "mnist", 100, 16)
    indices = np.array([3, 17, 42, 42, 99, 5])
    images, labels = worker.source.read(indices)
    gradients = per_example_gradients_by_loop(model, weights, images, labels)
    clip_norm = gradients.norm(dim=1).median().item()
    expected = (gradients * torch.clamp(clip_norm / gradients.norm(dim=1, keepdim=True), max=1.0)).sum(0)
    for _ in range(2):  # computed, then read back from the cache
        actual = worker.clipped_grad_sum(weights.numpy(), indices, clip_norm)
        torch.testing.assert_close(torch.from_numpy(actual).double(), expected, rtol=1e-4, atol=1e-7)
    assert worker.feature_cache.known.nonzero().flatten().tolist() == [3, 5, 17, 42, 99]
    features = Scattering2d((28, 28))(images)
    torch.testing.assert_close(worker.feature_cache.values[indices], features)
    evaluated = worker.evaluate(weights.numpy(), "test", 0, 50, ("accuracy",))
    test_images, test_labels = open_source("mnist", "test").read(np.arange(50))
    with torch.no_grad():
        loss = F.cross_entropy(model(test_images), test_labels, reduction="sum").item()
    assert evaluated["loss_sum"] == pytest.approx(loss, rel=1e-5)


def test_the_moving_average_warms_up_and_moves_toward_the_weights():
    assert [ema_decay_at(0.999, step) for step in (0, 1, 90)] == [0.1, 2 / 11, 0.91]
    assert ema_decay_at(0.5, 1000) == 0.5
    average, weights = torch.zeros(3), torch.tensor([1.0, 2.0, 4.0])
    update_ema(average, weights, 0.5, 1000)
    torch.testing.assert_close(average, torch.tensor([0.5, 1.0, 2.0]))
    with pytest.raises(UsageError, match=r"ema_decay must be in \(0, 1\)"):
        build_config({"steps": 1, "noise_multiplier": 1.0, "ema_decay": 1.0})
