"""Offline checks of the kustomize manifests: every overlay renders, every object
passes its schema, and the properties schemas miss hold (Job semantics, pinned
images, hardened containers, network policy, monitoring from one source).
Nothing here reaches a cluster."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from decimal import Decimal
from pathlib import Path

import jsonschema
import pytest
import yaml
from conftest import SHARED_DIR
from k8s_manifests import (
    CUSTOM_KINDS,
    OVERLAYS,
    RDZV_SECRET_NAME,
    RDZV_SECRET_PATH,
    REPO_ROOT,
    TRAINER_KINDS,
    container,
    containers,
    env_value,
    find,
    pod_specs,
    render,
    trainer_container,
)

from elastic_train.errors import EXIT_CONFIG_ERROR

#: The oldest Kubernetes with every Job feature used GA or beta-on-by-default
#: (podFailurePolicy GA 1.31, successPolicy beta 1.31, backoffLimitPerIndex
#: beta 1.29), and the newest that kubernetes-validate ships.
K8S_VERSIONS = ("1.31.0", "1.37.0")
SCHEMAS = SHARED_DIR / "schemas"
#: Schemas vendored with the repository (tests/schemas/vendor_crd.py), where the shared
#: directory has none: Kubeflow Trainer v2.
VENDORED_SCHEMAS = REPO_ROOT / "tests" / "schemas"
DEPLOY = REPO_ROOT / "deploy"


def trainer_pod(objs: list[dict]) -> dict:
    owner = next(o for o in objs if o["kind"] in TRAINER_KINDS)
    (pod,) = pod_specs(owner)
    return pod


def all_pods(objs: list[dict]) -> list[dict]:
    return [pod for obj in objs for pod in pod_specs(obj)]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_the_whole_stack(overlay: str) -> None:
    kinds = {(o["kind"], o["metadata"]["name"]) for o in render(overlay)}
    owner = {"kubeflow": "PyTorchJob", "trainer-v2": "TrainJob"}.get(overlay, "Job")
    trainer = (owner, "elastic-train")
    expected = {
        trainer, ("StatefulSet", "etcd"), ("Service", "etcd"), ("Service", "etcd-peers"),
        ("PodDisruptionBudget", "etcd"), ("PersistentVolumeClaim", "elastic-train-checkpoints"),
        ("ServiceAccount", "elastic-train"), ("NetworkPolicy", "etcd"),
        ("NetworkPolicy", "elastic-train"), ("PodMonitor", "elastic-train"),
        ("PrometheusRule", "elastic-train"), ("ConfigMap", "elastic-train-dashboard"),
    }  # fmt: skip
    assert expected <= kinds
    operator = overlay in ("kubeflow", "trainer-v2")  # the operator makes the Job
    assert (("Job", "elastic-train") in kinds) != operator
    assert (("Service", "elastic-train") in kinds) != operator


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_lives_in_the_job_namespace(overlay: str) -> None:
    objs = render(overlay)
    (namespace,) = [o["metadata"]["name"] for o in objs if o["kind"] == "Namespace"]
    stray = [
        f"{o['kind']}/{o['metadata']['name']}"
        for o in objs
        if o["kind"] != "Namespace" and o["metadata"].get("namespace") != namespace
    ]
    assert not stray


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_core_objects_pass_strict_schema_validation(version: str) -> None:
    import kubernetes_validate

    for overlay in OVERLAYS:
        for obj in render(overlay):
            if obj["kind"] in CUSTOM_KINDS:
                continue
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                name = f"{obj['kind']}/{obj['metadata']['name']}"
                pytest.fail(f"{overlay}: {name} invalid for Kubernetes {version}: {exc.message}")


@pytest.mark.parametrize(
    ("kind", "schema"),
    [
        ("PodMonitor", "podmonitor_v1.json"),
        ("PrometheusRule", "prometheusrule_v1.json"),
        ("PyTorchJob", "pytorchjob_v1.json"),
        ("TrainJob", "trainjob_v1alpha1.json"),
        ("TrainingRuntime", "trainingruntime_v1alpha1.json"),
    ],
)
def test_custom_resources_match_their_crd_schemas(kind: str, schema: str) -> None:
    path = SCHEMAS / schema if (SCHEMAS / schema).exists() else VENDORED_SCHEMAS / schema
    validator = jsonschema.Draft7Validator(json.loads(path.read_text()))
    checked = 0
    for overlay in OVERLAYS:
        for obj in render(overlay):
            if obj["kind"] == kind:
                errors = [
                    f"{'/'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(obj)
                ]
                assert not errors, f"{overlay}: {kind} does not match {schema}: {errors}"
                checked += 1
    assert checked > 0


@pytest.mark.parametrize("overlay", ["cpu", "gpu", "tls"])
def test_job_is_an_indexed_elastic_job(overlay: str) -> None:
    objs = render(overlay)
    job = find(objs, "Job", "elastic-train")
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    trainer = container(pod, "trainer")
    assert spec["completionMode"] == "Indexed"
    assert pod["restartPolicy"] == "Never", "podFailurePolicy requires restartPolicy Never"
    low, high = map(int, env_value(trainer, "NNODES").split(":"))
    assert 1 <= low <= high == spec["parallelism"] == spec["completions"]
    assert "--nnodes=$(NNODES)" in trainer["args"]
    assert spec["backoffLimitPerIndex"] >= 1
    assert spec["successPolicy"] == {"rules": [{"succeededCount": 1}]}
    rules = spec["podFailurePolicy"]["rules"]
    fail = [r for r in rules if r["action"] == "FailJob"]
    assert fail == [
        {"action": "FailJob", "onExitCodes": {"operator": "In", "values": [EXIT_CONFIG_ERROR]}}
    ]
    ignored = [c for r in rules if r["action"] == "Ignore" for c in r.get("onPodConditions", [])]
    assert {"type": "DisruptionTarget", "status": "True"} in ignored
    # torchrun waits 30 s for the workers' preemption checkpoint after SIGTERM.
    assert pod["terminationGracePeriodSeconds"] >= 45
    # The headless Service gives each pod the DNS name its peers connect to.
    service = find(objs, "Service", pod["subdomain"])
    assert service["spec"]["clusterIP"] == "None"
    labels = job["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_trainer_gets_shm_config_and_a_shared_checkpoint_volume(overlay: str) -> None:
    objs = render(overlay)
    pod = trainer_pod(objs)
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: volumes[m["name"]] for m in trainer_container(pod)["volumeMounts"]}
    assert mounts["/dev/shm"]["emptyDir"]["medium"] == "Memory"
    assert mounts["/dev/shm"]["emptyDir"]["sizeLimit"]
    claim = find(
        objs, "PersistentVolumeClaim", mounts["/checkpoints"]["persistentVolumeClaim"]["claimName"]
    )
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    config = find(objs, "ConfigMap", mounts["/config"]["configMap"]["name"])
    assert config["data"]["train.toml"] == (DEPLOY / "config" / "train.toml").read_text()
    account = find(objs, "ServiceAccount", pod["serviceAccountName"])
    assert account["automountServiceAccountToken"] is False
    assert pod["automountServiceAccountToken"] is False


def test_gpu_overlay_asks_for_one_gpu_per_worker() -> None:
    trainer = container(trainer_pod(render("gpu")), "trainer")
    limits = trainer["resources"]["limits"]
    assert int(limits["nvidia.com/gpu"]) == int(env_value(trainer, "NPROC_PER_NODE")) >= 1
    assert trainer["image"].endswith("-cuda")
    assert (
        "nvidia.com/gpu"
        not in container(trainer_pod(render("cpu")), "trainer")["resources"]["limits"]
    )


_QUANTITY = re.compile(r"^([+-]?(?:\d+\.?\d*|\.\d+))(Ki|Mi|Gi|Ti|Pi|Ei|[mkMGTPE]|[eE][+-]?\d+)?$")
_SUFFIX = {
    None: 1, "m": Decimal("0.001"), "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15,
    "E": 10**18, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
}  # fmt: skip


def quantity(text: str | int) -> Decimal:
    """A Kubernetes resource quantity as a number; raises on anything the API would reject."""
    match = _QUANTITY.match(str(text))
    if match is None:
        raise ValueError(f"not a Kubernetes quantity: {text!r}")
    number, suffix = match.groups()
    if suffix and suffix[0] in "eE":
        return Decimal(number) * Decimal(10) ** int(suffix[1:])
    return Decimal(number) * Decimal(_SUFFIX[suffix])


def test_quantity_parser_agrees_with_kubernetes() -> None:
    assert quantity("500m") == Decimal("0.5")
    assert quantity("2Gi") == 2 * 2**30
    assert quantity("1e3") == 1000
    for bad in ("2GB", "1.5.0", "", "Gi", "two"):
        with pytest.raises(ValueError):
            quantity(bad)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_resource_quantities_parse_and_requests_fit_limits(overlay: str) -> None:
    objs = render(overlay)
    for pod in all_pods(objs):
        for c in containers(pod):
            requests, limits = c["resources"]["requests"], c["resources"]["limits"]
            assert {"cpu", "memory"} <= requests.keys() & limits.keys(), c["name"]
            for name, value in requests.items():
                assert quantity(value) <= quantity(limits.get(name, value)), f"{c['name']} {name}"
            for value in limits.values():
                assert quantity(value) > 0
        for volume in pod.get("volumes", []):
            if "sizeLimit" in volume.get("emptyDir", {}):
                assert quantity(volume["emptyDir"]["sizeLimit"]) > 0
        # A memory emptyDir counts against the pod's memory limit.
        shm = [v for v in pod.get("volumes", []) if v.get("emptyDir", {}).get("medium") == "Memory"]
        memory = sum(quantity(c["resources"]["limits"]["memory"]) for c in pod["containers"])
        assert all(quantity(v["emptyDir"]["sizeLimit"]) < memory for v in shm)
    claims = [o for o in objs if o["kind"] == "PersistentVolumeClaim"] + [
        claim
        for o in objs
        if o["kind"] == "StatefulSet"
        for claim in o["spec"]["volumeClaimTemplates"]
    ]
    assert all(quantity(c["spec"]["resources"]["requests"]["storage"]) > 0 for c in claims)


_PINNED = re.compile(r"^[\w.\-/:]+:(?P<tag>[\w][\w.\-]{0,127})(@sha256:[0-9a-f]{64})?$")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_images_are_pinned(overlay: str) -> None:
    for pod in all_pods(render(overlay)):
        for c in containers(pod):
            match = _PINNED.match(c["image"])
            assert match, f"{c['name']}: image {c['image']!r} has no tag"
            assert match["tag"] != "latest", f"{c['name']}: image {c['image']!r} uses :latest"


def test_etcd_image_avoids_the_releases_with_data_inconsistency_bugs() -> None:
    etcd = container(next(pod_specs(find(render("cpu"), "StatefulSet", "etcd"))), "etcd")
    version = tuple(int(p) for p in etcd["image"].rsplit(":v", 1)[1].split("."))
    assert version >= (3, 5, 6), etcd["image"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_is_hardened(overlay: str) -> None:
    for pod in all_pods(render(overlay)):
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        for c in containers(pod):
            ctx = c["securityContext"]
            assert ctx["runAsNonRoot"] is True, c["name"]
            assert ctx["readOnlyRootFilesystem"] is True, c["name"]
            assert ctx["allowPrivilegeEscalation"] is False, c["name"]
            assert ctx["capabilities"] == {"drop": ["ALL"]}, c["name"]
            assert ctx["seccompProfile"] == {"type": "RuntimeDefault"}, c["name"]
            assert not ctx.get("privileged", False)


@pytest.mark.parametrize("overlay", ["cpu", "tls"])
def test_etcd_is_a_v3_only_cluster_with_probes_and_a_budget(overlay: str) -> None:
    objs = render(overlay)
    sts = find(objs, "StatefulSet", "etcd")
    pod = sts["spec"]["template"]["spec"]
    etcd = container(pod, "etcd")
    assert sts["spec"]["replicas"] == 3
    members = [
        f"etcd-{i}=$(SCHEME)://etcd-{i}.etcd-peers.$(POD_NAMESPACE).svc:2380" for i in range(3)
    ]
    assert f"--initial-cluster={','.join(members)}" in etcd["args"]
    assert "--enable-v2=false" in etcd["args"] and not any(
        "enable-v2=true" in a for a in etcd["args"]
    )
    assert (
        etcd["livenessProbe"]["httpGet"]["port"]
        == etcd["readinessProbe"]["httpGet"]["port"]
        == "etcd-metrics"
    )
    assert "--listen-metrics-urls=http://0.0.0.0:2381" in etcd["args"]
    assert sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    peers = find(objs, "Service", sts["spec"]["serviceName"])
    assert peers["spec"]["clusterIP"] == "None" and peers["spec"]["publishNotReadyAddresses"]
    budget = find(objs, "PodDisruptionBudget", "etcd")
    assert (
        budget["spec"]["selector"]["matchLabels"].items()
        <= sts["spec"]["template"]["metadata"]["labels"].items()
    )
    assert budget["spec"]["maxUnavailable"] == 1


def test_trainer_reaches_etcd_through_its_client_service() -> None:
    objs = render("cpu")
    trainer = container(trainer_pod(objs), "trainer")
    host, port = (
        next(a for a in trainer["args"] if a.startswith("--rdzv-endpoint="))
        .split("=")[1]
        .split(":")
    )
    client = find(objs, "Service", host)
    assert [p["port"] for p in client["spec"]["ports"]] == [int(port)]
    assert "--rdzv-backend=etcd" in trainer["args"]
    assert trainer["args"][-3:] == ["elastic_train/main.py", "--config", "/config/train.toml"]


def test_tls_overlay_turns_on_client_certificates_and_authentication() -> None:
    objs = render("tls")
    etcd = container(next(pod_specs(find(objs, "StatefulSet", "etcd"))), "etcd")
    assert env_value(etcd, "SCHEME") == "https"
    for flag in (
        "--client-cert-auth",
        "--peer-client-cert-auth",
        "--cert-file=/etc/etcd/tls/server.crt",
        "--bcrypt-cost=4",  # random passwords: a login costs etcd 1 ms, not 66 ms
    ):
        assert flag in etcd["args"]
    pod = trainer_pod(objs)
    trainer = container(pod, "trainer")
    conf = dict(item.split("=", 1) for item in env_value(trainer, "RDZV_CONF").split(","))
    assert conf["protocol"] == "https"
    secret_mounts = {
        m["mountPath"] for m in trainer["volumeMounts"]
        for v in pod["volumes"] if v["name"] == m["name"] and "secret" in v
    }  # fmt: skip
    for key in ("cacert", "cert", "key"):
        assert str(Path(conf[key]).parent) in secret_mounts
    (password,) = [e for e in trainer["env"] if e["name"] == "ETCD_PASSWORD"]
    assert "secretKeyRef" in password["valueFrom"], (
        "the password comes from a Secret, never a value"
    )
    assert "password" not in conf


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_job_secret_is_mounted_read_only_and_passed_as_secret_file(overlay: str) -> None:
    objs = render(overlay)
    pod = trainer_pod(objs)
    trainer = trainer_container(pod)
    volumes = {v["name"]: v for v in pod["volumes"]}
    (mount,) = [
        m for m in trainer["volumeMounts"]
        if volumes[m["name"]].get("secret", {}).get("secretName") == RDZV_SECRET_NAME
    ]  # fmt: skip
    assert mount["readOnly"] is True
    assert mount["mountPath"] == str(Path(RDZV_SECRET_PATH).parent)
    secret = volumes[mount["name"]]["secret"]
    assert secret["defaultMode"] & 0o007 == 0, "no other user of the node reads it"
    assert not secret.get("optional"), "a pod without the Secret never starts unsigned"
    if overlay == "kubeflow":
        policy = find(objs, "PyTorchJob", "elastic-train")["spec"]["elasticPolicy"]
        conf = {item["key"]: item["value"] for item in policy["rdzvConf"]}
    else:
        assert "--rdzv-conf=$(RDZV_CONF)" in trainer["args"]
        conf = dict(item.split("=", 1) for item in env_value(trainer, "RDZV_CONF").split(","))
    assert conf["secret_file"] == RDZV_SECRET_PATH
    assert "insecure" not in conf
    # The secret is a file, not an environment variable (inherited by every child process).
    assert not any(e["name"] == "ELASTIC_TRAIN_RDZV_SECRET" for e in trainer.get("env", []))


def test_the_documented_command_creates_the_secret_the_pods_mount() -> None:
    doc = " ".join((REPO_ROOT / "docs" / "deploy.md").read_text().replace("\\\n", " ").split())
    assert (
        f"openssl rand -hex 32 | kubectl -n elastic-train create secret generic "
        f"{RDZV_SECRET_NAME} --from-file=secret=/dev/stdin"
    ) in doc
    assert Path(RDZV_SECRET_PATH).name == "secret"


def _rule_ports(rule: dict) -> set:
    return {p["port"] for p in rule.get("ports", [])}


def test_network_policies_limit_etcd_to_trainers_and_metrics_to_monitoring() -> None:
    objs = render("cpu")
    etcd_policy = find(objs, "NetworkPolicy", "etcd")
    trainer_labels = find(objs, "Job", "elastic-train")["spec"]["template"]["metadata"]["labels"]
    for rule in etcd_policy["spec"]["ingress"]:
        if "client" in _rule_ports(rule):
            for peer in rule["from"]:
                selected = peer["podSelector"]["matchLabels"]
                assert "namespaceSelector" not in peer
                assert selected.items() <= trainer_labels.items() or selected == {
                    "app.kubernetes.io/name": "etcd"
                }
        else:
            assert _rule_ports(rule) <= {"peer", "etcd-metrics"}
    trainer_policy = find(objs, "NetworkPolicy", "elastic-train")
    assert trainer_policy["spec"]["podSelector"]["matchLabels"].items() <= trainer_labels.items()
    from_outside = [
        r
        for r in trainer_policy["spec"]["ingress"]
        if any("namespaceSelector" in p for p in r["from"])
    ]
    monitoring = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}
    }
    assert from_outside == [{"from": [monitoring], "ports": [{"port": "metrics"}]}]


def test_monitoring_objects_come_from_the_single_sources_in_deploy() -> None:
    objs = render("cpu")
    dashboards = sorted((DEPLOY / "grafana" / "dashboards").glob("*.json"))
    assert dashboards
    config_map = find(objs, "ConfigMap", "elastic-train-dashboard")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["data"] == {p.name: p.read_text() for p in dashboards}
    rules = yaml.safe_load(
        (DEPLOY / "prometheus" / "rules" / "elastic_train.rules.yml").read_text()
    )
    assert find(objs, "PrometheusRule", "elastic-train")["spec"] == rules
    # The committed PrometheusRule is exactly what its generator writes now.
    sys.path.insert(0, str(DEPLOY / "kubernetes"))
    try:
        import prometheusrule
    finally:
        sys.path.pop(0)
    assert (DEPLOY / "kubernetes" / "prometheusrule.yaml").read_text() == prometheusrule.render(), (
        "run: python deploy/kubernetes/prometheusrule.py"
    )
    monitor = find(objs, "PodMonitor", "elastic-train")
    pod_labels = find(objs, "Job", "elastic-train")["spec"]["template"]["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    trainer = container(trainer_pod(objs), "trainer")
    (port,) = [p for p in trainer["ports"] if p["name"] == endpoint["port"]]
    assert str(port["containerPort"]) == env_value(trainer, "ELASTIC_TRAIN_METRICS_PORT") == "9400"


def test_kubeflow_variant_uses_the_etcd_v3_backend_and_the_same_pod() -> None:
    objs = render("kubeflow")
    job = find(objs, "PyTorchJob", "elastic-train")
    policy = job["spec"]["elasticPolicy"]
    assert policy["rdzvBackend"] == "etcd-v3"
    assert (
        find(objs, "Service", policy["rdzvHost"])["spec"]["ports"][0]["port"] == policy["rdzvPort"]
    )
    worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]
    assert policy["minReplicas"] <= policy["maxReplicas"] == worker["replicas"]
    pod = worker["template"]["spec"]
    base_pod = find(render("../base"), "Job", "elastic-train")["spec"]["template"]["spec"]
    trainer = container(pod, "trainer")
    assert trainer["args"] == ["elastic_train/main.py", "--config", "/config/train.toml"]
    assert not any(e["name"] in ("NNODES", "RDZV_CONF", "RDZV_ID") for e in trainer["env"])
    # Everything else is the base Job's pod, copied by kustomize.
    for spec in (pod, base_pod):
        for key in ("subdomain", "restartPolicy"):
            spec.pop(key, None)
        for c in spec["containers"]:
            c.pop("args"), c.pop("env")
    assert pod == base_pod


def _checkov_skips(objs: list[dict]) -> list[str]:
    return [
        value for obj in objs
        for key, value in obj["metadata"].get("annotations", {}).items()
        if key.startswith("checkov.io/skip")
    ]  # fmt: skip


@pytest.mark.slow
def test_checkov_finds_no_failed_check(tmp_path: Path) -> None:
    checkov = shutil.which("checkov", path=str(Path(sys.executable).parent)) or shutil.which(
        "checkov"
    )
    if checkov is None:
        pytest.skip("checkov is not installed (pip install -e '.[dev]')")
    for overlay in OVERLAYS:
        objs = render(overlay)
        (tmp_path / f"{overlay}.yaml").write_text(yaml.safe_dump_all(objs))
        for skip in _checkov_skips(objs):
            check, _, why = skip.partition("=")
            assert re.fullmatch(r"CKV2?_K8S_\d+", check) and len(why) > 40, (
                f"unjustified skip {skip!r}"
            )
    proc = subprocess.run(
        [checkov, "--framework", "kubernetes", "--skip-download", "--quiet", "--compact",
         "--output", "json", "--directory", str(tmp_path)],
        capture_output=True, text=True, check=False, timeout=300,
    )  # fmt: skip
    report = json.loads(proc.stdout)
    # One report per framework; with nothing to scan checkov prints a bare summary.
    (report,) = report if isinstance(report, list) else [report]
    failed = [
        f"{r['check_id']} {r['resource']} ({r['file_path']})"
        for r in report["results"]["failed_checks"]
    ]
    assert not failed, "checkov failed checks:\n" + "\n".join(failed)
    assert report["summary"]["resource_count"] >= 4 * 12
