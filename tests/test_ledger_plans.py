"""Pre-registered plans: a budget split at creation, plans charged their PLD ε from the pool by basic composition,
their jobs admitted only with the mechanisms they declared, nothing refunded, and `verify` replaying all of it."""

import json
import sqlite3

import pytest

from accounting.accountants import get_accountant
from accounting.events import Composition, SampledGaussian
from accounting.ledger.admission import AdmissionRule, RdpTally
from accounting.ledger.admission.pools import PoolUse, pool_admits, rule_with_pool, split_budget
from accounting.ledger.client import RemoteLedger
from accounting.ledger.errors import BudgetExceeded, FailedPrecondition, InvalidArgument, PermissionDenied
from accounting.ledger.service import start_server
from accounting.ledger.store import open_embedded_ledger
from orchestrator.cli import main
from orchestrator.config import load_config
from orchestrator.planning import plan_run
from servers import TINY_JOB

DELTA = 1e-5
ADMIN_TOKEN = "admin-token-for-plan-tests-0123456789"
# The main MNIST job's mechanism (examples/mnist.toml): q = 256/60000, σ 1.1, 2,000 steps... at a tenth of its steps.
JOB = SampledGaussian(256 / 60000, 1.1, 200)
OTHER = SampledGaussian(256 / 60000, 1.0, 200)


@pytest.fixture
def ledger(tmp_path):
    with open_embedded_ledger(tmp_path / "ledger.db") as opened:
        opened.create_dataset("mnist", 10.0, DELTA, plan_share=0.5)
        yield opened


def test_a_split_adds_up_to_the_budget_and_a_dataset_without_one_keeps_its_rule_and_row():
    (filter_epsilon, filter_delta), (pool_epsilon, pool_delta) = split_budget(10.0, DELTA, 0.3)
    assert filter_epsilon + pool_epsilon == pytest.approx(10.0) and filter_delta + pool_delta == pytest.approx(DELTA)
    # Share 0: the rule, and so every stored row and history entry, are what they were before plans.
    assert rule_with_pool(10.0, DELTA, 0.0) == AdmissionRule.for_budget(10.0, DELTA)
    assert "plan_pool" not in rule_with_pool(10.0, DELTA, 0.0).to_dict()
    rule = rule_with_pool(10.0, DELTA, 0.5)
    assert AdmissionRule.from_dict(rule.to_dict()) == rule and rule.orders == AdmissionRule.for_budget(5.0, DELTA / 2).orders
    # Basic composition: epsilons and deltas add, each within the pool's.
    assert pool_admits(rule, PoolUse(4.0, DELTA / 4, 1), 0.99, DELTA / 4)
    assert not pool_admits(rule, PoolUse(4.0, DELTA / 4, 1), 1.01, DELTA / 4)
    assert not pool_admits(rule, PoolUse(1.0, DELTA / 2, 1), 1.0, DELTA / 10)


def test_a_plan_is_charged_its_pld_epsilon_once_and_its_jobs_take_nothing_from_the_filter(ledger):
    status = ledger.get_budget("mnist")
    assert (status.budget_epsilon, status.delta) == (5.0, DELTA / 2)
    assert (status.admission.plan_epsilon, status.admission.plan_delta) == (5.0, DELTA / 2)
    plan = ledger.register_plan("mnist", "sweep", [JOB, JOB, JOB])
    assert plan.delta == pytest.approx(DELTA / 20)  # a tenth of the pool's δ by default
    assert plan.epsilon == get_accountant("pld").epsilon(SampledGaussian(JOB.sampling_rate, 1.1, 600), plan.delta)
    first = ledger.reserve("mnist", "trial-0", JOB, plan="sweep")
    ledger.commit(first.reservation_id, 200, 0)
    ledger.release(first.reservation_id)
    second = ledger.reserve("mnist", "trial-1", JOB, plan="sweep")
    ledger.commit(second.reservation_id, 50, 0)
    ledger.release(second.reservation_id)  # stopped early: its 150 steps are not refunded, nor is trial 3
    status = ledger.get_budget("mnist")
    assert status.spent_epsilon_filter == 0.0 and status.reserved_epsilon == 0.0 and status.remaining_epsilon == 5.0
    assert (status.plans, status.plans_epsilon, status.plans_delta) == (1, plan.epsilon, plan.delta)
    assert status.to_dict()["plan_pool"]["remaining_epsilon"] == 5.0 - plan.epsilon
    (listed,) = ledger.list_plans("mnist")
    assert listed.started_jobs == 2 and listed.to_dict()["unstarted_jobs_not_refunded"] == 1
    assert [job.plan for job in ledger.list_jobs("mnist")] == ["sweep", "sweep"]
    released = [entry.details for entry in ledger.history("mnist") if entry.action == "release"]
    assert released[-1]["freed_steps"] == 0 and released[-1]["unrun_steps_not_refunded"] == 150
    assert ledger.verify().findings == ()


