"""The hardening every container of every build must show (CONVENTIONS: Kubernetes manifests and images)."""

from __future__ import annotations

from tests.k8s.kustomize import Container

# The one container allowed to run as root, and exactly how (k8s/base/triton/daemonset.yaml says why:
# the kubelet creates the hostPath folder root-owned and fsGroup does not apply to hostPath, so someone
# must chown it once for the non-root loader). Anything else running as root fails the suite.
ROOT_EXCEPTIONS = {("DaemonSet", "node-folder"): {"add": ["CHOWN"], "mounts": ["node-folder"]}}


def check_hardened(c: Container) -> None:
    exception = ROOT_EXCEPTIONS.get((c.workload["kind"], c.name))
    sc = c.spec.get("securityContext", {})
    assert isinstance(c.effective("runAsUser"), int), f"{c.where}: runAsUser must be numeric"
    assert sc.get("allowPrivilegeEscalation") is False, f"{c.where}: allowPrivilegeEscalation must be false"
    assert sc.get("readOnlyRootFilesystem") is True, f"{c.where}: readOnlyRootFilesystem must be true"
    assert sc.get("privileged", False) is False, f"{c.where}: privileged"
    assert sc.get("capabilities", {}).get("drop") == ["ALL"], f"{c.where}: capabilities must drop ALL"
    assert (c.effective("seccompProfile") or {}).get("type") == "RuntimeDefault", f"{c.where}: seccomp"
    if exception is None:
        assert c.effective("runAsNonRoot") is True, f"{c.where}: runAsNonRoot must be true"
        assert c.effective("runAsUser") != 0, f"{c.where}: runs as root"
        assert "add" not in sc.get("capabilities", {}), f"{c.where}: adds capabilities"
    else:
        assert sc["capabilities"].get("add") == exception["add"], f"{c.where}: the root exception grew"
        assert [m["name"] for m in c.spec.get("volumeMounts", [])] == exception["mounts"], c.where
        assert c.init, f"{c.where}: the root exception is for a run-once init container only"


def check_bounded(c: Container) -> None:
    resources = c.spec.get("resources", {})
    for kind in ("requests", "limits"):
        missing = {"cpu", "memory"} - set(resources.get(kind, {}))
        assert not missing, f"{c.where}: resources.{kind} lacks {sorted(missing)}"
