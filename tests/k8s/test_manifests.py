"""The manifests as a platform team receives them: every overlay builds with kustomize 5.7 (kubectl 1.35),
every object validates against the Kubernetes 1.35 schemas, the kustomize sources follow the conventions
(one object per base file, current fields only, placeholder images pinned by every overlay), and every
container of every build is hardened and bounded.

Triton and model-pod semantics are in test_workloads.py.
"""

from __future__ import annotations

import copy
import re
import shutil
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.k8s.conftest import BUILDS, OVERLAYS
from tests.k8s.hardening import check_bounded, check_hardened
from tests.k8s.kustomize import (
    K8S,
    KUBERNETES_VERSION,
    WORKLOAD_KINDS,
    Build,
    build,
    containers,
    name_of,
    pod_spec,
)
from tests.k8s.workloads import TRITONSHARE_IMAGE, component_of, triton_of
from tritonshare import __version__ as PROJECT_VERSION

# Images as the bases name them; the overlays pin them with `images:`.
PLACEHOLDER_IMAGES = {"tritonshare", "tritonserver"}  # the bases'
ADVERTISE_IMAGE = "tritonshare-advertise"  # the tritonshare image in Triton's pod, pinned apart (advertise component)

# Custom resources (no Kubernetes schema to check them against), each with the reason it is here. Anything
# else without a schema is a typo in apiVersion/kind and fails.
CUSTOM_RESOURCES = {
    ("monitoring.coreos.com/v1", "PodMonitor"): "Prometheus Operator; components/monitoring (GPU-memory issue)",
}

# kustomization fields kustomize 5 deprecates (each has a current replacement), and the current ones.
DEPRECATED_FIELDS = {
    "bases", "commonLabels", "patchesStrategicMerge", "patchesJson6902", "vars", "imageTags", "crds",
}  # fmt: skip
CURRENT_FIELDS = {
    "apiVersion", "kind", "resources", "components", "namespace", "namePrefix", "nameSuffix", "labels",
    "commonAnnotations", "patches", "images", "replicas", "configMapGenerator", "secretGenerator",
    "generatorOptions", "replacements", "helmCharts", "openapi", "buildMetadata", "sortOptions",
}  # fmt: skip


def _holds_workloads(base: Path) -> bool:
    return any(f"kind: {kind}" in f.read_text() for f in base.glob("*.yaml") for kind in WORKLOAD_KINDS)


WORKLOAD_BASES = [p for p in sorted((K8S / "base").iterdir()) if _holds_workloads(p)]


def kustomization_files() -> list[Path]:
    return sorted(K8S.rglob("kustomization.yaml"))


# --- building and schema validation ----------------------------------------------------------------------


@pytest.mark.parametrize("name", BUILDS)
def test_every_object_validates_against_the_kubernetes_schemas(builds: dict[str, Build], name: str) -> None:
    built = builds[name]
    assert built.objects, f"{name} builds to nothing"
    for obj in built.objects:
        if (obj["apiVersion"], obj["kind"]) in CUSTOM_RESOURCES:
            assert obj["metadata"].get("name") and isinstance(obj.get("spec"), dict), name_of(obj)
            continue
        try:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.SchemaNotFoundError as exc:  # a CRD or a typo in apiVersion/kind
            pytest.fail(f"{name}: {name_of(obj)} has no Kubernetes {KUBERNETES_VERSION} schema: {exc.message}")
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            pytest.fail(f"{name}: {name_of(obj)} is invalid at {path}: {exc.message}")


