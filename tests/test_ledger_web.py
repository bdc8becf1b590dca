"""The ledger's web side: the burn-down and the view behind the page, Prometheus metrics scraped from a real
`dpfleet ledger serve --metrics-port`, and the page in a real headless chromium (Selenium with Debian's driver)."""

import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from accounting.events import SampledGaussian
from accounting.ledger.callers import ADMIN, tenant_caller
from accounting.ledger.errors import BudgetExceeded, RateLimited
from accounting.ledger.service import view
from accounting.ledger.client import RemoteLedger
from accounting.ledger.service import BLOCK_GAUGES, DATASET_GAUGES, QUOTA_GAUGES, RPC_SECONDS, exposition
from accounting.ledger.service import start_server
from accounting.ledger.store import Ledger
from accounting.ledger.service import TOKEN_COOKIE
from accounting.ledger.verification import burn_down
from orchestrator.cli import main
from servers import self_signed_certificate, start_serve_process

ADMIN_TOKEN = "admin-token-for-tests-0123456789"
DELTA = 1e-5
STEP = SampledGaussian(0.004, 1.1, 1)
# status --json key of each gauge
GAUGE_FIGURES = {
    "dpfleet_ledger_budget_epsilon": "budget_epsilon",
    "dpfleet_ledger_delta": "delta",
    "dpfleet_ledger_spent_epsilon": "spent_epsilon_filter",
    "dpfleet_ledger_reserved_epsilon": "reserved_epsilon",
    "dpfleet_ledger_remaining_epsilon": "remaining_epsilon",
}
# Shown figure of each status key on the page
PAGE_FIGURES = ("privacy_unit", "budget_epsilon", "delta", "spent_epsilon_filter", "reserved_epsilon", "remaining_epsilon",
                "spent_epsilon", "released_jobs")


@pytest.fixture
def ledger(tmp_path):
    with Ledger(tmp_path / "ledger.db", caller=ADMIN) as opened:
        opened.create_tenant("acme")
        opened.create_tenant("globex")
        yield opened


def spend(ledger):
    """Reserve, commit, raise the budget, reserve again and release on acme/mnist; a dataset of globex too."""
    ledger.create_dataset("acme/mnist", 2.0, DELTA)
    first = ledger.reserve("acme/mnist", "job-1", STEP.with_steps(1000))
    ledger.commit(first.reservation_id, 300, 0)
    ledger.raise_budget("acme/mnist", 3.0)
    second = ledger.reserve("acme/mnist", "job-2", SampledGaussian(0.01, 1.0, 200))
    ledger.release(first.reservation_id)
    ledger.commit(second.reservation_id, 50, 0)
    ledger.create_dataset("globex/cifar", 1.0, DELTA)


# ------------------------------------------------------------ pure: burn-down, view, metrics


def test_burn_down_follows_each_change_and_ends_at_the_status(ledger):
    spend(ledger)
    points = burn_down(ledger.history("acme/mnist"))
    assert [point.action for point in points] == [
        "create_dataset", "reserve", "commit", "raise_budget", "reserve", "release", "commit",
    ]
    assert [point.budget_epsilon for point in points] == [2.0, 2.0, 2.0, 3.0, 3.0, 3.0, 3.0]
    created, reserved, committed = points[:3]
    assert (created.spent_epsilon_filter, created.reserved_epsilon, created.remaining_epsilon) == (0.0, 0.0, 2.0)
    assert reserved.spent_epsilon_filter == 0.0 and reserved.reserved_epsilon > 0.5
    assert 0 < committed.spent_epsilon_filter < reserved.reserved_epsilon
    assert committed.remaining_epsilon == reserved.remaining_epsilon  # a commit spends what was reserved
    assert points[5].remaining_epsilon > points[4].remaining_epsilon  # the release freed 700 steps
    for point in points:
        assert point.spent_epsilon_filter + point.reserved_epsilon + point.remaining_epsilon == pytest.approx(
            point.budget_epsilon, rel=1e-12
        )
    status = ledger.get_budget("acme/mnist")
    last = points[-1]
    assert (last.spent_epsilon_filter, last.reserved_epsilon, last.remaining_epsilon, last.budget_epsilon) == (
        status.spent_epsilon_filter, status.reserved_epsilon, status.remaining_epsilon, status.budget_epsilon
    )


