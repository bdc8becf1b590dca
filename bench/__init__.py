"""Benchmarks of dpfleet; each module runs with `python -m bench.<name>`."""
