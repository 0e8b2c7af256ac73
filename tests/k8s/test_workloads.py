"""What the built workloads must mean: Triton in POLL mode over the node folder, reachable only by model pods
on its own node; each model pod loading then proxying ONE name, from one place, with the CLI reading exactly
the environment the manifests give it.

Each test walks every build (overlays, and components on their base) that holds the objects it is about.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from tests.k8s.kustomize import (
    Build,
    Container,
    container,
    containers,
    environment,
    host_path_of,
    mount_for,
    pod_labels,
    pod_spec,
    selector_matches,
    volume,
)
from tests.k8s.workloads import (
    MODEL_LABEL,
    NODE_ROOT,
    PLATFORM,
    SHUTDOWN_MARGIN_S,
    TRITONSHARE_IMAGE,
    cli_params,
    flags,
    has_container,
    models,
    monitored,
    port_number,
    triton_container,
    triton_of,
    tritons,
    worst_case_shutdown_s,
)
from tests.support.triton import TritonServer, triton_available, triton_venv
from tritonshare.cli import main as cli

# --- Triton ------------------------------------------------------------------------------------------------


def test_triton_runs_in_poll_mode_with_tenant_safe_flags(builds: dict[str, Build]) -> None:
    for name, daemonset in tritons(builds):
        triton = triton_container(daemonset)
        command = triton.spec["command"]
        assert command[:2] == ["sh", "-c"] and command[3:] == ["tritonserver"], f"{name}: {triton.where} command"
        assert command[2].endswith('; exec tritonserver "$@"'), f"{name}: the shell must exec Triton with its args"
        f = flags(triton.spec["args"])
        assert f.get("model-control-mode") == "poll", f"{name}: Triton must run in POLL mode"
        assert 0 < int(f.get("repository-poll-secs", "15")) <= 5, f"{name}: --repository-poll-secs must be short"
        assert f.get("exit-on-error") == "false", f"{name}: one bad model would stop the server"
        assert triton.env_value("PYTHONDONTWRITEBYTECODE") == {"name": "PYTHONDONTWRITEBYTECODE", "value": "1"}, (
            f"{name}: without PYTHONDONTWRITEBYTECODE=1 POLL mode reloads Python models (REFERENCE §1)"
        )


@pytest.mark.triton
def test_triton_flags_exist_in_the_real_tritonserver(builds: dict[str, Build], tmp_path: Path) -> None:
    if not triton_available():
        pytest.fail(f"no Triton venv at {triton_venv()} — run scripts/setup.sh first")
    cmd, env = TritonServer(repository=tmp_path, log_path=tmp_path / "log").command()
    env["PATH"] = f"{Path(cmd[0]).parent}:{env['PATH']}"
    _, daemonset = next(tritons(builds))
    start = start_command(triton_container(daemonset), tmp_path)  # the container's own command, run for real
    proc = subprocess.run([*start, "--help"], env=env, capture_output=True, text=True, timeout=60, check=False)
    usage = proc.stdout + proc.stderr  # tritonserver prints its usage on stderr
    supported = set(re.findall(r"^\s+--([a-z0-9-]+)", usage, re.MULTILINE))
    assert "model-control-mode" in supported, usage[:500]
    for name, daemonset in tritons(builds):
        unknown = sorted(set(flags(triton_container(daemonset).spec["args"])) - supported)
        assert not unknown, f"{name}: tritonserver has no flags {unknown}"


def start_command(triton: Container, shm: Path) -> list[str]:
    """The Triton container's command, clearing ``shm`` instead of the pod's /dev/shm."""
    command = list(triton.spec["command"])
    assert command[2].count("/dev/shm/") == 1, f"{triton.where}: {command[2]!r} names /dev/shm once"
    command[2] = command[2].replace("/dev/shm/", f"{shm}/")
    return command


def test_triton_start_removes_the_regions_of_an_earlier_run_and_nothing_else(
    builds: dict[str, Build], tmp_path: Path
) -> None:
    """/dev/shm is the pod's: a Triton that crashed leaves its Python backend stubs' regions there, counted
    against the pod's memory, restart after restart. The container's command removes them, then becomes
    tritonserver (the same PID, so the kubelet's SIGTERM reaches Triton) with the manifest's arguments."""
    shm, bin_dir = tmp_path / "shm", tmp_path / "bin"
    shm.mkdir()
    bin_dir.mkdir()
    seen = tmp_path / "seen"
    fake = bin_dir / "tritonserver"
    fake.write_text(f'#!/bin/sh\necho $$ > {seen}.pid\nprintf "%s\\n" "$@" > {seen}\nexit 7\n')
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    for name, daemonset in tritons(builds):
        triton = triton_container(daemonset)
        leftovers = [shm / f"triton_python_backend_shm_region_{n}" for n in ("0b2c", "9f1e")]
        kept = [shm / "triton_python_backend_shm_region", shm / "other_tool_region", shm / "stub_region_0b2c"]
        for path in (*leftovers, *kept):
            path.write_bytes(b"\0" * 4096)
        proc = subprocess.Popen([*start_command(triton, shm), *triton.spec["args"]], env=env)
        assert proc.wait(timeout=30) == 7, f"{name}: Triton's exit status is not the container's"
        assert int((tmp_path / "seen.pid").read_text()) == proc.pid, f"{name}: the shell stays Triton's parent"
        assert seen.read_text().splitlines() == triton.spec["args"], f"{name}: Triton got other arguments"
        assert [p.name for p in leftovers if p.exists()] == [], f"{name}: regions of an earlier run left"
        assert all(p.exists() for p in kept), f"{name}: removed what is not a Python backend region"


def test_triton_probes_ask_live_never_ready(builds: dict[str, Build]) -> None:
    """Strict readiness is false while ANY model is not ready: one tenant would cut off all (REFERENCE §2)."""
    for name, daemonset in tritons(builds):
        triton = triton_container(daemonset)
        http_port = int(flags(triton.spec["args"])["http-port"])
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            get = triton.spec[probe]["httpGet"]
            assert get["path"] == "/v2/health/live", f"{name}: {probe} asks {get['path']}"
            assert port_number(triton, get["port"]) == http_port, f"{name}: {probe} is not on Triton's HTTP port"


# Triton answers /v2/health/live only once every model in its repository has loaded (up to 4 at a time,
# --model-load-thread-count; measured with Triton 2.51: six Python models whose initialize() sleeps 10 s → live
# after 22.9 s). A node's LLMs or TensorRT engines can take many minutes in all: a startup probe that gives up
# sooner restarts Triton mid-load, forever, and every tenant of the node stays down.
TRITON_START_BUDGET_S = 3600


def test_triton_startup_probe_waits_for_a_whole_repository_to_load(builds: dict[str, Build]) -> None:
    for name, daemonset in tritons(builds):
        probe = triton_container(daemonset).spec["startupProbe"]
        budget = probe.get("periodSeconds", 10) * probe.get("failureThreshold", 3)
        assert budget >= TRITON_START_BUDGET_S, (
            f"{name}: Triton is killed {budget}s into its start-up, before a node's models may all have loaded"
        )


def test_triton_reads_the_node_folder_and_owns_a_gpu(builds: dict[str, Build]) -> None:
    for name, daemonset in tritons(builds):
        triton = triton_container(daemonset)
        repository = flags(triton.spec["args"])["model-repository"]
        assert host_path_of(triton, repository) == f"{NODE_ROOT}/models", f"{name}: repository not on the node"
        mount = mount_for(triton, repository)
        # Triton runs tenants' code (Python/BLS models): it must not be able to rewrite other models.
        assert mount is not None and mount.get("readOnly") is True, f"{name}: Triton mounts the folder writable"
        assert volume(daemonset, mount["name"])["hostPath"]["type"] == "DirectoryOrCreate"
        limits = triton.spec["resources"]["limits"]
        gpus = [k for k in limits if k == "nvidia.com/gpu" or k.startswith("nvidia.com/mig-")]
        assert gpus, f"{name}: Triton requests no GPU: {limits}"


def test_gpu_flavours(builds: dict[str, Build]) -> None:
    limits = {
        n: triton_container(triton_of(builds[f"overlays/{n}"])).spec["resources"]["limits"]
        for n in ("gpu", "mig", "hami")
    }
    assert limits["gpu"]["nvidia.com/gpu"] == 1
    assert "nvidia.com/gpu" not in limits["mig"] and limits["mig"]["nvidia.com/mig-1g.5gb"] == 1
    assert {"nvidia.com/gpu", "nvidia.com/gpumem", "nvidia.com/gpucores"} <= set(limits["hami"])


def test_gpu_placement_follows_kserve_node_scheduling(builds: dict[str, Build]) -> None:
    toleration = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    for name in ("overlays/gpu", "overlays/mig"):
        spec = pod_spec(triton_of(builds[name]))
        assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}, name
        assert toleration in spec["tolerations"], name
    assert pod_spec(triton_of(builds["overlays/hami"]))["nodeSelector"] == {"gpu": "on"}
    for name, deployment in models(builds, overlays_only=True):
        assert toleration in pod_spec(deployment).get("tolerations", []), f"{name}: model pods need the toleration"


def test_triton_service_routes_to_the_callers_node_only(builds: dict[str, Build]) -> None:
    for name, daemonset in tritons(builds):
        triton, f = triton_container(daemonset), flags(triton_container(daemonset).spec["args"])
        service = builds[name].get("Service", "tritonshare-triton", daemonset["metadata"].get("namespace"))
        spec = service["spec"]
        assert spec["internalTrafficPolicy"] == "Local", f"{name}: model pods must reach their own node's Triton"
        assert selector_matches({"matchLabels": spec["selector"]}, pod_labels(daemonset))
        targets = {p["port"]: port_number(triton, p["targetPort"]) for p in spec["ports"]}
        expected = {8000: int(f["http-port"]), 8001: int(f["grpc-port"])}
        if monitored(builds[name]):  # for the proxies' re-export; admitted for model pods only
            expected[8002] = int(f["metrics-port"])
        assert targets == expected, f"{name}: Triton's metrics port reports every tenant: only with monitoring"


def test_network_policy_admits_only_model_pods_and_gc(builds: dict[str, Build]) -> None:
    example, platform = builds["overlays/example"], builds["overlays/gpu"]  # the example's models, on gpu's Triton
    policy, daemonset = platform.get("NetworkPolicy", "tritonshare-triton"), triton_of(platform)
    spec = policy["spec"]
    assert selector_matches(spec["podSelector"], pod_labels(daemonset)), "the policy must select Triton's pods"
    assert set(spec["policyTypes"]) == {"Ingress", "Egress"} and spec["egress"] == []
    allowed_ns = example.get("Namespace", "tritonshare-demo")["metadata"]["labels"]
    model = pod_labels(next(o for _, o in models({"example": example})))

    def admitted(pod: dict[str, str], namespace: dict[str, str]) -> bool:
        """A peer without a namespaceSelector stands for pods of the policy's own namespace (gc's)."""
        peers = [peer for rule in spec["ingress"] for peer in rule["from"]]
        assert all(set(peer) <= {"namespaceSelector", "podSelector"} and "podSelector" in peer for peer in peers)
        own = {"kubernetes.io/metadata.name": policy["metadata"]["namespace"]}
        return any(
            selector_matches(p.get("namespaceSelector", {"matchLabels": own}), namespace)
            and selector_matches(p["podSelector"], pod)
            for p in peers
        )

    assert admitted(model, allowed_ns), "the example's model pods must reach Triton"
    assert not admitted(model, {"kubernetes.io/metadata.name": "other"}), "a namespace not allowed got in"
    assert not admitted({"app": "anything"}, allowed_ns), "a pod without the model label got in"
    assert not admitted(pod_labels(daemonset), allowed_ns)
    gc_pods, own = (
        pod_labels(platform.get("DaemonSet", "tritonshare-gc", "tritonshare")),
        {"kubernetes.io/metadata.name": "tritonshare"},
    )
    assert admitted(gc_pods, own) and not admitted(gc_pods, allowed_ns), "gc's pods, from Triton's namespace only"
    triton, f = triton_container(daemonset), flags(triton_container(daemonset).spec["args"])
    ports = {port_number(triton, p["port"]) for rule in spec["ingress"] for p in rule["ports"]}
    expected = {int(f["http-port"]), int(f["grpc-port"])}
    assert monitored(platform), "the platform overlay shows per-model metrics"
    assert ports == expected | {int(f["metrics-port"])}, f"HTTP, gRPC and (monitoring) metrics only: {ports}"


def test_triton_pods_reach_nothing_but_the_api_server_and_only_to_advertise(builds: dict[str, Build]) -> None:
    """Triton runs tenants' code: its pod gets no egress, except HTTPS for the advertise init container (a
    NetworkPolicy applies to the whole pod) where that component is used."""
    for name, daemonset in tritons(builds):
        b = builds[name]
        namespace = daemonset["metadata"]["namespace"]
        policies = [
            p["spec"]
            for p in b.of_kind("NetworkPolicy")
            if p["metadata"].get("namespace") == namespace
            and selector_matches(p["spec"]["podSelector"], pod_labels(daemonset))
        ]
        assert any("Egress" in p["policyTypes"] and p.get("egress") == [] for p in policies), f"{name}: egress open"
        opened = [rule for p in policies if "Egress" in p["policyTypes"] for rule in p.get("egress", [])]
        if not has_container(b, "advertise"):
            assert not opened, f"{name}: egress from Triton's pod without the advertise component: {opened}"
            continue
        for rule in opened:
            assert rule.get("ports"), f"{name}: egress from Triton's pod to every port: {rule}"
            ports = {(port["port"], port.get("protocol", "TCP")) for port in rule["ports"]}
            assert ports <= {(443, "TCP"), (6443, "TCP")}, f"{name}: egress beyond the API server: {rule}"


# --- model pods --------------------------------------------------------------------------------------------


def test_model_pod_loads_then_proxies_one_name_set_once(builds: dict[str, Build]) -> None:
    for name, deployment in models(builds):
        spec = pod_spec(deployment)
        assert [c["name"] for c in spec["initContainers"]] == ["load"], name
        assert [c["name"] for c in spec["containers"]] == ["proxy"], name
        load, proxy = container(deployment, "load"), container(deployment, "proxy")
        assert load.spec["args"] == ["load"] and proxy.spec["args"] == ["proxy"], name
        ref = {"fieldRef": {"fieldPath": f"metadata.labels['{MODEL_LABEL}']"}}
        for c in (load, proxy):
            assert c.env_value("TRITONSHARE_NAME") == {"name": "TRITONSHARE_NAME", "valueFrom": ref}, c.where
        assert load.spec["envFrom"] == proxy.spec["envFrom"], f"{name}: loader and proxy read different settings"
        assert MODEL_LABEL in pod_labels(deployment), name


def test_every_tritonshare_container_runs_a_command_that_reads_its_environment(
    builds: dict[str, Build], monkeypatch: pytest.MonkeyPatch
) -> None:
    checked: set[str] = set()
    for name, b in builds.items():
        for workload in b.workloads():
            for c in containers(workload):
                if not TRITONSHARE_IMAGE.match(c.spec["image"]) or "command" in c.spec:
                    continue  # Triton and its init containers (NVIDIA's image)
                sub = c.spec["args"][0]
                assert sub in cli.commands, f"{name}: {c.where} runs {sub!r}, which tritonshare does not have"
                cli_params(c, b, monkeypatch)
                checked.add(sub)
    assert checked == {"load", "proxy", "gc", "advertise"}, f"containers run only {sorted(checked)}"


def test_model_environment_is_what_the_cli_reads(builds: dict[str, Build], monkeypatch: pytest.MonkeyPatch) -> None:
    for name, deployment in models(builds, overlays_only=True):
        load = cli_params(container(deployment, "load"), builds[name], monkeypatch)
        proxy = cli_params(container(deployment, "proxy"), builds[name], monkeypatch)
        assert load["name"] == proxy["name"] == pod_labels(deployment)[MODEL_LABEL], name
        assert re.match(r"^(s3|gs|https?)://", load["source"]), f"{name}: source {load['source']!r}"
        assert load["log_format"] == proxy["log_format"] == "json", f"{name}: pods want JSON logs"


def test_loader_proxy_and_triton_share_one_node_folder(
    builds: dict[str, Build], monkeypatch: pytest.MonkeyPatch
) -> None:
    triton = triton_container(triton_of(builds[PLATFORM]))
    triton_repository = host_path_of(triton, flags(triton.spec["args"])["model-repository"])
    for name, deployment in models(builds, overlays_only=True):
        for c in (container(deployment, "load"), container(deployment, "proxy")):
            params = cli_params(c, builds[name], monkeypatch)
            repository, staging = str(params["repository"]), str(params["staging"])
            assert host_path_of(c, repository) == triton_repository, f"{c.where}: not Triton's repository"
            assert host_path_of(c, staging) == f"{NODE_ROOT}/staging", f"{c.where}: staging {staging}"
            mount = mount_for(c, repository)
            # One mount, or the publishing rename(2) from staging into the repository fails with EXDEV.
            assert mount is not None and mount is mount_for(c, staging), f"{c.where}: staging on another mount"
            assert not mount.get("readOnly", False), f"{c.where}: must write the node folder"
        assert volume(deployment, "node-folder")["hostPath"]["type"] == "Directory", name


def test_proxy_readiness_is_its_own_model(builds: dict[str, Build], monkeypatch: pytest.MonkeyPatch) -> None:
    for name, deployment in models(builds, overlays_only=True):
        proxy = container(deployment, "proxy")
        params = cli_params(proxy, builds[name], monkeypatch)
        get = proxy.spec["readinessProbe"]["httpGet"]
        assert get["path"] == "/v2/health/ready", name
        # The metrics port: the REST port's --max-connections can be filled by anyone, the probe turned away.
        assert params["metrics_port"], f"{name}: the metrics port (the probe's) is off"
        assert port_number(proxy, get["port"]) == params["metrics_port"], f"{name}: probe not on the metrics port"
        assert "livenessProbe" not in proxy.spec, f"{name}: a Triton-dependent liveness restarts every proxy"


def test_grace_period_outlasts_the_drain_and_the_unload(
    builds: dict[str, Build], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Killed mid-unload, the proxy leaves the model loaded until its lease expires and gc removes it."""
    for name, deployment in models(builds, overlays_only=True):
        proxy = container(deployment, "proxy")
        needed = worst_case_shutdown_s(proxy, cli_params(proxy, builds[name], monkeypatch))
        grace = pod_spec(deployment)["terminationGracePeriodSeconds"]
        assert grace >= needed + SHUTDOWN_MARGIN_S, (
            f"{name}: terminationGracePeriodSeconds {grace} < {needed:g}s (preStop + drain + the unload's two "
            f"waits and Triton calls, see worst_case_shutdown_s) + {SHUTDOWN_MARGIN_S}s for the delete and exit"
        )


