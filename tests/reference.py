"""Reference implementations for tests: the slow, obvious way to compute what dpfleet computes fast."""

import copy

import torch
import torch.nn.functional as F

from workers.models import load_flat_parameters


def per_example_gradients_by_loop(model, flat_weights, inputs, labels, dtype=torch.float64):
    """[n, P] gradients, one backward pass per example on a copy of the model in ``dtype`` (floating inputs too)."""
    reference = copy.deepcopy(model).to(dtype)
    load_flat_parameters(reference, flat_weights)
    params = [p for p in reference.parameters() if p.requires_grad]
    rows = []
    for example, label in zip(inputs.to(dtype) if inputs.is_floating_point() else inputs, labels, strict=True):
        loss = F.cross_entropy(reference(example[None]), label[None])
        rows.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)]))
    return torch.stack(rows)


def clipped_sum_by_loop(gradients, clip_norm):
    """Sum of the rows of ``gradients``, each scaled down to L2 norm at most ``clip_norm``."""
    norms = gradients.norm(dim=1, keepdim=True)
    return (gradients * torch.clamp(clip_norm / norms, max=1.0)).sum(dim=0)


def relative_error(actual, expected):
    """||actual - expected|| / ||expected|| in float64."""
    return ((actual.double() - expected).norm() / expected.norm()).item()
