"""The files of deploy/: compose stack, Dockerfile, training config, shell
scripts, and the etcd TLS/auth scripts run against a real etcd."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml
from conftest import SHARED_DIR
from k8s_manifests import (
    RDZV_SECRET_PATH,
    REPO_ROOT,
    container,
    find,
    pod_specs,
    rdzv_parameters,
    render,
)
from secure_etcd import PASSWORD, secure_etcd

from elastic_train.config.load import load_config
from elastic_train.etcd.server import find_etcd_binary

DEPLOY = REPO_ROOT / "deploy"
COMPOSE = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
TRAINERS = {name: s for name, s in COMPOSE["services"].items() if re.fullmatch(r"node\d+", name)}


def _bind_mounts(service: dict) -> dict[str, str]:
    """``{container path: host path}`` of a service's bind mounts."""
    mounts = (v.split(":") for v in service["volumes"] if v.startswith("./"))
    return {target: source for source, target, *_ in mounts}


def test_compose_file_matches_the_compose_specification() -> None:
    schema = json.loads((SHARED_DIR / "schemas" / "compose-spec.json").read_text())
    validator = jsonschema.Draft7Validator(schema)
    errors = [f"{'/'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(COMPOSE)]
    assert not errors


def test_compose_trainers_form_one_elastic_job_on_a_shared_volume() -> None:
    assert len(TRAINERS) >= 2
    nodes = {s["environment"]["ELASTIC_TRAIN_NODE"] for s in TRAINERS.values()}
    assert len(nodes) == len(TRAINERS)
    for service in TRAINERS.values():
        args = service["command"]
        assert f"--nnodes=1:{len(TRAINERS)}" in args
        assert args[-3:] == ["elastic_train/main.py", "--config", "/config/train.toml"]
        assert "checkpoints:/checkpoints" in service["volumes"]
        assert "./config/train.toml:/config/train.toml:ro" in service["volumes"]
        assert service["depends_on"]["etcd"]["condition"] == "service_healthy"
        assert service["read_only"] and service["cap_drop"] == ["ALL"]
    # The rendezvous endpoint is the etcd service's client port, v2 off.
    (endpoint,) = {a.split("=", 1)[1] for a in args if a.startswith("--rdzv-endpoint=")}
    host, port = endpoint.split(":")
    etcd = COMPOSE["services"][host]["command"]
    assert f"--listen-client-urls=http://0.0.0.0:{port}" in etcd
    assert "--enable-v2=false" in etcd
    # One etcd release everywhere.
    sts = find(render("cpu"), "StatefulSet", "etcd")
    assert COMPOSE["services"]["etcd"]["image"] == container(next(pod_specs(sts)), "etcd")["image"]


def test_compose_prometheus_scrapes_every_trainer_with_the_shared_rules() -> None:
    prometheus = COMPOSE["services"]["prometheus"]
    mounts = _bind_mounts(prometheus)
    config = yaml.safe_load((DEPLOY / mounts["/etc/prometheus/prometheus.yml"]).read_text())
    # The rules are mounted from their single source where rule_files looks.
    assert mounts["/etc/prometheus/rules"] == "./prometheus/rules"
    assert config["rule_files"] == ["/etc/prometheus/rules/*.rules.yml"]
    ports = {s["environment"]["ELASTIC_TRAIN_METRICS_PORT"] for s in TRAINERS.values()}
    (scrape,) = config["scrape_configs"]
    (static,) = scrape["static_configs"]
    assert sorted(static["targets"]) == sorted(
        f"{name}:{port}" for name in TRAINERS for port in ports
    )


def test_compose_prometheus_config_and_rules_pass_promtool(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian package prometheus; .ci/run installs it)")
    text = (DEPLOY / "compose" / "prometheus.yml").read_text()
    config = tmp_path / "prometheus.yml"
    config.write_text(text.replace("/etc/prometheus/rules", str(DEPLOY / "prometheus" / "rules")))
    proc = subprocess.run(
        [promtool, "check", "config", str(config)], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS: 1 rule files found" in proc.stdout + proc.stderr


def test_compose_grafana_mounts_what_the_provisioning_expects() -> None:
    grafana = COMPOSE["services"]["grafana"]
    mounts = _bind_mounts(grafana)
    assert mounts["/etc/grafana/provisioning"] == "./grafana/provisioning"
    provider = yaml.safe_load(
        (DEPLOY / "grafana" / "provisioning" / "dashboards" / "elastic-train.yml").read_text()
    )
    (dashboards,) = provider["providers"]
    assert mounts[dashboards["options"]["path"]] == "./grafana/dashboards"
    assert list((DEPLOY / "grafana" / "dashboards").glob("*.json"))


def _dockerfile() -> list[str]:
    return (DEPLOY / "Dockerfile").read_text().splitlines()


def test_dockerfile_is_multi_stage_pinned_non_root_with_torchrun_entrypoint() -> None:
    lines = _dockerfile()
    args = dict(
        line.removeprefix("ARG ").split("=", 1)
        for line in lines
        if line.startswith("ARG ") and "=" in line
    )
    stages = [line.split() for line in lines if line.startswith("FROM ")]
    assert [s[-1] for s in stages] == ["build", "runtime"]
    bases = {s[1].replace("${PYTHON_IMAGE}", args["PYTHON_IMAGE"]) for s in stages}
    (base,) = bases
    assert re.fullmatch(r"[\w./-]+:\d+\.\d+\.\d+-[\w.-]+(@sha256:[0-9a-f]{64})?", base), base
    assert args["VARIANT"] == "cpu"
    # The image installs the torch range the package declares (its floor included).
    declared = re.findall(r'"(torch[<>=!~][^"]*)"', (REPO_ROOT / "pyproject.toml").read_text())
    assert declared == [args["TORCH_SPEC"].strip('"')]
    assert "cpu) index=" in "\n".join(lines) and "cuda) index=" in "\n".join(lines)
    (user,) = [line.split()[1] for line in lines if line.startswith("USER ")]
    uid, gid = map(int, user.split(":"))
    pod = find(render("cpu"), "Job", "elastic-train")["spec"]["template"]["spec"]
    assert uid == pod["securityContext"]["runAsUser"] != 0
    assert gid == pod["securityContext"]["runAsGroup"]
    (entrypoint,) = [line for line in lines if line.startswith("ENTRYPOINT ")]
    assert json.loads(entrypoint.removeprefix("ENTRYPOINT ")) == ["torchrun"]
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
    assert "*" in ignore and "!elastic_train/" in ignore


def test_deploy_config_loads_and_checkpoints_to_the_shared_volume() -> None:
    cfg = load_config(DEPLOY / "config" / "train.toml")
    trainer = container(
        find(render("cpu"), "Job", "elastic-train")["spec"]["template"]["spec"], "trainer"
    )
    (mount,) = [m for m in trainer["volumeMounts"] if m["name"] == "checkpoints"]
    assert cfg.checkpoint.dir == mount["mountPath"]
    assert f"checkpoints:{cfg.checkpoint.dir}" in TRAINERS["node0"]["volumes"]


def _shell_scripts() -> list[Path]:
    tracked = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=REPO_ROOT, capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    scripts = []
    for name in tracked:
        path = REPO_ROOT / name
        if not path.is_file():
            continue
        with path.open("rb") as fh:
            first = fh.readline()
        if path.suffix in (".sh", ".sbatch") or re.match(rb"#!.*\b(ba)?sh\b", first):
            scripts.append(path)
    return scripts


def test_shell_scripts_pass_shellcheck() -> None:
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck is not installed (Debian package shellcheck; .ci/run installs it)")
    scripts = _shell_scripts()
    assert DEPLOY / "slurm" / "train.sbatch" in scripts
    assert DEPLOY / "etcd" / "make-certs.sh" in scripts
    proc = subprocess.run(
        [shellcheck, "--shell=bash", *map(str, scripts)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout


def _etcdctl(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(Path(find_etcd_binary()).with_name("etcdctl")), *args],
        env=env, capture_output=True, text=True, check=False, timeout=30,
    )  # fmt: skip


@pytest.mark.slow
def test_etcd_scripts_make_a_tls_cluster_with_a_user_limited_to_the_prefix(tmp_path: Path) -> None:
    with secure_etcd(tmp_path) as etcd:
        assert (etcd.certs / "client.key").stat().st_mode & 0o077 == 0, "keys are private"
        again = etcd.create_user()  # finds authentication on, logs in as root
        assert again.returncode == 0, again.stderr
        assert "secret" not in again.stdout + again.stderr
        user = {**etcd.ctl_env, "ETCDCTL_USER": f"elastic-train:{PASSWORD}"}
        assert _etcdctl(user, "put", "/elastic-train/run1/state", "x").returncode == 0
        got = _etcdctl(user, "get", "/elastic-train/run1/state").stdout.split()
        assert got == ["/elastic-train/run1/state", "x"]
        outside = _etcdctl(user, "put", "/other/key", "x")
        assert outside.returncode != 0 and "permission denied" in outside.stderr
        wrong = _etcdctl({**user, "ETCDCTL_USER": "elastic-train:wrong"}, "get", "/elastic-train/x")
        assert wrong.returncode != 0 and "authentication failed" in wrong.stderr
        no_cert = {k: v for k, v in user.items() if k not in ("ETCDCTL_CERT", "ETCDCTL_KEY")}
        no_cert["ETCDCTL_DIAL_TIMEOUT"] = "2s"
        assert _etcdctl(no_cert, "get", "/elastic-train/x").returncode != 0


def _make_compose_secret(directory: Path) -> subprocess.CompletedProcess[str]:
    """Run the rdzv-secret service's program with ``directory`` standing in for its volume."""
    maker = COMPOSE["services"]["rdzv-secret"]
    assert maker["entrypoint"] == ["python", "-c"]
    (program,) = maker["command"]
    local = program.replace(str(Path(RDZV_SECRET_PATH).parent), str(directory))
    return subprocess.run(
        [sys.executable, "-c", local], capture_output=True, text=True, timeout=30, check=True
    )


def test_compose_makes_the_job_secret_once_and_every_node_signs_with_it(tmp_path: Path) -> None:
    volume = str(Path(RDZV_SECRET_PATH).parent)
    maker = COMPOSE["services"]["rdzv-secret"]
    assert f"rdzv-secret:{volume}" in maker["volumes"] and maker["read_only"]
    for service in TRAINERS.values():
        assert f"rdzv-secret:{volume}:ro" in service["volumes"]
        assert service["depends_on"]["rdzv-secret"]["condition"] == "service_completed_successfully"
        (conf,) = [a.split("=", 1)[1] for a in service["command"] if a.startswith("--rdzv-conf=")]
        items = dict(item.split("=", 1) for item in conf.split(","))
        assert items["secret_file"] == RDZV_SECRET_PATH and "insecure" not in items
    made = _make_compose_secret(tmp_path)
    assert made.stdout + made.stderr == "", "nothing secret is printed"
    secret = tmp_path / Path(RDZV_SECRET_PATH).name
    first = secret.read_text()
    assert re.fullmatch(r"[0-9a-f]{64}\n", first)
    assert secret.stat().st_mode & 0o777 == 0o600
    # `docker compose up` runs it again: restarting nodes keep their peers' key.
    _make_compose_secret(tmp_path)
    assert secret.read_text() == first


def test_compose_rdzv_reset_service_resets_the_nodes_run() -> None:
    from elastic_train.cli import build_parser

    reset = COMPOSE["services"]["rdzv-reset"]
    assert reset["profiles"] == ["tools"], "only on request, never on `docker compose up`"
    assert reset["entrypoint"][0] == "elastic-train"
    args = build_parser().parse_args(reset["entrypoint"][1:])
    node = {
        k: v for k, v in (a.split("=", 1) for a in TRAINERS["node0"]["command"] if "=" in a)
    }  # fmt: skip
    assert args.endpoint == node["--rdzv-endpoint"] and args.run_id == node["--rdzv-id"]
    prefix = dict(i.split("=", 1) for i in node["--rdzv-conf"].split(","))["key_prefix"]
    assert args.key_prefix == prefix


def test_compose_nodes_run_the_same_command_as_the_kubernetes_pods(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from torch.distributed.run import config_from_args, get_args_parser

    from elastic_train.torchrun_plugin import check_rdzv_conf

    pod = find(render("cpu"), "Job", "elastic-train")["spec"]["template"]["spec"]
    k8s_args = container(pod, "trainer")["args"]
    _make_compose_secret(tmp_path)
    secret_file = tmp_path / Path(RDZV_SECRET_PATH).name
    for service in TRAINERS.values():
        args = [a.replace(RDZV_SECRET_PATH, str(secret_file)) for a in service["command"]]
        assert [a.split("=")[0] for a in args] == [a.split("=")[0] for a in k8s_args]
        for name, value in service["environment"].items():
            monkeypatch.setenv(name, value)
        _, _, script = config_from_args(get_args_parser().parse_args(args))
        assert script[-3:] == ["elastic_train/main.py", "--config", "/config/train.toml"]
        params = rdzv_parameters(args)
        config = check_rdzv_conf(params)[0]
        assert config.key_prefix == "/elastic-train"
        assert config.secret == secret_file.read_bytes().strip()
