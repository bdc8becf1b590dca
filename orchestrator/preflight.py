"""What a run checks before any budget is reserved or worker started: its model and its data files.

Each check raises UsageError, naming what is wrong and what to do.
"""

from __future__ import annotations

import torch
from torch import nn

from orchestrator.config import TrainConfig
from orchestrator.errors import UsageError
from workers.sources import SPLITS, DataError, check_source, read_first
from workers.validation import check_model, unchanged_buffers


def check_trainable(config: TrainConfig, model: nn.Module) -> None:
    """Refuse a model that mixes examples, or one whose trainable parameters layer_clip_norms leaves out."""
    check_model(model)
    layer_clip_norms = config.layer_clip_norms
    if layer_clip_norms is not None:
        unmatched = layer_clip_norms.unmatched([name for name, p in model.named_parameters() if p.requires_grad])
        if unmatched:
            raise UsageError(f"layer_clip_norms gives no clip norm to {', '.join(unmatched)}; every trainable "
                             "parameter needs a prefix (e.g. the layer's name in model.named_parameters())")


def check_data(config: TrainConfig, model: nn.Module) -> None:
    """Check both splits' files of the config's dataset (UsageError on a bad file).

    With check_data = "full", integer labels must lie below the dataset's
    num_classes, else below `model`'s output width on a test example.
    The built-ins are verified by digest, and a ``module:function``
    dataset's examples are not read in the driver, so only tables are checked.
    """
    if isinstance(config.dataset, str):
        return
    full = config.check_data == "full"
    try:
        num_classes = None
        if full:
            check_source(config.dataset, "test")
            first_test_input, _ = read_first(config.dataset, "test", 1)
            # The saved model's buffers are the ones it was built with: this forward may not write them.
            with torch.no_grad(), unchanged_buffers(model):
                num_classes = model(first_test_input).shape[-1]
        for split in SPLITS:
            check_source(config.dataset, split, full, num_classes)
    except DataError as error:
        raise UsageError(str(error), error.with_values) from None
