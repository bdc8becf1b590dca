"""The driver side of dpfleet: configuration, sampling, aggregation and the training loop; the CLI in cli/."""

__version__ = "0.1.0"
