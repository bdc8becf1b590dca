"""Model registry and the flat-vector view of a model's trainable parameters.

Built-in models take MNIST-shaped input [B,1,28,28] and return logits [B,10];
the ``_32`` ScatterNets take CIFAR-shaped input [B,3,32,32].
A job names a model by a registry name or by ``package.module:function``, a
factory that takes no arguments and returns an ``nn.Module``.

The driver and workers exchange parameters as one flat float32 vector in
``model.named_parameters()`` order (trainable parameters only); that order is
the contract between ``flat_parameters``, ``load_flat_parameters`` and the
per-example clipped gradient sums.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Mapping

import numpy as np
import torch
from torch import nn

from workers import features
from workers.names import MODEL_NAMES

ModelFactory = Callable[[], nn.Module]

_FACTORIES: dict[str, ModelFactory] = {}


def _register(name: str) -> Callable[[ModelFactory], ModelFactory]:
    if name not in MODEL_NAMES:
        # Configs are checked against MODEL_NAMES without loading this module.
        raise ValueError(f"built-in model {name!r} must be listed in workers.names.MODEL_NAMES")

    def add(factory: ModelFactory) -> ModelFactory:
        _FACTORIES[name] = factory
        return factory

    return add


def _tutorial_cnn(activation: Callable[[], nn.Module]) -> nn.Sequential:
    """The MNIST CNN shared by the TF Privacy, GDP and Opacus tutorials, with the given activation."""
    # TF 'same' for a 28x28 input, kernel 8, stride 2: output ceil(28/2) = 14
    # needs (14-1)*2 + 8 - 28 = 6 rows of padding, split 3 before and 3 after,
    # which is PyTorch's symmetric padding=3.
    return nn.Sequential(
        nn.Conv2d(1, 16, 8, stride=2, padding=3),
        activation(),
        nn.MaxPool2d(2, stride=1),
        nn.Conv2d(16, 32, 4, stride=2),
        activation(),
        nn.MaxPool2d(2, stride=1),
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, 32),
        activation(),
        nn.Linear(32, 10),
    )


@_register("gdp_cnn")
def gdp_cnn() -> nn.Module:
    """The CNN of the GDP tutorial (Bu et al.): the TF Privacy MNIST CNN with tanh.

    Keras layers mapped to PyTorch, with Keras' default initialisation
    (Glorot-uniform kernels, zero biases).
    """
    model = _tutorial_cnn(nn.Tanh)
    for layer in model:
        if isinstance(layer, (nn.Conv2d, nn.Linear)):
            nn.init.xavier_uniform_(layer.weight)
            nn.init.zeros_(layer.bias)
    return model


@_register("opacus_cnn")
def opacus_cnn() -> nn.Module:
    """The CNN of the Opacus MNIST tutorial: same shape as ``gdp_cnn`` with ReLU, PyTorch init."""
    return _tutorial_cnn(nn.ReLU)


@_register("lenet5")
def lenet5() -> nn.Module:
    """MindArmour's LeNet5 (bias-free valid convolutions, truncated-normal(0.05) init).

    The seed resizes MNIST to 32x32; this pads 28x28 with two zero pixels on each
    side instead, as classic LeNet-5 does, so it takes MNIST as stored.
    """
    model = nn.Sequential(
        nn.ZeroPad2d(2),
        nn.Conv2d(1, 6, 5, bias=False),
        nn.ReLU(),
        nn.MaxPool2d(2, stride=2),
        nn.Conv2d(6, 16, 5, bias=False),
        nn.ReLU(),
        nn.MaxPool2d(2, stride=2),
        nn.Flatten(),
        nn.Linear(16 * 5 * 5, 120),
        nn.ReLU(),
        nn.Linear(120, 84),
        nn.ReLU(),
        nn.Linear(84, 10),
    )
    # MindSpore's TruncatedNormal(sigma) draws within two sigma of zero.
    sigma = 0.05
    for parameter in model.parameters():
        nn.init.trunc_normal_(parameter, std=sigma, a=-2 * sigma, b=2 * sigma)
    return model


@_register("scatternet_linear")
def scatternet_linear() -> nn.Module:
    """Tramèr & Boneh's ScatterNet + linear for 28x28 grayscale images (``workers.features``)."""
    return features.scatternet_linear((28, 28), 1)


