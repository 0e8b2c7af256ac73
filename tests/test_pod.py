"""tritonshare.pod: a proxy container restarted inside a live pod finds its model unloaded (its own SIGTERM
did that) and, given the pod's SOURCE, installs it again while it serves — real Triton, real proxy processes."""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from tests.support.install import install_model, model_ready
from tests.support.models import write_model
from tests.support.proxy import ProxyProcess
from tests.support.triton import TritonServer
from tritonshare.common.layout import NodeLayout
from tritonshare.common.repository import RECORD_FILE

pytestmark = [pytest.mark.triton]

REINSTALLING = "installing it again from"


def wait_ready(proxy: ProxyProcess, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"http://{proxy.url}/v2/health/ready", timeout=2) as answer:
                if answer.status == 200:
                    return
        except (urllib.error.HTTPError, OSError):
            pass
        assert time.monotonic() < deadline, proxy.log_text()
        assert proxy.process is not None and proxy.process.poll() is None, proxy.log_text()
        time.sleep(0.1)


def infer_through(proxy: ProxyProcess, name: str) -> list[float]:
    client = httpclient.InferenceServerClient(proxy.url, network_timeout=30)
    try:
        tensor = httpclient.InferInput("INPUT0", [3], "FP32")
        tensor.set_data_from_numpy(np.array([1.0, 2.0, 3.0], dtype=np.float32))
        output = client.infer(name, [tensor]).as_numpy("OUTPUT0")
        assert output is not None
        return [float(x) for x in output]
    finally:
        client.close()


def test_a_proxy_restarted_after_its_unload_installs_its_model_again_and_serves_it(
    triton: TritonServer, layout: NodeLayout, model_name: str, tmp_path: Path
) -> None:
    source = str(write_model(tmp_path / "model"))
    first = ProxyProcess(model_name, triton, layout, tmp_path / "first.log", ["--source", source]).start()
    try:
        wait_ready(first)  # not installed when it started: it installed the model itself
        assert infer_through(first, model_name) == [1.0, 2.0, 3.0]
    finally:
        assert first.terminate() == 0  # SIGTERM, as the kubelet stops a container: drain, then unload
    assert not layout.model_dir(model_name).exists() and not model_ready(triton, model_name)

    restarted = ProxyProcess(model_name, triton, layout, tmp_path / "restarted.log", ["--source", source]).start()
    try:
        wait_ready(restarted)
        assert infer_through(restarted, model_name) == [1.0, 2.0, 3.0]
        assert REINSTALLING in restarted.log_text()
        deadline = time.monotonic() + 10  # the install's own poll may notice readiness after the proxy's probe
        while "is ready (installed)" not in restarted.log_text():
            assert time.monotonic() < deadline, restarted.log_text()
            time.sleep(0.05)
    finally:
        assert restarted.terminate() == 0
    assert not layout.model_dir(model_name).exists()


def test_a_proxy_whose_model_is_there_leaves_it_as_it_is(
    triton: TritonServer, layout: NodeLayout, model_name: str, tmp_path: Path
) -> None:
    folder = install_model(layout, triton, model_name)
    record = folder / RECORD_FILE
    before = record.read_bytes() if record.exists() else None
    missing = str(tmp_path / "no-such-model")  # never read: nothing is installed again
    proxy = ProxyProcess(model_name, triton, layout, tmp_path / "proxy.log", ["--source", missing]).start()
    try:
        wait_ready(proxy)
        assert infer_through(proxy, model_name) == [1.0, 2.0, 3.0]
        assert REINSTALLING not in proxy.log_text()
        assert (record.read_bytes() if record.exists() else None) == before
    finally:
        assert proxy.terminate() == 0
