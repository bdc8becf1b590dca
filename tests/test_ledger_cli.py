"""`dpfleet ledger ...` against the embedded ledger file and against a server on loopback."""

import json
import sqlite3

import pytest

from accounting.accountants import get_accountant
from accounting.events import Composition, SampledGaussian, SampledSkellam
from accounting.ledger.admission import AdmissionRule, RdpTally
from accounting.ledger.callers import ADMIN
from accounting.ledger.client import RemoteLedger
from accounting.ledger.service import start_server
from accounting.ledger.store import open_embedded_ledger
from orchestrator.cli import main

ADMIN_TOKEN = "admin-token-for-tests-0123456789"
DELTA = 1e-5
STATUS_KEYS = {
    "name", "tenant", "privacy_unit", "budget_epsilon", "delta", "admission", "spent_epsilon_filter", "spent_epsilon",
    "spent_epsilon_accountant", "spent_epsilon_rdp",
    "reserved_epsilon", "remaining_epsilon", "jobs", "released_jobs", "blocks", "quotas", "scheduling", "queued_jobs",
}


def run(capsys, *argv):
    """Run one ledger command the way `dpfleet` does; return (exit status, stdout, stderr)."""
    status = main(list(argv))
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def run_json(capsys, *argv):
    status, out, err = run(capsys, *argv, "--json")
    assert status == 0, err
    return json.loads(out)


