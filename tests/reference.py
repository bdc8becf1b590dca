"""Reference implementations for tests: the slow, obvious way to compute what dpfleet computes fast."""

import copy

import torch
import torch.nn.functional as F

from workers.models import load_flat_parameters


def per_example_gradients_by_loop(model, flat_weights, inputs, labels, dtype=torch.float64, loss_fn=F.cross_entropy):
    """[n, P] gradients, one backward pass per example on a copy of the model in ``dtype``.

    Example i's gradient is that of ``loss_fn(model(x_i[None]), y_i[None])``.
    Floating-point inputs and labels are cast to ``dtype``; integer ones (token
    ids, class labels) are passed as they are. A parameter the loss does not
    depend on has a zero gradient.
    """
    reference = copy.deepcopy(model).to(dtype)
    load_flat_parameters(reference, flat_weights)
    params = [p for p in reference.parameters() if p.requires_grad]
    rows = []
    for example, label in zip(_in_dtype(inputs, dtype), _in_dtype(labels, dtype), strict=True):
        loss = loss_fn(reference(example[None]), label[None])
        rows.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params, materialize_grads=True)]))
    return torch.stack(rows)


def _in_dtype(values, dtype):
    """``values`` cast to ``dtype`` when floating-point, unchanged otherwise."""
    return values.to(dtype) if values.is_floating_point() else values


def clipped_sum_by_loop(gradients, clip_norm):
    """Sum of the rows of ``gradients``, each scaled down to L2 norm at most ``clip_norm``."""
    norms = gradients.norm(dim=1, keepdim=True)
    return (gradients * torch.clamp(clip_norm / norms, max=1.0)).sum(dim=0)


def relative_error(actual, expected):
    """||actual - expected|| / ||expected|| in float64."""
    return ((actual.double() - expected).norm() / expected.norm()).item()
