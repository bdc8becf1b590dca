"""Each example's loss is the job's loss on a batch of one: ignored positions, class weights, label smoothing.

Padded token sequences of different lengths (and one with every position
ignored) through a small Embedding + GRU language model: both engines'
clipped sums must match a float64 loop of ``loss_fn(model(x_i[None]),
y_i[None])`` backward per example to 1e-5 relative. Where torch's loss on one
example is NaN (nothing to average over), that example must add exactly
nothing.
"""

import functools
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from reference import clipped_sum_by_loop, per_example_gradients_by_loop, relative_error
from workers.engines import fast_clipped_sum
from workers.losses import ClassLoss, class_loss_of, per_example_losses
from workers.models import flat_parameters
from workers.tasks import LOSSES as BUILT_IN_LOSSES
from workers.tasks import token_cross_entropy
from workers.vmap_engine import per_example_clipped_sum

TOLERANCE = 1e-5
VOCABULARY, WIDTH, LENGTH = 7, 5, 6
# Valid positions per example; 0 is an example whose positions are all ignored.
LENGTHS = (6, 1, 4, 0, 3, 6, 2, 5)
CLASS_WEIGHTS = torch.tensor([0.5, 2.0, 1.0, 0.25, 3.0, 1.5, 0.75])


class TokenModel(nn.Module):
    """Embedding, GRU and a linear read-out per position: logits [B, T, V], or [B, V, T] as torch's losses take them."""

    def __init__(self, classes_last: bool) -> None:
        super().__init__()
        self.classes_last = classes_last
        self.embedding = nn.Embedding(VOCABULARY, WIDTH)
        self.gru = nn.GRU(WIDTH, WIDTH, batch_first=True)
        self.head = nn.Linear(WIDTH, VOCABULARY)

    def forward(self, tokens):
        logits = self.head(self.gru(self.embedding(tokens))[0])
        return logits if self.classes_last else logits.transpose(1, 2)


def padded_batch(padding=-100, seed=0):
    """Tokens [B, T] and next-token labels [B, T], each example's labels past its length set to ``padding``."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, VOCABULARY, (len(LENGTHS), LENGTH), generator=generator)
    labels = torch.randint(1, VOCABULARY, (len(LENGTHS), LENGTH), generator=generator)
    for row, length in enumerate(LENGTHS):
        labels[row, length:] = padding
    return tokens, labels


def masked_token_loss(logits, labels):
    """A user's own token loss that keeps the counted positions by boolean indexing, which vmap cannot batch."""
    kept = labels != -100
    return F.cross_entropy(logits[kept], labels[kept])


def summed_token_loss(logits, labels):
    """A user's own loss with its own reduction: the sum over the counted tokens."""
    return F.cross_entropy(logits, labels, reduction="sum")


def weighted(dtype):
    return CLASS_WEIGHTS.to(dtype)


# Per case: the loss the engines run, the same loss for the float64 loop, logits with classes last, the padding label.
LOSSES = {
    "cross_entropy": (F.cross_entropy, F.cross_entropy, False, -100),
    "class_weights": (functools.partial(F.cross_entropy, weight=weighted(torch.float32)),
                      functools.partial(F.cross_entropy, weight=weighted(torch.float64)), False, -100),
    "label_smoothing": (functools.partial(F.cross_entropy, label_smoothing=0.2),
                        functools.partial(F.cross_entropy, label_smoothing=0.2), False, -100),
    "weights_smoothing_and_custom_ignore_index": (
        nn.CrossEntropyLoss(weight=weighted(torch.float32), label_smoothing=0.1, ignore_index=0),
        nn.CrossEntropyLoss(weight=weighted(torch.float64), label_smoothing=0.1, ignore_index=0), False, 0),
    "nll_with_weights": (functools.partial(F.nll_loss, weight=weighted(torch.float32)),
                         functools.partial(F.nll_loss, weight=weighted(torch.float64)), False, -100),
    "token_cross_entropy": (token_cross_entropy, token_cross_entropy, True, -100),
    "class_loss_tokens_weighted_smoothed": (
        ClassLoss(weight=CLASS_WEIGHTS, label_smoothing=0.3, classes_last=True),
        lambda logits, labels: F.cross_entropy(logits.transpose(1, 2), labels, weight=weighted(torch.float64),
                                               label_smoothing=0.3), True, -100),
    "user_loss_not_batchable_by_vmap": (masked_token_loss, masked_token_loss, True, -100),
    "user_loss_with_its_own_reduction": (summed_token_loss, summed_token_loss, False, -100),
}