def test_the_owners_burn_down_counts_another_tenants_jobs_on_a_shared_dataset_and_shows_only_figures(ledger):
    ledger.create_dataset("acme/shared", 5.0, DELTA)
    ledger.set_quota("acme/shared", "globex", 2.0)
    globex, acme = tenant_caller("globex"), tenant_caller("acme")
    theirs = ledger.reserve("acme/shared", "theirs", STEP.with_steps(400), caller=globex)
    ledger.commit(theirs.reservation_id, 400, 0, caller=globex)
    ledger.reserve("shared", "ours", STEP.with_steps(300), caller=acme)
    (shared,) = [dataset for dataset in view.ledger_view(ledger, acme)["datasets"] if dataset["name"] == "shared"]
    status = ledger.get_budget("shared", caller=acme)
    last = shared["burn_down"][-1]
    assert [last[key] for key in ("spent_epsilon_filter", "reserved_epsilon", "remaining_epsilon")] == [
        status.spent_epsilon_filter, status.reserved_epsilon, status.remaining_epsilon]
    assert status.spent_epsilon_filter > 0  # globex's commit, which acme's own history entries do not hold
    assert set(last) == {"at", "action", "budget_epsilon", "spent_epsilon_filter", "reserved_epsilon",
                         "remaining_epsilon"}


def test_burn_down_refuses_a_history_that_does_not_start_at_the_creation(ledger):
    spend(ledger)
    with pytest.raises(ValueError, match="from its creation"):
        burn_down(ledger.history("acme/mnist")[1:])


def test_a_tenants_view_holds_its_own_datasets_and_each_tables_that_plug_in(ledger, monkeypatch):
    spend(ledger)
    monkeypatch.setattr(
        view, "DATASET_TABLES",
        [*view.DATASET_TABLES, lambda ledger, caller, status: view.table("queue", ["job"], [[status.name]])],
    )
    acme = tenant_caller("acme")
    shown = view.ledger_view(ledger, acme)
    assert [dataset["name"] for dataset in shown["datasets"]] == ["mnist"]
    (mnist,) = shown["datasets"]
    assert mnist["status"] == ledger.get_budget("mnist", caller=acme).to_dict()
    assert [point["action"] for point in mnist["burn_down"]][-1] == "commit"
    blocks, quotas, jobs, queue, plugged = mnist["tables"]
    assert (blocks["title"], blocks["rows"], quotas["rows"], queue["rows"]) == ("blocks", [], [], [])
    assert [row[1:5] for row in jobs["rows"]] == [["job-1", "released", 300, 1000], ["job-2", "active", 50, 200]]
    assert plugged == {"title": "queue", "columns": ["job"], "rows": [["mnist"]]}
    (tenant,) = shown["tenants"]
    assert tenant["tenant"] == "acme" and tenant["tables"][0]["rows"][0][:2] == ["mnist", "example"]
    everything = view.ledger_view(ledger, ADMIN)
    assert [dataset["name"] for dataset in everything["datasets"]] == ["acme/mnist", "globex/cifar"]
    assert [tenant["tenant"] for tenant in everything["tenants"]] == ["acme", "globex"]


def test_metrics_text_holds_each_datasets_figures_by_tenant_and_bare_name(ledger):
    spend(ledger)
    statuses = ledger.list_datasets()
    families = {family.name: family for family in text_string_to_metric_families(exposition(statuses, None).decode())}
    assert set(families) == {name for name, _, _ in (*DATASET_GAUGES, *BLOCK_GAUGES, *QUOTA_GAUGES)} | {
        "dpfleet_ledger_jobs"}
    for status in statuses:
        bare = status.name.split("/")[1]
        for name, key in GAUGE_FIGURES.items():
            (sample,) = [s for s in families[name].samples if s.labels == {"tenant": status.tenant, "dataset": bare}]
            assert sample.value == getattr(status, key)
    jobs = {(s.labels["dataset"], s.labels["state"]): s.value for s in families["dpfleet_ledger_jobs"].samples}
    assert jobs == {("mnist", "active"): 1, ("mnist", "released"): 1, ("mnist", "queued"): 0,
                    ("cifar", "active"): 0, ("cifar", "released"): 0, ("cifar", "queued"): 0}


