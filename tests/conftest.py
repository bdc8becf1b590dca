"""Shared fixtures: keep every test away from the user's own ledger and run directories."""

import pytest


@pytest.fixture(autouse=True)
def isolated_dpfleet_home(tmp_path, monkeypatch):
    """Point the embedded ledger at a throwaway directory for every test."""
    monkeypatch.setenv("DPFLEET_HOME", str(tmp_path / "dpfleet-home"))