def reference_sum(model, flat_weights, tokens, labels, loss_fn, clip_norm=None):
    """The float64 loop's clipped sum; an example whose gradient is not finite (nothing to average) adds nothing."""
    gradients = per_example_gradients_by_loop(model, flat_weights, tokens, labels, loss_fn=loss_fn)
    finite = gradients.isfinite().all(1)
    gradients = torch.where(finite[:, None], gradients, 0.0)
    norms = gradients.norm(dim=1)
    clip_norm = clip_norm or norms[norms > 0].median().item()
    return clipped_sum_by_loop(gradients, clip_norm), norms, clip_norm


@pytest.mark.parametrize("engine", ["fast", "vmap"])
@pytest.mark.parametrize("case", list(LOSSES))
def test_padded_sequences_match_the_float64_loop_in_both_engines(case, engine):
    engine_loss, loop_loss, classes_last, padding = LOSSES[case]
    torch.manual_seed(3)
    model = TokenModel(classes_last)
    flat_weights = flat_parameters(model)
    tokens, labels = padded_batch(padding)
    expected, expected_norms, clip_norm = reference_sum(model, flat_weights, tokens, labels, loop_loss)
    assert (expected_norms > clip_norm).any() and ((expected_norms <= clip_norm) & (expected_norms > 0)).any()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="fast clipping engine")  # the layer rules, no whole-model fallback
        run = fast_clipped_sum if engine == "fast" else per_example_clipped_sum
        actual, norms = run(model, flat_weights, tokens, labels, clip_norm, 3, engine_loss, return_norms=True)
    assert relative_error(actual, expected) < TOLERANCE
    total = torch.stack([values.double() ** 2 for values in norms.values()]).sum(0).sqrt()
    counted = expected_norms > 0
    assert relative_error(total[counted], expected_norms[counted]) < TOLERANCE
    assert LENGTHS.index(0) in torch.nonzero(~counted).flatten().tolist()


@pytest.mark.parametrize("case", [case for case, (loss_fn, *_) in LOSSES.items() if class_loss_of(loss_fn) is not None])
def test_an_example_with_nothing_to_average_has_loss_zero_and_zero_gradient(case):
    engine_loss, loop_loss, classes_last, padding = LOSSES[case]
    torch.manual_seed(4)
    model = TokenModel(classes_last).double()
    tokens, labels = padded_batch(padding)
    empty = LENGTHS.index(0)
    alone = loop_loss(model(tokens[empty : empty + 1]), labels[empty : empty + 1])
    assert alone.isnan()  # what torch gives: 0 / 0
    logits = model(tokens)
    losses = per_example_losses(engine_loss, logits, labels)
    assert losses[empty] == 0
    (gradient,) = torch.autograd.grad(losses[empty], logits)
    assert gradient.isfinite().all() and not gradient.any()
    others = [row for row in range(len(LENGTHS)) if row != empty]
    expected = torch.stack([loop_loss(model(tokens[row : row + 1]), labels[row : row + 1]) for row in others])
    assert torch.allclose(losses[others], expected, rtol=1e-12, atol=0)


def test_class_probabilities_as_labels_average_over_positions():
    torch.manual_seed(5)
    logits = torch.randn(4, 3, 5, dtype=torch.float64)
    probabilities = torch.softmax(torch.randn(4, 3, 5, dtype=torch.float64), 1)
    loss_fn = nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0, 0.5]), label_smoothing=0.1)
    expected = torch.stack([loss_fn(logits[row : row + 1], probabilities[row : row + 1]) for row in range(4)])
    assert torch.allclose(per_example_losses(loss_fn, logits, probabilities), expected, rtol=1e-12, atol=0)


