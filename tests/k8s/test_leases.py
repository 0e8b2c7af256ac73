"""Leases and garbage collection as the manifests wire them: every model pod tells its loader and proxy who it
is (downward API), so they hold a lease on NAME in the node's leases/ folder; beside every Triton DaemonSet, gc's
runs `tritonshare gc` over that same folder with the same lease TTL, on the same nodes, asking that node's
Triton; the node-folder init container creates leases/ for the tritonshare UID. Values are read as the real
CLI parses them.
"""

from __future__ import annotations

from urllib.parse import urlsplit

import pytest

from tests.k8s.hardening import check_bounded, check_hardened
from tests.k8s.kustomize import (
    POD_UID,
    Build,
    Container,
    container,
    containers,
    host_path_of,
    mount_for,
    pod_labels,
    pod_spec,
    selector_matches,
    volume,
)
from tests.k8s.workloads import (
    IDENTITY,
    NODE_ROOT,
    NODE_UID,
    cli_params,
    flags,
    models,
    node_agents,
    port_number,
    triton_container,
)

FOLDERS = {"repository": "models", "staging": "staging", "leases": "leases"}  # option → folder in NODE_ROOT


def test_loader_and_proxy_hold_a_lease_as_their_pod(builds: dict[str, Build], monkeypatch: pytest.MonkeyPatch) -> None:
    for name, deployment in models(builds):
        for c in (container(deployment, "load"), container(deployment, "proxy")):
            for var, field in IDENTITY.items():
                expected = {"name": var, "valueFrom": {"fieldRef": {"fieldPath": field}}}
                assert c.env_value(var) == expected, f"{name}: {c.where} needs {var} from the downward API"
    for name, deployment in models(builds, overlays_only=True):
        meta = deployment["metadata"]
        for c in (container(deployment, "load"), container(deployment, "proxy")):
            params = cli_params(c, builds[name], monkeypatch)
            # Without a UID no lease is taken, and gc would remove the model once older than the TTL.
            assert params["pod_uid"] == POD_UID, f"{name}: {c.where} takes no lease"
            assert params["pod_name"].startswith(meta["name"] + "-"), f"{name}: {c.where} pod name"
            assert params["pod_namespace"] == meta.get("namespace", "default"), f"{name}: {c.where} namespace"
            leases = str(params["leases"])
            assert host_path_of(c, leases) == f"{NODE_ROOT}/leases", f"{c.where}: leases at {leases}"
            mount = mount_for(c, leases)
            assert mount is not None and not mount.get("readOnly", False), f"{c.where}: must write its lease"


