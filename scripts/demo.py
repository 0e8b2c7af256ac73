"""The local demo: a real Triton (POLL mode), a model served as a tar.gz by a local HTTP server,
``tritonshare load`` → ``tritonshare proxy`` → inference through the proxy (REST and gRPC) → refusals of
another tenant's model and of the admin API → SIGTERM → drain and unload. Run it with scripts/demo.sh.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import tritonclient.grpc as grpcclient  # noqa: E402
import tritonclient.http as httpclient  # noqa: E402
from tests.support.install import install_model, model_ready  # noqa: E402
from tests.support.models import write_model  # noqa: E402
from tests.support.ports import free_port, wait_port  # noqa: E402
from tests.support.triton import TritonServer  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from tritonshare.common.layout import NodeLayout  # noqa: E402

TRITONSHARE = str(Path(sys.executable).parent / "tritonshare")


def step(text: str) -> None:
    print(f"\n\033[1m== {text}\033[0m", flush=True)


def make_archive(work: Path) -> Path:
    model = write_model(work / "src" / "identity")
    archive = work / "www" / "identity.tar.gz"
    archive.parent.mkdir(parents=True)
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(model, arcname="identity")
    return archive


def infer_rest(url: str, model: str) -> np.ndarray:
    client = httpclient.InferenceServerClient(url)
    data = np.arange(4, dtype=np.float32)
    inp = httpclient.InferInput("INPUT0", [4], "FP32")
    inp.set_data_from_numpy(data)
    return client.infer(model, [inp]).as_numpy("OUTPUT0")


def infer_grpc(url: str, model: str) -> np.ndarray:
    client = grpcclient.InferenceServerClient(url)
    data = np.arange(4, dtype=np.float32) * 10
    inp = grpcclient.InferInput("INPUT0", [4], "FP32")
    inp.set_data_from_numpy(data)
    try:
        return client.infer(model, [inp]).as_numpy("OUTPUT0")
    finally:
        client.close()


def refused(call: Callable[[], object]) -> str:
    try:
        call()
    except InferenceServerException as exc:
        return f"refused: {exc.status()} {exc.message()}"
    return "NOT refused"


def main() -> int:
    work = ROOT / ".demo"
    shutil.rmtree(work, ignore_errors=True)
    node = work / "node"
    layout = NodeLayout(repository=node / "models", staging=node / "staging")
    layout.repository.mkdir(parents=True)
    layout.staging.mkdir()

    step("start a real Triton 2.51 (CPU, POLL mode every 1 s) on the node folder")
    triton = TritonServer(repository=layout.repository, log_path=work / "triton.log").start()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        print(f"Triton HTTP {triton.url}, gRPC {triton.grpc_url}")
        step("another tenant's model is already on the node")
        install_model(layout, triton, "neighbour")
        print("neighbour ready:", model_ready(triton, "neighbour"))

        step("serve our model as identity.tar.gz from a local HTTP server")
        archive = make_archive(work)
        port = free_port()
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "http.server",
                    str(port),
                    "--bind",
                    "127.0.0.1",
                    "--directory",
                    str(archive.parent),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        wait_port(port)
        source = f"http://127.0.0.1:{port}/{archive.name}"

        node_args = [
            "--repository",
            str(layout.repository),
            "--staging",
            str(layout.staging),
            "--triton-url",
            triton.url,
        ]
        step(f"tritonshare load {source} --name demo")
        started = time.monotonic()
        load = subprocess.run(
            [
                TRITONSHARE,
                "load",
                source,
                "--name",
                "demo",
                *node_args,
                "--termination-log",
                str(work / "termination-log"),
            ],
            check=False,
        )
        print(
            f"exit code {load.returncode} after {time.monotonic() - started:.1f}s; "
            f"repository holds {sorted(p.name for p in layout.repository.iterdir())}"
        )
        if load.returncode != 0:
            return load.returncode

        step("tritonshare proxy --name demo (REST, gRPC, metrics)")
        http_port, grpc_port, metrics_port = free_port(), free_port(), free_port()
        proxy = subprocess.Popen(
            [
                TRITONSHARE,
                "proxy",
                "--name",
                "demo",
                *node_args,
                "--triton-grpc",
                triton.grpc_url,
                "--host",
                "127.0.0.1",
                "--http-port",
                str(http_port),
                "--grpc-port",
                str(grpc_port),
                "--metrics-port",
                str(metrics_port),
                "--drain-timeout-s",
                "10",
            ]
        )
        procs.append(proxy)
        for p in (http_port, grpc_port, metrics_port):
            wait_port(p)
        rest_url, grpc_url = f"127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}"

        step("inference through the proxy")
        print("REST  demo([0,1,2,3])      ->", infer_rest(rest_url, "demo"))
        print("gRPC  demo([0,10,20,30])   ->", infer_grpc(grpc_url, "demo"))

        step("what a tenant cannot do through its proxy")
        print("REST infer on 'neighbour'   ->", refused(lambda: infer_rest(rest_url, "neighbour")))
        print("gRPC infer on 'neighbour'   ->", refused(lambda: infer_grpc(grpc_url, "neighbour")))
        admin = httpclient.InferenceServerClient(rest_url)
        print("REST repository index       ->", refused(admin.get_model_repository_index))
        print("REST unload 'neighbour'     ->", refused(lambda: admin.unload_model("neighbour")))

        step("SIGTERM the proxy: drain, then unload the model")
        proxy.send_signal(signal.SIGTERM)
        code = proxy.wait(timeout=60)
        print(f"proxy exit code {code}; repository holds {sorted(p.name for p in layout.repository.iterdir())}")
        print(
            "Triton serves demo:",
            model_ready(triton, "demo"),
            "| neighbour untouched:",
            model_ready(triton, "neighbour"),
        )
        ok = code == 0 and not model_ready(triton, "demo") and model_ready(triton, "neighbour")
        step("demo " + ("complete" if ok else "FAILED"))
        return 0 if ok else 1
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        triton.stop()


if __name__ == "__main__":
    sys.exit(main())
