"""The manifests printed in docs/kubernetes.md are meant to be pasted: they must be valid Kubernetes 1.35
objects, and the Deployment snippet must keep the same contract as k8s/base/model. The README's shorter pod
template too, where it shows a part of that contract."""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.k8s.admission import refusals
from tests.k8s.hardening import check_bounded, check_hardened
from tests.k8s.kustomize import (
    KUBERNETES_VERSION,
    POD_UID,
    Build,
    container,
    containers,
    pod_labels,
    pod_spec,
    selector_matches,
)
from tests.k8s.workloads import IDENTITY, SHUTDOWN_MARGIN_S, cli_params, models, tritons, worst_case_shutdown_s
from tests.support.triton import REPO_ROOT
from tritonshare import __version__

DOC = REPO_ROOT / "docs" / "kubernetes.md"
README = REPO_ROOT / "README.md"


def _yaml_blocks(path: Path) -> list[Any]:
    blocks = re.findall(r"```yaml\n(.*?)```", path.read_text(), re.DOTALL)
    return [doc for block in blocks for doc in yaml.safe_load_all(block) if doc]


def _documented_objects() -> list[dict[str, Any]]:
    return _yaml_blocks(DOC)


def _documented_deployment() -> dict[str, Any]:
    """The guide's Deployment snippet ("In your own Deployment")."""
    return next(o for o in _documented_objects() if o["kind"] == "Deployment")


def _readme_pod_template() -> dict[str, Any]:
    """The README's snippet: a Deployment's pod template (metadata and spec), not a whole object."""
    (template,) = [doc for doc in _yaml_blocks(README) if set(doc) == {"metadata", "spec"}]
    return dict(template)


def test_documented_manifests_validate() -> None:
    objects = _documented_objects()
    assert {o["kind"] for o in objects} >= {"Deployment", "ValidatingAdmissionPolicy"}
    for obj in objects:
        try:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"docs: {obj['kind']} invalid at {'.'.join(map(str, exc.path))}: {exc.message}")