def test_blocks_quotas_and_the_queue_show_on_the_page_and_in_the_metrics_as_the_status_has_them(ledger):
    ledger.create_dataset("acme/daily", 10.0, DELTA)
    for day in ("day-1", "day-2"):
        ledger.add_block("acme/daily", day, 10.0, data={"partition": {"column": "day", "value": day}})
    ledger.set_quota("acme/daily", "globex", 0.5, block="day-1")
    held = ledger.reserve("acme/daily", "job-1", STEP.with_steps(100_000), blocks=["day-1"])
    ledger.commit(held.reservation_id, 300, 0)
    waiting = ledger.enqueue("acme/daily", "job-2", STEP.with_steps(100_000), priority=2, blocks=["day-1"])
    status = ledger.get_budget("acme/daily")
    (daily,) = view.ledger_view(ledger, ADMIN)["datasets"]
    blocks, quotas, jobs, queue = daily["tables"]
    assert blocks["rows"] == [
        [block.name, block.budget_epsilon, block.delta, block.spent_epsilon_filter, block.reserved_epsilon,
         block.remaining_epsilon] for block in status.blocks]
    assert [row[0] for row in blocks["rows"]] == ["day-1", "day-2"] and blocks["rows"][0][3] > 0
    (quota,) = status.quotas
    assert quotas["rows"] == [["globex", "day-1", 0.5, quota.spent_epsilon_filter, quota.reserved_epsilon,
                               quota.remaining_epsilon, "no"]]
    assert queue["title"] == f"queue ({status.scheduling.name})"
    assert [row[:5] for row in queue["rows"]] == [[1, waiting.queue_id, "job-2", 2, 100_000]] and queue["rows"][0][7]
    families = {family.name: family
                for family in text_string_to_metric_families(exposition([status], None).decode())}
    for name, _, figure in BLOCK_GAUGES:
        assert {s.labels["block"]: s.value for s in families[name].samples} == {
            block.name: figure(block) for block in status.blocks}
    for name, _, figure in QUOTA_GAUGES:
        (sample,) = families[name].samples
        assert sample.labels == {"tenant": "acme", "dataset": "daily", "block": "day-1", "quota_tenant": "globex"}
        assert sample.value == figure(quota)
    queued = [s.value for s in families["dpfleet_ledger_jobs"].samples if s.labels["state"] == "queued"]
    assert queued == [status.queued_jobs] == [1]


# ------------------------------------------------------------ a real server: metrics and page over HTTP


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """`dpfleet ledger serve --http-port 0 --metrics-port 0` with acme/mnist (spent and reserved) and globex/cifar."""
    directory = tmp_path_factory.mktemp("served")
    token_file = directory / "admin-token"
    token_file.write_text(ADMIN_TOKEN + "\n")
    process, address = start_serve_process(
        directory / "ledger.db", token_file, extra_args=("--http-port", "0", "--metrics-port", "0")
    )
    try:
        urls = dict(re.fullmatch(r"(page|metrics) on (http://127\.0\.0\.1:\d+/\S*)\n", process.stdout.readline()).groups()
                    for _ in range(2))
        with RemoteLedger(address, ADMIN_TOKEN) as admin:
            tokens = {tenant: admin.create_tenant(tenant).token for tenant in ("acme", "globex")}
        with RemoteLedger(address, tokens["acme"]) as acme:
            acme.create_dataset("mnist", 2.0, DELTA)
            first = acme.reserve("mnist", "job-1", STEP.with_steps(1000))
            acme.commit(first.reservation_id, 300, 0)
            acme.commit(first.reservation_id, 200, 1)
            acme.reserve("mnist", "job-2", STEP.with_steps(100))
            with pytest.raises(BudgetExceeded):
                acme.reserve("mnist", "job-3", STEP.with_steps(10**6))
        with RemoteLedger(address, tokens["globex"]) as globex:
            globex.create_dataset("cifar", 1.0, DELTA)
        yield {"address": address, "tokens": tokens, **urls}
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0, process.stderr.read()  # the HTTP side stops with the server
    finally:
        process.kill()
        process.wait()
        process.stdout.close()
        process.stderr.close()


