"""Shared fixtures: keep every test away from the user's own ledger and run directories; one in-process Ray for the
modules that ask for it; hold back PLD epsilons."""

import threading
from types import SimpleNamespace

import pytest
import ray

# The in-process Ray `local_ray` started (its GCS address) and the module that uses it now; None when there is none.
_shared_ray = {"address": None, "module": None}


@pytest.fixture(autouse=True)
def isolated_dpfleet_home(tmp_path, monkeypatch):
    """Point the embedded ledger at a throwaway directory for every test."""
    monkeypatch.setenv("DPFLEET_HOME", str(tmp_path / "dpfleet-home"))


@pytest.fixture(scope="module")
def local_ray(request):
    """A local Ray of 2 CPUs for this module's runs, which then do not start their own.

    Starting Ray takes seconds, so one module hands it on to the next module
    that asks for it; the first test of a module that does not ask finds no
    Ray running (`no_ray_left_from_another_module`). Each module's actors are
    gone with its fixtures, and the trainer kills its own.
    """
    from orchestrator.trainer import init_local_ray  # torch and the trainer, only for modules that train

    if not _is_shared_ray_up():
        if ray.is_initialized():
            ray.shutdown()
        init_local_ray(2, log_to_driver=False)
        _shared_ray["address"] = ray.get_runtime_context().gcs_address
    _shared_ray["module"] = request.module.__name__


@pytest.fixture(autouse=True)
def no_ray_left_from_another_module(request):
    """Stop the shared Ray before a test of another module than the one using it, unless the test asks for it."""
    if "local_ray" not in request.fixturenames and _shared_ray["module"] != request.module.__name__:
        if _is_shared_ray_up():
            ray.shutdown()
        _shared_ray.update(address=None, module=None)


def _is_shared_ray_up() -> bool:
    return ray.is_initialized() and ray.get_runtime_context().gcs_address == _shared_ray["address"]


@pytest.fixture
def held_back_pld(monkeypatch):
    """Make the ledger's PLD epsilons wait until the test sets the returned event (or 30 s pass)."""
    from accounting.ledger import caches

    may_finish = threading.Event()
    real_get_accountant = caches.get_accountant

    def held_back(name):
        accountant = real_get_accountant(name)

        def epsilon(events, delta):
            may_finish.wait(30)
            return accountant.epsilon(events, delta)

        return SimpleNamespace(epsilon=epsilon)

    real_extended = caches.COMPOSED.extended

    def held_back_extended(lineage, committed_events):
        may_finish.wait(30)
        return real_extended(lineage, committed_events)

    monkeypatch.setattr(caches, "get_accountant", held_back)
    monkeypatch.setattr(caches.COMPOSED, "extended", held_back_extended)
    yield may_finish
    may_finish.set()