def test_documented_deployment_keeps_the_model_pod_contract() -> None:
    deployment = _documented_deployment()
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
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0
    assert deployment["spec"]["progressDeadlineSeconds"] >= 3600 + 600 + 60, "the loader's default deadlines"
    anti = pod_spec(deployment)["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert anti[0]["matchLabelKeys"] == ["tritonshare.io/model"]
    assert [v["hostPath"]["path"] for v in pod_spec(deployment)["volumes"] if "hostPath" in v] == [
        "/var/lib/tritonshare"
    ]


def test_documented_grace_periods_outlast_the_proxy_shutdown(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same worst case as k8s/base/model's (test_workloads.py), for both snippets."""
    docs = _documented_deployment()
    readme = {"kind": "Deployment", "metadata": {"name": "readme"}, "spec": {"template": _readme_pod_template()}}
    for where, deployment in (("docs/kubernetes.md", docs), ("README.md", readme)):
        proxy = container(deployment, "proxy")
        params = cli_params(proxy, Build(name=where, objects=[deployment], stderr=""), monkeypatch)
        needed, grace = worst_case_shutdown_s(proxy, params), pod_spec(deployment)["terminationGracePeriodSeconds"]
        assert grace >= needed + SHUTDOWN_MARGIN_S, f"{where}: grace {grace}s, the proxy's shutdown {needed:g}s"


def test_documented_deployment_holds_leases_as_its_pod(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the pod's UID no lease is taken, and gc would remove the model while the pod serves it."""
    deployment = _documented_deployment()
    snippet = Build(name="docs/kubernetes.md", objects=[deployment], stderr="")
    for c in (container(deployment, "load"), container(deployment, "proxy")):
        for var, field in IDENTITY.items():
            assert c.env_value(var) == {"name": var, "valueFrom": {"fieldRef": {"fieldPath": field}}}, c.where
        params = cli_params(c, snippet, monkeypatch)
        assert params["pod_uid"] == POD_UID and params["name"] == "my_model", f"docs: {c.where}"


def test_documented_pods_are_scraped_by_the_pod_monitor(builds: dict[str, Build]) -> None:
    """Without the labels the PodMonitor selects on, Prometheus never scrapes the pod's proxy, and the
    per-model HPA gets no metric."""
    selector = builds["components/monitoring"].one("PodMonitor")["spec"]["selector"]
    deployment = _documented_deployment()
    assert selector_matches(selector, pod_labels(deployment)), f"docs/kubernetes.md: {pod_labels(deployment)}"
    readme = _readme_pod_template()["metadata"]["labels"]
    assert selector_matches(selector, readme), f"README.md: pod labels {readme} miss the PodMonitor's {selector}"


# --- the admission policy of "Trust boundary" -------------------------------------------------------------

Obj = dict[str, Any]
MODELS_NAMESPACE: Obj = {"metadata": {"name": "ml-team", "labels": {"tritonshare.io/models": "allowed"}}}


def _node_folder_policy() -> Obj:
    return next(o for o in _documented_objects() if o["kind"] == "ValidatingAdmissionPolicy")


def _pod(workload: Obj) -> Obj:
    """The pod a workload's controller creates, as admission sees it."""
    return copy.deepcopy({"metadata": workload["spec"]["template"]["metadata"], "spec": pod_spec(workload)})


def _namespace_of(workload: Obj, b: Build) -> Obj:
    name = workload["metadata"].get("namespace")
    found = [o for o in b.of_kind("Namespace") if o["metadata"]["name"] == name]
    return found[0] if found else MODELS_NAMESPACE


def test_documented_admission_policy_admits_the_shipped_pods(builds: dict[str, Build]) -> None:
    policy = _node_folder_policy()
    documented = _documented_deployment()
    assert refusals(policy, _pod(documented), MODELS_NAMESPACE) == [], "docs: the policy refuses its own snippet"
    for name, deployment in models(builds, overlays_only=True):
        assert refusals(policy, _pod(deployment), _namespace_of(deployment, builds[name])) == [], name
    for name, daemonset in tritons(builds):
        namespace = {"metadata": {"name": daemonset["metadata"]["namespace"]}}
        assert refusals(policy, _pod(daemonset), namespace) == [], f"{name}: the policy refuses Triton's pods"


def test_documented_admission_policy_pins_what_a_node_folder_pod_runs() -> None:
    """Checking the image alone limits nothing: the tritonshare image with the node folder mounted runs any
    of its commands, or a shell, and `tritonshare unload --name <another tenant's model>` removes that model."""
    policy = _node_folder_policy()
    model = _pod(_documented_deployment())
    image = model["spec"]["containers"][0]["image"]
    unload = ["unload", "--name", "someone_elses_model"]
    shell = ["sh", "-c", "rm -rf /var/lib/tritonshare/models/*"]
    attempts: dict[str, Callable[[Obj], None]] = {
        "a proxy running unload": lambda s: s["containers"][0].update(args=unload),
        "a loader running gc": lambda s: s["initContainers"][0].update(args=["gc", "--once"]),
        "a shell": lambda s: s["containers"][0].update(command=shell),
        "the entrypoint given as command": lambda s: s["containers"][0].update(command=["tritonshare"], args=unload),
        "a second container running unload": lambda s: s["containers"].append(
            {"name": "x", "image": image, "args": unload}
        ),
        "a debug container": lambda s: s.update(ephemeralContainers=[{"name": "d", "image": image, "args": unload}]),
        "another image": lambda s: s["containers"][0].update(image="busybox:1.37"),
    }
    for what, edit in attempts.items():
        pod = copy.deepcopy(model)
        edit(pod["spec"])
        assert refusals(policy, pod, MODELS_NAMESPACE), f"docs: the node-folder policy admits {what}"
    other_namespace = {"metadata": {"name": "other", "labels": {}}}
    assert refusals(policy, model, other_namespace), "docs: the policy admits model pods in any namespace"
    elsewhere = copy.deepcopy(model)
    elsewhere["spec"]["volumes"] = [v for v in elsewhere["spec"]["volumes"] if "hostPath" not in v]
    elsewhere["spec"]["containers"][0].update(command=shell, image="busybox:1.37")
    assert refusals(policy, elsewhere, other_namespace) == [], "docs: the policy refuses pods without the folder"


def test_documented_admission_policy_keeps_other_ways_to_the_folder_out_of_model_namespaces() -> None:
    """Model namespaces run Pod Security at `privileged` (for the folder's hostPath), so a pod there that does
    not mount the folder as spelled — a host path above it, below it or spelled otherwise, a privileged
    container, the host's PID namespace — would reach it unchecked; outside them the folder is named, not
    the host paths the platform's own agents mount (a node exporter's `/`)."""
    policy = _node_folder_policy()
    shell = {"name": "x", "image": "busybox:1.37", "command": ["sh", "-c", "rm -rf /host/*"]}

    def pod(*, host_path: str | None = None, **spec: Any) -> Obj:
        volumes = [{"name": "host", "hostPath": {"path": host_path}}] if host_path else []
        return {"metadata": {"name": "p"}, "spec": {"containers": [copy.deepcopy(shell)], "volumes": volumes} | spec}

    privileged = pod()
    privileged["spec"]["containers"][0]["securityContext"] = {"privileged": True}
    sys_admin = pod()
    sys_admin["spec"]["containers"][0]["securityContext"] = {"capabilities": {"add": ["SYS_ADMIN"]}}
    privileged_init = pod(initContainers=[shell | {"securityContext": {"privileged": True}}])
    debug = pod(ephemeralContainers=[shell | {"securityContext": {"capabilities": {"add": ["SYS_PTRACE"]}}}])
    refused_in_model_namespace = {
        "the host's root": pod(host_path="/"),
        "a folder above the node folder": pod(host_path="/var/lib"),
        "/proc (every process's root)": pod(host_path="/proc"),
        "a privileged container": privileged,
        "a privileged init container": privileged_init,
        "a capability beyond baseline": sys_admin,
        "a debug container with one": debug,
        "the host's PID namespace": pod(hostPID=True),
        "the host's network": pod(hostNetwork=True),
    }
    for what, attempt in refused_in_model_namespace.items():
        assert refusals(policy, attempt, MODELS_NAMESPACE), f"docs: the policy admits {what} in a model namespace"
    model = _pod(_documented_deployment())
    for spelling in (
        "/var/lib//tritonshare",
        "/var/lib/./tritonshare",
        "/var/lib/tritonshare/",
        "/var/lib/tritonshare/models",
    ):
        respelled = copy.deepcopy(model)
        for volume in respelled["spec"]["volumes"]:
            if "hostPath" in volume:
                volume["hostPath"]["path"] = spelling
        assert refusals(policy, respelled, MODELS_NAMESPACE), f"docs: the policy admits the folder as {spelling}"
        assert refusals(policy, pod(host_path=spelling), {"metadata": {"name": "other"}}), spelling
    baseline = pod()
    baseline["spec"]["containers"][0]["securityContext"] = {"capabilities": {"add": ["NET_BIND_SERVICE"]}}
    assert refusals(policy, baseline, MODELS_NAMESPACE) == [], "docs: the policy refuses what baseline admits"
    exporter = pod(host_path="/", hostPID=True, hostNetwork=True)
    monitoring = {"metadata": {"name": "monitoring", "labels": {}}}
    assert refusals(policy, exporter, monitoring) == [], (
        "docs: the policy refuses a node exporter outside model namespaces"
    )