def status_json(capsys, served, token):
    """`dpfleet ledger status --json` against the served ledger with `token`: {name: status}."""
    assert main(["ledger", "status", "--ledger", served["address"], "--token", token, "--json"]) == 0
    return {dataset["name"]: dataset for dataset in json.loads(capsys.readouterr().out)["datasets"]}


def get(url, token=None, data=None):
    """(status, headers, body) of an HTTP request, with `Authorization: Bearer token` when given."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    request = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.headers, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.headers, error.read().decode()


def scrape(served, token):
    status, _, body = get(served["metrics"], token)
    assert status == 200, body
    return {family.name: family for family in text_string_to_metric_families(body)}


def test_scraped_metrics_equal_the_status_and_time_every_rpc(served, capsys):
    families = scrape(served, ADMIN_TOKEN)
    statuses = status_json(capsys, served, ADMIN_TOKEN)
    for name, key in GAUGE_FIGURES.items():
        scraped = {f"{s.labels['tenant']}/{s.labels['dataset']}": s.value for s in families[name].samples}
        assert scraped == {dataset: status[key] for dataset, status in statuses.items()}, name
    counts = {
        (s.labels["method"], s.labels["code"]): s.value
        for s in families[RPC_SECONDS].samples if s.name == f"{RPC_SECONDS}_count"
    }
    assert counts[("Reserve", "OK")] == 2
    assert counts[("Reserve", "RESOURCE_EXHAUSTED")] == 1
    assert counts[("Commit", "OK")] == 2
    assert counts[("CreateDataset", "OK")] == 2
    buckets = [s for s in families[RPC_SECONDS].samples
               if s.name.endswith("_bucket") and s.labels["method"] == "Commit" and s.labels["le"] == "+Inf"]
    assert [bucket.value for bucket in buckets] == [2]


def test_metrics_need_a_token_and_show_a_tenant_only_its_own_datasets(served):
    for token in (None, "dpf_0123456789abcdef_not-a-token"):
        status, headers, body = get(served["metrics"], token)
        assert status == 401 and headers["WWW-Authenticate"].startswith("Bearer"), body
    families = scrape(served, served["tokens"]["globex"])
    assert {s.labels["dataset"] for s in families["dpfleet_ledger_budget_epsilon"].samples} == {"cifar"}
    assert RPC_SECONDS not in families


def test_page_and_its_data_refuse_without_a_token_and_sign_in_sets_a_cookie(served):
    status, headers, body = get(served["page"])
    assert status == 401 and 'id="sign-in"' in body and headers["WWW-Authenticate"].startswith("Bearer")
    assert get(served["page"] + "view.json")[0] == 401
    status, _, body = get(served["page"] + "view.json", served["tokens"]["globex"])
    assert status == 200 and [dataset["name"] for dataset in json.loads(body)["datasets"]] == ["cifar"]
    wrong = urllib.parse.urlencode({"token": "dpf_0123456789abcdef_not-a-token"}).encode()
    status, _, body = get(served["page"] + "sign-in", data=wrong)
    assert status == 401 and "not known to this ledger" in body
    opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor())
    signed_in = urllib.parse.urlencode({"token": served["tokens"]["globex"]}).encode()
    with opener.open(served["page"] + "sign-in", data=signed_in, timeout=30) as response:
        assert response.status == 200 and 'data-dataset' not in response.read().decode()  # drawn by page.js
    with opener.open(served["page"] + "view.json", timeout=30) as response:
        assert [dataset["name"] for dataset in json.load(response)["datasets"]] == ["cifar"]


def test_sign_in_guesses_spend_the_key_ids_allowance_that_grpc_spends_and_never_lock_out_its_token(served):
    token = served["tokens"]["acme"]
    key_id = token.split("_")[1]
    guess = urllib.parse.urlencode({"token": f"dpf_{key_id}_guessed"}).encode()
    answers = [get(served["page"] + "sign-in", data=guess) for _ in range(21)]  # the server's burst is 20
    assert [status for status, _, _ in answers] == [401] * 20 + [429]
    _, headers, body = answers[-1]
    assert f"key id {key_id}" in body and int(headers["Retry-After"]) >= 1
    with pytest.raises(RateLimited, match=f"key id {key_id}"):  # one allowance, whichever door is knocked on
        RemoteLedger(served["address"], f"dpf_{key_id}_guessed").list_datasets()
    assert get(served["page"] + "view.json", token)[0] == 200
    assert [status for status, _, _ in (get(served["page"] + "sign-in", data=urllib.parse.urlencode(
        {"token": f"dpf_{index:016x}_made-up"}).encode()) for index in range(3))] == [401] * 3


def test_a_busy_port_is_refused_by_name_and_a_ledger_that_cannot_answer_is_a_503(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port} .*choose another --metrics-port"):
            start_server(tmp_path / "ledger.db", "127.0.0.1", 0, ADMIN_TOKEN, http_port=0, metrics_port=port,
                         allow_key_beside_database=True)
    running = start_server(tmp_path / "ledger.db", "127.0.0.1", 0, ADMIN_TOKEN, metrics_port=0, allow_key_beside_database=True)  # the file is free
    try:
        metrics = f"http://127.0.0.1:{running.web.metrics_port}/metrics"
        assert running.web.http_port is None and get(metrics)[0] == 401
        running.ledger.close()  # a ledger that cannot answer: the scrape says why
        status, _, body = get(metrics, ADMIN_TOKEN)
        assert status == 503 and "is closed" in body
    finally:
        running.stop(grace_seconds=1.0)


class NoRedirect(urllib.request.HTTPRedirectHandler):
    """Hands a redirect back as an HTTPError, so that a test can read its headers."""

    def redirect_request(self, *args):
        return None


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_with_tls_the_page_and_metrics_are_https_and_the_cookie_is_secure(tmp_path):
    certificate, key = self_signed_certificate(tmp_path)
    running = start_server(
        tmp_path / "ledger.db", "127.0.0.1", 0, ADMIN_TOKEN, tls_cert=certificate, tls_key=key, http_port=0,
        metrics_port=0, allow_key_beside_database=True,
    )
    trusting = ssl.create_default_context(cafile=str(certificate))
    try:
        metrics = urllib.request.Request(
            f"https://127.0.0.1:{running.web.metrics_port}/metrics", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
        )
        with urllib.request.urlopen(metrics, context=trusting, timeout=30) as response:
            assert response.status == 200
        sign_in = urllib.request.Request(
            f"https://127.0.0.1:{running.web.http_port}/sign-in", urllib.parse.urlencode({"token": ADMIN_TOKEN}).encode()
        )
        no_redirect = urllib.request.build_opener(urllib.request.HTTPSHandler(context=trusting), NoRedirect())
        with pytest.raises(urllib.error.HTTPError) as redirected:
            no_redirect.open(sign_in, timeout=30)
        assert redirected.value.code == 303
        cookie = redirected.value.headers["Set-Cookie"]
        assert cookie.startswith(f"{TOKEN_COOKIE}=") and {"HttpOnly", "Secure", "SameSite=Strict"} <= {
            part.strip() for part in cookie.split(";")
        }
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
            urllib.request.urlopen(metrics, timeout=30)  # plain trust store: the self-signed server is refused
    finally:
        running.stop(grace_seconds=1.0)


@pytest.mark.parametrize("flag", ["--http-port", "--metrics-port"])
def test_serve_refuses_a_port_out_of_range(tmp_path, capsys, flag):
    assert main(["ledger", "serve", "--db", str(tmp_path / "ledger.db"), flag, "65536"]) == 2
    assert f"{flag} must be in [0, 65535] (got 65536)" in capsys.readouterr().err


# ------------------------------------------------------------ the page in a real browser


def chromium_and_driver() -> tuple[str, str]:
    """Debian's chromium and chromedriver (same version), installed with apt-get when missing; else skip, saying why."""
    found = shutil.which("chromium"), shutil.which("chromedriver")
    if all(found):
        return found
    if not shutil.which("apt-get") or os.geteuid() != 0:
        pytest.skip("chromium and chromedriver are missing, and apt-get cannot install them here (not root or no apt)")
    environment = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "chromium", "chromium-driver"]):
        try:
            subprocess.run(command, env=environment, capture_output=True, text=True, timeout=900, check=True)
        except subprocess.TimeoutExpired:
            pytest.skip(f"installing chromium failed: {' '.join(command)} took over 900 s")
        except subprocess.CalledProcessError as error:
            pytest.skip(f"installing chromium failed: {' '.join(command)}: {error.stderr.strip()[-500:]}")
    return shutil.which("chromium"), shutil.which("chromedriver")