def test_schema_validation_is_strict(builds: dict[str, Build]) -> None:
    """A misspelled field must fail validation, or the test above proves nothing."""
    workload = copy.deepcopy(triton_of(builds["overlays/gpu"]))
    pod_spec(workload)["containers"][0]["securityContxt"] = {"runAsNonRoot": True}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(workload, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("name", BUILDS)
def test_kustomize_builds_without_warnings(builds: dict[str, Build], name: str) -> None:
    assert builds[name].stderr.strip() == "", f"kustomize warned while building {name}"


# --- kustomize sources ------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", kustomization_files(), ids=lambda p: str(p.relative_to(K8S)))
def test_kustomizations_use_current_fields_only(path: Path) -> None:
    doc = yaml.safe_load(path.read_text())
    used = set(doc)
    assert not used & DEPRECATED_FIELDS, f"{path}: deprecated kustomize fields {sorted(used & DEPRECATED_FIELDS)}"
    assert used <= CURRENT_FIELDS, f"{path}: unknown kustomize fields {sorted(used - CURRENT_FIELDS)}"
    versions = {"Component": "kustomize.config.k8s.io/v1alpha1", "Kustomization": "kustomize.config.k8s.io/v1beta1"}
    assert versions.get(doc.get("kind")) == doc.get("apiVersion"), f"{path}: apiVersion/kind"
    if path.parent.parent == K8S / "components":
        assert doc["kind"] == "Component", f"{path}: k8s/components/* must be kustomize Components"
    for patch in doc.get("patches", []):
        assert "path" in patch or "patch" in patch, f"{path}: a patch without content: {patch}"


@pytest.mark.parametrize("base", sorted((K8S / "base").iterdir()), ids=lambda p: p.name)
def test_base_holds_one_object_per_file(base: Path) -> None:
    kustomization = yaml.safe_load((base / "kustomization.yaml").read_text())
    listed = set(kustomization.get("resources", []))
    for f in sorted(base.glob("*.yaml")):
        if f.name == "kustomization.yaml":
            continue
        assert f.name in listed, f"{f} is not listed in {base}/kustomization.yaml resources"
        docs = [d for d in yaml.safe_load_all(f.read_text()) if d]
        assert len(docs) == 1, f"{f} holds {len(docs)} objects; the base keeps one object per file"
        assert f.stem == docs[0]["kind"].lower(), f"{f} holds a {docs[0]['kind']}: name the file after it"


# --- images ---------------------------------------------------------------------------------------------


def _images(objects: list[dict[str, Any]]) -> set[str]:
    return {c.spec["image"] for o in objects if o["kind"] in ("Deployment", "DaemonSet") for c in containers(o)}


def test_node_folder_settings_are_shared_by_both_bases() -> None:
    """Paths and lease TTL come from one file for the model pods and gc (k8s/base/node-folder)."""
    for base in ("model", "gc"):
        resources = yaml.safe_load((K8S / "base" / base / "kustomization.yaml").read_text())["resources"]
        assert "../node-folder" in resources, f"k8s/base/{base} must include the shared node-folder settings"


@pytest.mark.parametrize("base", WORKLOAD_BASES, ids=lambda p: p.name)
def test_bases_name_placeholder_images(base: Path) -> None:
    objects = [d for f in base.glob("*.yaml") for d in yaml.safe_load_all(f.read_text()) if d and "kind" in d]
    images = _images(objects)
    assert images and images <= PLACEHOLDER_IMAGES, f"{base}: images {images} are not the placeholders"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlays_pin_every_image(overlay_builds: dict[str, Build], overlay: str) -> None:
    for image in _images(overlay_builds[overlay].objects):
        assert image not in PLACEHOLDER_IMAGES | {ADVERTISE_IMAGE}, (
            f"overlays/{overlay} leaves image {image!r} unpinned"
        )
        tag = image.rsplit("@", 1)[1] if "@" in image else image.rsplit(":", 1)[-1]
        assert ("@" in image or ":" in image.rsplit("/", 1)[-1]) and tag != "latest", (
            f"overlays/{overlay}: image {image!r} is not pinned to a tag or digest"
        )
        if TRITONSHARE_IMAGE.match(image) and "@" not in image:
            assert tag == PROJECT_VERSION, (
                f"overlays/{overlay}: {image} is not the image of this release ({PROJECT_VERSION})"
            )


def test_all_overlays_pin_the_same_images(overlay_builds: dict[str, Build]) -> None:
    by_repo: dict[str, set[str]] = {}
    for b in overlay_builds.values():
        for image in _images(b.objects):
            by_repo.setdefault(re.split(r"[:@]", image.rsplit("/", 1)[-1])[0], set()).add(image)
    assert by_repo.keys() == PLACEHOLDER_IMAGES
    for repo, pinned in by_repo.items():
        assert len(pinned) == 1, f"overlays disagree on the {repo} image: {sorted(pinned)}"


PLATFORM_OVERLAYS = [  # the overlays holding Triton's half
    o
    for o in OVERLAYS
    if "../../base/triton" in yaml.safe_load((K8S / "overlays" / o / "kustomization.yaml").read_text())["resources"]
]


@pytest.mark.parametrize("overlay", PLATFORM_OVERLAYS)
def test_a_tritonshare_upgrade_leaves_triton_running(
    overlay_builds: dict[str, Build], overlay: str, tmp_path: Path
) -> None:
    """Any change to Triton's pod restarts Triton, and every model of the node with it: a new `tritonshare`
    pin or a changed node-folder.env must roll gc (and model pods) alone. Rendered from a copy of k8s/ with
    both changed."""
    copy_ = tmp_path / "k8s"
    shutil.copytree(K8S, copy_)
    kustomization = copy_ / "overlays" / overlay / "kustomization.yaml"
    doc = yaml.safe_load(kustomization.read_text())
    (pin,) = [i for i in doc["images"] if i["name"] == "tritonshare"]
    pin["newTag"] = "99.0.0"
    kustomization.write_text(yaml.safe_dump(doc))
    env = copy_ / "base" / "node-folder" / "node-folder.env"
    env.write_text(env.read_text().replace("TRITONSHARE_LEASE_TTL_S=600", "TRITONSHARE_LEASE_TTL_S=900"))
    before, after = overlay_builds[overlay], build(kustomization.parent, name=f"{overlay} upgraded")

    def daemonset(b: Build, component: str) -> dict[str, Any]:
        (found,) = [d for d in b.of_kind("DaemonSet") if component_of(d) == component]
        return found

    assert daemonset(after, "gc") != daemonset(before, "gc"), "the change did not reach gc: the test proves nothing"
    assert daemonset(after, "triton") == daemonset(before, "triton"), (
        f"overlays/{overlay}: upgrading tritonshare changes Triton's DaemonSet, which restarts Triton on every node"
    )


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlays_replace_every_placeholder(overlay_builds: dict[str, Build], overlay: str) -> None:
    text = yaml.safe_dump_all(overlay_builds[overlay].objects)
    assert "PLACEHOLDER" not in text, f"overlays/{overlay} leaves a PLACEHOLDER of the base in place"


# --- hardened, bounded containers -------------------------------------------------------------------------


@pytest.mark.parametrize("name", BUILDS)
def test_every_container_is_hardened_and_bounded(builds: dict[str, Build], name: str) -> None:
    checked = 0
    for workload in builds[name].workloads():
        spec = pod_spec(workload)
        assert spec.get("automountServiceAccountToken") is False, f"{name_of(workload)}: mounts an API token"
        for flag in ("hostNetwork", "hostPID", "hostIPC"):
            assert not spec.get(flag, False), f"{name_of(workload)}: {flag}"
        for c in containers(workload):
            check_hardened(c)
            check_bounded(c)
            checked += 1
    assert checked, f"{name} builds no containers"


def test_root_exception_is_the_documented_one(builds: dict[str, Build]) -> None:
    """The one root container exists, runs as UID 0 and only chowns the node folder to the image's UID."""
    daemonset = triton_of(builds["overlays/gpu"])
    node_folder = next(c for c in containers(daemonset) if c.name == "node-folder")
    assert node_folder.effective("runAsUser") == 0 and node_folder.effective("runAsNonRoot") is False
    argv = node_folder.spec["command"] + node_folder.spec.get("args", [])
    assert argv == ["chown", "65532:65532", node_folder.mount("node-folder")["mountPath"]], (  # type: ignore[index]
        f"the root init container must chown the node folder itself, nothing else: {argv}"
    )
