"""A ledger no tenant can cheat or stall: several tenants drive every operation at random, and an oracle checks.

A hypothesis state machine creates tenants, datasets (per example and per person) and blocks (declared by rows, by
user id, and by files under every alias: a symlink, a file:// URL, a hard link, a `/./` spelling, a copy, a trailing
slash, the parent folder), sets quotas, reserves, commits (and retries), releases, queues and cancels, rotates
tokens, raises budgets and restarts the store. After every step the oracle (tests/ledger_oracle.py), which knows
what each block holds from the files themselves and composes the admitted charges with dp-accounting, finds no row
or person over a budget protecting it, no two blocks sharing one, no tenant over its quota, the ledger's
reservations as it recorded them, and `verify` finds nothing, while it names a reservation edited in a copy of the
file. One rule times another tenant's status while a tenant's costliest calls run.

CI runs it on SQLite (a small profile, some 10 s on 2 cores); DPFLEET_LEDGER_PROPERTY_PROFILE=long runs longer
and on PostgreSQL too (skipped where no PostgreSQL can start).
"""

import os
import shutil
import sqlite3
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, \
    run_state_machine_as_test

from accounting.events import Composition, SampledGaussian
from accounting.ledger.callers import ADMIN
from accounting.ledger.errors import BudgetExceeded, LedgerError, Unauthenticated
from accounting.ledger.store import Ledger, open_embedded_ledger
from accounting.ledger.validation import ACTIVE, ADMITTED, MAX_PLAN_MECHANISMS, QUEUED
from ledger_oracle import Budget, Charge, Dataset, Oracle, group_charge
from orchestrator.ledger_session import with_identity
from workers.sources import user_hash_buckets, write_parquet_shards

PROFILES = {
    "ci": settings(max_examples=25, stateful_step_count=50, deadline=None,
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]),
    "long": settings(max_examples=60, stateful_step_count=60, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]),
}
PROFILE = os.environ.get("DPFLEET_LEDGER_PROPERTY_PROFILE", "ci")
# Uncached mechanisms in the costly dry run: each costs the ledger 10-100 ms of curves, so CI asks for a few and the
# long profile for the most a plan may hold.
COSTLY_MECHANISMS = {"ci": 3, "long": MAX_PLAN_MECHANISMS}[PROFILE]
TENANTS = ("alice", "bob", "carol")
# Mechanisms whose group bounds (below) keep σ over the sensitivity at 1 or more, where the accountants' series
# converge at every order of the grid (below it a new curve costs seconds).
MECHANISMS = ((0.01, 2.0, 1.0), (0.01, 3.0, 1.0), (0.02, 4.0, 2.0), (0.001, 8.0, 1.0))
STEPS = (1, 50, 500, 2000, 4000, 200_000)
PEOPLE = 80
ROWS = 100
FILE_ROWS = 10
# Another tenant's status while a tenant's costliest calls run (a plan of MAX_PLAN_MECHANISMS uncached mechanisms,
# a commit of every unrun step): generous, as the bounded-work change is not in the tree these bounds were set on.
STALL_BOUND_SECONDS = 2.0
WORST_CALL_BOUND_SECONDS = 60.0
# Between two reads of the status, so that the reader does not take the CPU the costly calls need.
READ_PAUSE_SECONDS = 0.005