def test_a_job_outside_its_plans_declared_mechanisms_is_refused_and_so_is_one_past_its_end(ledger):
    ledger.register_plan("mnist", "daily", [JOB, OTHER])
    with pytest.raises(FailedPrecondition, match="does not run what plan 'daily' declared for its job 1 of 2: the "
                                                 "plan declared 200 steps at q 0.00426667, σ 1.1; the job plans "
                                                 "200 steps at q 0.00426667, σ 1"):
        ledger.reserve("mnist", "day-1", OTHER, plan="daily")  # the plan's second job, run first
    with pytest.raises(FailedPrecondition, match="declared for its job 1"):
        ledger.reserve("mnist", "day-1", SampledGaussian(JOB.sampling_rate, 1.1, 201), plan="daily")  # one step more
    ledger.reserve("mnist", "day-1", JOB, plan="daily")
    ledger.reserve("mnist", "day-2", OTHER, plan="daily")
    with pytest.raises(FailedPrecondition, match="all 2 jobs of plan 'daily' have started"):
        ledger.reserve("mnist", "day-3", OTHER, plan="daily")
    assert ledger.list_plans("mnist")[0].started_jobs == 2
    assert ledger.verify().findings == ()


def test_the_pool_admits_plans_by_basic_composition_and_refuses_past_it(ledger, tmp_path):
    big = [SampledGaussian(256 / 60000, 1.1, 2000)] * 3
    first = ledger.register_plan("mnist", "a", big, delta=DELTA / 4)
    with pytest.raises(BudgetExceeded, match="the plan pool of dataset 'mnist' \\(1 plan\\(s\\) so far\\)"):
        ledger.register_plan("mnist", "b", big * 6, delta=DELTA / 4)  # 18 runs: ε 4.4, past the 3.4 left
    with pytest.raises(BudgetExceeded, match="δ 2.5e-06 left, where the plan asks δ 5e-06"):
        ledger.register_plan("mnist", "c", [JOB], delta=DELTA / 2)
    with pytest.raises(InvalidArgument, match="at most its pool's delta"):
        ledger.register_plan("mnist", "d", [JOB], delta=DELTA)
    second = ledger.register_plan("mnist", "e", big, delta=DELTA / 4)
    assert second.epsilon == first.epsilon
    assert ledger.get_budget("mnist").plans_epsilon == first.epsilon + second.epsilon <= 5.0
    # The filter's part is untouched by the plans, and admits as any dataset of its budget does.
    filtered = ledger.reserve("mnist", "single", JOB)
    assert ledger.get_budget("mnist").reserved_epsilon == \
        AdmissionRule.for_budget(5.0, DELTA / 2).epsilon(RdpTally.of(JOB))
    ledger.release(filtered.reservation_id)
    with pytest.raises(FailedPrecondition, match="set a plan pool aside, whose plans' jobs read every row"):
        ledger.add_block("mnist", "day-1", 1.0, data={"rows": [0, 10]})
    with open_embedded_ledger(tmp_path / "plain.db") as plain:
        plain.create_dataset("mnist", 10.0, DELTA)
        with pytest.raises(FailedPrecondition, match="has no plan pool"):
            plain.register_plan("mnist", "a", [JOB])