@_register("scatternet_cnn")
def scatternet_cnn() -> nn.Module:
    """ScatterNet + a small tanh CNN for 28x28 grayscale images (``workers.features``)."""
    return features.scatternet_cnn((28, 28), 1)


@_register("scatternet_linear_32")
def scatternet_linear_32() -> nn.Module:
    """ScatterNet + linear for 32x32 RGB images (CIFAR-10's shape)."""
    return features.scatternet_linear((32, 32), 3)


@_register("scatternet_cnn_32")
def scatternet_cnn_32() -> nn.Module:
    """ScatterNet + a small tanh CNN for 32x32 RGB images (CIFAR-10's shape)."""
    return features.scatternet_cnn((32, 32), 3)


def input_shape(name: str) -> tuple[int, int, int]:
    """The [C, H, W] of one input example of a built-in model: 3x32x32 for the ``_32`` ScatterNets, else 1x28x28."""
    if name not in _FACTORIES:
        raise ValueError(f"{name!r} is not a built-in model; use one of {', '.join(MODEL_NAMES)}")
    return (3, 32, 32) if name.endswith("_32") else (1, 28, 28)


def build_model(spec: str | Mapping, trained_in: str | None = None) -> nn.Module:
    """Build a fresh model from a registry name (see ``MODEL_NAMES``), ``package.module:function``, or a pretrained
    model's spec (a ``model = { hf, task }`` table with its ``adapter``: ``workers.pretrained``).

    ``trained_in`` is the folder the module was imported from when the run
    trained (``module_folder``), which the error names when it does not import.
    """
    if isinstance(spec, Mapping):
        from workers.pretrained import build_pretrained

        return build_pretrained(spec)
    if spec in _FACTORIES:
        return _FACTORIES[spec]()
    if spec.count(":") != 1 or not all(spec.split(":")) or spec.startswith("."):
        raise ValueError(_bad_spec_message(spec, "it is neither a registered name nor module:function"))
    module_name, function_name = spec.split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        # Only a missing spec module is the spec's fault; a dependency the
        # module itself lacks should surface as the import error it is.
        missing = error.name or ""
        if not (module_name == missing or module_name.startswith(missing + ".")):
            raise
        # A well-formed spec whose module is not on the import path: where Python looked, and the fix.
        raise ValueError(f"model {spec!r}: {not_importable(module_name, trained_in)}") from error
    factory = getattr(module, function_name, None)
    if not callable(factory):
        raise ValueError(_bad_spec_message(spec, f"{module_name!r} has no function {function_name!r}"))
    model = factory()
    if not isinstance(model, nn.Module):
        raise ValueError(
            f"model factory {spec!r} returned {type(model).__name__}, not a torch.nn.Module; make it return the model"
        )
    return model


def module_folder(spec: str | Mapping) -> str | None:
    """The folder a ``module:function`` spec's module was imported from: the entry of the import path that holds it
    (its package's parent for ``package.module``). None for a built-in model, a pretrained one, or a module not
    imported (or one without a file)."""
    if isinstance(spec, Mapping):
        return None
    module_name = spec.partition(":")[0]
    module = sys.modules.get(module_name) if spec not in _FACTORIES else None
    path = getattr(module, "__file__", None)
    if path is None:
        return None
    depth = module_name.count(".") + (os.path.basename(path) == "__init__.py")
    folder = os.path.dirname(os.path.realpath(path))
    for _ in range(depth):
        folder = os.path.dirname(folder)
    return folder