def write_world(root):
    """The files blocks are declared over, and every alias of them; with what each location holds, as the oracle
    knows it: example-level file keys, and the people of the per-person files."""
    rng = np.random.default_rng(0)
    data = root / "data"
    for index in range(3):
        write_parquet_shards(str(data / f"f{index}"), [(rng.random((FILE_ROWS, 4), dtype=np.float32),
                                                        np.arange(FILE_ROWS) % 2)], FILE_ROWS, 1)
    (root / "alias-f0").symlink_to(data / "f0")
    (root / "linked").mkdir()
    (part,) = sorted((data / "f0").iterdir())
    os.link(part, root / "linked" / part.name)
    (root / "copied").mkdir()
    shutil.copy(next((data / "f1").iterdir()), root / "copied" / "part.parquet")
    example = {
        f"{data}/f0": {"f0"}, f"{data}/f1": {"f1"}, f"{data}/f2": {"f2"}, str(part): {"f0"},
        str(root / "alias-f0"): {"f0"}, f"file://{data}/f0": {"f0"}, str(root / "linked"): {"f0"},
        f"{data}/./f0": {"f0"}, str(root / "copied"): {"f1"}, f"{data}/f0/": {"f0"}, str(data): {"f0", "f1", "f2"},
    }
    import pyarrow as pa
    import pyarrow.parquet as pq

    people = {}
    for name, ids in (("int", np.arange(40, dtype=np.int64)), ("float", np.arange(40, dtype=np.float64)),
                      ("int2", np.arange(40, 80, dtype=np.int64))):
        (root / "people" / name).mkdir(parents=True)
        pq.write_table(pa.table({"x": pa.array(np.zeros(len(ids), np.float32)), "label": pa.array(ids % 2),
                                 "user_id": pa.array(ids)}), str(root / "people" / name / "part.parquet"))
        people[str(root / "people" / name)] = {int(person) for person in ids}
    people[str(root / "people")] = set(range(PEOPLE))
    return example, people


def events_of(plan):
    """The planned events of (mechanism, steps) pairs, in order."""
    return Composition(tuple(SampledGaussian(rate, sigma, steps, factor) for (rate, sigma, factor), steps in plan))


plans = st.lists(st.tuples(st.sampled_from(MECHANISMS), st.sampled_from(STEPS)), min_size=1, max_size=2).map(tuple)


