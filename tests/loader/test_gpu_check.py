"""``--require-gpu-memory-mib``: before publishing, the loader reads Triton's GPU memory from its metrics page.

The GPU figures come from a local HTTP server serving a Triton metrics page for two GPUs (Triton's series
format: ``nv_gpu_memory_{total,used}_bytes{gpu_uuid=...}``); the model itself is loaded by the real Triton,
whose own metrics page (this machine has no GPU) serves the "no GPU memory reported" case.
"""

from __future__ import annotations

import os
import re
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.loader.test_run import expect_failure, infer_identity, node_entries, settings
from tests.support.models import write_model
from tests.support.ports import free_port
from tests.support.triton import REPO_ROOT, TritonServer
from tritonshare.common.errors import ExitCode, InsufficientSpace, TritonUnavailable
from tritonshare.common.layout import NodeLayout
from tritonshare.common.triton_metrics_page import default_metrics_url
from tritonshare.loader.gpu_check import metrics_url
from tritonshare.loader.run import run
from tritonshare.loader.settings import LoaderSettings

pytestmark = pytest.mark.triton

GIB = 1 << 30
# Two 16 GiB GPUs: 12 GiB used on the first, 1 GiB on the second → 4096 + 15360 = 19456 MiB free of 32768.
TWO_GPUS_PAGE = f"""\
# HELP nv_inference_request_success Number of successful inference requests, all batch sizes
# TYPE nv_inference_request_success counter
nv_inference_request_success{{model="other-tenant",version="1"}} 42
# HELP nv_gpu_utilization GPU utilization rate [0.0 - 1.0)
# TYPE nv_gpu_utilization gauge
nv_gpu_utilization{{gpu_uuid="GPU-0e9fdafb-5adb-91cd-26a8-308d34357efc"}} 0.500000
nv_gpu_utilization{{gpu_uuid="GPU-a07dfe08-b87f-1f96-7083-07a26d0fa83e"}} 0.000000
# HELP nv_gpu_memory_total_bytes GPU total memory, in bytes
# TYPE nv_gpu_memory_total_bytes gauge
nv_gpu_memory_total_bytes{{gpu_uuid="GPU-0e9fdafb-5adb-91cd-26a8-308d34357efc"}} {16 * GIB}.000000
nv_gpu_memory_total_bytes{{gpu_uuid="GPU-a07dfe08-b87f-1f96-7083-07a26d0fa83e"}} {16 * GIB}.000000
# HELP nv_gpu_memory_used_bytes GPU used memory, in bytes
# TYPE nv_gpu_memory_used_bytes gauge
nv_gpu_memory_used_bytes{{gpu_uuid="GPU-0e9fdafb-5adb-91cd-26a8-308d34357efc"}} {12 * GIB}.000000
nv_gpu_memory_used_bytes{{gpu_uuid="GPU-a07dfe08-b87f-1f96-7083-07a26d0fa83e"}} {1 * GIB}.000000
"""
FREE_MIB = 15360  # on the freest GPU; 19456 MiB free on both together