@pytest.fixture
def embedded(tmp_path, monkeypatch):
    monkeypatch.setenv("DPFLEET_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("DPFLEET_LEDGER", raising=False)
    monkeypatch.delenv("DPFLEET_TOKEN", raising=False)
    return tmp_path / "home" / "ledger.db"


@pytest.fixture
def server(tmp_path, monkeypatch):
    monkeypatch.delenv("DPFLEET_LEDGER", raising=False)
    monkeypatch.delenv("DPFLEET_TOKEN", raising=False)
    running = start_server(tmp_path / "served.db", "127.0.0.1", 0, ADMIN_TOKEN, allow_key_beside_database=True)
    yield running
    running.stop(grace_seconds=1.0)


def test_embedded_ledger_needs_no_server_and_shows_spending(capsys, embedded):
    created = run_json(capsys, "ledger", "dataset", "create", "mnist", "--epsilon", "2", "--delta", "1e-5")
    assert created["datasets"][0]["remaining_epsilon"] == 2.0
    with open_embedded_ledger(embedded) as ledger:
        reservation = ledger.reserve("mnist", "job-1", SampledGaussian(0.004, 1.1, 500))
        ledger.commit(reservation.reservation_id, 200, 0)

    (dataset,) = run_json(capsys, "ledger", "status")["datasets"]
    assert set(dataset) == STATUS_KEYS
    assert (dataset["name"], dataset["tenant"]) == ("mnist", "local")
    assert (dataset["budget_epsilon"], dataset["delta"]) == (2.0, DELTA)
    assert dataset["spent_epsilon"] == get_accountant("pld").epsilon(SampledGaussian(0.004, 1.1, 200), DELTA)
    assert dataset["spent_epsilon"] < dataset["spent_epsilon_rdp"] and dataset["spent_epsilon_accountant"] == "pld"
    assert dataset["spent_epsilon_rdp"] < dataset["spent_epsilon_filter"]
    accounted = dataset["spent_epsilon_filter"] + dataset["reserved_epsilon"] + dataset["remaining_epsilon"]
    assert accounted == pytest.approx(2.0)
    assert dataset["admission"] == AdmissionRule.for_budget(2.0, DELTA).to_dict()
    assert dataset["admission"]["delta_per_order"] == DELTA / len(dataset["admission"]["orders"])
    jobs = [(job["job_id"], job["committed_steps"], job["unrun_steps"]) for job in dataset["jobs"]]
    assert jobs == [("job-1", 200, 300)]

    status, table, _ = run(capsys, "ledger", "status", "--dataset", "mnist")
    assert status == 0
    assert table.splitlines()[0].split()[:4] == ["dataset", "unit", "budget", "ε"]
    assert table.splitlines()[2].split()[:2] == ["mnist", "example"]
    assert "job-1" in table and reservation.reservation_id in table

    released = run_json(capsys, "ledger", "release", reservation.reservation_id)
    assert (released["state"], released["committed_steps"], released["unrun_steps"]) == ("released", 200, 0)
    assert run_json(capsys, "ledger", "jobs", "--active")["jobs"] == []
    assert [job["state"] for job in run_json(capsys, "ledger", "jobs")["jobs"]] == ["released"]
    actions = [entry["action"] for entry in run_json(capsys, "ledger", "history", "--dataset", "mnist")["history"]]
    assert actions == ["create_dataset", "reserve", "commit", "release"]


def test_bad_flags_exit_2_and_write_nothing(capsys, embedded):
    run(capsys, "ledger", "dataset", "create", "mnist", "--epsilon", "1", "--delta", "1e-5")
    before = run_json(capsys, "ledger", "history")["history"]
    for argv, complaint in [
        (("dataset", "create", "cifar", "--epsilon", "nan", "--delta", "1e-5"),
         "--epsilon: budget epsilon must be a finite number"),
        (("dataset", "create", "cifar", "--epsilon", "ten", "--delta", "1e-5"), "--epsilon must be a number"),
        (("dataset", "create", "cifar", "--epsilon", "1e-300", "--delta", "1e-5"),
         "--epsilon: budget epsilon must be in [1e-06, 10000] (got 1e-300)"),
        (("dataset", "create", "cifar", "--epsilon", "1", "--delta", "2"), "--delta: delta must be in [1e-20, 0.1]"),
        (("dataset", "create", "cifar", "--epsilon", "1", "--delta", "0.999999"), "--delta: delta must be in"),
        (("dataset", "create", "cifar", "--epsilon", "1", "--delta", "5e-324"), "--delta: delta must be in"),
        (("block", "add", "mnist", "d1", "--epsilon", "1e300"), "--epsilon: block epsilon must be in"),
        (("dataset", "create", "x" * 10_000, "--epsilon", "1", "--delta", "1e-5"), "dataset name must be 1 to 128"),
        (("dataset", "create", "mnist", "--epsilon", "1", "--delta", "1e-5"), "already exists"),
        (("dataset", "raise", "mnist", "--epsilon", "inf"), "--epsilon: budget epsilon must be a finite number"),
        (("status", "--token", "t"), "--token needs --ledger"),
        (("release", "r-0000000000000000"), "does not exist"),
        (("history", "--limit", "0"), "--limit must be an integer >= 1"),
    ]:
        status, out, err = run(capsys, "ledger", *argv)
        assert (status, out) == (2, ""), argv
        assert complaint in err
    assert run_json(capsys, "ledger", "history")["history"] == before


def test_remote_ledger_through_flags_and_environment(capsys, server, monkeypatch):
    created = run_json(capsys, "ledger", "tenant", "create", "acme", "--ledger", server.address, "--token", ADMIN_TOKEN)
    assert set(created) == {"tenant", "token"} and created["tenant"] == "acme"
    monkeypatch.setenv("DPFLEET_LEDGER", server.address)
    monkeypatch.setenv("DPFLEET_TOKEN", created["token"])
    run_json(capsys, "ledger", "dataset", "create", "mnist", "--epsilon", "2", "--delta", "1e-5")
    assert [dataset["name"] for dataset in run_json(capsys, "ledger", "status")["datasets"]] == ["mnist"]

    status, _, err = run(capsys, "ledger", "dataset", "raise", "mnist", "--epsilon", "5")
    assert status == 2 and "needs the admin token" in err
    raised = run_json(capsys, "ledger", "dataset", "raise", "acme/mnist", "--epsilon", "5", "--token", ADMIN_TOKEN)
    assert raised["datasets"][0]["budget_epsilon"] == 5.0

    monkeypatch.setenv("DPFLEET_TOKEN", "not-a-token")
    status, _, err = run(capsys, "ledger", "status")
    assert status == 2 and "not a dpfleet ledger token" in err
    status, _, err = run(capsys, "ledger", "status", "--ledger", "127.0.0.1:1", "--timeout", "1")
    assert status == 2 and "did not answer" in err


def test_status_that_does_not_wait_marks_an_rdp_figure_and_says_why(capsys, server, held_back_pld):
    admin = ("--ledger", server.address, "--token", ADMIN_TOKEN)
    run_json(capsys, "ledger", "tenant", "create", "acme", *admin)
    run_json(capsys, "ledger", "dataset", "create", "acme/mnist", "--epsilon", "2", "--delta", "1e-5", *admin)
    uncommon = SampledGaussian(0.0037, 1.07, 1)  # a composition no other test has had the PLD of
    reservation = server.ledger.reserve("acme/mnist", "job-1", uncommon.with_steps(100), caller=ADMIN)
    server.ledger.commit(reservation.reservation_id, 29, 0, caller=ADMIN)

    (dataset,) = run_json(capsys, "ledger", "status", "--no-wait", *admin)["datasets"]
    assert dataset["spent_epsilon_accountant"] == "rdp" and dataset["spent_epsilon"] == dataset["spent_epsilon_rdp"]
    status, table, _ = run(capsys, "ledger", "status", "--dataset", "acme/mnist", "--no-wait", *admin)
    assert status == 0 and "(rdp)" in table and "not ready yet" in table
    held_back_pld.set()
    (dataset,) = run_json(capsys, "ledger", "status", *admin)["datasets"]
    assert dataset["spent_epsilon_accountant"] == "pld" and dataset["spent_epsilon"] < dataset["spent_epsilon_rdp"]
    status, table, _ = run(capsys, "ledger", "status", *admin)
    assert "(pld)" in table and "not ready yet" not in table


def test_verify_names_the_dataset_and_entry_of_a_hand_edited_row_and_exits_1(capsys, embedded):
    run_json(capsys, "ledger", "dataset", "create", "mnist", "--epsilon", "2", "--delta", "1e-5")
    with open_embedded_ledger(embedded) as ledger:
        reservation = ledger.reserve("mnist", "job-1", SampledGaussian(0.004, 1.1, 500))
        ledger.commit(reservation.reservation_id, 200, 0)
    status, out, _ = run(capsys, "ledger", "verify")
    assert status == 0 and out.startswith("no findings in 5 history entries (every hash checked, all replayed) and 1 "
                                          "datasets of ")
    with open_embedded_ledger(embedded) as ledger:
        ledger.commit(reservation.reservation_id, 100, 1)
    status, out, _ = run(capsys, "ledger", "verify")
    assert status == 0 and "(every hash checked, 1 replayed after the last verified entry)" in out
    status, out, _ = run(capsys, "ledger", "verify", "--full")
    assert status == 0 and "(every hash checked, all replayed)" in out
    with sqlite3.connect(embedded) as connection:
        connection.execute("DROP TRIGGER history_is_append_only_update")
        (entry_id,) = connection.execute("SELECT MIN(id) FROM history WHERE action = 'commit'").fetchone()
        connection.execute("UPDATE history SET actor = 'someone else' WHERE id = ?", (entry_id,))
    edited = "its fields do not match its hash (the row was edited)"
    status, out, _ = run(capsys, "ledger", "verify", "--db", str(embedded))
    assert status == 1 and out.splitlines()[0] == f"entry {entry_id} of dataset local/mnist: {edited}"
    report = run(capsys, "ledger", "verify", "--json")[1]
    assert json.loads(report)["findings"] == [{"entry_id": entry_id, "dataset": "local/mnist", "problem": edited}]


def test_head_is_signed_and_verify_head_finds_the_tail_cut_since(capsys, embedded, tmp_path):
    run_json(capsys, "ledger", "dataset", "create", "mnist", "--epsilon", "2", "--delta", "1e-5")
    key_file = tmp_path / "kept-apart" / "history.key"
    status, out, _ = run(capsys, "ledger", "head", "--history-key", str(key_file))
    assert status == 0
    head = json.loads(out)
    assert head["entries"] == 3 and len(head["signature"]) == 64  # the ledger's creation, 'local', mnist
    status, out, _ = run(capsys, "ledger", "head")  # the default key signs otherwise
    assert json.loads(out)["signature"] != head["signature"]
    head_file = tmp_path / "head.json"
    head_file.write_text(json.dumps(head))
    status, out, _ = run(capsys, "ledger", "verify", "--head", str(head_file))
    assert status == 1 and out.startswith("head file: its signature does not match the history key")
    with open_embedded_ledger(embedded) as ledger:
        signed = ledger.head()
    head_file.write_text(json.dumps(signed.to_dict()))
    status, out, _ = run(capsys, "ledger", "verify", "--head", str(head_file))
    assert status == 0 and f"checked against the head of 3 entries signed at {signed.at}" in out
    with sqlite3.connect(embedded) as connection:
        connection.execute("DROP TRIGGER history_is_append_only_delete")
        connection.execute("DELETE FROM history WHERE action = 'create_dataset'")
        connection.execute("DELETE FROM datasets")
    status, out, _ = run(capsys, "ledger", "verify", "--head", str(head_file))
    assert status == 1 and out.splitlines() == [
        f"signed head: the history has 2 entries; at {signed.at} it had 3: entries were cut from its tail",
        "verified state: the history has 2 entries; the last verify checked 3: entries were cut from its tail",
        out.splitlines()[-1],
    ]


def test_a_delta_above_one_over_the_dataset_size_is_warned_about(capsys, embedded):
    status, _, err = run(capsys, "ledger", "dataset", "create", "mnist", "--epsilon", "1", "--delta", "1e-3",
                         "--dataset-size", "60000")
    assert status == 0 and err.startswith("warning: delta 0.001 is above 1/N = 1.67e-05 for a dataset of 60000 rows")
    status, _, err = run(capsys, "ledger", "dataset", "create", "cifar", "--epsilon", "1", "--delta", "1e-6",
                         "--dataset-size", "60000")
    assert (status, err) == (0, "")


# ---------------------------------------------------------------- the charge, known before the job starts


def mnist_job(tmp_path, **keys):
    """A config file for MNIST's plan (its size is known without reading it), with `keys` added."""
    config = tmp_path / "job.toml"
    lines = ['dataset = "mnist"', "batch_size = 250", "steps = 2000", *(f"{key} = {json.dumps(value)}"
                                                                         for key, value in keys.items())]
    config.write_text("\n".join(lines) + "\n")
    return str(config)


def test_a_target_by_the_accountant_is_charged_more_by_the_filter_and_fits_says_so_before_the_job(
        capsys, embedded, tmp_path):
    run_json(capsys, "ledger", "dataset", "create", "mnist", "--epsilon", "10", "--delta", "1e-5")
    shown = run_json(capsys, "ledger", "fits", "--config", mnist_job(tmp_path, target_epsilon=3.0))
    ((budget, charge),) = [(item["budget"], item["filter_epsilon"]) for item in shown["filter_charges"]]
    assert budget == "dataset mnist" and shown["epsilon_accountant"] == "pld"
    assert shown["epsilon"] == pytest.approx(3.0, rel=2e-3) and shown["epsilon"] <= 3.0
    assert charge > 3.0  # the PLD target is not what the RDP filter charges ...
    assert charge == pytest.approx(shown["checks"][0]["needed_epsilon"], rel=1e-12)  # ... and fits shows the charge
    status, out, _ = run(capsys, "ledger", "fits", "--config", mnist_job(tmp_path, target_epsilon=3.0))
    assert status == 0 and (f"this job would take ε {charge:.3g} of the budget (remaining 10 → {10 - charge:.3g}); "
                            f"its own privacy: ε {shown['epsilon']:.3g} (pld, δ 1e-05)") in out


def test_with_the_filter_basis_the_ledger_charges_at_most_the_target_within_calibration_tolerance(
        capsys, embedded, tmp_path):
    from orchestrator.config import load_config
    from orchestrator.errors import UsageError
    from orchestrator.ledger_session import filter_basis
    from orchestrator.planning import plan_run

    run_json(capsys, "ledger", "dataset", "create", "mnist", "--epsilon", "10", "--delta", "1e-5")
    config_file = mnist_job(tmp_path, target_epsilon=3.0, target_epsilon_basis="filter")
    shown = run_json(capsys, "ledger", "fits", "--config", config_file)
    ((_, charge),) = [(item["budget"], item["filter_epsilon"]) for item in shown["filter_charges"]]
    assert 3.0 * (1 - 2e-3) <= charge <= 3.0
    assert shown["epsilon"] < 3.0  # the run's PLD ε is below what the filter charges
    config = load_config(config_file, {})
    with pytest.raises(UsageError, match="needs the admission rule of the ledger budget"):
        plan_run(config)
    with open_embedded_ledger(embedded) as ledger:
        plan = plan_run(config, charge_epsilon=filter_basis(ledger, "mnist", ()))
        assert plan.noise_multiplier == shown["noise_multiplier"]
        ledger.reserve("mnist", "job", plan.planned_events)
        charged = ledger.get_budget("mnist").reserved_epsilon
    assert charged == pytest.approx(charge, rel=1e-12) and 3.0 * (1 - 2e-3) <= charged <= 3.0
    # σ 0.1% smaller would be charged more than the target: σ is the smallest that meets it.
    smaller = plan_run(load_config(mnist_job(tmp_path, noise_multiplier=plan.noise_multiplier * 0.999), {}))
    assert AdmissionRule.for_budget(10.0, DELTA).epsilon(RdpTally.of(smaller.planned_events)) > 3.0
    status, _, err = run(capsys, "ledger", "fits", "--config",
                         mnist_job(tmp_path, noise_multiplier=1.0, target_epsilon_basis="filter"))
    assert status == 2 and "give target_epsilon" in err


def test_fits_answers_for_a_dataset_train_would_register_as_it_would_and_registers_nothing(capsys, embedded, tmp_path):
    config = mnist_job(tmp_path, noise_multiplier=1.0, dataset_budget_epsilon=3.0)
    status, out, _ = run(capsys, "ledger", "fits", "--config", config)
    plan = RdpTally.of(SampledGaussian(250 / 60000, 1.0, 2000))
    takes = AdmissionRule.for_budget(3.0, DELTA).epsilon(plan)
    own = get_accountant("pld").epsilon(SampledGaussian(250 / 60000, 1.0, 2000), DELTA)
    assert status == 0
    assert ("dataset 'mnist' is not registered: dpfleet train would register it with budget ε 3 at δ 1e-05 on first "
            "use; nothing is registered now.") in out
    assert (f"this job would take ε {takes:.3g} of the budget (remaining 3 → {3 - takes:.3g}); its own privacy: "
            f"ε {own:.3g} (pld, δ 1e-05)") in out
    first_use = run_json(capsys, "ledger", "fits", "--config", config)
    assert not first_use["registered"] and first_use["first_use"]["budget_epsilon"] == 3.0
    assert first_use["takes"] == [{"block": None, "epsilon": takes, "remaining_epsilon": 3.0,
                                   "remaining_after_epsilon": 3.0 - takes}]
    assert run_json(capsys, "ledger", "status")["datasets"] == []
    assert "create_dataset" not in [entry["action"] for entry in run_json(capsys, "ledger", "history")["history"]]
    # Registered as dpfleet train registers it, the ledger gives the same answer.
    run_json(capsys, "ledger", "dataset", "create", "mnist", "--epsilon", "3", "--delta", "1e-5")
    registered = run_json(capsys, "ledger", "fits", "--config", config)
    assert registered["registered"] and registered["checks"] == first_use["checks"]


def test_ledger_jobs_shows_what_each_job_took_the_first_paying_the_conversion_offset(capsys, server, monkeypatch):
    """Two jobs of one plan whose commits interleave, then a third: each job's charge is the rise its commits made
    in the filter's ε of the committed steps, in the order they were charged; the charges add up to spent ε
    (filter), through the server and the client."""
    monkeypatch.setenv("DPFLEET_LEDGER", server.address)
    monkeypatch.setenv("DPFLEET_TOKEN", ADMIN_TOKEN)
    run_json(capsys, "ledger", "tenant", "create", "acme")
    run_json(capsys, "ledger", "dataset", "create", "acme/mnist", "--epsilon", "10", "--delta", "1e-5")
    plan = SampledGaussian(0.004, 1.1, 500)
    with RemoteLedger(server.address, ADMIN_TOKEN) as ledger:
        first = ledger.reserve("acme/mnist", "first", plan)
        second = ledger.reserve("acme/mnist", "second", plan)
        for sequence in range(2):
            for job in (first, second):
                ledger.commit(job.reservation_id, 250, sequence)
        for job in (first, second):
            ledger.release(job.reservation_id)
        third = ledger.reserve("acme/mnist", "third", plan)
        ledger.commit(third.reservation_id, 100, 0)
        spent = ledger.get_budget("acme/mnist").spent_epsilon_filter
    rule = AdmissionRule.for_budget(10.0, DELTA)
    half, whole, part = (RdpTally.of(plan.with_steps(steps)) for steps in (250, 500, 100))

    def epsilon(*tallies):
        return rule.epsilon(sum(tallies, RdpTally.zero()))

    jobs = {job["job_id"]: job for job in run_json(capsys, "ledger", "jobs")["jobs"]}
    charges = {name: job["charges"] for name, job in jobs.items()}
    assert [charge[name] for charge in charges["first"] for name in ("block", "remaining_before_epsilon")] == [
        None, 10.0]
    assert charges["first"][0]["admitted_epsilon"] == epsilon(whole)
    assert charges["second"][0]["admitted_epsilon"] == epsilon(whole, whole) - epsilon(whole)
    assert charges["third"][0]["remaining_before_epsilon"] == 10.0 - epsilon(whole, whole)
    took = {name: charge[0]["charged_epsilon"] for name, charge in charges.items()}
    assert took["first"] == pytest.approx(epsilon(half) + epsilon(half, half, half) - epsilon(half, half), rel=1e-12)
    assert took["second"] == pytest.approx(epsilon(half, half) - epsilon(half) + epsilon(whole, whole)
                                           - epsilon(half, half, half), rel=1e-12)
    assert took["third"] == pytest.approx(epsilon(whole, whole, part) - epsilon(whole, whole), rel=1e-12)
    # The first job paid the conversion's offset: the second, of the same plan, took less than a fifth of it.
    assert took["second"] < took["first"] / 5 and sum(took.values()) == pytest.approx(spent, rel=1e-12)
    status, table, _ = run(capsys, "ledger", "jobs")
    header, _, *rows = table.split("\n\n")[0].splitlines()
    assert status == 0 and "took ε (filter)" in header
    assert [row.split()[6] for row in rows] == [f"{took[name]:.4g}" for name in ("first", "second", "third")]
    assert "its first job pays the RDP-to-(ε, δ) conversion's offset" in table
    (dataset,) = run_json(capsys, "ledger", "status")["datasets"]
    assert dataset["jobs"][0]["charges"] is None  # a status does not replay them


def test_token_rotate_and_revoke_for_tenants_and_the_admin(capsys, server):
    remote = ("--ledger", server.address)
    first = run_json(capsys, "ledger", "tenant", "create", "acme", *remote, "--token", ADMIN_TOKEN)["token"]
    status, _, err = run(capsys, "ledger", "token", "rotate", *remote, "--token", ADMIN_TOKEN)
    assert status == 2 and "name a tenant (--tenant NAME) or ask for the admin token (--admin)" in err
    status, out, _ = run(capsys, "ledger", "token", "rotate", "--tenant", "acme", *remote, "--token", first)
    assert status == 0 and "stops working on every server within a second" in out
    second = out.strip().splitlines()[-1]
    status, _, err = run(capsys, "ledger", "status", *remote, "--token", first)
    assert status == 2 and "revoked or rotated" in err
    assert run_json(capsys, "ledger", "status", *remote, "--token", second) == {"datasets": []}
    revoked = run_json(capsys, "ledger", "token", "revoke", "--tenant", "acme", *remote, "--token", ADMIN_TOKEN)
    assert revoked == {"tenant": "acme", "revoked_key_id": second.split("_")[1]}
    status, _, err = run(capsys, "ledger", "status", *remote, "--token", second)
    assert status == 2 and "revoked or rotated" in err
    admin = run_json(capsys, "ledger", "token", "rotate", "--admin", *remote, "--token", ADMIN_TOKEN)
    assert admin["tenant"] is None
    status, _, err = run(capsys, "ledger", "status", *remote, "--token", ADMIN_TOKEN)
    assert status == 2
    status, _, err = run(
        capsys, "ledger", "token", "revoke", "--admin-key-id", admin["token"].split("_")[1], *remote,
        "--token", admin["token"],
    )
    assert status == 2 and "is the last one; rotate it" in err


def test_a_wrong_token_and_an_unreachable_ledger_are_each_one_paragraph(server, capsys, tmp_path):
    status, _, err = run(capsys, "ledger", "status", "--ledger", server.address, "--token", "wrong-token")
    assert status != 0 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert "the token is not a dpfleet ledger token; use the token printed by" in err, err
    from servers import free_port

    status, _, err = run(capsys, "ledger", "status", "--ledger", f"127.0.0.1:{free_port()}", "--token", ADMIN_TOKEN)
    assert status != 0 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


def test_the_ledger_records_and_shows_who_adds_each_jobs_noise(capsys, server, monkeypatch):
    """A job with the silos' Skellam noise is admitted by the filter at its RDP, and its listing and history say
    "silos" beside a driver-noise job's "driver", through the server and the client."""
    monkeypatch.setenv("DPFLEET_LEDGER", server.address)
    monkeypatch.setenv("DPFLEET_TOKEN", ADMIN_TOKEN)
    run_json(capsys, "ledger", "tenant", "create", "acme")
    run_json(capsys, "ledger", "dataset", "create", "acme/mnist", "--epsilon", "3", "--delta", "1e-5")
    silos = Composition((SampledSkellam(0.004, 1.1, 500, 1.0, 2.0**-12),))
    with RemoteLedger(server.address, ADMIN_TOKEN) as ledger:
        in_silos = ledger.reserve("acme/mnist", "in-silos", silos)
        at_driver = ledger.reserve("acme/mnist", "at-driver", SampledGaussian(0.004, 1.1, 500))
        ledger.commit(in_silos.reservation_id, 100, 0)
    assert in_silos.noise_placement == "silos" and at_driver.noise_placement == "driver"
    jobs = {job["job_id"]: job for job in run_json(capsys, "ledger", "jobs")["jobs"]}
    assert (jobs["in-silos"]["noise_placement"], jobs["at-driver"]["noise_placement"]) == ("silos", "driver")
    assert Composition.from_dict(jobs["in-silos"]["planned_events"]) == silos
    status, table, _ = run(capsys, "ledger", "jobs")
    header, _, *rows = table.split("\n\n")[0].splitlines()  # the table, not the note under it
    assert status == 0 and "noise" in header.split()
    placements = {row.split()[2]: row.split() for row in rows}
    assert "silos" in placements["in-silos"] and "driver" in placements["at-driver"]
    status, history, _ = run(capsys, "ledger", "history")
    assert [line for line in history.splitlines() if "in-silos" in line and "noise=silos" in line]
    # The filter holds the Skellam job at its RDP: more than the same steps with the driver's Gaussian noise.
    (dataset,) = run_json(capsys, "ledger", "status")["datasets"]
    rule = AdmissionRule.from_dict(dataset["admission"])
    assert dataset["spent_epsilon_filter"] == pytest.approx(rule.epsilon(RdpTally.of(silos.split(100)[0])))
    assert dataset["spent_epsilon"] == get_accountant("rdp").epsilon(silos.split(100)[0], DELTA)
