"""The driver side of dpfleet: configuration, sampling, aggregation, training loop and CLI."""
