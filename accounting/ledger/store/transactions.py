"""The transaction and lock discipline of the ledger: one writer with group commit, a pool of readers.

Durability: WAL journal with synchronous=FULL, so a change is on disk when
its transaction returns; every state change is one BEGIN IMMEDIATE
transaction, which also serialises writers across processes sharing the file.
Reads run on a pool of connections of their own, beside writes and beside
each other. Under the write lock only cached RDP curves may be used
(`curves_outside_lock`), so the lock covers reading and writing rows only.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Callable, Iterator

from accounting.ledger.caches import CurveNotCached, compute_curve, rdp_curves_cached_only
from accounting.ledger.databases import Connection, Database
from accounting.ledger.errors import FailedPrecondition, LedgerUnavailable

# How often one change is run again after computing a curve it found missing under the lock (see
# curves_outside_lock); a change still missing one after that computes the rest in place.
_CURVE_ATTEMPTS = 8
# Changes grouped into one transaction at most; bounds the wait of the first of them.
_MAX_BATCH = 64

_CHANGE = threading.local()


def curves_outside_lock(method: Callable) -> Callable:
    """Run a change so that the RDP curves it needs are computed with no lock held.

    Under the write lock only cached curves may be used (caches.rdp_curves_cached_only):
    a missing one aborts the change's savepoint and releases the lock, the
    curve is computed, and the change runs again from the start, which is
    safe as nothing of it was written. So the lock covers reading and
    writing rows only, and one tenant's new mechanisms never stall another
    tenant's commits.
    """

    @functools.wraps(method)
    def change(*args: object, **kwargs: object) -> object:
        previous = getattr(_CHANGE, "curves_cached_only", False)
        try:
            for _ in range(_CURVE_ATTEMPTS):
                _CHANGE.curves_cached_only = True
                try:
                    return method(*args, **kwargs)
                except CurveNotCached as missing:
                    _CHANGE.curves_cached_only = False
                    compute_curve(missing.mechanism)
            _CHANGE.curves_cached_only = False
            return method(*args, **kwargs)
        finally:
            _CHANGE.curves_cached_only = previous

    return change


class _Batch:
    """Changes sharing one transaction; `committed` is set once its COMMIT returned (or failed: `error`)."""

    def __init__(self) -> None:
        self.changes = 0
        self.committed = threading.Event()
        self.error: BaseException | None = None


class Transactions:
    """The connections of one ledger to its database: `change` for a state change, `read` for a snapshot.

    Safe to share between threads. `write_lock` is held while a change runs
    (and while its batch commits).
    """

    def __init__(self, database: Database) -> None:
        self._database = database
        self._writer: Connection | None = None
        self.write_lock = threading.Lock()
        self._writers_waiting = 0
        self._waiting_lock = threading.Lock()
        self._batch: _Batch | None = None
        self._idle_readers: list[Connection] = []
        self._readers_lock = threading.Lock()
        self._closed = False

    def close(self) -> None:
        """Close every connection; a read in progress finishes first on its own connection, which closes after it."""
        with self.write_lock, self._readers_lock:
            self._closed = True
            for reader in self._idle_readers:
                reader.close()
            self._idle_readers.clear()
            if self._writer is not None:
                self._writer.close()
                self._writer = None

    def _unavailable(self, error: BaseException) -> LedgerUnavailable:
        return LedgerUnavailable(
            f"the ledger's database {self._database.location} did not answer ({type(error).__name__}: "
            f"{str(error).strip()}); nothing of this request was acknowledged: retry it"
        )

    def _drop_writer(self, error: BaseException) -> LedgerUnavailable:
        """Forget a writer whose database went away; the changes of its open batch fail with LedgerUnavailable."""
        unavailable = self._unavailable(error)
        batch, self._batch = self._batch, None
        if batch is not None:
            batch.error = unavailable
            batch.committed.set()
        writer, self._writer = self._writer, None
        with contextlib.suppress(Exception):
            writer.close()
        return unavailable

    @contextlib.contextmanager
    def change(self) -> Iterator[Connection]:
        """One state change, in its own savepoint; on success, returns only once it is durable.

        Group commit: changes that queue up while one transaction is being
        committed (fsync'd) run one after another in the next transaction,
        each in a savepoint, and the last of them commits it. A change that
        fails rolls back its savepoint and raises at once; a change that
        succeeds waits until the COMMIT of its transaction has returned.
        A database that stops answering fails every change of the open
        transaction with LedgerUnavailable; the next change connects again.
        """
        with self._waiting_lock:
            self._writers_waiting += 1
        self.write_lock.acquire()
        with self._waiting_lock:
            self._writers_waiting -= 1
        batch = None
        try:
            self._open_savepoint()
            with self._in_savepoint() as writer:
                yield writer
            batch = self._batch
            batch.changes += 1
        finally:
            if self._batch is not None and (self._writers_waiting == 0 or self._batch.changes >= _MAX_BATCH):
                self._commit_batch()
            self.write_lock.release()
        batch.committed.wait()
        if batch.error is not None:
            raise batch.error

    def _open_savepoint(self) -> None:
        """Connect the writer if needed, begin a batch's transaction if none is open, open the change's savepoint."""
        try:
            if self._closed:
                raise FailedPrecondition(f"the ledger {self._database.location} is closed")
            if self._writer is None:
                self._writer = self._database.connect()
            if self._batch is None:
                for statement in self._database.begin_change:
                    self._writer.execute(statement)
                self._batch = _Batch()
            self._writer.execute("SAVEPOINT change")
        except self._database.unavailable_errors as error:
            raise self._drop_writer(error) from None

    @contextlib.contextmanager
    def _in_savepoint(self) -> Iterator[Connection]:
        """The change itself: its savepoint released when it succeeds, rolled back when it raises."""
        unavailable_errors = self._database.unavailable_errors
        try:
            cached_only = getattr(_CHANGE, "curves_cached_only", False)
            with rdp_curves_cached_only() if cached_only else contextlib.nullcontext():
                yield self._writer
        except BaseException as error:
            try:
                self._writer.execute("ROLLBACK TO change")
                self._writer.execute("RELEASE change")
            except unavailable_errors as lost:
                raise self._drop_writer(lost) from None
            if isinstance(error, unavailable_errors):
                raise self._drop_writer(error) from None
            raise
        try:
            self._writer.execute("RELEASE change")
        except unavailable_errors as error:
            raise self._drop_writer(error) from None

    def _commit_batch(self) -> None:
        batch, self._batch = self._batch, None
        try:
            self._writer.execute("COMMIT")
        except self._database.unavailable_errors as error:
            batch.error = self._drop_writer(error)
        except BaseException as error:
            if self._writer.in_transaction:
                self._writer.execute("ROLLBACK")
            batch.error = error
        batch.committed.set()

    @contextlib.contextmanager
    def read(self) -> Iterator[Connection]:
        """A snapshot of what is committed, on a connection of its own (reads run beside writes)."""
        unavailable_errors = self._database.unavailable_errors
        with self._readers_lock:
            if self._closed:
                raise FailedPrecondition(f"the ledger {self._database.location} is closed")
            reader = self._idle_readers.pop() if self._idle_readers else None
        keep = True
        try:
            if reader is None:
                reader = self._database.connect()
            reader.execute(self._database.begin_read)
            try:
                yield reader
            finally:
                reader.execute("COMMIT")
        except unavailable_errors as error:
            keep = False
            raise self._unavailable(error) from None
        finally:
            with self._readers_lock:
                if reader is not None and (self._closed or not keep):
                    with contextlib.suppress(Exception):
                        reader.close()
                elif reader is not None:
                    self._idle_readers.append(reader)