def test_only_the_owner_registers_a_plan_and_runs_its_jobs(tmp_path):
    with open_embedded_ledger(tmp_path / "ledger.db") as ledger:
        ledger.create_tenant("acme")
        ledger.create_tenant("rival")
        ledger.create_dataset("acme/mnist", 10.0, DELTA, plan_share=0.5)
        ledger.set_quota("acme/mnist", "rival", 1.0)
        ledger.register_plan("acme/mnist", "sweep", [JOB])
        rival = ledger.authenticate(ledger.rotate_token("rival").token)
        with pytest.raises(PermissionDenied, match="plans are charged to a dataset's own plan pool"):
            ledger.register_plan("acme/mnist", "mine", [JOB], caller=rival)
        with pytest.raises(Exception, match="has no plan 'sweep' of tenant 'rival'"):
            ledger.reserve("acme/mnist", "job", JOB, plan="sweep", caller=rival)


def test_a_served_ledger_splits_registers_and_admits_a_plans_job_as_the_embedded_one_does(tmp_path):
    server = start_server(tmp_path / "served.db", "127.0.0.1", 0, ADMIN_TOKEN, allow_key_beside_database=True)
    try:
        with RemoteLedger(server.address, ADMIN_TOKEN) as admin:
            token = admin.create_tenant("acme").token
        with RemoteLedger(server.address, token) as ledger:
            created = ledger.create_dataset("mnist", 10.0, DELTA, plan_share=0.5)
            assert (created.budget_epsilon, created.admission.plan_epsilon) == (5.0, 5.0)
            plan = ledger.register_plan("mnist", "sweep", [JOB, OTHER], delta=DELTA / 4)
            assert plan.epsilon == get_accountant("pld").epsilon(Composition((JOB, OTHER)), DELTA / 4)
            with pytest.raises(FailedPrecondition, match="does not run what plan 'sweep' declared"):
                ledger.reserve("mnist", "job-1", OTHER, plan="sweep")
            job = ledger.reserve("mnist", "job-1", JOB, plan="sweep")
            assert job.plan == "sweep"
            ledger.commit(job.reservation_id, 200, 0)
            status = ledger.get_budget("mnist")
            assert (status.plans, status.plans_epsilon, status.spent_epsilon_filter) == (1, plan.epsilon, 0.0)
            assert [listed.started_jobs for listed in ledger.list_plans("mnist")] == [1]
    finally:
        server.stop(grace_seconds=1.0)


def plan_rows(path, statement, *parameters):
    with sqlite3.connect(path) as connection:
        connection.execute(statement, parameters)


def test_verify_finds_a_plan_charged_less_than_its_pld_epsilon_a_forged_plan_and_a_forged_start(tmp_path):
    path = tmp_path / "ledger.db"
    with open_embedded_ledger(path) as ledger:
        ledger.create_dataset("mnist", 10.0, DELTA, plan_share=0.5)
        ledger.register_plan("mnist", "sweep", [JOB, JOB])
        ledger.reserve("mnist", "trial-0", JOB, plan="sweep")
    # Whoever holds the file lowers what the plan cost, adds a plan no history registered, and starts a job twice.
    plan_rows(path, "UPDATE plans SET epsilon = epsilon / 2")
    plan_rows(path, "INSERT INTO plans (dataset_id, name, tenant, jobs, epsilon, delta, started_jobs, created_at) "
                    "SELECT dataset_id, 'forged', tenant, jobs, 0.001, delta, 0, created_at FROM plans")
    plan_rows(path, "UPDATE plans SET started_jobs = 0 WHERE name = 'sweep'")
    with open_embedded_ledger(path) as ledger:
        found = [str(finding) for finding in ledger.verify(full=True).findings]
    assert any("plan 'sweep': its row differs from what its history replays to" in line for line in found), found
    assert any("plan 'forged' has a row but no history entry" in line for line in found), found


