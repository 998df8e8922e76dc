"""Render the kustomize overlays, and turn a rendered pod into local processes.

Shared by ``test_k8s.py`` (offline checks) and ``test_manifest_commands.py``
(the rendered commands run for real). A "local pod" gets what the kubelet
would give it: its volumes as directories (ConfigMap data written out, a PVC
shared by every pod that claims it), its environment with ``fieldRef`` values
and ``$(VAR)`` references resolved, and the image's ENTRYPOINT and WORKDIR.
Mount paths, service host names and container ports are then substituted
with temporary directories, loopback endpoints and free ports.
"""

from __future__ import annotations

import functools
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from torch.distributed.elastic.rendezvous import RendezvousParameters

REPO_ROOT = Path(__file__).resolve().parents[1]
K8S_DIR = REPO_ROOT / "k8s"
DOCKERFILE = REPO_ROOT / "deploy" / "Dockerfile"
OVERLAYS = ("cpu", "gpu", "tls", "kubeflow", "trainer-v2")
#: Kinds validated against vendored JSON schemas instead of kubernetes-validate.
CUSTOM_KINDS = ("PodMonitor", "PrometheusRule", "PyTorchJob", "TrainJob", "TrainingRuntime")
#: Kinds that hold the trainer's pod template, one per overlay.
TRAINER_KINDS = ("Job", "PyTorchJob", "TrainingRuntime")

Obj = dict[str, Any]

#: The Secret of the job secret (every launch path's), and where pods read it.
RDZV_SECRET_NAME = "elastic-train-rdzv-secret"
RDZV_SECRET_PATH = "/etc/elastic-train/rdzv/secret"


def rdzv_secrets(secret: str = "5e" * 32) -> dict[str, dict[str, str]]:
    """The data of the job secret's Secret, as ``local_process(secrets=...)`` takes it."""
    return {RDZV_SECRET_NAME: {"secret": secret + "\n"}}


@functools.cache
def _rendered_text(overlay: str) -> str:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: it renders the kustomize overlays")
    proc = subprocess.run(
        [kubectl, "kustomize", str(K8S_DIR / "overlays" / overlay)],
        capture_output=True, text=True, check=False, timeout=60,
    )  # fmt: skip
    if proc.returncode != 0:
        pytest.fail(f"kubectl kustomize k8s/overlays/{overlay} failed:\n{proc.stderr}")
    return proc.stdout


def render(overlay: str) -> list[Obj]:
    """The objects of ``k8s/overlays/<overlay>`` (a fresh copy on every call)."""
    return [doc for doc in yaml.safe_load_all(_rendered_text(overlay)) if doc]


def find(objs: list[Obj], kind: str, name: str | None = None) -> Obj:
    matches = [o for o in objs if o["kind"] == kind and name in (None, o["metadata"]["name"])]
    assert len(matches) == 1, f"expected one {kind} {name or ''}, found {len(matches)}"
    return matches[0]


def pod_specs(obj: Obj) -> Iterator[Obj]:
    """The pod specs an object creates pods from."""
    if obj["kind"] in ("Job", "StatefulSet", "Deployment", "DaemonSet"):
        yield obj["spec"]["template"]["spec"]
    elif obj["kind"] == "PyTorchJob":
        for replica in obj["spec"]["pytorchReplicaSpecs"].values():
            yield replica["template"]["spec"]
    elif obj["kind"] in ("TrainingRuntime", "ClusterTrainingRuntime"):
        for replicated in obj["spec"]["template"]["spec"]["replicatedJobs"]:
            yield replicated["template"]["spec"]["template"]["spec"]


def containers(pod: Obj) -> list[Obj]:
    return [*pod.get("initContainers", []), *pod["containers"]]


def container(pod: Obj, name: str) -> Obj:
    (match,) = [c for c in containers(pod) if c["name"] == name]
    return match


def trainer_container(pod: Obj) -> Obj:
    """The torchrun container: "trainer", or "node" in a Kubeflow Trainer v2 runtime,
    whose controller applies a TrainJob's settings to the container of that name."""
    (match,) = [c for c in pod["containers"] if c["name"] in ("trainer", "node")]
    return match


def env_value(c: Obj, name: str) -> str:
    (entry,) = [e for e in c.get("env", []) if e["name"] == name]
    return entry["value"]


def image_entrypoint() -> tuple[list[str], str]:
    """The runtime stage's ENTRYPOINT (exec form) and last WORKDIR of deploy/Dockerfile."""
    entrypoint, workdir = None, None
    for line in DOCKERFILE.read_text().splitlines():
        if line.startswith("ENTRYPOINT "):
            entrypoint = json.loads(line.removeprefix("ENTRYPOINT "))
        elif line.startswith("WORKDIR "):
            workdir = line.removeprefix("WORKDIR ").strip()
    assert entrypoint and workdir, "deploy/Dockerfile needs an exec-form ENTRYPOINT and a WORKDIR"
    return entrypoint, workdir


