"""tritonshare.pod: a proxy container restarted inside a live pod finds its model unloaded (its own SIGTERM
did that) and, given the pod's SOURCE, installs it again while it serves — and a SIGTERM during that install
stops it and cleans up before the proxy exits. Real Triton, real proxy processes, a real slow HTTP store."""

from __future__ import annotations

import os
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
from tests.support.storage import CrawlingHttpServer, big_model
from tests.support.triton import TritonServer
from tritonshare.common.layout import NodeLayout
from tritonshare.common.repository import RECORD_FILE

pytestmark = [pytest.mark.triton]

REINSTALLING = "installing it again from"
MIB = 1 << 20


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


def staged(layout: NodeLayout, name: str) -> list[str]:
    """The staging entries an install of ``name`` made (``NAME.download.<id>``)."""
    return sorted(entry for entry in os.listdir(layout.staging) if entry.startswith(f"{name}."))


@pytest.mark.storage
@pytest.mark.parametrize("packing", ["zip", "tar"])  # download threads, ranged parts / unpacked as it arrives
def test_sigterm_while_the_proxy_installs_its_model_again_stops_the_install_and_leaves_nothing_behind(
    packing: str,
    crawling_server: CrawlingHttpServer,
    triton: TritonServer,
    layout: NodeLayout,
    model_name: str,
    tmp_path: Path,
) -> None:
    """The pod is deleted while its restarted proxy fetches the model again (24 s at the store's pace): the
    proxy's drain stops the install, its workspace goes, no folder for NAME is published behind the drain,
    and the proxy exits within the grace period."""
    source = crawling_server.serve(big_model(tmp_path, packing))
    args = ["--source", source, "--drain-timeout-s", "5"]
    proxy = ProxyProcess(model_name, triton, layout, tmp_path / "proxy.log", args).start()
    try:
        deadline = time.monotonic() + 30
        while crawling_server.sent < 2 * MIB:
            assert proxy.process is not None and proxy.process.poll() is None, proxy.log_text()
            assert time.monotonic() < deadline, "the install did not start downloading"
            time.sleep(0.05)
        assert staged(layout, model_name) != []  # the install fills its workspace
        stopped = time.monotonic()
        code = proxy.terminate(timeout_s=30)
        took = time.monotonic() - stopped
    finally:
        proxy.stop()
    log = proxy.log_text()
    assert code == 0, log
    assert took < 5, f"the proxy took {took:.1f} s to exit: the kubelet's grace period is 30 s by default\n{log}"
    assert staged(layout, model_name) == [], log
    assert not layout.model_dir(model_name).exists()
    assert f"install of {model_name} stopped by SIGTERM while downloading: cleaned up" in log
    assert "Traceback" not in log
