"""The manifests printed in docs/kubernetes.md are meant to be pasted: they must be valid Kubernetes 1.35
objects, and the Deployment snippet must keep the same contract as k8s/base/model."""

from __future__ import annotations

import re
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.k8s.hardening import check_bounded, check_hardened
from tests.k8s.kustomize import KUBERNETES_VERSION, POD_UID, Build, container, containers, pod_labels, pod_spec
from tests.k8s.workloads import IDENTITY, cli_params
from tests.support.triton import REPO_ROOT
from tritonshare import __version__

DOC = REPO_ROOT / "docs" / "kubernetes.md"


def _documented_objects() -> list[dict[str, Any]]:
    blocks = re.findall(r"```yaml\n(.*?)```", DOC.read_text(), re.DOTALL)
    return [doc for block in blocks for doc in yaml.safe_load_all(block) if doc]


def test_documented_manifests_validate() -> None:
    objects = _documented_objects()
    assert {o["kind"] for o in objects} >= {"Deployment", "ValidatingAdmissionPolicy"}
    for obj in objects:
        try:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"docs: {obj['kind']} invalid at {'.'.join(map(str, exc.path))}: {exc.message}")


def test_documented_deployment_keeps_the_model_pod_contract() -> None:
    deployment = next(o for o in _documented_objects() if o["kind"] == "Deployment")
    for c in containers(deployment):
        check_hardened(c)
        check_bounded(c)
        assert c.spec["image"].endswith(f"/tritonshare:{__version__}"), f"docs: {c.where} names another image"
    load, proxy = container(deployment, "load"), container(deployment, "proxy")
    assert (load.spec["args"], proxy.spec["args"]) == (["load"], ["proxy"])
    name = load.env_value("TRITONSHARE_NAME")
    assert name == proxy.env_value("TRITONSHARE_NAME")
    assert name is not None and "tritonshare.io/model" in name["valueFrom"]["fieldRef"]["fieldPath"]
    assert "tritonshare.io/model" in pod_labels(deployment)
    assert proxy.spec["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": "metrics"}
    assert pod_spec(deployment)["terminationGracePeriodSeconds"] > 5 + 30 + 30
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0
    anti = pod_spec(deployment)["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert anti[0]["matchLabelKeys"] == ["tritonshare.io/model"]
    assert [v["hostPath"]["path"] for v in pod_spec(deployment)["volumes"] if "hostPath" in v] == [
        "/var/lib/tritonshare"
    ]


def test_documented_deployment_holds_leases_as_its_pod(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the pod's UID no lease is taken, and gc would remove the model while the pod serves it."""
    deployment = next(o for o in _documented_objects() if o["kind"] == "Deployment")
    snippet = Build(name="docs/kubernetes.md", objects=[deployment], stderr="")
    for c in (container(deployment, "load"), container(deployment, "proxy")):
        for var, field in IDENTITY.items():
            assert c.env_value(var) == {"name": var, "valueFrom": {"fieldRef": {"fieldPath": field}}}, c.where
        params = cli_params(c, snippet, monkeypatch)
        assert params["pod_uid"] == POD_UID and params["name"] == "my_model", f"docs: {c.where}"
