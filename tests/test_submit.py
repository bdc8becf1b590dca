"""Running on a cluster: `dpfleet submit`, plain `ray job submit` and `ray submit`'s script against a real Ray head
on loopback with token authentication, charging a real ledger server; and deploy/ checked against Ray's own
cluster-config validator and the keys each Kubernetes kind needs.

The head is started with `ray start --block` in a process group of its own, on ports and a temp dir of its own,
and stopped by signalling that group only: other Ray instances on the machine are left alone.
"""

import contextlib
import copy
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
import zipfile
from pathlib import Path

import jsonschema
import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config
from ray._private.runtime_env.packaging import create_package
from ray._raylet import AuthenticationTokenLoader
from ray.job_submission import JobStatus, JobSubmissionClient

from accounting.ledger.client import RemoteLedger
from orchestrator.cli import main
from orchestrator.config import load_config
from orchestrator.cli.submit import CONFIG_VARIABLE, UPLOAD_EXCLUDES, job_entrypoint
from servers import DPFLEET, REPOSITORY, TINY_JOB, free_port, start_serve_process, tiny_job_epsilon

DEPLOY = REPOSITORY / "deploy"
RAY = str(Path(sys.executable).with_name("ray"))
IMAGE = "ghcr.io/your-org/dpfleet:0.1.0"
ADMIN_TOKEN = "admin-token-for-submit-tests-0123"
STEPS = 10
TINY = TINY_JOB + f"cpus_per_worker = 1\nsteps = {STEPS}\n"
DATASETS = ("digits-submit", "digits-plain")


def clean_env(**extra):
    """This process's environment without any Ray or ledger settings, plus `extra`."""
    env = {name: value for name, value in os.environ.items()
           if not name.startswith("RAY_") and name not in ("DPFLEET_LEDGER", "DPFLEET_TOKEN")}
    env.update({name: str(value) for name, value in extra.items()})
    return env


def reported_epsilon(output):
    match = re.search(r"^epsilon \(pld\)\s+(\S+)\s*$", output, re.MULTILINE)
    assert match, f"no epsilon row in the summary: {output[-3000:]}"
    return float(match.group(1))


def output_of(result):
    return f"exit {result.returncode}\nstdout: {result.stdout[-4000:]}\nstderr: {result.stderr[-4000:]}"


def wait_for_job(client, job_id, timeout=120):
    deadline = time.monotonic() + timeout
    while (status := client.get_job_status(job_id)) not in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED):
        assert time.monotonic() < deadline, f"job {job_id} still {status} after {timeout} s"
        time.sleep(0.5)
    return status


def first_job_runs(url, token, head, log_path, timeout=180):
    """Block until the head accepts and runs a trivial job (its job agent registers a while after the dashboard)."""
    deadline = time.monotonic() + timeout
    while True:
        if head.poll() is not None:
            pytest.fail(f"ray start exited with {head.returncode}: {log_path.read_text()[-3000:]}")
        try:
            with ray_address_unset():
                client = JobSubmissionClient(url, headers={"Authorization": f"Bearer {token}"})
            job_id = client.submit_job(entrypoint="true")
            break
        except (ConnectionError, RuntimeError) as error:
            if time.monotonic() > deadline:
                pytest.fail(f"the Ray head at {url} took no job within {timeout} s: {error}")
            time.sleep(1.0)
    assert wait_for_job(client, job_id) == JobStatus.SUCCEEDED
    return client


