"""specd/k8s_check.py (`make k8s-check`) against the real KubeRay CRD in k8s/schemas/:
the shipped manifests pass; a planted unknown field, a wrong type, a duplicate list-map key and a
bad Service each fail, naming the path. Needs no network and no Kubernetes."""
from __future__ import annotations

import copy

import pytest
import yaml

from specd import k8s_check as K

RAYSERVICE = K.ROOT / "k8s" / "rayservice-demo.yaml"

@pytest.fixture(scope="module")
def crd():
    return K.load_crd()


@pytest.fixture(scope="module")
def shipped():
    docs = K.documents(RAYSERVICE)
    kinds = [d.get("kind") for d in docs]
    return docs[kinds.index("RayService")], docs[kinds.index("Service")]


def paths(problems) -> list[str]:
    return [p.path for p in problems]


def test_shipped_manifests_pass(capsys):
    assert K.main([]) == 0
    out = capsys.readouterr().out
    assert "RayService/specd" in out and "Service/specd-grpc" in out
    assert " 0 errors" in out and "ERROR" not in out


def test_crd_is_the_v1_rayservice(crd):
    assert (crd.api_version, crd.kind) == ("ray.io/v1", "RayService")


def test_unknown_field_fails_with_its_path(crd, shipped):
    doc = copy.deepcopy(shipped[0])
    doc["spec"]["rayClusterConfig"]["headGroupSpec"]["bogusField"] = True
    head = doc["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    head["imagePullPolicyy"] = "Always"  # a typo deep inside the inlined PodSpec
    doc["metadata"]["lables"] = {"a": "b"}  # root metadata: an ObjectMeta
    found = paths(K.check_custom(doc, crd))
    assert "spec.rayClusterConfig.headGroupSpec.bogusField" in found
    assert "spec.rayClusterConfig.headGroupSpec.template.spec.containers[0].imagePullPolicyy" in found
    assert "metadata.lables" in found
    assert len(found) == 3


def test_wrong_type_fails_with_its_path(crd, shipped):
    doc = copy.deepcopy(shipped[0])
    doc["spec"]["rayClusterConfig"]["workerGroupSpecs"][1]["replicas"] = "one"
    doc["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["maxReplicas"] = 2**40  # format: int32
    found = K.check_custom(doc, crd)
    assert paths(found) == ["spec.rayClusterConfig.workerGroupSpecs[0].maxReplicas",
                            "spec.rayClusterConfig.workerGroupSpecs[1].replicas"]
    assert "int32" in found[0].message and "integer" in found[1].message


def test_what_the_api_server_checks_beyond_json_schema(crd, shipped):
    doc = copy.deepcopy(shipped[0])
    ports = doc["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]["ports"]
    ports.append({"containerPort": 9000, "name": "grpc2"})  # list-map key (containerPort, protocol=TCP)
    doc["spec"]["managedBy"] = "me"  # CEL: self in ['ray.io/kuberay-operator', ...]
    del doc["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["groupName"]  # required
    found = {p.path: p.message for p in K.check_custom(doc, crd)}
    head = "spec.rayClusterConfig.headGroupSpec.template.spec.containers[0]"
    assert "duplicate" in found[f"{head}.ports[{len(ports) - 1}]"]
    assert "managedBy" in found["spec.managedBy"]
    assert "required" in found["spec.rayClusterConfig.workerGroupSpecs[0].groupName"]
    assert len(found) == 3


def test_core_objects_use_kubernetes_validate(shipped):
    svc = copy.deepcopy(shipped[1])
    assert K.check_core(svc) == []
    svc["spec"]["ports"][0]["port"] = "grpc"
    svc["spec"]["selectr"] = {}
    assert paths(K.check_core(svc)) == ["spec.ports[0].port", "spec.selectr"]
    assert "no Kubernetes" in K.check_core({**svc, "kind": "Servise"})[0].message


def test_command_fails_on_a_bad_file_and_names_the_path(tmp_path, shipped, capsys):
    bad = copy.deepcopy(shipped[0])
    bad["spec"]["rayClusterConfig"]["headGroupSpec"]["bogusField"] = 1
    f = tmp_path / "bad.yaml"
    f.write_text(yaml.safe_dump_all([bad, shipped[1]]))
    assert K.main([str(f)]) == 1
    out = capsys.readouterr().out
    assert "RayService/specd: spec.rayClusterConfig.headGroupSpec.bogusField: unknown field" in out
    assert "1 errors" in out


def test_crd_path_from_env(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("KUBERAY_CRD", str(tmp_path / "missing.yaml"))
    assert K.crd_path() == tmp_path / "missing.yaml"
    assert K.main([str(RAYSERVICE)]) == 2
    assert "missing.yaml" in capsys.readouterr().err
