"""Two pods of one model share one install: each proxy holds a lease; the model stays while either lives."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable

from tests.support.install import install_model, model_ready
from tests.support.proxy import TRITONSHARE, ProxyProcess
from tests.support.triton import TritonServer
from tritonshare.common.layout import NodeLayout
from tritonshare.common.lease import Holder, LeaseStore

POD_A, POD_B = "4c1f7a52-aaaa-4d6e-9b0a-0c1d2e3f4a01", "4c1f7a52-bbbb-4d6e-9b0a-0c1d2e3f4a02"


def _pod(uid: str, layout: NodeLayout) -> list[str]:
    return [
        "--pod-uid",
        uid,
        "--pod-name",
        f"pod-{uid[9:13]}",
        "--pod-namespace",
        "team",
        "--leases",
        str(layout.leases),
    ]


def test_the_model_stays_until_the_last_of_two_pods_stops(
    triton: TritonServer, layout: NodeLayout, start_proxy: Callable[..., ProxyProcess], model_name: str
) -> None:
    install_model(layout, triton, model_name)
    first = start_proxy(model_name, *_pod(POD_A, layout), "--lease-ttl-s", "5")
    second = start_proxy(model_name, *_pod(POD_B, layout), "--lease-ttl-s", "5")
    leases = LeaseStore(layout.leases, ttl_s=5)
    assert sorted(lease.holder.uid for lease in leases.leases(model_name)) == [POD_A, POD_B]
    time.sleep(6)  # past one TTL: only the heartbeats keep both leases fresh
    assert len(leases.fresh(model_name)) == 2
    assert first.terminate() == 0
    assert layout.model_dir(model_name).is_dir()
    assert model_ready(triton, model_name)
    assert "another pod's lease on it is fresh" in first.log_text()
    assert second.terminate() == 0
    assert not layout.model_dir(model_name).exists()
    assert not model_ready(triton, model_name)
    assert leases.leases(model_name) == []


def test_unload_leaves_a_model_another_pod_holds(triton: TritonServer, layout: NodeLayout, model_name: str) -> None:
    install_model(layout, triton, model_name)
    leases = LeaseStore(layout.leases)
    leases.acquire(model_name, Holder(uid=POD_A))
    leases.acquire(model_name, Holder(uid=POD_B))
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRITONSHARE_")}
    args = [
        TRITONSHARE,
        "unload",
        "--name",
        model_name,
        "--repository",
        str(layout.repository),
        "--staging",
        str(layout.staging),
        "--triton-url",
        triton.url,
        "--leases",
        str(layout.leases),
    ]
    done = subprocess.run([*args, "--pod-uid", POD_A], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert layout.model_dir(model_name).is_dir()
    done = subprocess.run([*args, "--pod-uid", POD_B], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert not layout.model_dir(model_name).exists()
    assert not model_ready(triton, model_name)
