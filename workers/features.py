"""Fixed feature maps in front of a trainable head: wavelet scattering (ScatterNet) and its per-worker cache.

Tramèr & Boneh (ICLR 2021) train private linear models and small CNNs on
the wavelet scattering transform of images instead of on their pixels. The
scattering is a fixed feature map: its Morlet filters depend on the image
size, the scale J and the number of angles L only, never on data. It is
applied to each example on its own, so an example's features are a function
of that example alone, and the per-example gradient of the head on them is
exactly the per-example gradient of the whole model.

``FeatureModel`` holds such a map and the head. A gradient worker therefore
computes each training example's features once, the first time a step
samples it, and keeps them (``FeatureCache``): caching changes where a value
is computed, not which value, so the sampling, the clipping to C and the
noise, and with them ε, are those of the same model without the cache.

The filters are kymatio's (``kymatio.scattering2d.filter_bank``, version
0.3.0). Its forward pass is written here rather than called: kymatio's
torch backend writes into a fresh tensor in place (``x_r[..., 0] = ...``),
which ``torch.func.vmap`` refuses, and ``kymatio.torch`` itself cannot be
imported with SciPy 1.15 or later (its 3-D module imports
``scipy.special.sph_harm``, which SciPy removed). The transform below is the
algorithm of ``kymatio.scattering2d.core.scattering2d`` step for step; a
test checks it against kymatio's ``ScatteringTorch2D``.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

SCATTERING_SCALES = 2
SCATTERING_ANGLES = 8
# GroupNorm's groups over the scattering channels (81 per image channel): Tramèr & Boneh's 27.
FEATURE_GROUPS = 27
# Examples whose features are computed at once: a bound on memory, not a privacy parameter.
FEATURE_BATCH = 256


class Scattering2d(nn.Module):
    """The 2-D wavelet scattering transform of order 2 (kymatio's filters and algorithm), with no parameters.

    Takes images [B, C, H, W] and returns [B, C * K, H / 2^J, W / 2^J] with
    K = 1 + J·L + L²·J(J-1)/2 paths per image channel (81 for J = 2, L = 8),
    ordered as kymatio orders them: the low-pass, then order 1, then order 2.
    The filters are buffers; every operation is out of place, so
    ``torch.func.vmap`` can batch it.
    """

    def __init__(self, shape: tuple[int, int], scales: int = SCATTERING_SCALES, angles: int = SCATTERING_ANGLES):
        super().__init__()
        from kymatio.scattering2d.filter_bank import filter_bank
        from kymatio.scattering2d.utils import compute_padding

        height, width = shape
        if 2**scales > min(height, width):
            raise ValueError(f"images of {height}x{width} are too small for 2^J = {2**scales}; lower J")
        padded_height, padded_width = compute_padding(height, width, scales)
        # kymatio's split: the odd pixel of padding, if any, goes after.
        self.padding = ((padded_width - width) // 2, (padded_width - width + 1) // 2,
                        (padded_height - height) // 2, (padded_height - height + 1) // 2)
        if max(self.padding) >= min(height, width):
            raise ValueError(f"images of {height}x{width} are too small to reflect-pad for J = {scales}")
        self.shape, self.scales = (height, width), scales
        filters = filter_bank(padded_height, padded_width, scales, angles)
        for level, values in enumerate(filters["phi"]["levels"]):
            self.register_buffer(f"phi_{level}", torch.from_numpy(np.asarray(values, dtype=np.float32)))
        # The wavelets of each scale j stacked over their angles, at each resolution kymatio builds (those below
        # j, up to J - 2, that order 2 needs): one batched product each.
        for j in range(scales):
            wavelets = [psi for psi in filters["psi"] if psi["j"] == j]
            for level in range(len(wavelets[0]["levels"])):
                stacked = np.stack([np.asarray(psi["levels"][level], dtype=np.float32) for psi in wavelets])
                self.register_buffer(f"psi_{j}_{level}", torch.from_numpy(stacked))
        self.angles = angles

    @property
    def paths(self) -> int:
        """Scattering paths per image channel: 1 + J·L + L²·J(J-1)/2."""
        return 1 + self.scales * self.angles + self.angles**2 * self.scales * (self.scales - 1) // 2

    def output_shape(self, channels: int) -> tuple[int, int, int]:
        """The [C * K, H / 2^J, W / 2^J] features of one image of ``channels`` channels."""
        return channels * self.paths, self.shape[0] // 2**self.scales, self.shape[1] // 2**self.scales

    def forward(self, images: Tensor) -> Tensor:
        """Scattering coefficients of ``images`` [..., C, H, W]: [..., C * K, H / 2^J, W / 2^J].

        kymatio's order: the low-pass; order 1 by scale, then angle; order 2
        by its first path, then the second path's scale and angle.
        """
        leading, (height, width) = images.shape[:-2], images.shape[-2:]
        if (height, width) != self.shape:
            raise ValueError(f"this scattering takes {self.shape[0]}x{self.shape[1]} images (got {height}x{width})")
        padded = F.pad(images.reshape(-1, 1, height, width), self.padding, mode="reflect")[:, 0]
        spectrum = torch.fft.fft2(padded.to(torch.promote_types(padded.dtype, torch.complex64)))
        count, scales = spectrum.shape[0], self.scales
        order_one, order_two = [], []
        for j1 in range(scales):
            # [n, L, ...]: the modulus of each wavelet's response at scale j1, back in the Fourier domain.
            first = _modulus_spectrum(_subsampled(spectrum[:, None] * getattr(self, f"psi_{j1}_0"), 2**j1))
            order_one.append(self._low_pass(first, j1, 2 ** (scales - j1)))
            # [n, L, L', ...]: each first path (L) against every wavelet of a coarser scale j2 (L' in all).
            second = [self._low_pass(_modulus_spectrum(_subsampled(first[:, :, None] * getattr(self, f"psi_{j2}_{j1}"),
                                                                   2 ** (j2 - j1))), j2, 2 ** (scales - j2))
                      for j2 in range(j1 + 1, scales)]
            if second:
                order_two.append(torch.cat(second, dim=2))
        coefficients = [self._low_pass(spectrum, 0, 2**scales)[:, None]] + order_one + order_two
        stacked = torch.cat([part.reshape(count, -1, *part.shape[-2:]) for part in coefficients], dim=1)
        return stacked.reshape(*leading[:-1], leading[-1] * stacked.shape[1], *stacked.shape[2:])

    def _low_pass(self, spectrum: Tensor, level: int, subsampling: int) -> Tensor:
        """The low-pass average of signals given by their spectra at resolution ``level``, unpadded."""
        averaged = torch.fft.ifft2(_subsampled(spectrum * getattr(self, f"phi_{level}"), subsampling)).real
        return averaged[..., 1:-1, 1:-1]


def _modulus_spectrum(spectrum: Tensor) -> Tensor:
    """The spectrum of the modulus of the signals whose spectra are given."""
    return torch.fft.fft2(torch.fft.ifft2(spectrum).abs().to(spectrum.dtype))


def _subsampled(spectrum: Tensor, factor: int) -> Tensor:
    """The spectra [..., H / factor, W / factor] of signals subsampled by ``factor`` in space: periodised means."""
    if factor == 1:
        return spectrum
    *leading, height, width = spectrum.shape
    periods = spectrum.reshape(*leading, factor, height // factor, factor, width // factor)
    return periods.mean(-2).mean(-3)


class FeatureModel(nn.Module):
    """A fixed feature map (``features``, no trainable parameters) followed by a trainable ``head``.

    ``model(x) = head(features(x))``. Gradient workers compute the features
    of each example once and train the head on them (``on_features``);
    every trainable parameter is the head's, named ``head.…`` either way.
    """

    def __init__(self, features: nn.Module, head: nn.Module):
        super().__init__()
        trainable = [name for name, parameter in features.named_parameters() if parameter.requires_grad]
        if trainable:
            raise ValueError(f"a FeatureModel's feature map must be fixed, but it trains {', '.join(trainable)}; "
                             "move those layers into the head")
        self.features, self.head = features, head

    def forward(self, inputs: Tensor) -> Tensor:
        """The head's output on the features of ``inputs``."""
        return self.head(self.features(inputs))

    def on_features(self) -> FeatureModel:
        """The same head (shared, not copied) behind an identity: a model that takes features as its input."""
        return FeatureModel(nn.Identity(), self.head)


def feature_map(model: nn.Module) -> tuple[nn.Module | None, nn.Module]:
    """(the fixed feature map, the model that takes its features) of a FeatureModel; (None, model) otherwise."""
    if isinstance(model, FeatureModel) and not isinstance(model.features, nn.Identity):
        return model.features, model.on_features()
    return None, model


def compute_features(features: nn.Module, inputs: Tensor) -> Tensor:
    """``features`` applied to ``inputs`` [B, ...], FEATURE_BATCH examples at a time, without autograd."""
    with torch.no_grad():
        parts = [features(inputs[start : start + FEATURE_BATCH]) for start in range(0, len(inputs), FEATURE_BATCH)]
        return torch.cat(parts) if parts else features(inputs)


class FeatureCache:
    """A training source's examples as features of a fixed map, each computed on its first read and then kept.

    ``source`` is an ``ExampleSource`` (``workers.sources``); reads return
    (features, labels) on the CPU. The map is applied to each example on its
    own, so a cached value is the one a fresh computation would give.
    """

    def __init__(self, source, features: nn.Module, device: torch.device):
        self.source, self.features, self.device = source, features, device
        self.known = torch.zeros(len(source), dtype=torch.bool)
        self.values: Tensor | None = None
        self.labels: Tensor | None = None

    def __len__(self) -> int:
        return len(self.source)

    def read(self, indices: np.ndarray) -> tuple[Tensor, Tensor]:
        """Features and labels of the examples at ``indices``, computing those not yet cached."""
        selected = torch.as_tensor(np.asarray(indices, dtype=np.int64))
        missing = torch.unique(selected[~self.known[selected]])
        if missing.numel():
            inputs, labels = self.source.read(missing.numpy())
            computed = compute_features(self.features, inputs.to(self.device)).cpu()
            if self.values is None:
                # Allocated once, untouched pages cost nothing until an example's features are written.
                self.values = torch.empty((len(self.source), *computed.shape[1:]), dtype=computed.dtype)
                self.labels = torch.empty((len(self.source), *labels.shape[1:]), dtype=labels.dtype)
            self.values[missing], self.labels[missing] = computed, labels
            self.known[missing] = True
        if self.values is None:
            inputs, labels = self.source.read(selected.numpy())
            return compute_features(self.features, inputs.to(self.device)).cpu(), labels
        return self.values[selected], self.labels[selected]


def scatternet_linear(shape: tuple[int, int] = (28, 28), channels: int = 1, classes: int = 10) -> FeatureModel:
    """Tramèr & Boneh's ScatterNet + linear model: scattering (J=2, L=8), GroupNorm(27) without data statistics, linear.

    The GroupNorm normalises each example's features by their own mean and
    variance within each group (no affine parameters): nothing is estimated
    from the training data.
    """
    scattering = Scattering2d(shape)
    feature_channels, height, width = scattering.output_shape(channels)
    head = nn.Sequential(
        nn.GroupNorm(FEATURE_GROUPS, feature_channels, affine=False),
        nn.Flatten(),
        nn.Linear(feature_channels * height * width, classes),
    )
    nn.init.zeros_(head[2].weight)
    nn.init.zeros_(head[2].bias)
    return FeatureModel(scattering, head)


def scatternet_cnn(shape: tuple[int, int] = (28, 28), channels: int = 1, classes: int = 10) -> FeatureModel:
    """ScatterNet + a small tanh CNN (after Tramèr & Boneh): scattering, GroupNorm(27), two 3x3 convolutions, linear."""
    scattering = Scattering2d(shape)
    feature_channels, height, width = scattering.output_shape(channels)
    pooled = height // 2
    layers: list[nn.Module] = [
        nn.GroupNorm(FEATURE_GROUPS, feature_channels, affine=False),
        nn.Conv2d(feature_channels, 64, 3, padding=1), nn.Tanh(), nn.MaxPool2d(2),
        nn.Conv2d(64, 64, 3, padding=1), nn.Tanh(),
    ]
    if pooled >= 4:
        layers.append(nn.MaxPool2d(2))
        pooled //= 2
    layers += [nn.Flatten(), nn.Linear(64 * pooled * pooled, classes)]
    return FeatureModel(scattering, nn.Sequential(*layers))
