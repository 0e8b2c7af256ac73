"""What the workload tests share: finding the Triton DaemonSets and model Deployments in the builds, reading
Triton's flags and container ports, and parsing a tritonshare container's command line and environment with
the real click CLI, exactly as the pod would."""

from __future__ import annotations

import dataclasses
import inspect
import os
import re
from collections.abc import Iterator
from typing import Any

import click
import pytest

from tests.k8s.kustomize import Build, Container, container, containers, environment, pod_labels
from tritonshare.cli import main as cli
from tritonshare.common.triton import TritonClient
from tritonshare.common.unload import UnloadSettings
from tritonshare.pod import STOP_WAIT_S

TRITONSHARE_IMAGE = re.compile(r"^(?:.+/)?tritonshare(?::|@|$)")
MODEL_LABEL = "tritonshare.io/model"  # the pod label that holds the model NAME
MODELS_NAMESPACE_LABEL = "tritonshare.io/models"  # what a namespace needs for its model pods to reach Triton
NODE_ROOT = "/var/lib/tritonshare"
NODE_UID = 65532  # USER of images/Dockerfile, owner of the node folder
PLATFORM = "overlays/gpu"  # the Triton half that model-only overlays run against
# What a model pod's loader and proxy need from the downward API to hold a lease as their pod.
IDENTITY = {
    "TRITONSHARE_POD_UID": "metadata.uid",
    "TRITONSHARE_POD_NAME": "metadata.name",
    "TRITONSHARE_POD_NAMESPACE": "metadata.namespace",
}

Obj = dict[str, Any]


def tritons(builds: dict[str, Build]) -> Iterator[tuple[str, Obj]]:
    found = [(n, o) for n, b in builds.items() for o in b.of_kind("DaemonSet") if component_of(o) == "triton"]
    assert found, "no build holds the Triton DaemonSet"
    yield from found


def triton_of(b: Build) -> Obj:
    """The build's Triton DaemonSet (gc's runs beside it)."""
    found = [o for o in b.of_kind("DaemonSet") if component_of(o) == "triton"]
    assert len(found) == 1, f"{len(found)} Triton DaemonSets in one build"
    return found[0]


def node_agents(builds: dict[str, Build]) -> Iterator[tuple[str, Obj, Obj]]:
    """(build, Triton's DaemonSet, gc's DaemonSet in Triton's namespace) for every build holding Triton."""
    for name, triton in tritons(builds):
        namespace = triton["metadata"].get("namespace")
        gcs = [o for o in builds[name].of_kind("DaemonSet") if component_of(o) == "gc"]
        assert [o["metadata"].get("namespace") for o in gcs] == [namespace], f"{name}: gc is not beside Triton"
        yield name, triton, gcs[0]


def models(builds: dict[str, Build], overlays_only: bool = False) -> Iterator[tuple[str, Obj]]:
    found = [
        (n, o)
        for n, b in builds.items()
        if not overlays_only or n.startswith("overlays/")
        for o in b.of_kind("Deployment")
        if component_of(o) == "model"
    ]
    assert found, "no build holds a model Deployment"
    yield from found


def component_of(workload: Obj) -> str | None:
    return pod_labels(workload).get("app.kubernetes.io/component")


def monitored(b: Build) -> bool:
    """The build includes k8s/components/monitoring (its PodMonitor)."""
    return bool(b.of_kind("PodMonitor"))


def has_container(b: Build, name: str) -> bool:
    return any(c.name == name for w in b.workloads() for c in containers(w))


def flags(args: list[str]) -> dict[str, str]:
    out = {}
    for arg in args:
        assert arg.startswith("--") and "=" in arg, f"Triton argument {arg!r}: write flags as --name=value"
        key, value = arg[2:].split("=", 1)
        out[key] = value
    return out


def triton_container(daemonset: Obj) -> Container:
    return container(daemonset, "triton")


def port_number(c: Container, port: int | str) -> int:
    if isinstance(port, int):
        return port
    for p in c.spec.get("ports", []):
        if p["name"] == port:
            number: int = p["containerPort"]
            return number
    raise AssertionError(f"{c.where}: no container port named {port!r}")


def cli_params(c: Container, b: Build, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Parse the container's command line and environment with the real click CLI, as the pod would."""
    env = environment(c, b).values
    sub, *rest = c.spec["args"]
    # The pod's containers share ConfigMaps: each variable must be read by one of the pod's commands.
    subs = {sub} | {o.spec["args"][0] for o in containers(c.workload) if o.spec.get("args")}
    pod_commands = [cli, *(cli.commands[s] for s in subs if s in cli.commands)]
    known = {p.envvar for cmd in pod_commands for p in cmd.params if isinstance(p.envvar, str)}
    unknown = sorted(k for k in env if k.startswith("TRITONSHARE_") and k not in known)
    assert not unknown, f"{c.where}: no command of the pod reads {unknown} — a typo or a missing option?"
    for key in [k for k in os.environ if k.startswith("TRITONSHARE_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    try:
        group = cli.make_context("tritonshare", [sub])
        params: dict[str, Any] = cli.commands[sub].make_context(sub, list(rest), parent=group).params
    except click.ClickException as exc:
        message = f"{c.where}: tritonshare {sub} rejects its environment: {exc.format_message()}"
        raise AssertionError(message) from exc
    return params | group.params


# The Triton calls an unload makes past its two timed waits (src/tritonshare/common/unload.py), each bounded by
# the client's timeout: wait_quiet's last look, which may begin just after its deadline; the look again under
# NAME's lock and the unload request (_release); _wait_unloaded's last look, likewise.
UNLOAD_TRITON_CALLS = 4
SHUTDOWN_MARGIN_S = 10  # beyond the worst case: deleting the model folder, the lease, the process's exit


def worst_case_shutdown_s(proxy: Container, params: dict[str, Any]) -> float:
    """From the kubelet's SIGTERM decision to the proxy's exit, at worst: the preStop sleep, the drain, then the
    unload, which applies its timeout twice in a row — waiting until Triton is quiet on NAME (no answer, or
    LOADING, up to the deadline), then, the folder removed, until Triton stops serving it — each wait ending
    up to one poll interval and one Triton call past its deadline. The proxy passes no poll interval and makes
    its own client, so both are the code's defaults. With --source, the drain also waits for a reinstall it
    stopped, up to :data:`~tritonshare.pod.STOP_WAIT_S`, meanwhile. Not counted: deleting the folder (its size)
    and exiting."""
    pre_stop: float = proxy.spec.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
    total = pre_stop + max(params["drain_timeout_s"], STOP_WAIT_S if params["source"] else 0.0)
    if params["unload_on_exit"]:
        interval = next(f.default for f in dataclasses.fields(UnloadSettings) if f.name == "poll_interval_s")
        call = inspect.signature(TritonClient).parameters["timeout_s"].default
        assert isinstance(interval, float) and isinstance(call, float), (interval, call)
        total += 2 * (params["unload_timeout_s"] + interval) + UNLOAD_TRITON_CALLS * call
    return total