@contextlib.contextmanager
def ray_address_unset():
    """Ray's job client prefers RAY_ADDRESS to the address it is given; keep this process's out of the way."""
    saved = {name: os.environ.pop(name) for name in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS") if name in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


@pytest.fixture(scope="module")
def ray_head():
    """A Ray head on 127.0.0.1 with token auth, its own ports and temp dir, in its own process group."""
    # Short, because Ray's unix sockets live under it.
    temp = Path(tempfile.mkdtemp(prefix="dpfray-", dir="/tmp"))
    token = secrets.token_hex(16)
    gcs_port, dashboard_port, client_port, agent_port = (free_port() for _ in range(4))
    token_home = temp / "home-with-token"
    (token_home / ".ray").mkdir(parents=True)
    (token_home / ".ray" / "auth_token").write_text(token)
    # The cluster's jobs run `python` from its PATH: this interpreter, as on a node of the dpfleet image.
    env = clean_env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token, DPFLEET_HOME=temp / "dpfleet-home",
                    PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    log_path = temp / "ray-start.log"
    with open(log_path, "w") as log:
        head = subprocess.Popen(
            [RAY, "start", "--head", "--block", "--node-ip-address", "127.0.0.1", "--port", str(gcs_port),
             "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dashboard_port),
             "--ray-client-server-port", str(client_port), "--dashboard-agent-listen-port", str(agent_port),
             "--num-cpus", "2", "--object-store-memory", str(200 * 1024**2), "--temp-dir", str(temp / "ray"),
             "--disable-usage-stats"],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
    url = f"http://127.0.0.1:{dashboard_port}"
    try:
        client = first_job_runs(url, token, head, log_path)
        yield {"url": url, "token": token, "gcs": f"127.0.0.1:{gcs_port}", "token_home": token_home,
               "client": client}
    finally:
        # `ray start --block` stops its node on SIGTERM; SIGKILL to the group then takes whatever lingers.
        head.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            head.wait(timeout=60)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(head.pid, signal.SIGKILL)
        head.wait(timeout=30)
        shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture(scope="module")
def ledger(tmp_path_factory):
    """A real `dpfleet ledger serve` with tenant 'acme' owning one dataset per way of submitting."""
    directory = tmp_path_factory.mktemp("ledger")
    token_file = directory / "admin-token"
    token_file.write_text(ADMIN_TOKEN)
    process, address = start_serve_process(directory / "ledger.db", token_file)
    try:
        with RemoteLedger(address, ADMIN_TOKEN) as admin:
            token = admin.create_tenant("acme").token
        with RemoteLedger(address, token) as acme:
            for dataset in DATASETS:
                acme.create_dataset(dataset, 50.0, 1e-5)
        yield {"address": address, "token": token}
    finally:
        process.terminate()
        process.wait(timeout=30)


@pytest.fixture
def ray_token(monkeypatch):
    """Run `dpfleet submit` in this process with a HOME and RAY_AUTH_TOKEN of the test's choosing.

    Ray's token loader caches what it found, so its cache is reset on the way in and out.
    """
    loader = AuthenticationTokenLoader.instance()

    def use(home, token):
        monkeypatch.setenv("HOME", str(home))
        monkeypatch.setenv("RAY_AUTH_TOKEN", token)
        for name in ("RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS", "RAY_API_SERVER_ADDRESS"):
            monkeypatch.delenv(name, raising=False)
        loader.reset_cache()

    yield use
    monkeypatch.undo()
    loader.reset_cache()


def error_lines(capsys):
    return capsys.readouterr().err.strip().splitlines()


def assert_charged_once(ledger, dataset, run_name):
    with RemoteLedger(ledger["address"], ledger["token"]) as acme:
        jobs = acme.list_jobs(dataset=dataset)
        spent = acme.get_budget(dataset).spent_epsilon
    assert len(jobs) == 1, jobs
    (job,) = jobs
    assert job.job_id.startswith(f"{run_name}-") and job.state == "released" and job.committed_steps == STEPS
    assert spent == pytest.approx(tiny_job_epsilon(STEPS), rel=1e-9)


def write_tiny(directory, run_name):
    path = directory / "tiny.toml"
    path.write_text(TINY + f'run_dir = "runs/{run_name}"\n')
    return path


def test_dpfleet_submit_trains_on_the_cluster_and_the_ledger_records_the_charge(ray_head, ledger, tmp_path):
    config = write_tiny(tmp_path, "submit-dpfleet")
    result = subprocess.run(
        [*DPFLEET, "submit", "--address", ray_head["url"], "--config", str(config), "--workers", "2",
         "--ledger", ledger["address"], "--token", ledger["token"], "--dataset-name", "digits-submit"],
        cwd=tmp_path, env=clean_env(HOME=ray_head["token_home"]), capture_output=True, text=True, timeout=400,
    )
    assert result.returncode == 0, output_of(result)
    assert re.search(r"job raysubmit_\w+ succeeded", result.stderr), output_of(result)
    assert reported_epsilon(result.stdout) == pytest.approx(tiny_job_epsilon(STEPS), rel=1e-3)
    assert_charged_once(ledger, "digits-submit", "submit-dpfleet")


def test_plain_ray_job_submit_of_the_same_config_succeeds(ray_head, ledger, tmp_path):
    config = write_tiny(tmp_path, "submit-plain")
    # docs/cluster.md's command, run from the checkout; the head is this machine, so the config may stay outside it.
    result = subprocess.run(
        [RAY, "job", "submit", "--address", ray_head["url"], "--working-dir", ".",
         "--runtime-env-json", json.dumps({"env_vars": {"DPFLEET_TOKEN": ledger["token"]}}),
         "--", "python", "-m", "orchestrator.cli", "train", "--config", str(config), "--no-progress",
         "--ledger", ledger["address"], "--dataset-name", "digits-plain"],
        cwd=REPOSITORY, env=clean_env(HOME=ray_head["token_home"], RAY_AUTH_MODE="token"),
        capture_output=True, text=True, timeout=400,
    )
    assert result.returncode == 0, output_of(result)
    assert reported_epsilon(result.stdout) == pytest.approx(tiny_job_epsilon(STEPS), rel=1e-3)
    assert_charged_once(ledger, "digits-plain", "submit-plain")


def test_a_submission_without_the_right_ray_token_is_refused_and_runs_nothing(ray_head, tmp_path, ray_token, capsys):
    config = write_tiny(tmp_path, "refused")
    jobs_before = len(ray_head["client"].list_jobs())
    empty_home = tmp_path / "home"
    empty_home.mkdir()

    missing = subprocess.run([*DPFLEET, "submit", "--address", ray_head["url"], "--config", str(config)],
                             env=clean_env(HOME=empty_home), capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2, output_of(missing)
    assert missing.stderr.strip().splitlines()[-1].startswith(
        f"dpfleet submit: error: the Ray cluster at {ray_head['url']} requires a Ray token and none was found")
    assert "Traceback" not in missing.stderr

    ray_token(empty_home, "not-the-token")
    assert main(["submit", "--address", ray_head["url"], "--config", str(config)]) == 2
    assert "rejected the Ray token" in error_lines(capsys)[-1]

    # Without RAY_AUTH_MODE, Ray's own client sends no token at all: the cluster itself must refuse.
    plain = subprocess.run([RAY, "job", "submit", "--address", ray_head["url"], "--", "echo", "ran"],
                           env=clean_env(HOME=empty_home), capture_output=True, text=True, timeout=120)
    assert plain.returncode != 0 and "Missing authentication token" in plain.stderr + plain.stdout, output_of(plain)

    assert len(ray_head["client"].list_jobs()) == jobs_before


def test_a_job_that_fails_on_the_cluster_makes_submit_exit_1_with_its_status(ray_head, ledger, tmp_path):
    config = write_tiny(tmp_path, "submit-failing")
    result = subprocess.run(
        [*DPFLEET, "submit", "--address", ray_head["url"], "--config", str(config),
         "--ledger", ledger["address"], "--token", ledger["token"], "--dataset-name", "no-such-dataset"],
        env=clean_env(HOME=ray_head["token_home"]), capture_output=True, text=True, timeout=400,
    )
    assert result.returncode == 1, output_of(result)
    assert "no-such-dataset" in result.stdout, output_of(result)
    assert re.fullmatch(r"dpfleet submit: job raysubmit_\w+ FAILED: Job entrypoint command failed with exit code \d+.*",
                        result.stderr.strip().splitlines()[-1]), output_of(result)


def test_an_unreachable_cluster_and_a_bad_config_are_one_line_errors(tmp_path, ray_token, capsys):
    ray_token(tmp_path, "some-token")
    config = write_tiny(tmp_path, "nowhere")
    address = f"http://127.0.0.1:{free_port()}"
    assert main(["submit", "--address", address, "--config", str(config)]) == 2
    assert error_lines(capsys)[-1].startswith(f"dpfleet submit: error: cannot reach the Ray Jobs API at {address}")

    bad = tmp_path / "bad.toml"
    bad.write_text(TINY + "noise_multiplyer = 2.0\n")
    assert main(["submit", "--address", address, "--config", str(bad)]) == 2
    (line,) = error_lines(capsys)
    assert line.startswith("dpfleet submit: error: unknown config key(s): noise_multiplyer")


def test_the_ray_submit_script_runs_train_from_the_checkout_joined_to_the_cluster(tmp_path):
    checkout = tmp_path / "checkout"
    (checkout / "orchestrator" / "cli").mkdir(parents=True)
    (checkout / "orchestrator" / "__init__.py").write_text("")
    (checkout / "orchestrator" / "cli" / "__init__.py").write_text("")
    # A stand-in for dpfleet's command line: reports where and how it was run.
    (checkout / "orchestrator" / "cli" / "__main__.py").write_text(
        "import json, os, sys\n"
        "print(json.dumps({'cwd': os.getcwd(), 'argv': sys.argv[1:], 'ray': os.environ.get('RAY_ADDRESS')}))\n"
        "sys.exit(7)\n"
    )
    script = [sys.executable, str(DEPLOY / "submit_train.py")]

    joined = subprocess.run([*script, "--config", "examples/mnist.toml", "--workers", "4", "--no-progress"],
                            env=clean_env(DPFLEET_SOURCE=checkout), capture_output=True, text=True, timeout=60)
    assert joined.returncode == 7, output_of(joined)
    assert json.loads(joined.stdout) == {
        "cwd": str(checkout), "ray": "auto",
        "argv": ["train", "--config", "examples/mnist.toml", "--workers", "4", "--no-progress"],
    }

    given = subprocess.run([*script, "--source", str(checkout), "--config", "job.toml"],
                           env=clean_env(RAY_ADDRESS="10.0.0.1:6379"), capture_output=True, text=True, timeout=60)
    assert json.loads(given.stdout)["ray"] == "10.0.0.1:6379"

    missing = subprocess.run([*script, "--source", str(tmp_path / "nowhere"), "--config", "job.toml"],
                             env=clean_env(), capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "holds no dpfleet checkout" in missing.stderr, output_of(missing)


def run_entrypoint(tmp_path, entrypoint, config_text):
    """Run a job's entrypoint as the cluster would, with a stand-in for its python that prints its arguments and
    the config file it was given: (the arguments, the file's text)."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir(exist_ok=True)
    (fake_bin / "python").write_text('#!/bin/sh\nprintf "%s\\n" "$@"\necho ---\ncat "$5"\n')
    (fake_bin / "python").chmod(0o755)
    result = subprocess.run(
        entrypoint, shell=True, executable="/bin/sh",
        env={"PATH": f"{fake_bin}{os.pathsep}/usr/bin:/bin", CONFIG_VARIABLE: config_text,
             "DPFLEET_LEDGER": "ledger.example:50051"},
        capture_output=True, text=True, timeout=30,
    )
    assert result.returncode == 0, output_of(result)
    arguments, config_file = result.stdout.split("---\n")
    return arguments.splitlines(), config_file


def test_the_entrypoint_hands_the_config_to_train_byte_for_byte(tmp_path):
    config_text = 'run_dir = "runs/100% of $HOME, `date` and \\"quotes\\""\nsteps = 3\n'
    arguments, config_file = run_entrypoint(tmp_path, job_entrypoint("ledger.example:50051", "3", "it's digits"),
                                            config_text)
    assert arguments[:4] == ["-m", "orchestrator.cli", "train", "--config"]
    assert arguments[5:] == ["--no-progress", "--ledger", "ledger.example:50051", "--workers", "3",
                             "--dataset-name", "it's digits"]
    assert config_file == config_text


def test_submit_overwrite_reaches_the_train_it_submits(tmp_path, monkeypatch):
    """`dpfleet submit --overwrite` submits `dpfleet train ... --overwrite`, which train's own parser reads; without
    it, none (a finished run_dir on the cluster is then refused, as `dpfleet train` refuses it)."""
    from orchestrator.cli import build_parser, submit

    entrypoints = []

    class JobsAPI:
        def submit_job(self, entrypoint, runtime_env):
            entrypoints.append(entrypoint)
            return f"job-{len(entrypoints)}"

    monkeypatch.setattr(submit, "_client", lambda address, headers: JobsAPI())
    monkeypatch.setattr(submit, "ray_auth_headers", lambda: {})
    config = tmp_path / "job.toml"
    config.write_text(TINY)
    for flags in ([], ["--overwrite"]):
        assert main(["submit", "--address", "http://127.0.0.1:8265", "--config", str(config), "--ledger",
                     "ledger.example:50051", "--token", "t", "--no-wait", *flags]) == 0
    for entrypoint, overwrite in zip(entrypoints, (False, True), strict=True):
        arguments, _ = run_entrypoint(tmp_path, entrypoint, TINY)
        train = build_parser(("train",)).parse_args(arguments[2:])
        assert train.command == "train" and train.overwrite is overwrite


def test_the_working_dir_upload_holds_the_code_and_leaves_environments_and_results_behind(tmp_path, monkeypatch):
    # Without help from .gitignore: the excludes alone must keep the upload small.
    monkeypatch.setenv("RAY_RUNTIME_ENV_IGNORE_GITIGNORE", "1")
    package = tmp_path / "working_dir.zip"
    create_package(str(REPOSITORY), package, include_gitignore=False, excludes=UPLOAD_EXCLUDES)
    names = zipfile.ZipFile(package).namelist()
    assert {"orchestrator/cli/__init__.py", "workers/__init__.py", "accounting/ledger/service/__init__.py"} <= set(names)
    assert not [name for name in names if re.match(r"(\.venv|\.git|runs|bench/results|data)/|.*__pycache__/", name)]
    assert package.stat().st_size < 5 * 1024**2


def load_yaml_documents(name):
    return [document for document in yaml.safe_load_all((DEPLOY / name).read_text()) if document is not None]


def test_every_yaml_in_deploy_parses_into_documents_of_a_known_shape():
    names = sorted(path.name for path in DEPLOY.glob("*.yaml"))
    assert names == ["cluster.yaml", "ledger.yaml", "rayjob.yaml"]
    for name in names:
        documents = load_yaml_documents(name)
        assert documents, name
        for document in documents:
            assert isinstance(document, dict) and (
                {"apiVersion", "kind", "metadata"} <= document.keys() or "cluster_name" in document
            ), (name, document)


def start_commands(config, key):
    return [command for command in config[key] if "ray start" in command]


def test_cluster_yaml_passes_rays_own_validation_with_a_gpu_worker_and_token_auth():
    config = yaml.safe_load((DEPLOY / "cluster.yaml").read_text())
    validate_config(prepare_config(copy.deepcopy(config)))
    with pytest.raises(jsonschema.ValidationError):
        validate_config(prepare_config({**copy.deepcopy(config), "head_node_typo": "head"}))

    assert config["cluster_name"] and config["provider"]["type"] == "aws" and config["auth"]["ssh_user"]
    node_types = config["available_node_types"]
    assert config["head_node_type"] in node_types
    gpu_workers = [node for name, node in node_types.items()
                   if name != config["head_node_type"] and node["resources"].get("GPU", 0) >= 1]
    assert gpu_workers and all(node["max_workers"] >= 1 for node in gpu_workers)
    assert node_types[config["head_node_type"]]["resources"] == {"CPU": 0}
    assert config["docker"]["image"] == IMAGE

    assert config["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        (command,) = start_commands(config, key)
        assert "RAY_AUTH_MODE=token" in command.split(), (key, command)
    (head_start,) = start_commands(config, "head_start_ray_commands")
    assert re.search(r"\bDPFLEET_LEDGER=\S+:\d+\b", head_start) and "--num-cpus=0" in head_start
    source_mount = next(remote for remote, local in config["file_mounts"].items() if local == ".")
    assert f"pip install --quiet {source_mount}" in config["setup_commands"]


def env_of(container):
    return {variable["name"]: variable for variable in container.get("env", [])}


def assert_ray_token_auth(container):
    env = env_of(container)
    assert env["RAY_AUTH_MODE"]["value"] == "token", container["name"]
    assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "dpfleet-ray-token", "key": "auth_token"}


def test_rayjob_yaml_runs_dpfleet_train_on_gpu_workers_with_secrets_for_the_ledger_and_ray(tmp_path):
    documents = {document["kind"]: document for document in load_yaml_documents("rayjob.yaml")}
    assert documents.keys() == {"ConfigMap", "RayJob"}
    job = documents["RayJob"]
    assert job["apiVersion"] == "ray.io/v1"
    spec = job["spec"]
    entrypoint = shlex.split(spec["entrypoint"])
    assert entrypoint[:2] == ["dpfleet", "train"]

    cluster = spec["rayClusterSpec"]
    head = cluster["headGroupSpec"]["template"]["spec"]
    (head_container,) = head["containers"]
    mount = next(volume for volume in head_container["volumeMounts"] if volume["name"] == "job-config")
    config_map = next(volume for volume in head["volumes"] if volume["name"] == "job-config")["configMap"]["name"]
    assert config_map == documents["ConfigMap"]["metadata"]["name"]
    config_path = Path(entrypoint[entrypoint.index("--config") + 1])
    assert config_path.parent == Path(mount["mountPath"])
    config_file = tmp_path / config_path.name
    config_file.write_text(documents["ConfigMap"]["data"][config_path.name])
    config = load_config(str(config_file), {})

    worker_groups = cluster["workerGroupSpecs"]
    gpus = 0
    for group in worker_groups:
        (container,) = group["template"]["spec"]["containers"]
        limits = container["resources"]["limits"]
        assert int(limits["nvidia.com/gpu"]) >= 1
        gpus += group["replicas"] * int(limits["nvidia.com/gpu"])
        assert_ray_token_auth(container)
        assert container["image"] == IMAGE
    assert config.gpus_per_worker == 1 and config.workers == gpus

    head_env = env_of(head_container)
    assert head_env["DPFLEET_LEDGER"]["valueFrom"]["secretKeyRef"] == {"name": "dpfleet-ledger-client", "key": "address"}
    assert head_env["DPFLEET_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "dpfleet-ledger-client", "key": "token"}
    assert_ray_token_auth(head_container)
    (submitter,) = spec["submitterPodTemplate"]["spec"]["containers"]
    assert_ray_token_auth(submitter)
    assert head_container["image"] == submitter["image"] == IMAGE


def test_ledger_yaml_serves_a_persistent_ledger_with_grpc_health_probes_and_a_secret_admin_token():
    """Also its page and metrics on ports of their own, which the pod's Prometheus annotations name."""
    documents = {document["kind"]: document for document in load_yaml_documents("ledger.yaml")}
    assert documents.keys() == {"Deployment", "Service", "PersistentVolumeClaim"}
    deployment, service, claim = documents["Deployment"], documents["Service"], documents["PersistentVolumeClaim"]
    assert deployment["apiVersion"] == "apps/v1" and deployment["spec"]["replicas"] == 1
    pod = deployment["spec"]["template"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    (container,) = pod["spec"]["containers"]
    assert container["image"] == IMAGE
    command = container["command"]
    assert command[:3] == ["dpfleet", "ledger", "serve"]
    flags = ("--db", "--host", "--port", "--admin-token-file", "--http-port", "--metrics-port")
    flag = {name: command[command.index(name) + 1] for name in flags}
    assert flag["--host"] == "0.0.0.0"
    port = int(flag["--port"])

    container_ports = {entry["name"]: entry["containerPort"] for entry in container["ports"]}
    assert container_ports == {"grpc": port, "http": int(flag["--http-port"]), "metrics": int(flag["--metrics-port"])}
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/path"] == "/metrics"
    assert int(annotations["prometheus.io/port"]) == container_ports["metrics"]
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == port, probe

    mounts = {mount["name"]: mount["mountPath"] for mount in container["volumeMounts"]}
    volumes = {volume["name"]: volume for volume in pod["spec"]["volumes"]}
    data = next(name for name, volume in volumes.items() if "persistentVolumeClaim" in volume)
    assert volumes[data]["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    assert Path(flag["--db"]).parent == Path(mounts[data])
    secret = next(name for name, volume in volumes.items() if "secret" in volume)
    assert volumes[secret]["secret"]["secretName"] == "dpfleet-ledger-admin"
    assert Path(flag["--admin-token-file"]).parent == Path(mounts[secret])
    history_key = command[command.index("--history-key") + 1]
    assert volumes["history-key"]["secret"]["secretName"] == "dpfleet-ledger-history-key"
    assert Path(history_key).parent == Path(mounts["history-key"]) != Path(mounts[data])  # never beside the file

    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert {entry["targetPort"] for entry in service["spec"]["ports"]} == set(container_ports)
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"] and claim["spec"]["resources"]["requests"]["storage"]


def dockerfile_instructions():
    text = re.sub(r"\\\n", " ", (DEPLOY / "Dockerfile").read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def test_the_dockerfile_installs_dpfleet_with_the_pinned_torch_on_cuda_as_a_non_root_user():
    instructions = dockerfile_instructions()
    keywords = [keyword for keyword, _ in instructions]
    assert set(keywords) <= {"ARG", "FROM", "ENV", "RUN", "USER", "WORKDIR", "COPY", "EXPOSE", "CMD"}
    arguments = dict(argument.split("=", 1) for keyword, argument in instructions if keyword == "ARG")
    base = next(argument for keyword, argument in instructions if keyword == "FROM")
    base = re.sub(r"\$\{(\w+)\}", lambda match: arguments[match.group(1)], base)
    assert re.fullmatch(r"nvidia/cuda:\d+\.\d+\.\d+-\w+-ubuntu\d+\.\d+", base), base

    (user,) = [argument for keyword, argument in instructions if keyword == "USER"]
    assert user not in ("root", "0")
    runs = " && ".join(argument for keyword, argument in instructions if keyword == "RUN")
    assert f"useradd --create-home --uid 1000 --shell /bin/bash {user}" in runs
    assert f"HOME=/home/{user}" in " ".join(argument for keyword, argument in instructions if keyword == "ENV")

    pins = tomllib.loads((REPOSITORY / "pyproject.toml").read_text())["project"]["dependencies"]
    for package in ("torch", "torchvision"):
        (pin,) = [pin for pin in pins if pin.startswith(f"{package}==")]
        assert pin in runs.split(), pin
    copies = [index for index, keyword in enumerate(keywords) if keyword == "COPY"]
    copied = {word for index in copies for word in instructions[index][1].split()[:-1] if not word.startswith("--")}
    assert {"pyproject.toml", "README.md", "accounting", "orchestrator", "workers"} <= copied
    # The checkout itself, with or without extras (`pip install .` or `pip install ".[postgresql]"`).
    (install,) = [index for index, (keyword, argument) in enumerate(instructions)
                  if keyword == "RUN" and re.match(r'pip install "?\.(\[[\w,]+\])?"? ', argument)]
    assert keywords.index("USER") < max(copies) < install
    assert "ENTRYPOINT" not in keywords