def not_importable(module_name: str, trained_in: str | None = None) -> str:
    """Why ``module_name`` (of a ``module:function`` spec) did not import: the folders Python looked in, and the fix.

    The folders are the import path's own (the current folder or the
    script's, PYTHONPATH, a config's folder), not Python's installation.
    ``trained_in``, where a run recorded it, is the folder the module was
    imported from as the run trained: the fix names it.
    """
    installed = {os.path.realpath(prefix) for prefix in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    folders = []
    for entry in sys.path:
        folder = os.path.realpath(entry or os.getcwd())
        if os.path.isdir(folder) and not any(folder.startswith(prefix + os.sep) for prefix in installed) \
                and folder not in folders:
            folders.append(folder)
    file_name = module_name.replace(".", os.sep) + ".py"
    looked = (f"module {module_name!r} cannot be imported: Python looked for {file_name} in "
              f"{', '.join(folders) or 'no folder of its own'} (the current folder is {os.getcwd()})")
    if trained_in is None:
        return f"{looked}; run from the folder that holds {file_name}, or set PYTHONPATH to that folder"
    if trained_in in folders:
        return (f"{looked}; the run imported it from {trained_in}, which holds no {file_name} now: put it back "
                "there, or set PYTHONPATH to the folder that holds it")
    return (f"{looked}; the run imported it from {trained_in}: run from that folder, or set "
            f"PYTHONPATH={trained_in}")


def _bad_spec_message(spec: str, reason: str) -> str:
    return (
        f"bad model spec {spec!r}: {reason}; use one of {list(MODEL_NAMES)} or "
        "'package.module:function' naming a function that takes no arguments and "
        "returns an nn.Module"
    )


def _trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(name, parameter) for name, parameter in model.named_parameters() if parameter.requires_grad]


def parameter_count(model: nn.Module) -> int:
    """Number of trainable scalars, i.e. the length of ``flat_parameters(model)``."""
    return sum(parameter.numel() for _, parameter in _trainable(model))


def flat_parameters(model: nn.Module) -> torch.Tensor:
    """All trainable parameters as one detached 1-D float32 tensor, in ``named_parameters()`` order."""
    trainable = _trainable(model)
    if not trainable:
        return torch.zeros(0, dtype=torch.float32)
    return torch.cat([parameter.detach().reshape(-1).to(torch.float32) for _, parameter in trainable])


def _split_flat(
    model: nn.Module, flat: torch.Tensor | np.ndarray, what: str
) -> list[tuple[nn.Parameter, torch.Tensor]]:
    """Pair each trainable parameter with its slice of a vector laid out as by ``flat_parameters``."""
    flat = torch.as_tensor(flat)
    expected = parameter_count(model)
    if flat.dim() != 1 or flat.numel() != expected:
        raise ValueError(
            f"flat {what} vector must be 1-D with {expected} entries for this model "
            f"(got shape {tuple(flat.shape)}); build it with flat_parameters() on the same model spec"
        )
    pairs, offset = [], 0
    for _, parameter in _trainable(model):
        size = parameter.numel()
        pairs.append((parameter, flat[offset : offset + size].reshape(parameter.shape)))
        offset += size
    return pairs


def load_flat_parameters(model: nn.Module, flat: torch.Tensor | np.ndarray) -> None:
    """Copy a vector laid out as by ``flat_parameters`` into the model's trainable parameters, in place."""
    with torch.no_grad():
        for parameter, values in _split_flat(model, flat, "parameter"):
            parameter.copy_(values)


def bind_flat_views(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """Make every trainable parameter, and its ``.grad``, a view into one flat float32 buffer each.

    Returns (weights, gradient): 1-D buffers laid out as by ``flat_parameters``,
    on the parameters' device. Writing the gradient buffer sets every
    ``.grad``, and the weights buffer always holds the current weights, so
    neither needs a copy in or out of the model. The parameters keep their
    values; in-place updates (optimizer steps, ``load_state_dict``) keep the
    views. Something that replaces a parameter's data (``model.to``) or sets
    ``.grad`` to None breaks them.
    """
    trainable = _trainable(model)
    wrong = [f"{name} ({parameter.dtype})" for name, parameter in trainable if parameter.dtype != torch.float32]
    if wrong:
        raise ValueError(f"the flat weight vector is float32, and these trainable parameters are not: "
                         f"{', '.join(wrong)}; build the model in float32")
    device = trainable[0][1].device if trainable else torch.device("cpu")
    weights = torch.empty(parameter_count(model), dtype=torch.float32, device=device)
    gradient = torch.zeros_like(weights)
    offset = 0
    with torch.no_grad():
        for _, parameter in trainable:
            size = parameter.numel()
            weights[offset : offset + size].copy_(parameter.reshape(-1))
            parameter.data = weights[offset : offset + size].view_as(parameter)
            parameter.grad = gradient[offset : offset + size].view_as(parameter)
            offset += size
    return weights, gradient