@pytest.fixture(scope="module")
def browser():
    """A headless chromium driven by Selenium, with its console log kept."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    chromium, chromedriver = chromium_and_driver()
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,1600"):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(chromedriver))
    driver.implicitly_wait(0)
    yield driver
    driver.quit()


def screenshot_folder(tmp_path) -> Path:
    """Where the page's screenshots go: $DPFLEET_SCREENSHOTS (docs/ to refresh the documentation's), else tmp_path."""
    return Path(os.environ.get("DPFLEET_SCREENSHOTS") or tmp_path)


def wait_for_chart(driver, dataset):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    selector = f'section[data-dataset="{dataset}"] .chart .main-svg'
    WebDriverWait(driver, 30).until(lambda d: d.find_elements(By.CSS_SELECTOR, selector))


def shown_figures(driver, dataset):
    """{status key: (exact value, text shown)} of a dataset's figures on the page; a number's exact value is its
    data-value, a word's its text."""
    from selenium.webdriver.common.by import By

    cells = driver.find_elements(By.CSS_SELECTOR, f'section[data-dataset="{dataset}"] [data-figure]')
    return {
        cell.get_attribute("data-figure"): (
            float(cell.get_attribute("data-value")) if cell.get_attribute("data-value") is not None else cell.text,
            cell.text,
        )
        for cell in cells
    }


