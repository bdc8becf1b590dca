"""Shared fixtures: keep every test away from the user's own ledger and run directories; hold back PLD epsilons."""

import threading
from types import SimpleNamespace

import pytest


@pytest.fixture(autouse=True)
def isolated_dpfleet_home(tmp_path, monkeypatch):
    """Point the embedded ledger at a throwaway directory for every test."""
    monkeypatch.setenv("DPFLEET_HOME", str(tmp_path / "dpfleet-home"))


@pytest.fixture
def held_back_pld(monkeypatch):
    """Make the ledger's PLD epsilons wait until the test sets the returned event (or 30 s pass)."""
    from accounting.ledger import core

    may_finish = threading.Event()
    real_get_accountant = core.get_accountant

    def held_back(name):
        accountant = real_get_accountant(name)

        def epsilon(events, delta):
            may_finish.wait(30)
            return accountant.epsilon(events, delta)

        return SimpleNamespace(epsilon=epsilon)

    monkeypatch.setattr(core, "get_accountant", held_back)
    yield may_finish
    may_finish.set()
