"""The Kubeflow Trainer v2 overlay (``k8s/overlays/trainer-v2``): a ``TrainJob`` on a
``TrainingRuntime`` whose pods run torchrun with our etcd rendezvous.

Offline, like the other overlays: the objects are checked against the Trainer's
own CRD schemas (vendored in ``tests/schemas/``, made strict) in
``test_k8s.py``; here, what the schemas cannot say. The torchrun command is
parsed with the ``PET_*`` variables the Trainer's torch plugin injects
(kubeflow/trainer ``pkg/runtime/framework/plugins/torch/torch.go``, v2.3.0), so
a variable that silently replaced one of our flags would fail here.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from k8s_manifests import (
    REPO_ROOT,
    PodIdentity,
    env_value,
    find,
    local_process,
    pod_specs,
    rdzv_parameters,
    rdzv_secrets,
    render,
    trainer_container,
)

from elastic_train.torchrun_plugin import check_rdzv_conf

SCHEMAS = REPO_ROOT / "tests" / "schemas"
#: The Trainer's fixed port for the torchrun master (pkg/constants, ContainerTrainerPort).
TRAINER_MASTER_PORT = 29400
COMMIT = "658725bdae5c7e3a0854d93ac6ff492e109a22ab"  # kubeflow/trainer tag v2.3.0


def _objects() -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any]]:
    objs = render("trainer-v2")
    return objs, find(objs, "TrainJob", "elastic-train"), find(objs, "TrainingRuntime")


def _node_job(runtime: dict[str, Any]) -> dict[str, Any]:
    (replicated,) = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    return replicated


def test_the_trainjob_runs_on_the_namespaced_runtime_of_this_overlay() -> None:
    _, job, runtime = _objects()
    ref = job["spec"]["runtimeRef"]
    assert (ref["apiGroup"], ref["kind"], ref["name"]) == (
        "trainer.kubeflow.org", "TrainingRuntime", runtime["metadata"]["name"],
    )  # fmt: skip
    assert job["metadata"]["namespace"] == runtime["metadata"]["namespace"] == "elastic-train"
    assert job["apiVersion"] == runtime["apiVersion"] == "trainer.kubeflow.org/v1alpha1"
    # The torch policy, and the names the controller applies the TrainJob's settings to.
    assert runtime["spec"]["mlPolicy"]["torch"] == {}
    node = _node_job(runtime)
    assert node["name"] == "node"
    assert node["template"]["metadata"]["labels"] == {
        "trainer.kubeflow.org/trainjob-ancestor-step": "trainer"
    }
    (pod,) = pod_specs(runtime)
    assert [c["name"] for c in pod["containers"]] == ["node"]
    # No PET_* in the TrainJob: the Trainer refuses them (reserved) and injects its own.
    assert not any(e["name"].startswith("PET_") for e in job["spec"]["trainer"].get("env", []))


def test_the_node_job_is_the_base_job_and_the_pod_the_base_pod() -> None:
    """One definition of the Job semantics and the pod: copied by kustomize."""
    _, job, runtime = _objects()
    spec = copy.deepcopy(_node_job(runtime)["template"]["spec"])
    base = find(render("../base"), "Job", "elastic-train")["spec"]
    assert spec["completionMode"] == "Indexed" and spec["backoffLimitPerIndex"] >= 1
    assert spec["podFailurePolicy"] == base["podFailurePolicy"]  # exit 78 fails the job
    assert spec["successPolicy"] == base["successPolicy"]
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never", "podFailurePolicy needs it"
    assert "subdomain" not in pod, "the JobSet's own headless Service names the pods"
    base["template"]["spec"].pop("subdomain")
    pod["containers"][0]["name"] = "trainer"
    assert spec["template"] == base["template"]
    # Pods started = the most nodes torchrun accepts, wherever it is set.
    nnodes = env_value(trainer_container(pod), "NNODES")
    low, high = (int(n) for n in nnodes.split(":"))
    assert (
        low
        < high
        == job["spec"]["trainer"]["numNodes"]
        == runtime["spec"]["mlPolicy"]["numNodes"]
        == spec["parallelism"]
    )


def _trainer_env(trainjob: dict[str, Any]) -> dict[str, str]:
    """The PET_* variables the Trainer v2.3.0 torch plugin gives the "node" container."""
    name = trainjob["metadata"]["name"]
    return {
        "PET_NNODES": str(trainjob["spec"]["trainer"]["numNodes"]),
        "PET_NPROC_PER_NODE": "auto",  # the plugin's default without numProcPerNode
        "PET_NODE_RANK": "2",
        "PET_MASTER_ADDR": f"{name}-node-0-0.{name}",
        "PET_MASTER_PORT": str(TRAINER_MASTER_PORT),
    }


def test_torchrun_uses_the_etcd_rendezvous_whatever_the_trainer_injects(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    objs, job, runtime = _objects()
    (pod_spec,) = pod_specs(runtime)
    pod = PodIdentity(
        name="elastic-train-node-0-2", namespace="elastic-train", index=2, job_uid="uid-v2"
    )
    node = local_process(
        objs, pod_spec, trainer_container(pod_spec), pod=pod, root=tmp_path,
        substitutions={}, secrets=rdzv_secrets("ef" * 32),
    )  # fmt: skip
    for name, value in {**_trainer_env(job), **node.env}.items():
        monkeypatch.setenv(name, value)  # torchrun reads PET_* as its flags' defaults
    assert Path(node.argv[0]).name == "torchrun", "the image's ENTRYPOINT"
    params = rdzv_parameters(node.argv[1:])
    assert params.backend == "etcd"
    assert params.endpoint == "etcd:2379"
    service = find(objs, "Service", "etcd")
    assert service["spec"]["ports"][0]["port"] == 2379
    assert (params.min_nodes, params.max_nodes) == (1, job["spec"]["trainer"]["numNodes"])
    assert params.run_id == "uid-v2", "the child Job's uid: a re-created job never rejoins"
    config = check_rdzv_conf(params)[0]
    assert config.key_prefix == "/elastic-train"
    assert config.secret == b"ef" * 32, "the job secret from the mounted Secret"
    assert node.env["ELASTIC_TRAIN_NODE"] == "node2"


def _schema(name: str) -> dict[str, Any]:
    return json.loads((SCHEMAS / name).read_text())


@pytest.mark.parametrize("name", ["trainjob_v1alpha1.json", "trainingruntime_v1alpha1.json"])
def test_the_vendored_schemas_name_their_source_and_commit(name: str) -> None:
    comment = _schema(name)["$comment"]
    assert "https://github.com/kubeflow/trainer/blob/v2.3.0/manifests/base/crds/" in comment
    assert COMMIT in comment


def test_the_strict_schema_refuses_what_the_trainer_would_not_accept() -> None:
    """The validation has teeth: the ``elasticPolicy`` of v2.0 and v2.1 (gone since v2.2), a
    misspelt key and a wrong type are each refused, and the rendered objects pass."""
    _, job, runtime = _objects()
    validator = jsonschema.Draft7Validator(_schema("trainingruntime_v1alpha1.json"))
    assert not list(validator.iter_errors(runtime))
    for path, value in [
        (("mlPolicy", "torch", "elasticPolicy"), {"maxNodes": 4}),
        (("mlPolicy", "numNode"), 4),
        (("mlPolicy", "numNodes"), "4"),
    ]:
        bad = copy.deepcopy(runtime)
        parent = bad["spec"]
        for key in path[:-1]:
            parent = parent[key]
        parent[path[-1]] = value
        assert list(validator.iter_errors(bad)), path
    job_validator = jsonschema.Draft7Validator(_schema("trainjob_v1alpha1.json"))
    assert not list(job_validator.iter_errors(job))
    bad_job = copy.deepcopy(job)
    bad_job["spec"]["runtimeRef"].pop("name")
    assert list(job_validator.iter_errors(bad_job))


def test_monitoring_and_network_policies_select_the_runtime_pods() -> None:
    objs, _, runtime = _objects()
    labels = _node_job(runtime)["template"]["spec"]["template"]["metadata"]["labels"]
    monitor = find(objs, "PodMonitor", "elastic-train")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    trainers = find(objs, "NetworkPolicy", "elastic-train")["spec"]["podSelector"]
    assert trainers["matchLabels"].items() <= labels.items()
    etcd_clients = [
        peer["podSelector"]["matchLabels"]
        for rule in find(objs, "NetworkPolicy", "etcd")["spec"]["ingress"]
        for peer in rule.get("from", [])
        if "podSelector" in peer
    ]
    assert any(selected.items() <= labels.items() for selected in etcd_clients)