def test_one_replica_of_a_model_per_node_and_models_may_share(builds: dict[str, Build]) -> None:
    example = list(models({"example": builds["overlays/example"]}))
    assert len({pod_labels(d)[MODEL_LABEL] for _, d in example}) == 2, "the example shows two models"
    for name, deployment in models(builds):
        terms = pod_spec(deployment)["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert len(terms) == 1, name
        term, labels = terms[0], pod_labels(deployment)
        assert term["topologyKey"] == "kubernetes.io/hostname" and term["namespaceSelector"] == {}, name
        assert term["matchLabelKeys"] == [MODEL_LABEL], name
        selector = term["labelSelector"]
        in_selector = set(selector.get("matchLabels", {})) | {e["key"] for e in selector.get("matchExpressions", [])}
        assert MODEL_LABEL not in in_selector, f"{name}: the API refuses a key in matchLabelKeys and labelSelector"
        resolved = selector | {
            "matchExpressions": [
                *selector.get("matchExpressions", []),
                {"key": MODEL_LABEL, "operator": "In", "values": [labels[MODEL_LABEL]]},
            ]
        }
        assert selector_matches(resolved, labels), f"{name}: a second replica could join the first on a node"
        for _, other in example:
            if pod_labels(other)[MODEL_LABEL] != labels[MODEL_LABEL]:
                assert not selector_matches(resolved, pod_labels(other)), f"{name}: keeps other models away"
        assert deployment["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0, f"{name}: surge would deadlock"


def test_disruption_budgets_drain_a_model_one_pod_at_a_time(builds: dict[str, Build]) -> None:
    budgets = [(n, p) for n, b in builds.items() if n.startswith("overlays/") for p in b.of_kind("PodDisruptionBudget")]
    assert budgets, "no overlay shows a model's disruption budget (k8s/components/disruption-budget)"
    for name, budget in budgets:
        spec, meta = budget["spec"], budget["metadata"]
        # minAvailable: 1 (or maxUnavailable: 0) on a one-replica model would block every drain of its node
        assert "minAvailable" not in spec and spec.get("maxUnavailable") == 1, f"{name}: {meta['name']}: {spec}"
        assert spec.get("unhealthyPodEvictionPolicy") == "AlwaysAllow", f"{name}: an unready pod would block drains"
        guarded = [
            d["metadata"]["name"]
            for _, d in models({name: builds[name]})
            if d["metadata"].get("namespace") == meta.get("namespace")
            and selector_matches(spec["selector"], pod_labels(d))
        ]
        assert guarded == [meta["name"]], f"{name}: {meta['name']} guards the pods of {guarded}: one model's only"


def test_model_pods_follow_the_triton_pod(builds: dict[str, Build]) -> None:
    daemonset = triton_of(builds[PLATFORM])
    for name, deployment in models(builds):
        terms = pod_spec(deployment)["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert len(terms) == 1, name
        assert terms[0]["topologyKey"] == "kubernetes.io/hostname", name
        assert terms[0]["namespaces"] == [daemonset["metadata"]["namespace"]], name
        assert selector_matches(terms[0]["labelSelector"], pod_labels(daemonset)), f"{name}: misses Triton"
        assert not selector_matches(terms[0]["labelSelector"], pod_labels(deployment)), name


def test_model_service_exposes_the_proxy_ports(builds: dict[str, Build], monkeypatch: pytest.MonkeyPatch) -> None:
    for name, deployment in models(builds, overlays_only=True):
        meta = deployment["metadata"]
        service = builds[name].get("Service", meta["name"], meta.get("namespace"))
        selector, labels = service["spec"]["selector"], pod_labels(deployment)
        assert selector.get(MODEL_LABEL) == labels[MODEL_LABEL], f"{name}: Service selects other models' pods"
        assert selector_matches({"matchLabels": selector}, labels), f"{name}: Service misses its pods"
        proxy = container(deployment, "proxy")
        params = cli_params(proxy, builds[name], monkeypatch)
        ports = {p["name"]: (p["port"], port_number(proxy, p["targetPort"])) for p in service["spec"]["ports"]}
        assert ports == {"http": (9000, params["http_port"]), "grpc": (9001, params["grpc_port"])}, name


def test_models_reach_triton_through_its_service(builds: dict[str, Build], monkeypatch: pytest.MonkeyPatch) -> None:
    platform = builds[PLATFORM]
    for name, deployment in models(builds, overlays_only=True):
        for c in (container(deployment, "load"), container(deployment, "proxy")):
            params = cli_params(c, builds[name], monkeypatch)
            endpoints = [urlsplit(params["triton_url"])]
            if "triton_grpc" in params:
                endpoints.append(urlsplit("//" + params["triton_grpc"]))
            for url in endpoints:
                service, namespace, suffix = (url.hostname or "").split(".", 2)
                assert suffix == "svc", f"{c.where}: {url.geturl()} is not a Service address"
                ports = [p["port"] for p in platform.get("Service", service, namespace)["spec"]["ports"]]
                assert url.port in ports, f"{c.where}: {url.geturl()} is not a port of Service {service}"


def test_credentials_reach_only_the_loader(builds: dict[str, Build]) -> None:
    for name, b in builds.items():
        for workload in b.workloads():
            for c in containers(workload):
                if c.name == "load":
                    continue
                env = environment(c, b)
                assert not env.from_secrets, f"{name}: {c.where} reads secrets {sorted(env.from_secrets)}"
                cloud = sorted(k for k in env.values if re.match(r"^(AWS_|GOOGLE_)", k))
                assert not cloud, f"{name}: {c.where} gets storage credentials {cloud}"
                for m in c.spec.get("volumeMounts", []):
                    assert "secret" not in volume(workload, m["name"]), f"{name}: {c.where} mounts a secret"


def test_source_overlays(builds: dict[str, Build]) -> None:
    def load(overlay: str) -> tuple[Container, Build]:
        b = builds[f"overlays/{overlay}"]
        return container(b.one("Deployment"), "load"), b

    s3, b = load("s3")
    secrets = environment(s3, b).from_secrets
    assert {k: v.get("optional", False) for k, v in secrets.items()} == {
        "AWS_ACCESS_KEY_ID": False,
        "AWS_SECRET_ACCESS_KEY": False,
        "AWS_ENDPOINT_URL": True,
        "AWS_REGION": True,
    }
    gcs_key, b = load("gcs-key")
    key_file = gcs_key.env_value("GOOGLE_APPLICATION_CREDENTIALS")["value"]  # type: ignore[index]
    mount = next(m for m in gcs_key.spec["volumeMounts"] if key_file.startswith(m["mountPath"] + "/"))
    secret = volume(gcs_key.workload, mount["name"])["secret"]
    assert mount["readOnly"] and key_file.endswith("/" + secret["items"][0]["path"])
    assert pod_spec(gcs_key.workload)["securityContext"]["fsGroup"] == gcs_key.effective("runAsUser")
    gcs, b = load("gcs")
    assert pod_spec(gcs.workload)["nodeSelector"] == {"iam.gke.io/gke-metadata-server-enabled": "true"}
    assert not environment(gcs, b).from_secrets and gcs.env_value("GOOGLE_APPLICATION_CREDENTIALS") is None
    http, b = load("http")
    assert environment(http, b).values["TRITONSHARE_SOURCE"].startswith("https://")
    assert not environment(http, b).from_secrets


def test_progress_deadline_outlasts_the_loaders_deadlines(
    builds: dict[str, Build], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rollout waits for each new pod's loader: past progressDeadlineSeconds (600 s by default) the
    Deployment reports ProgressDeadlineExceeded and `kubectl rollout status` fails while a big model loads."""
    for name, deployment in models(builds, overlays_only=True):
        load = cli_params(container(deployment, "load"), builds[name], monkeypatch)
        needed = load["download_timeout_s"] + load["timeout_s"]
        deadline = deployment["spec"].get("progressDeadlineSeconds", 600)
        assert deadline >= needed + 60, f"{name}: progressDeadlineSeconds {deadline} < the loader's {needed:g}s + 60s"


def test_the_example_holds_its_models_only(builds: dict[str, Build]) -> None:
    """Applied after the platform's overlay, the example must not apply Triton's objects again with its own
    settings (images, components), and `kubectl delete -k` of it must not delete Triton or its namespace."""
    example, platform = builds["overlays/example"], builds["overlays/gpu"]

    def key(o: dict[str, Any]) -> tuple[str, str, str | None]:
        return o["kind"], o["metadata"]["name"], o["metadata"].get("namespace")

    shared = {key(o) for o in example.objects} & {key(o) for o in platform.objects}
    assert shared == set(), f"the example applies the platform's {sorted(shared, key=str)}"
    namespaces = {o["metadata"].get("namespace") for o in example.objects if o["kind"] != "Namespace"}
    assert namespaces == {"tritonshare-demo"}, f"the example reaches into {namespaces}"
    assert [o["metadata"]["name"] for o in example.of_kind("Namespace")] == ["tritonshare-demo"]


def test_triton_is_scheduled_and_kept_ahead_of_ordinary_pods(builds: dict[str, Build]) -> None:
    """Without a priority a full node leaves Triton pending (and every model pod of the node with it), and
    memory pressure may evict it before the pods it serves."""
    for name, daemonset in tritons(builds):
        class_name = pod_spec(daemonset).get("priorityClassName")
        assert class_name, f"{name}: Triton has no priorityClassName"
        priority = builds[name].get("PriorityClass", class_name)
        assert 0 < priority["value"] <= 1_000_000_000, f"{name}: {priority['value']} (user classes: ≤ 1e9)"
        assert not priority.get("globalDefault", False), f"{name}: {class_name} would be every pod's priority"
