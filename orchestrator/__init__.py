"""The driver's room: config, planning, sampling, noise, aggregation and the training loop; the CLI in cli/."""

from accounting.lazy import public_face

__version__ = "0.1.0"

__getattr__, __dir__, __all__ = public_face(__name__, {
    "aggregation": ["NodeAggregation"],
    "config": ["build_config", "load_config"],
    "noise": ["GaussianNoise", "NoiseFeed", "TorchGaussianNoise", "driver_threads", "noisy_mean_gradient"],
    "planning": ["plan_run"],
    "trainer": ["Trainer"],
})