def test_every_triton_node_runs_gc_over_the_model_pods_folder(
    builds: dict[str, Build], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, _, daemonset in node_agents(builds):
        (gc,) = containers(daemonset)
        assert not gc.init and gc.spec["args"] == ["gc"], f"{name}: {gc.where} is not `tritonshare gc`"
        check_hardened(gc)
        check_bounded(gc)
        assert gc.effective("runAsUser") == NODE_UID, f"{name}: gc must run as the node folder's owner"
        params = cli_params(gc, builds[name], monkeypatch)
        assert not params["once"], f"{name}: gc must keep running"
        for option, folder in FOLDERS.items():
            path = str(params[option])
            assert host_path_of(gc, path) == f"{NODE_ROOT}/{folder}", f"{name}: gc {option} is {path}"
            mount = mount_for(gc, path)
            assert mount is not None and not mount.get("readOnly", False), f"{name}: gc renames out and deletes"
        assert mount_for(gc, str(params["repository"])) is mount_for(gc, str(params["staging"])), name
        # Triton's pod creates the folder and hands it to gc's UID; gc must not make one root owns.
        assert volume(daemonset, "node-folder")["hostPath"]["type"] == "Directory", name


def test_gc_runs_on_every_triton_node_and_asks_that_nodes_triton(
    builds: dict[str, Build], monkeypatch: pytest.MonkeyPatch
) -> None:
    """gc is a DaemonSet of its own: nothing but placement ties it to Triton's nodes, and the Service to the
    Triton of its own node. A node with Triton and no gc keeps dead pods' models on its GPU for good."""
    for name, triton, daemonset in node_agents(builds):
        placement = ("nodeSelector", "tolerations", "affinity", "nodeName")
        ours, theirs = pod_spec(daemonset), pod_spec(triton)
        for field in placement:
            assert ours.get(field) == theirs.get(field), f"{name}: gc's {field} is not Triton's"
        params = cli_params(container(daemonset, "gc"), builds[name], monkeypatch)
        url = urlsplit(params["triton_url"])
        namespace = daemonset["metadata"]["namespace"]
        service = builds[name].get("Service", url.hostname or "", namespace)["spec"]  # a name in gc's namespace
        assert service["internalTrafficPolicy"] == "Local", f"{name}: gc could ask another node's Triton"
        assert selector_matches({"matchLabels": service["selector"]}, pod_labels(triton)), name
        (port,) = [p for p in service["ports"] if p["port"] == url.port]
        triton_http = int(flags(triton_container(triton).spec["args"])["http-port"])
        assert port_number(triton_container(triton), port["targetPort"]) == triton_http, f"{name}: {url.geturl()}"


def test_network_policies_let_gc_ask_triton_and_nothing_else(builds: dict[str, Build]) -> None:
    for name, triton, daemonset in node_agents(builds):
        namespace = daemonset["metadata"]["namespace"]
        policies = [
            p["spec"] for p in builds[name].of_kind("NetworkPolicy") if p["metadata"].get("namespace") == namespace
        ]
        (ours,) = [p for p in policies if selector_matches(p["podSelector"], pod_labels(daemonset))]
        assert set(ours["policyTypes"]) == {"Ingress", "Egress"} and ours["ingress"] == [], f"{name}: gc serves nothing"
        server = triton_container(triton)
        http = int(flags(server.spec["args"])["http-port"])
        for rule in ours["egress"]:
            ports = {(port_number(server, p["port"]), p.get("protocol", "TCP")) for p in rule["ports"]}
            if "to" in rule:  # the Triton pods of the namespace, its HTTP port
                (peer,) = rule["to"]
                assert set(peer) == {"podSelector"} and selector_matches(peer["podSelector"], pod_labels(triton))
                assert ports == {(http, "TCP")}, f"{name}: gc reaches Triton on {ports}"
            else:
                assert ports == {(53, "UDP"), (53, "TCP")}, f"{name}: gc's egress beyond DNS and Triton: {rule}"
        admitted = [
            port_number(server, port["port"])
            for policy in policies
            if selector_matches(policy["podSelector"], pod_labels(triton))
            for rule in policy.get("ingress", [])
            if any(
                set(peer) == {"podSelector"} and selector_matches(peer["podSelector"], pod_labels(daemonset))
                for peer in rule["from"]
            )
            for port in rule["ports"]
        ]
        assert admitted == [http], f"{name}: Triton's NetworkPolicy must admit gc on its HTTP port alone: {admitted}"


def test_one_lease_ttl_for_loaders_proxies_and_gc(builds: dict[str, Build], monkeypatch: pytest.MonkeyPatch) -> None:
    """gc's TTL decides when a pod counts as dead; the proxy refreshes ten times per its own TTL."""
    ttls: dict[str, float] = {}
    for name, _, daemonset in node_agents(builds):
        gc = container(daemonset, "gc")
        ttls[f"{name}: {gc.where}"] = cli_params(gc, builds[name], monkeypatch)["lease_ttl_s"]
    for name, deployment in models(builds, overlays_only=True):
        for c in (container(deployment, "load"), container(deployment, "proxy")):
            ttls[f"{name}: {c.where}"] = cli_params(c, builds[name], monkeypatch)["lease_ttl_s"]
    assert len(set(ttls.values())) == 1, f"lease TTLs differ: {ttls}"


def test_node_folder_init_creates_every_folder_for_the_tritonshare_uid(
    builds: dict[str, Build], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Root hands the node folder to the tritonshare UID, which then creates the sub-folders gc and the model
    pods use: root without CAP_DAC_OVERRIDE could not create them in a folder that UID already owns."""
    for name, daemonset, gc_daemonset in node_agents(builds):
        inits = [c.name for c in containers(daemonset) if c.init]
        chown, layout = container(daemonset, "node-folder"), container(daemonset, "node-layout")
        assert inits.index("node-folder") < inits.index("node-layout"), f"{name}: init order {inits}"
        assert layout.effective("runAsUser") == NODE_UID, f"{name}: {layout.where} must create as the owner"
        owner, *owned = _argv(chown)[1:]
        assert _argv(chown)[0] == "chown" and owner == f"{NODE_UID}:{NODE_UID}", f"{name}: {chown.where}"
        assert {_on_node(chown, p) for p in owned} == {NODE_ROOT}, f"{name}: root chowns {owned}"
        assert _argv(layout)[:2] == ["mkdir", "-p"], f"{name}: {layout.where}"
        created = {_on_node(layout, p) for p in _argv(layout)[2:]}
        gc = container(gc_daemonset, "gc")
        params = cli_params(gc, builds[name], monkeypatch)
        needed = {_on_node(gc, str(params[option])) for option in FOLDERS}
        assert needed <= created, f"{name}: {layout.where} creates {sorted(created)} only"


def _argv(c: Container) -> list[str]:
    argv: list[str] = c.spec["command"] + c.spec.get("args", [])
    return argv


def _on_node(c: Container, path: str) -> str:
    node_path = host_path_of(c, path)
    assert node_path is not None, f"{c.where}: {path} is not on the node folder's mount"
    return node_path
