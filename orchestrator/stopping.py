"""How `dpfleet train` stops when it is told to: SIGTERM and SIGHUP take Ctrl-C's path.

Kubernetes, `ray job stop` and `timeout` stop a process with SIGTERM, and a
closed terminal sends SIGHUP; by default either ends the process where it
stands, leaving its windows of planned batches and its reservation behind.
Within `stopped_as_interrupted` each raises KeyboardInterrupt instead, as
SIGINT does, so every window and worker is closed, the steps not run are
released, and the command exits with status 130. Ray's start puts its own
SIGTERM handlers in (one exits at once, one aborts), so the trainer puts
these back once Ray is up (`keep_stop_handlers`).

Only the command line installs them, from its main thread: the Python API
never takes over the signal handlers of the program that calls it, which
decides how it stops (and can stop a job with KeyboardInterrupt itself).
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager

# The handlers `stopped_as_interrupted` installed, while its block runs.
_installed: dict[signal.Signals, object] = {}


@contextmanager
def stopped_as_interrupted(*signals: signal.Signals) -> Iterator[None]:
    """Within the block, the first of `signals` to arrive raises KeyboardInterrupt, as SIGINT does.

    Once one has arrived, further ones are ignored, so that the clean-up
    it starts runs to its end. The previous handlers come back after the
    block. Call it from the main thread.
    """
    def interrupt(number, frame) -> None:
        for each in signals:
            signal.signal(each, signal.SIG_IGN)
        _installed.clear()
        raise KeyboardInterrupt(f"stopped by {signal.Signals(number).name}")

    previous = {each: signal.signal(each, interrupt) for each in signals}
    _installed.update(dict.fromkeys(signals, interrupt))
    try:
        yield
    finally:
        _installed.clear()
        for each, handler in previous.items():
            signal.signal(each, handler)


def keep_stop_handlers() -> None:
    """Put back the handlers `stopped_as_interrupted` installed, after Ray's start replaced them (else nothing)."""
    for number, handler in _installed.items():
        signal.signal(number, handler)