class MetricsPage:
    """A local HTTP server answering every GET with ``TWO_GPUS_PAGE``; counts the requests."""

    def __init__(self) -> None:
        page = TWO_GPUS_PAGE.encode()
        self.hits = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                outer.hits += 1
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(page)))
                self.end_headers()
                self.wfile.write(page)

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (http.server's name)
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/metrics"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


@pytest.fixture
def metrics_page() -> Iterator[MetricsPage]:
    server = MetricsPage()
    yield server
    server.stop()


def test_a_model_that_fits_in_free_gpu_memory_is_loaded_and_served(
    layout: NodeLayout,
    triton: TritonServer,
    model_name: str,
    tmp_path: Path,
    metrics_page: MetricsPage,
    cleanup: list[str],
) -> None:
    cleanup.append(model_name)
    conf = settings(
        layout, triton, write_model(tmp_path / "m"), model_name,
        require_gpu_memory_mib=FREE_MIB, triton_metrics_url=metrics_page.url,
    )  # fmt: skip
    assert run(conf) == ExitCode.OK
    infer_identity(triton, model_name)
    assert metrics_page.hits == 2  # before the download, and the last look before publishing


@pytest.mark.parametrize("asked", [FREE_MIB + 1, 19456])  # 19456: free on the two GPUs together, on neither
def test_a_model_larger_than_the_freest_gpu_is_not_published(
    layout: NodeLayout, triton: TritonServer, model_name: str, tmp_path: Path, metrics_page: MetricsPage, asked: int
) -> None:
    conf = settings(
        layout, triton, write_model(tmp_path / "m"), model_name,
        require_gpu_memory_mib=asked, triton_metrics_url=metrics_page.url,
    )  # fmt: skip
    error = expect_failure(
        InsufficientSpace,
        ExitCode.INSUFFICIENT_SPACE,
        re.escape(
            f"the freest of Triton's 2 GPU(s) has {FREE_MIB} MiB free (19456 MiB free of 32768 MiB on all), "
            f"the model asks for {asked} MiB on one GPU"
        ),
        layout,
        conf,
    )
    assert "tritonshare.io/gpu-memory" in str(error)
    assert not layout.model_dir(model_name).exists()


def test_a_model_that_cannot_fit_is_refused_before_anything_is_downloaded(
    layout: NodeLayout, triton: TritonServer, model_name: str, tmp_path: Path, metrics_page: MetricsPage
) -> None:
    """An init container crash-looping on a full GPU must not download the model at every restart."""
    conf = settings(
        layout, triton, write_model(tmp_path / "m"), model_name,
        require_gpu_memory_mib=FREE_MIB + 1, triton_metrics_url=metrics_page.url,
    )  # fmt: skip

    def no_download(path: Path) -> int:  # measured right before downloading
        raise AssertionError("the loader went on to download")

    with pytest.raises(InsufficientSpace, match="the freest of Triton's 2 GPU"):
        run(conf, disk_free=no_download)


def test_triton_without_gpu_memory_metrics_is_a_clear_error(
    layout: NodeLayout, triton: TritonServer, model_name: str, tmp_path: Path
) -> None:
    real_page = f"http://127.0.0.1:{triton.metrics_port}/metrics"  # this machine's Triton has no GPU
    conf = settings(
        layout, triton, write_model(tmp_path / "m"), model_name,
        require_gpu_memory_mib=1, triton_metrics_url=real_page,
    )  # fmt: skip
    error = expect_failure(
        InsufficientSpace, ExitCode.INSUFFICIENT_SPACE, "Triton reports no GPU memory at " + real_page, layout, conf
    )
    assert "--require-gpu-memory-mib 0 to skip the check" in str(error)


def test_an_unreadable_metrics_page_fails_with_triton_unavailable(
    layout: NodeLayout, triton: TritonServer, model_name: str, tmp_path: Path
) -> None:
    nobody = f"http://127.0.0.1:{free_port()}/metrics"
    conf = settings(
        layout, triton, write_model(tmp_path / "m"), model_name,
        require_gpu_memory_mib=1, triton_metrics_url=nobody,
    )  # fmt: skip
    error = expect_failure(
        TritonUnavailable, ExitCode.TRITON_UNAVAILABLE, "cannot read Triton's GPU memory: GET " + nobody, layout, conf
    )
    assert "--triton-metrics-url" in str(error)


def test_the_check_is_off_by_default(
    layout: NodeLayout,
    triton: TritonServer,
    model_name: str,
    tmp_path: Path,
    metrics_page: MetricsPage,
    cleanup: list[str],
) -> None:
    cleanup.append(model_name)
    conf = settings(layout, triton, write_model(tmp_path / "m"), model_name, triton_metrics_url=metrics_page.url)
    assert conf.require_gpu_memory_mib == 0
    assert run(conf) == ExitCode.OK
    assert metrics_page.hits == 0


def test_the_cli_takes_the_requirement_from_the_environment_and_exits_15(
    layout: NodeLayout, triton: TritonServer, model_name: str, tmp_path: Path, metrics_page: MetricsPage
) -> None:
    termination = tmp_path / "termination"
    env = {
        **os.environ,
        "TRITONSHARE_REQUIRE_GPU_MEMORY_MIB": "40000",
        "TRITONSHARE_TRITON_METRICS_URL": metrics_page.url,
    }
    before = node_entries(layout)
    cmd = [
        str(REPO_ROOT / ".venv" / "bin" / "tritonshare"), "load", str(write_model(tmp_path / "m")),
        "--name", model_name, "--repository", str(layout.repository), "--staging", str(layout.staging),
        "--leases", str(tmp_path / "leases"), "--triton-url", triton.url, "--termination-log", str(termination),
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=110)
    assert proc.returncode == ExitCode.INSUFFICIENT_SPACE, proc.stderr
    message = termination.read_text()
    assert f"has {FREE_MIB} MiB free" in message and "asks for 40000 MiB on one GPU" in message
    assert node_entries(layout) == before


def test_the_metrics_page_defaults_to_tritons_host_on_port_8002() -> None:
    assert default_metrics_url("http://triton.tritonshare.svc:8000") == "http://triton.tritonshare.svc:8002/metrics"
    assert default_metrics_url("[::1]:8000") == "http://[::1]:8002/metrics"
    conf = LoaderSettings(source="/m", name="m", triton_url="http://10.0.0.7:8000")
    assert metrics_url(conf) == "http://10.0.0.7:8002/metrics"


@pytest.mark.parametrize(
    ("given", "used"),
    [
        ("http://10.0.0.7:8002", "http://10.0.0.7:8002/metrics"),  # Triton answers any path: no path read none
        ("http://10.0.0.7:8002/", "http://10.0.0.7:8002/metrics"),
        ("http://10.0.0.7:9102/custom/metrics", "http://10.0.0.7:9102/custom/metrics"),
    ],
)
def test_a_metrics_url_without_a_path_gets_tritons_metrics_path(given: str, used: str) -> None:
    assert metrics_url(LoaderSettings(source="/m", name="m", triton_metrics_url=given)) == used
