"""Shared fixtures: keep every test away from the user's own ledger and run directories; one in-process Ray for the
modules that ask for it, with gradient workers pooled from run to run; hold back PLD epsilons."""

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
    """A local Ray of 2 CPUs for this module's runs, which then do not start their own; returns its GCS address.

    Starting Ray takes seconds, so one module hands it on to the next module
    that asks for it; the first test of a module that does not ask finds no
    Ray running (`no_ray_left_from_another_module`). Each module's actors are
    gone with its fixtures, and the trainer kills its own; the workers another
    module pooled are ended before this module's fixtures start actors. A
    `dpfleet train` process joins it when given the address as RAY_ADDRESS.
    """
    from orchestrator.trainer import init_local_ray  # torch and the trainer, only for modules that train

    WORKER_POOL.clear()
    if not _is_shared_ray_up():
        if ray.is_initialized():
            ray.shutdown()
        init_local_ray(2, log_to_driver=False)
        _shared_ray["address"] = ray.get_runtime_context().gcs_address
    _shared_ray["module"] = request.module.__name__
    return _shared_ray["address"]


@pytest.fixture(autouse=True)
def no_ray_left_from_another_module(request):
    """Stop the shared Ray before a test of another module than the one using it, unless the test asks for it.

    A test that asks for the shared Ray but not for `worker_pool` finds no pooled worker holding its CPUs.
    """
    if "local_ray" not in request.fixturenames and _shared_ray["module"] != request.module.__name__:
        if _is_shared_ray_up():
            ray.shutdown()
        _shared_ray.update(address=None, module=None)
    if "local_ray" in request.fixturenames and "worker_pool" not in request.fixturenames:
        WORKER_POOL.clear()


def _is_shared_ray_up() -> bool:
    return ray.is_initialized() and ray.get_runtime_context().gcs_address == _shared_ray["address"]


class _WorkerArguments:
    """Stands in for the worker's actor class: `gradient_worker(config, _WorkerArguments)` is what it would start."""

    @staticmethod
    def options(**options):
        return SimpleNamespace(remote=lambda *arguments, **keywords: repr((options, arguments, keywords)))


class WorkerPool:
    """Gradient workers kept from one run to the next (an actor's start imports torch and loads its data: seconds).

    A run is handed the pool's workers in order, and new ones past the end:
    each is the real actor that `gradient_worker` starts for the run's
    config, and its calls are pure functions of their arguments (weights,
    indices, clip norm), so a run cannot tell a pooled worker from a new
    one. The pool holds the workers of one set of arguments: a run that
    needs others ends them first, freeing their CPUs. Workers of a Ray that
    has since stopped are forgotten.
    """

    def __init__(self):
        self.workers: list = []
        self.arguments: str | None = None
        self.gcs_address: str | None = None

    def worker_for(self, trainer) -> "ray.actor.ActorHandle":
        """The next worker for `trainer`'s run (the trainer's `_new_worker`, which the fixture replaces)."""
        from orchestrator.fleet import gradient_worker

        arguments = gradient_worker(trainer.config, _WorkerArguments, planned_dataset=trainer.planned_dataset)
        if arguments != self.arguments or ray.get_runtime_context().gcs_address != self.gcs_address:
            self.clear()
            self.arguments, self.gcs_address = arguments, ray.get_runtime_context().gcs_address
        handed = trainer.__dict__.get("worker_pool_handed", 0)
        trainer.worker_pool_handed = handed + 1
        if handed == len(self.workers):
            self.workers.append(gradient_worker(trainer.config, planned_dataset=trainer.planned_dataset))
        return self.workers[handed]

    def clear(self) -> None:
        """End the pool's workers (if their Ray is still the one running) and forget them."""
        if self.workers and ray.is_initialized() and ray.get_runtime_context().gcs_address == self.gcs_address:
            for worker in self.workers:
                ray.kill(worker)
        self.workers, self.arguments, self.gcs_address = [], None, None


WORKER_POOL = WorkerPool()


@pytest.fixture
def worker_pool(monkeypatch):
    """The pool (`WorkerPool`) from which this test's runs take their gradient workers, on the Ray the test asks for.

    A worker that a run loses for good (killed with no restart left) stays
    in the pool: only the last test of a module to use the pool may do that.
    A module fixture that starts actors on the shared Ray is set up before
    this fixture can end the pool: such a module asks for it in no test.
    """
    from orchestrator.trainer import Trainer

    monkeypatch.setattr(Trainer, "_new_worker", lambda trainer: WORKER_POOL.worker_for(trainer))
    return WORKER_POOL


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
