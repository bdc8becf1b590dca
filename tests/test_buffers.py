"""No buffer learns from a private batch: running statistics are refused, and a forward that writes a buffer is too.

The attacker here is a model whose buffer keeps a running mean of the
training inputs and uses it in evaluation: without the check, evaluation
metrics and the saved model carry un-noised statistics of private examples.
"""

import pytest
import torch
from torch import nn

from workers.actor import GradientWorker
from workers.engines import ENGINES, clipped_sum
from workers.models import flat_parameters
from workers.validation import UnsupportedModuleError, check_model, unchanged_buffers
from workers.vmap_engine import microbatch_clipped_sum

TRAIN_SUBSET = 64


class RunningInputMean(nn.Module):
    """Keeps a running mean of its training inputs in a buffer and subtracts it, as a batch norm's statistics do."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(features))

    def forward(self, inputs):
        # Centred by the mean before this batch: no example's output depends on another's.
        centred = inputs - self.mean
        if self.training:
            self.mean.mul_(0.9).add_(0.1 * inputs.detach().mean(0))
        return centred


def buffer_writing_model():
    return nn.Sequential(nn.Flatten(), RunningInputMean(28 * 28), nn.Linear(28 * 28, 10))


def instance_norm_model():
    return nn.Sequential(nn.Conv2d(1, 2, 5), nn.InstanceNorm2d(2, affine=True, track_running_stats=True),
                         nn.Flatten(), nn.Linear(2 * 24 * 24, 10))


@pytest.mark.parametrize("engine", list(ENGINES))
def test_the_worker_refuses_running_statistics_before_loading_data(engine):
    with pytest.raises(UnsupportedModuleError, match=r"1 \(InstanceNorm2d\).*track_running_stats=False"):
        GradientWorker(f"{__name__}:instance_norm_model", "mnist", TRAIN_SUBSET, 8, engine=engine)


def test_every_running_statistics_module_is_named_and_instance_statistics_pass():
    model = nn.Sequential(nn.InstanceNorm1d(3, track_running_stats=True), nn.BatchNorm1d(3),
                          nn.InstanceNorm3d(3, track_running_stats=True), nn.InstanceNorm2d(3), nn.GroupNorm(1, 3))
    with pytest.raises(UnsupportedModuleError) as refusal:
        check_model(model)
    message = str(refusal.value)
    assert "0 (InstanceNorm1d), 2 (InstanceNorm3d)" in message and "1 (BatchNorm1d)" in message
    assert "3 (InstanceNorm2d)" not in message and "GroupNorm" in message  # GroupNorm only as the fix
    check_model(nn.Sequential(nn.InstanceNorm2d(3, affine=True), nn.GroupNorm(1, 3), nn.LayerNorm(3)))


@pytest.mark.parametrize("engine", list(ENGINES))
def test_a_model_that_writes_a_buffer_is_refused_when_its_worker_starts(engine):
    # The worker's engine check runs the model on synthetic examples, before any step reads a private row.
    with pytest.raises(UnsupportedModuleError, match=r"writes buffer\(s\) 1\.mean \(in 1, RunningInputMean\)"):
        GradientWorker(f"{__name__}:buffer_writing_model", "mnist", TRAIN_SUBSET, 8, engine=engine)


def test_microbatches_refuse_a_buffer_write_too():
    model = buffer_writing_model()
    built = model[1].mean.clone()
    inputs, labels = torch.rand(6, 1, 28, 28), torch.randint(0, 10, (6,))
    with pytest.raises(UnsupportedModuleError, match="1.mean"):
        microbatch_clipped_sum(model, flat_parameters(model), inputs, labels, torch.tensor([0, 0, 1, 1, 2, 2]), 1.0)
    assert torch.equal(model[1].mean, built)


class Counter(nn.Module):
    """Writes its buffers in the ways a module can: in place, through ``.data``, and by replacing one."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.register_buffer("count", torch.zeros((), dtype=torch.int64))
        self.register_buffer("seen", torch.full((2,), float("nan")))

    def forward(self, inputs):
        if self.how == "in place":
            self.count += 1
        elif self.how == "through data":
            self.seen.data[0] = inputs.sum()
        elif self.how == "replaced":
            self.seen = inputs.detach().sum().expand(2)
        return inputs


@pytest.mark.parametrize("how", ["in place", "through data", "replaced"])
def test_any_buffer_write_is_put_back_and_refused(how):
    model = nn.Sequential(Counter(how))
    count, seen = model[0].count, model[0].seen
    with pytest.raises(UnsupportedModuleError, match=r"writes buffer\(s\) 0\.(count|seen) \(in 0, Counter\)"):
        with unchanged_buffers(model):
            model(torch.ones(3))
    assert model[0].count is count and model[0].seen is seen
    assert count == 0 and seen.isnan().all()


def test_a_forward_that_reads_its_buffers_passes_and_a_failure_of_its_own_is_not_blamed_on_them():
    model = nn.Sequential(Counter("reads only"))
    with unchanged_buffers(model):
        model(torch.ones(3))
    with pytest.raises(ZeroDivisionError), unchanged_buffers(model, probe=lambda: model(torch.ones(3))):
        raise ZeroDivisionError


@pytest.mark.parametrize("engine", list(ENGINES))
def test_a_model_with_buffers_it_only_reads_trains_as_before(engine):
    torch.manual_seed(0)
    model = buffer_writing_model().eval()  # in eval mode the module reads its buffer and writes nothing
    inputs, labels = torch.rand(6, 1, 28, 28), torch.randint(0, 10, (6,))
    summed = clipped_sum(engine, model, flat_parameters(model), inputs, labels, 1.0, 4)
    assert summed.isfinite().all() and summed.any()


@pytest.mark.parametrize("engine", list(ENGINES))
def test_a_buffer_written_beside_the_layer_rules_is_refused_by_both_engines(engine):
    # The count does not change any output, so the fast engine's rules hold and its own step writes the buffer.
    torch.manual_seed(1)
    model = nn.Sequential(Counter("in place"), nn.Linear(3, 2))
    inputs, labels = torch.randn(5, 3), torch.randint(0, 2, (5,))
    with pytest.raises(UnsupportedModuleError, match=r"writes buffer\(s\) 0\.count \(in 0, Counter\)"):
        clipped_sum(engine, model, flat_parameters(model), inputs, labels, 1.0, 4)
    assert model[0].count == 0