def test_torch_losses_in_any_form_are_recognised_and_others_are_not():
    assert class_loss_of(F.cross_entropy).function is F.cross_entropy
    smoothing = class_loss_of(functools.partial(F.cross_entropy, label_smoothing=0.1, ignore_index=3))
    assert (smoothing.label_smoothing, smoothing.ignore_index) == (0.1, 3)
    assert class_loss_of(nn.NLLLoss(reduction="sum")).reduction == "sum"
    # Options a ClassLoss cannot reproduce, or a loss that gives one number per position, are evaluated as they are.
    assert class_loss_of(functools.partial(F.cross_entropy, reduction="none")) is None
    assert class_loss_of(nn.CrossEntropyLoss(reduction="none")) is None
    assert class_loss_of(summed_token_loss) is None
    logits, labels = torch.randn(3, 4, 2), torch.randint(0, 4, (3, 2))
    with pytest.raises(ValueError, match="a loss must give one number for a batch of one example \\(got shape"):
        per_example_losses(nn.CrossEntropyLoss(reduction="none"), logits, labels)
    with pytest.raises(ValueError, match="reduction must be one of"):
        ClassLoss(reduction="none")


def test_a_loss_vmap_cannot_batch_sees_the_outputs_its_gradient_flows_back_through():
    # With identity weights and all-ones inputs, example i's gradient of half its squared output norm is
    # v v^T for its dropout mask v: symmetric only if the loss's output gradient and the parameters'
    # backward pass used the same mask.
    torch.manual_seed(6)
    model = nn.Sequential(nn.Dropout(0.5), nn.Linear(6, 6, bias=False))
    nn.init.eye_(model[1].weight)

    def half_squared_norm_of_finite_outputs(outputs, labels):
        return outputs[outputs.isfinite()].pow(2).sum() / 2  # boolean indexing: vmap cannot batch it

    summed = per_example_clipped_sum(model, flat_parameters(model), torch.ones(8, 6), torch.zeros(8), 1e6, 4,
                                     half_squared_norm_of_finite_outputs).reshape(6, 6)
    assert summed.any() and not torch.equal(summed, torch.diag(summed.diagonal()))
    assert torch.equal(summed, summed.T)


BUILT_IN_EXAMPLES = {
    # A built-in loss: (outputs, labels) of 5 examples as its task has them.
    "cross_entropy": lambda: (torch.randn(5, 4), torch.tensor([0, 3, -100, 1, 2])),
    "token_cross_entropy": lambda: (torch.randn(5, 3, 4), torch.tensor([[1, 2, -100]] * 4 + [[-100] * 3])),
    "mse": lambda: (torch.randn(5, 2), torch.randn(5, 2)),
    "bce_with_logits": lambda: (torch.randn(5), torch.randint(0, 2, (5,)).double()),
}


@pytest.mark.parametrize("name", list(BUILT_IN_EXAMPLES))
def test_every_built_in_loss_gives_each_example_its_loss_alone(name):
    assert set(BUILT_IN_EXAMPLES) == set(BUILT_IN_LOSSES)
    torch.manual_seed(7)
    outputs, labels = BUILT_IN_EXAMPLES[name]()
    outputs = outputs.double()
    loss_fn = BUILT_IN_LOSSES[name]
    alone = torch.stack([loss_fn(outputs[row : row + 1], labels[row : row + 1]) for row in range(5)])
    losses = per_example_losses(loss_fn, outputs, labels)
    # Where the example alone is 0/0 (every position ignored) its loss is 0.
    assert torch.allclose(losses, torch.nan_to_num(alone, nan=0.0), rtol=1e-12, atol=0)
    assert alone.isnan().any() == (name in ("cross_entropy", "token_cross_entropy"))