def test_browser_is_refused_without_a_token_then_signs_in_and_shows_the_status(served, browser, capsys, tmp_path):
    from selenium.webdriver.common.by import By

    folder = screenshot_folder(tmp_path)
    browser.delete_all_cookies()
    browser.get(served["page"])
    assert "no token" in browser.find_element(By.ID, "refusal").text
    assert not browser.find_elements(By.CSS_SELECTOR, "section.dataset")
    browser.save_screenshot(str(folder / "ledger-sign-in.png"))
    browser.get_log("browser")  # drops the refused load's own 401
    browser.find_element(By.ID, "token").send_keys(served["tokens"]["acme"])
    browser.find_element(By.CSS_SELECTOR, "#sign-in button").click()
    wait_for_chart(browser, "mnist")
    (status,) = status_json(capsys, served, served["tokens"]["acme"]).values()
    figures = shown_figures(browser, "mnist")
    assert set(figures) == set(PAGE_FIGURES)
    assert figures.pop("privacy_unit") == ("example", "example")
    for key, (exact, text) in figures.items():
        assert exact == status[key], key
        assert float(text) == pytest.approx(status[key], rel=1e-5), key
    assert [s.get_attribute("data-dataset") for s in browser.find_elements(By.CSS_SELECTOR, "section.dataset")] == [
        "mnist"
    ]
    jobs = browser.find_elements(By.CSS_SELECTOR, 'section[data-dataset="mnist"] [data-table="jobs"] tbody tr')
    assert [row.find_elements(By.TAG_NAME, "td")[1].text for row in jobs] == ["job-1", "job-2"]
    browser.save_screenshot(str(folder / "ledger-page.png"))
    errors = [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]
    assert errors == []


def test_browser_with_the_admin_token_as_a_bearer_header_sees_every_tenant(served, browser, capsys):
    from selenium.webdriver.common.by import By

    browser.delete_all_cookies()
    browser.execute_cdp_cmd("Network.enable", {})
    browser.execute_cdp_cmd("Network.setExtraHTTPHeaders", {"headers": {"Authorization": f"Bearer {ADMIN_TOKEN}"}})
    try:
        browser.get(served["page"])
        wait_for_chart(browser, "globex/cifar")
        statuses = status_json(capsys, served, ADMIN_TOKEN)
        shown = [s.get_attribute("data-dataset") for s in browser.find_elements(By.CSS_SELECTOR, "section.dataset")]
        assert shown == list(statuses) == ["acme/mnist", "globex/cifar"]
        for dataset, status in statuses.items():
            assert {key: exact for key, (exact, _) in shown_figures(browser, dataset).items()} == {
                key: status[key] for key in PAGE_FIGURES
            }
    finally:
        browser.execute_cdp_cmd("Network.setExtraHTTPHeaders", {"headers": {}})