_VAR_REF = re.compile(r"\$\((\w+)\)")


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes ``$(VAR)`` expansion: defined variables only, others stay as written."""
    return _VAR_REF.sub(lambda m: env.get(m.group(1), m.group(0)), text)


def replace_paths(text: str, mounts: Mapping[str, Path]) -> str:
    """Replace each mount path (as a whole path prefix) with its local directory, in one pass."""
    if not mounts:
        return text
    longest_first = sorted(mounts, key=len, reverse=True)
    pattern = "|".join(re.escape(m) for m in longest_first)
    return re.sub(
        rf"(?<![\w./-])({pattern})(?=/|$|[\"',\s])", lambda m: str(mounts[m.group(1)]), text
    )


@dataclass(frozen=True)
class PodIdentity:
    """What the API server and the Job controller would fill in."""

    name: str
    namespace: str
    index: int
    job_uid: str


def _field_ref(path: str, pod: PodIdentity) -> str:
    known = {
        "metadata.name": pod.name,
        "metadata.namespace": pod.namespace,
        "metadata.labels['batch.kubernetes.io/controller-uid']": pod.job_uid,
        "metadata.annotations['batch.kubernetes.io/job-completion-index']": str(pod.index),
    }
    assert path in known, f"the local pod runner does not know fieldRef {path!r}"
    return known[path]


@dataclass(frozen=True)
class LocalProcess:
    argv: list[str]
    env: dict[str, str]
    cwd: Path


def local_process(
    objs: list[Obj],
    pod_spec: Obj,
    c: Obj,
    *,
    pod: PodIdentity,
    root: Path,
    substitutions: Mapping[str, str],
    host_ports: Mapping[int, int] | None = None,
    secrets: Mapping[str, Mapping[str, str]] | None = None,
) -> LocalProcess:
    """The process a container of ``pod_spec`` would run, on this machine.

    ``root`` holds the pod's volumes (``root/<pod>/<volume>``, PVCs shared as
    ``root/pvc/<claim>``); ``substitutions`` maps texts such as ``etcd:2379``
    to their local stand-ins, in the arguments, environment and ConfigMaps.
    Pods share this machine's network, so each container port is moved to
    ``host_ports[port]`` in the environment variables that name it.
    ``secrets`` holds the data of the Secrets the pod mounts or reads.
    """
    secrets = secrets or {}
    mounts = _mount_volumes(
        objs, pod_spec, c, pod=pod, root=root, substitutions=substitutions, secrets=secrets
    )
    env: dict[str, str] = {}
    for entry in c.get("env", []):
        source = entry.get("valueFrom", {})
        if "value" in entry:
            env[entry["name"]] = expand(entry["value"], env)
        elif "secretKeyRef" in source:
            env[entry["name"]] = secrets[source["secretKeyRef"]["name"]][
                source["secretKeyRef"]["key"]
            ]
        else:
            env[entry["name"]] = _field_ref(source["fieldRef"]["fieldPath"], pod)

    def localize(text: str) -> str:
        text = replace_paths(text, mounts)
        for old, new in substitutions.items():
            text = text.replace(old, new)
        return text

    moved = {str(p): str(q) for p, q in (host_ports or {}).items()}
    local_env = {k: moved.get(v, localize(v)) for k, v in env.items()}
    entrypoint, workdir = image_entrypoint()
    command = c.get("command", entrypoint)
    # $(VAR) expands to the manifest's value, localized once with the argument.
    args = [localize(expand(a, env)) for a in c.get("args", [])]
    assert workdir == "/opt/elastic-train", "the image's WORKDIR holds elastic_train/ (the repo)"
    return LocalProcess(
        argv=[_executable(command[0]), *command[1:], *args], env=local_env, cwd=REPO_ROOT
    )


def _executable(name: str) -> str:
    """``python``/``torchrun`` of the image: those of the running interpreter's environment."""
    found = shutil.which(name, path=str(Path(sys.executable).parent))
    assert found, f"{name} is not in {Path(sys.executable).parent}"
    return found


def _mount_volumes(
    objs: list[Obj],
    pod_spec: Obj,
    c: Obj,
    *,
    pod: PodIdentity,
    root: Path,
    substitutions: Mapping[str, str],
    secrets: Mapping[str, Mapping[str, str]],
) -> dict[str, Path]:
    volumes = {v["name"]: v for v in pod_spec.get("volumes", [])}
    mounts: dict[str, Path] = {}
    for mount in c.get("volumeMounts", []):
        volume = volumes[mount["name"]]
        if "persistentVolumeClaim" in volume:
            local = root / "pvc" / volume["persistentVolumeClaim"]["claimName"]
        else:
            local = root / pod.name / mount["name"]
        mounts[mount["mountPath"]] = local
    for mount in c.get("volumeMounts", []):
        local = mounts[mount["mountPath"]]
        local.mkdir(parents=True, exist_ok=True)
        volume = volumes[mount["name"]]
        if "configMap" in volume:
            config_map = find(objs, "ConfigMap", volume["configMap"]["name"])
            for key, text in config_map["data"].items():
                text = replace_paths(text, mounts)
                for old, new in substitutions.items():
                    text = text.replace(old, new)
                (local / key).write_text(text)
        elif "secret" in volume:
            for key, text in secrets[volume["secret"]["secretName"]].items():
                (local / key).write_text(text)
        else:
            assert {"emptyDir", "persistentVolumeClaim"} & volume.keys(), (
                f"the local pod runner cannot provide volume {volume}"
            )
    return mounts


def rdzv_parameters(torchrun_args: list[str]) -> RendezvousParameters:
    """What torchrun makes of its arguments' (and PET_* variables') --rdzv-* options."""
    from torch.distributed.run import config_from_args, get_args_parser

    config, _, _ = config_from_args(get_args_parser().parse_args(torchrun_args))
    return RendezvousParameters(
        backend=config.rdzv_backend, endpoint=config.rdzv_endpoint, run_id=config.run_id,
        min_nodes=config.min_nodes, max_nodes=config.max_nodes, **config.rdzv_configs,
    )  # fmt: skip