def test_the_command_line_splits_a_budget_registers_runs_of_a_config_and_lists_them(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("DPFLEET_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("DPFLEET_LEDGER", raising=False)
    config = tmp_path / "job.toml"
    config.write_text('dataset = "mnist"\nbatch_size = 256\nsteps = 2000\nnoise_multiplier = 1.1\n')
    # Before the dataset exists, fits says how a first use would split the budget it registers.
    first_use = tmp_path / "first-use.toml"
    first_use.write_text(config.read_text() + "dataset_plan_share = 0.5\n")
    assert main(["ledger", "fits", "--config", str(first_use)]) == 0
    assert ("would register it with budget ε 5 at δ 5e-06 for the filter, and a plan pool of ε 5 at δ 5e-06 beside "
            "it on first use") in capsys.readouterr().out
    assert main(["ledger", "dataset", "create", "mnist", "--epsilon", "10", "--delta", "1e-5", "--plan-share",
                 "0.99"]) == 0
    assert "plan pools (set aside at creation" in capsys.readouterr().out
    assert main(["ledger", "plan", "register", "daily", "--config", str(config), "--runs", "3", "--delta",
                 "4.95e-6", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    three_runs = get_accountant("pld").epsilon(SampledGaussian(256 / 60000, 1.1, 6000), 4.95e-6)
    assert shown["plan"]["epsilon"] == three_runs and len(shown["plan"]["jobs"]) == 3
    assert shown["pool"]["remaining_epsilon"] == pytest.approx(9.9 - three_runs)
    assert main(["ledger", "plan", "register", "daily", "--config", str(config)]) == 2  # the name is taken
    assert "already has a plan 'daily'" in capsys.readouterr().err
    assert main(["ledger", "plan", "register", "more", "--config", str(config), "--runs", "400"]) == 3
    assert "the plan pool of dataset 'mnist'" in capsys.readouterr().err
    with open_embedded_ledger() as ledger:
        job, _, _ = plan_run(load_config(str(config), {})).ledger_plan("example")
        ledger.reserve("mnist", "day-1", job, plan="daily")
    assert main(["ledger", "plan", "list", "mnist"]) == 0
    listed = capsys.readouterr().out
    assert "daily" in listed and "not refunded" in listed
    assert main(["ledger", "jobs"]) == 0
    assert "paid with plan daily" in capsys.readouterr().out


def test_tune_registers_its_grid_as_a_plan_and_each_trial_runs_in_it(local_ray, worker_pool, tmp_path, capsys):
    base, grid = tmp_path / "base.toml", tmp_path / "grid.toml"
    # The dataset is registered on first use with half of its budget set aside as the plan pool.
    base.write_text(TINY_JOB.replace("workers = 2", "workers = 1") + "steps = 3\nseed = 2\ndataset_plan_share = 0.5\n")
    grid.write_text("learning_rate = [0.05, 0.5]\n")
    assert main(["tune", "--config", str(base), "--grid", str(grid), "--run-dir", str(tmp_path / "tune"),
                 "--no-progress"]) == 0
    out = capsys.readouterr().out
    with open_embedded_ledger() as ledger:
        (plan,) = ledger.list_plans("mnist")
        jobs = ledger.list_jobs("mnist")
        status = ledger.get_budget("mnist")
    both = get_accountant("pld").epsilon(SampledGaussian(30 / 600, 1.0, 6), plan.delta)
    assert "with budget epsilon 10 at delta 1e-05 (50% of it set aside as its plan pool)" in out
    assert f"registered the 2 trials as plan {plan.name!r}, charged ε {both:.4g}" in out
    assert plan.epsilon == both and plan.started_jobs == 2
    assert [(job.plan, job.committed_steps) for job in jobs] == [(plan.name, 3), (plan.name, 3)]
    assert status.spent_epsilon_filter == 0.0 and status.plans_epsilon == both
    assert "ledger: reserved 3 steps on 'mnist' (reservation" in out and "this job takes nothing more (plan" in out
    with open_embedded_ledger() as ledger:
        assert ledger.verify().findings == ()