class LedgerMachine(RuleBasedStateMachine):
    """Tenants against one ledger, and the oracle beside it (see the module docstring)."""

    def __init__(self, open_ledger, file, world):
        super().__init__()
        self.open_ledger = open_ledger
        self.file = file
        self.example_files, self.people_files = world
        self.ledger = open_ledger()
        self.oracle = Oracle()
        self.tokens: dict[str, str] = {}
        self.queued: dict[str, Charge] = {}
        self.sequences: dict[str, list[tuple[int, int]]] = {}
        self.jobs = 0
        self.stall_timed = False

    def teardown(self):
        self.ledger.close()

    # ------------------------------------------------------------ helpers

    def caller(self, tenant):
        """The tenant's caller, from its current token, as a server authenticates it."""
        return self.ledger.authenticate(self.tokens[tenant])

    def next_job(self):
        self.jobs += 1
        return f"job{self.jobs}"

    def charged(self, dataset, plan, job_unit, rows_per_person):
        """The oracle's own charge of a plan on a dataset: the plan, or its group bound for people of at most
        `rows_per_person` rows; None where a job of that unit has no sound charge there."""
        unit = self.oracle.datasets[dataset].unit
        if unit == job_unit:
            return plan
        if unit == "user" and rows_per_person is not None:
            return group_charge(plan, rows_per_person)
        return None

    def record(self, reservation_id, tenant, dataset, blocks, charged):
        """Record a reservation the ledger admitted; none is admitted that has no sound charge."""
        assert charged is not None, f"reservation {reservation_id} admitted a job whose unit the dataset cannot charge"
        if reservation_id in self.oracle.charges:  # a retried reserve: the same hold
            return
        charge = Charge(tenant, dataset, tuple(blocks), charged)
        self.oracle.charges[reservation_id] = charge
        over_quota = self.oracle.quota_overspent(charge)
        assert not over_quota, over_quota

    def sync_queue(self):
        """Record the queued jobs the ledger admitted since (every change serves the queue)."""
        # In the order they were queued: the ids are random, and what the machine draws later follows this order.
        listed = {job.queue_id: job for job in self.ledger.list_queued(state=None, caller=ADMIN)}
        for queue_id, waiting in list(self.queued.items()):
            job = listed.get(queue_id)
            if job is None or job.state == QUEUED:
                continue
            del self.queued[queue_id]
            if job.state == ADMITTED:
                self.record(job.reservation_id, waiting.tenant, waiting.dataset, waiting.blocks, waiting.events)

    # ------------------------------------------------------------ tenants

    @initialize()
    def tenants(self):
        for tenant in TENANTS:
            self.tokens[tenant] = self.ledger.create_tenant(tenant, caller=ADMIN).token
        # One dataset of each unit to start from, so that most steps act on data.
        self.create_dataset("alice", "d0", "example", 2.0, 1e-5)
        self.create_dataset("bob", "d0", "user", 2.0, 1e-5)

    @rule(tenant=st.sampled_from(TENANTS), by_admin=st.booleans())
    def rotate(self, tenant, by_admin):
        old = self.tokens[tenant]
        caller = ADMIN if by_admin else self.caller(tenant)
        self.tokens[tenant] = self.ledger.rotate_token(tenant, caller=caller).token
        with pytest.raises(Unauthenticated):
            self.ledger.authenticate(old)
        assert self.caller(tenant).tenant == tenant

    @rule()
    def restart(self):
        self.ledger.close()
        self.ledger = self.open_ledger()

    # ------------------------------------------------------------ datasets and blocks

    @rule(owner=st.sampled_from(TENANTS), name=st.sampled_from(["d0", "d1"]),
          unit=st.sampled_from(["example", "user"]), epsilon=st.sampled_from([1.0, 2.0, 4.0]),
          delta=st.sampled_from([1e-5, 1e-6]))
    def create_dataset(self, owner, name, unit, epsilon, delta):
        try:
            status = self.ledger.create_dataset(name, epsilon, delta, unit, caller=self.caller(owner))
        except LedgerError:
            assert f"{owner}/{name}" in self.oracle.datasets
            return
        self.oracle.datasets[f"{owner}/{name}"] = Dataset(owner, unit,
                                                          Budget(epsilon, delta, status.admission.orders))

    @precondition(lambda self: self.oracle.datasets)
    @rule(data=st.data(), block=st.sampled_from(["b0", "b1", "b2", "b3"]),
          epsilon=st.sampled_from([0.5, 1.0, 2.0, 4.0]))
    def add_block(self, data, block, epsilon):
        dataset = data.draw(st.sampled_from(sorted(self.oracle.datasets)))
        known = self.oracle.datasets[dataset]
        if known.unit == "example":
            kind = data.draw(st.sampled_from(["rows", "files", "files"]))
            if kind == "rows":
                first = data.draw(st.integers(0, ROWS // 10 - 1)) * 10
                stop = data.draw(st.integers(first // 10 + 1, ROWS // 10)) * 10
                declaration, atoms = {"rows": [first, stop]}, {("row", row) for row in range(first, stop)}
            else:
                location = data.draw(st.sampled_from(sorted(self.example_files)))
                declaration = {"files": [location]}
                atoms = {("file", key, row) for key in self.example_files[location] for row in range(FILE_ROWS)}
        else:
            kind = data.draw(st.sampled_from(["user_hash", "user_range", "files"]))
            buckets = data.draw(st.integers(2, 3))
            bucket = data.draw(st.integers(0, buckets - 1))
            in_bucket = {int(person) for person in np.flatnonzero(user_hash_buckets(np.arange(PEOPLE), buckets)
                                                                 == bucket)}
            if kind == "user_hash":
                declaration, atoms = {"user_hash": {"buckets": buckets, "bucket": bucket}}, in_bucket
            elif kind == "user_range":
                first = data.draw(st.integers(0, 7)) * 10
                stop = data.draw(st.integers(first // 10 + 1, 8)) * 10
                declaration, atoms = {"user_range": [first, stop]}, set(range(first, stop))
            else:
                location = data.draw(st.sampled_from(sorted(self.people_files)))
                declaration = {"files": [location], "user_hash": {"buckets": buckets, "bucket": bucket}}
                atoms = self.people_files[location] & in_bucket
        owner = self.caller(known.owner)
        status = self.ledger.get_budget(dataset, caller=owner)
        declaration = with_identity(block, declaration, status, "user_id" if known.unit == "user" else None)
        try:
            status = self.ledger.add_block(dataset, block, epsilon, data=declaration, caller=owner)
        except LedgerError:
            return
        (added,) = [stored for stored in status.blocks if stored.name == block]
        # Each unit is in one block at most, so that its guarantee is that block's budget (docs/ledger.md).
        for other, (_, held) in known.blocks.items():
            assert not held & atoms, f"block {block!r} of {dataset} shares units with block {other!r}"
        known.blocks[block] = (Budget(epsilon, added.delta, added.admission.orders), frozenset(atoms))

    @precondition(lambda self: self.oracle.datasets)
    @rule(data=st.data(), tenant=st.sampled_from(TENANTS), epsilon=st.sampled_from([0.5, 1.0, 3.0]))
    def set_quota(self, data, tenant, epsilon):
        dataset = data.draw(st.sampled_from(sorted(self.oracle.datasets)))
        block = data.draw(st.sampled_from([None, *sorted(self.oracle.datasets[dataset].blocks)]))
        try:
            status = self.ledger.set_quota(dataset, tenant, epsilon, block, caller=ADMIN)
        except LedgerError:
            return
        (quota,) = [quota for quota in status.quotas
                    if quota.tenant == tenant and quota.block == block and not quota.inherited]
        delta = self.oracle.datasets[dataset].budget.delta if block is None else \
            self.oracle.datasets[dataset].blocks[block][0].delta
        self.oracle.quotas[(dataset, tenant, block)] = Budget(epsilon, delta, quota.admission.orders)

    @precondition(lambda self: self.oracle.datasets)
    @rule(data=st.data(), epsilon=st.sampled_from([1.0, 2.0, 4.0, 8.0]))
    def raise_budget(self, data, epsilon):
        dataset = data.draw(st.sampled_from(sorted(self.oracle.datasets)))
        try:
            self.ledger.raise_budget(dataset, epsilon, caller=ADMIN)
        except LedgerError:
            return
        known = self.oracle.datasets[dataset]
        known.budget = Budget(epsilon, known.budget.delta, known.budget.orders)  # its filter's orders stay fixed

    # ------------------------------------------------------------ jobs

    def draw_job(self, data):
        """A job on a dataset: mostly one the ledger should take (its blocks, its unit), sometimes not."""
        # Mostly a dataset of blocks: a job on a dataset's own budget closes it to blocks.
        of_blocks = sorted(name for name, known in self.oracle.datasets.items() if known.blocks)
        dataset = data.draw(st.sampled_from(of_blocks if of_blocks and data.draw(st.integers(0, 3))
                                            else sorted(self.oracle.datasets)))
        known = self.oracle.datasets[dataset]
        named = sorted(known.blocks)
        blocks = data.draw(st.lists(st.sampled_from(named), min_size=1, max_size=2, unique=True)) if named else []
        if data.draw(st.integers(0, 9)) == 0:
            blocks = [] if named else ["b0"]
        job_unit = known.unit if data.draw(st.integers(0, 5)) else data.draw(st.sampled_from(["example", "user"]))
        rows_per_person = None
        if job_unit == "example" and known.unit == "user":
            rows_per_person = data.draw(st.sampled_from([None, 1, 2, 2]))
        return dataset, tuple(blocks), data.draw(plans), job_unit, rows_per_person

    @precondition(lambda self: self.oracle.datasets)
    @rule(data=st.data())
    def reserve(self, data):
        dataset, blocks, plan, job_unit, rows_per_person = self.draw_job(data)
        guests = sorted({tenant for (named, tenant, _) in self.oracle.quotas if named == dataset})
        owner = self.oracle.datasets[dataset].owner
        tenant = data.draw(st.sampled_from([owner, owner, owner, *guests, data.draw(st.sampled_from(TENANTS))]))
        try:
            reservation = self.ledger.reserve(dataset, self.next_job(), events_of(plan), privacy_unit=job_unit,
                                              rows_per_person=rows_per_person, blocks=blocks,
                                              caller=self.caller(tenant))
        except LedgerError:
            return
        self.record(reservation.reservation_id, tenant, dataset, blocks,
                    self.charged(dataset, plan, job_unit, rows_per_person))

    @precondition(lambda self: self.oracle.datasets)
    @rule(data=st.data(), priority=st.integers(0, 2))
    def enqueue(self, data, priority):
        dataset, blocks, plan, job_unit, rows_per_person = self.draw_job(data)
        owner = self.oracle.datasets[dataset].owner
        try:
            queued = self.ledger.enqueue(dataset, self.next_job(), events_of(plan), priority=priority,
                                         privacy_unit=job_unit, rows_per_person=rows_per_person, blocks=blocks,
                                         caller=self.caller(owner))
        except LedgerError:
            return
        charged = self.charged(dataset, plan, job_unit, rows_per_person)
        if queued.state == ADMITTED:
            self.record(queued.reservation_id, owner, dataset, blocks, charged)
        elif queued.state == QUEUED:
            assert charged is not None, "a job the dataset cannot charge waits in its queue"
            self.queued[queued.queue_id] = Charge(owner, dataset, blocks, charged)

    @precondition(lambda self: self.queued)
    @rule(data=st.data())
    def cancel_queued(self, data):
        queue_id = data.draw(st.sampled_from(list(self.queued)))
        try:
            self.ledger.cancel_queued(queue_id, caller=self.caller(self.queued[queue_id].tenant))
        except LedgerError:
            pass  # admitted meanwhile: the next sync records its reservation

    def active(self):
        # In the order they were made, never by id: the ids are random, and hypothesis replays a draw by position.
        return [rid for rid, charge in self.oracle.charges.items() if charge.active]

    @precondition(lambda self: self.oracle.charges)
    @rule(data=st.data(), how=st.sampled_from(["one", "all", "over", "retry"]))
    def commit(self, data, how):
        reservation_id = data.draw(st.sampled_from(list(self.oracle.charges)))
        charge = self.oracle.charges[reservation_id]
        done = self.sequences.setdefault(reservation_id, [])
        unrun = charge.planned_steps - charge.committed
        if how == "retry" and done:
            sequence, steps = done[-1]
        else:
            sequence, steps = len(done), {"one": 1, "all": max(unrun, 1), "over": unrun + 1, "retry": 1}[how]
        retried = (sequence, steps) in done
        try:
            self.ledger.commit(reservation_id, steps, sequence, caller=self.caller(charge.tenant))
        except BudgetExceeded:
            return  # a commit meets the filters and quotas as they are now (a quota may have been lowered)
        except LedgerError:
            assert not (charge.active and not retried and steps <= unrun), f"a commit of {steps} of {unrun} refused"
            return
        assert retried or (charge.active and steps <= unrun), f"a commit of {steps} of {unrun} unrun steps taken"
        if not retried:
            done.append((sequence, steps))
            charge.committed += steps

    @precondition(lambda self: any(charge.active for charge in self.oracle.charges.values()))
    @rule(data=st.data())
    def release(self, data):
        reservation_id = data.draw(st.sampled_from(self.active()))
        charge = self.oracle.charges[reservation_id]
        self.ledger.release(reservation_id, caller=self.caller(charge.tenant))
        charge.active = False

    @precondition(lambda self: not self.stall_timed
                  and len({dataset.split("/")[0] for dataset in self.oracle.datasets}) >= 2)
    @rule(data=st.data())
    def costly_calls_do_not_stall_another_tenant(self, data):
        """A tenant's costliest calls (a dry run of COSTLY_MECHANISMS uncached mechanisms, a commit of every
        unrun step of a reservation) while another tenant reads its own dataset's status; once a run."""
        self.stall_timed = True
        busy, reading = data.draw(st.permutations(sorted(self.oracle.datasets)).map(
            lambda names: next((a, b) for a in names for b in names if a.split("/")[0] != b.split("/")[0])))
        tenant = busy.split("/")[0]
        fresh = time.monotonic_ns() % 10**6
        plan = Composition(tuple(SampledGaussian(0.01, 3.0 + (fresh + index) * 1e-7, 10)
                                 for index in range(COSTLY_MECHANISMS)))
        mine = [rid for rid in self.active() if self.oracle.charges[rid].tenant == tenant]
        outcome = {}

        def costly():
            started = time.monotonic()
            try:
                self.ledger.fits(busy, plan, caller=self.caller(tenant))
            except LedgerError:
                pass
            if mine:
                charge = self.oracle.charges[mine[0]]
                sequence, steps = len(self.sequences.setdefault(mine[0], [])), charge.planned_steps - charge.committed
                try:
                    self.ledger.commit(mine[0], steps, sequence, caller=self.caller(tenant))
                    outcome["committed"] = (mine[0], sequence, steps)
                except LedgerError:
                    pass  # nothing unrun, or a quota lowered since the reserve refuses the commit
            outcome["seconds"] = time.monotonic() - started

        worker = threading.Thread(target=costly)
        reader = self.caller(reading.split("/")[0])
        worker.start()
        slowest = 0.0
        while worker.is_alive():
            started = time.monotonic()
            self.ledger.get_budget(reading, pld_may_be_pending=True, caller=reader)
            slowest = max(slowest, time.monotonic() - started)
            time.sleep(READ_PAUSE_SECONDS)
        worker.join()
        if "committed" in outcome:
            reservation_id, sequence, steps = outcome["committed"]
            self.sequences[reservation_id].append((sequence, steps))
            self.oracle.charges[reservation_id].committed += steps
        assert slowest <= STALL_BOUND_SECONDS, f"another tenant's status took {slowest:.3f} s"
        assert outcome["seconds"] <= WORST_CALL_BOUND_SECONDS, f"the costliest calls took {outcome['seconds']:.1f} s"

    @precondition(lambda self: self.file is not None and self.oracle.charges)
    @rule(data=st.data())
    def verify_finds_an_edited_reservation(self, data):
        """An administrator of the file adds a step to a reservation's committed count in a copy of it: verify
        names that reservation (and the ledger itself is left as it was)."""
        reservation_id = data.draw(st.sampled_from(list(self.oracle.charges)))
        copy = self.file.with_name(f"{self.file.stem}-edited.db")
        source, target = sqlite3.connect(self.file), sqlite3.connect(copy)
        try:
            source.backup(target)
            with target:
                target.execute("UPDATE reservations SET committed_steps = committed_steps + 1 WHERE id = ?",
                               (reservation_id,))
        finally:
            source.close()
            target.close()
        with Ledger(copy, caller=ADMIN) as edited:
            findings = [str(finding) for finding in edited.verify().findings]
        for leftover in copy.parent.glob(f"{copy.name}*"):
            leftover.unlink()
        assert any(reservation_id in finding for finding in findings), findings

    # ------------------------------------------------------------ what must always hold

    @invariant()
    def the_oracle_agrees(self):
        self.sync_queue()
        overspent = self.oracle.overspent()
        assert not overspent, overspent
        held = {job.reservation_id: (job.state == ACTIVE, job.committed_steps)
                for job in self.ledger.list_jobs(caller=ADMIN)}
        expected = {rid: (charge.active, charge.committed) for rid, charge in self.oracle.charges.items()}
        assert held == expected
        assert self.ledger.verify().findings == ()


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return write_world(tmp_path_factory.mktemp("world"))


def run_machine(new_database, world):
    """Run the machine, each example on a new database: `new_database()` gives the function that opens it and
    its SQLite file (None on PostgreSQL)."""
    run_state_machine_as_test(lambda: LedgerMachine(*new_database(), world=world), settings=PROFILES[PROFILE])


def test_no_tenant_oversells_a_row_on_sqlite(tmp_path, world):
    numbers = iter(range(10**6))

    def new_database():
        path = tmp_path / f"ledger-{next(numbers)}.db"
        return (lambda: open_embedded_ledger(path)), path

    run_machine(new_database, world)


@pytest.mark.skipif(PROFILE != "long", reason="the PostgreSQL machine runs with DPFLEET_LEDGER_PROPERTY_PROFILE=long")
def test_no_tenant_oversells_a_row_on_postgresql(world):
    pytest.importorskip("psycopg", reason="the PostgreSQL ledger needs psycopg (the test extra installs it)")
    from bench.postgres import PostgresCluster, postgresql_binaries

    binaries, where = postgresql_binaries()
    if binaries is None:
        pytest.skip(where)
    cluster = PostgresCluster(binaries)
    cluster.start()
    numbers = iter(range(10**6))

    def new_database():
        url = cluster.create_database(f"machine{next(numbers)}")
        return (lambda: Ledger(url, caller=ADMIN)), None

    try:
        run_machine(new_database, world)
    finally:
        cluster.stop()
