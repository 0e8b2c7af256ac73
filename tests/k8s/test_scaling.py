"""GPU-memory-aware placement and per-model autoscaling as the overlays wire them: Triton pods that own whole
GPUs advertise their GPU memory (NVML) and the models placed on them request a share of it; every Triton
overlay opens its metrics port to the proxies, which re-export their own model's series for one PodMonitor;
an HPA scales a model's Deployment on the prometheus-adapter metric and owns its replica count.
"""

from __future__ import annotations

from urllib.parse import urlsplit

import pytest
import yaml

from tests.k8s.kustomize import Build, container, containers, pod_labels, selector_matches
from tests.k8s.workloads import (
    MODEL_LABEL,
    PLATFORM,
    cli_params,
    component_of,
    flags,
    has_container,
    models,
    monitored,
    port_number,
    triton_container,
    triton_of,
    tritons,
)
from tritonshare.proxy.triton_metrics import default_url

SLICED_GPU_RESOURCES = ("nvidia.com/mig-", "nvidia.com/gpumem")  # NVML reports the parent GPU there


# --- placement ---------------------------------------------------------------------------------------------


def test_advertise_reads_nvml_only_where_triton_owns_whole_gpus(
    builds: dict[str, Build], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert has_container(builds["overlays/gpu"], "advertise")
    for name, daemonset in tritons(builds):
        if not has_container(builds[name], "advertise"):
            continue
        advertise, triton = container(daemonset, "advertise"), triton_container(daemonset)
        assert advertise.init, f"{name}: advertise must finish before Triton starts"
        params = cli_params(advertise, builds[name], monkeypatch)
        limits = triton.spec["resources"]["limits"]
        if any(k.startswith(SLICED_GPU_RESOURCES) for k in limits):
            assert params["gpu_memory_mib"], f"{name}: on a GPU slice, state its size (--gpu-memory-mib)"
        else:
            assert params["gpu_memory_mib"] is None, f"{name}: a whole GPU is measured with NVML"
            gpus = advertise.spec["resources"]["limits"].get("nvidia.com/gpu")
            assert gpus == limits["nvidia.com/gpu"], f"{name}: NVML must see the GPUs Triton gets"


def test_model_pods_request_the_gpu_memory_their_triton_advertises(
    builds: dict[str, Build], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The example's models run on the `gpu` overlay's Triton, which advertises the node's GPU memory."""
    platform, example = builds["overlays/gpu"], builds["overlays/example"]
    resource = cli_params(container(triton_of(platform), "advertise"), platform, monkeypatch)["resource"]
    deployments = [d for d in example.of_kind("Deployment") if component_of(d) == "model"]
    assert len(deployments) == 2, "the example shows two models"
    for deployment in deployments:
        app = [c for c in containers(deployment) if not c.init]
        mib = sum(int(c.spec["resources"]["limits"].get(resource, 0)) for c in app)
        assert mib > 0, f"example: {deployment['metadata']['name']} requests no {resource}"
        for c in app:  # extended resources: requests, if stated, must equal limits
            requested = c.spec["resources"].get("requests", {}).get(resource)
            assert requested in (None, c.spec["resources"]["limits"].get(resource)), c.where


# --- metrics -----------------------------------------------------------------------------------------------


def test_every_triton_overlay_opens_its_metrics_to_the_proxies(builds: dict[str, Build]) -> None:
    for name, _ in tritons(builds):
        if name.startswith("overlays/"):
            assert monitored(builds[name]), f"{name}: without k8s/components/monitoring, no per-model metrics"


def test_proxies_read_triton_metrics_through_the_service(
    builds: dict[str, Build], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, deployment in models(builds, overlays_only=True):
        platform = builds[name] if builds[name].of_kind("DaemonSet") else builds[PLATFORM]
        assert monitored(platform), name
        params = cli_params(container(deployment, "proxy"), builds[name], monkeypatch)
        configured = params.get("triton_metrics_url")  # None: Triton's host at port 8002
        url = urlsplit(default_url(params["triton_url"]) if configured is None else configured)
        assert url.hostname, f"{name}: the proxy's Triton metrics are off"
        service_name, namespace, _ = url.hostname.split(".", 2)
        ports = {p["port"]: p for p in platform.get("Service", service_name, namespace)["spec"]["ports"]}
        assert url.port in ports, f"{name}: {url.geturl()} is no port of Service {service_name}"
        triton = triton_container(triton_of(platform))
        metrics_port = int(flags(triton.spec["args"])["metrics-port"])
        assert port_number(triton, ports[url.port]["targetPort"]) == metrics_port, f"{name}: {url.geturl()}"
        policy = platform.get("NetworkPolicy", "tritonshare-triton", namespace)["spec"]
        admitted = {port_number(triton, p["port"]) for rule in policy["ingress"] for p in rule["ports"]}
        assert metrics_port in admitted, f"{name}: the NetworkPolicy refuses the proxy's metrics reads"


def test_pod_monitor_scrapes_each_proxy_never_triton(builds: dict[str, Build], monkeypatch: pytest.MonkeyPatch) -> None:
    spec = builds[PLATFORM].one("PodMonitor")["spec"]
    assert spec["namespaceSelector"] == {"any": True}, "model pods live in tenants' namespaces"
    # Triton's own page holds every tenant's series: the PodMonitor must not select Triton pods.
    assert not selector_matches(spec["selector"], pod_labels(triton_of(builds[PLATFORM])))
    for name, deployment in models(builds, overlays_only=True):
        assert selector_matches(spec["selector"], pod_labels(deployment)), f"{name}: its pods are not scraped"
        proxy = container(deployment, "proxy")
        metrics_port = cli_params(proxy, builds[name], monkeypatch)["metrics_port"]
        endpoints = [(port_number(proxy, e["port"]), e["path"]) for e in spec["podMetricsEndpoints"]]
        assert endpoints == [(metrics_port, "/metrics")] and metrics_port > 0, f"{name}: scrapes {endpoints}"


# --- autoscaling -------------------------------------------------------------------------------------------


def test_hpa_scales_its_model_deployment_and_owns_the_replica_count(builds: dict[str, Build]) -> None:
    hpas = [(n, h) for n, b in builds.items() for h in b.of_kind("HorizontalPodAutoscaler")]
    assert any(n.startswith("overlays/") for n, _ in hpas), "no overlay shows per-model autoscaling"
    adapter = builds[PLATFORM].get("ConfigMap", "tritonshare-prometheus-adapter")
    served = {rule["name"]["as"] for rule in yaml.safe_load(adapter["data"]["config.yaml"])["rules"]}
    for name, hpa in hpas:
        spec, meta = hpa["spec"], hpa["metadata"]
        ref = spec["scaleTargetRef"]
        assert (ref["apiVersion"], ref["kind"]) == ("apps/v1", "Deployment"), f"{name}: {ref}"
        target = builds[name].get("Deployment", ref["name"], meta.get("namespace"))
        assert component_of(target) == "model", f"{name}: the HPA scales {ref['name']}, not a model"
        assert "replicas" not in target["spec"], f"{name}: `kubectl apply` would reset the HPA's replica count"
        assert meta["labels"][MODEL_LABEL] == pod_labels(target)[MODEL_LABEL], name
        assert 1 <= spec["minReplicas"] <= spec["maxReplicas"], name
        for metric in spec["metrics"]:
            assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] in served, f"{name}: {metric}"
