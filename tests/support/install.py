"""Put a model into Triton's repository the way the loader does (staged, one rename) and wait for it."""

from __future__ import annotations

import fcntl
import os
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.support.models import IDENTITY_CONFIG, IDENTITY_MODEL, write_model
from tests.support.triton import TritonServer
from tritonshare.common.layout import NodeLayout
from tritonshare.common.triton import TritonClient


def install_model(
    layout: NodeLayout,
    triton: TritonServer,
    name: str,
    *,
    config: str = IDENTITY_CONFIG,
    model_py: str = IDENTITY_MODEL,
    timeout_s: float = 60,
) -> Path:
    staged = layout.staging / f"{name}.test"
    write_model(staged, config=config, model_py=model_py)
    target = layout.model_dir(name)
    os.rename(staged, target)
    wait_model_ready(triton, name, timeout_s=timeout_s)
    return target


def model_ready(triton: TritonServer, name: str) -> bool:
    try:
        with urllib.request.urlopen(f"{triton.url}/v2/models/{name}/ready", timeout=2) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def wait_model_ready(triton: TritonServer, name: str, *, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if model_ready(triton, name):
            return
        time.sleep(0.2)
    raise TimeoutError(f"model {name} not ready after {timeout_s}s; Triton log:\n{triton.log_tail()}")


def wait_loading(triton: TritonServer, name: str, *, timeout_s: float = 30) -> None:
    """Return once Triton's index says LOADING for NAME (a folder just published, at Triton's next poll)."""
    client = TritonClient(triton.url)
    deadline = time.monotonic() + timeout_s
    while not any(s.state == "LOADING" for s in client.model_states(name)):
        assert time.monotonic() < deadline, f"Triton never said LOADING for {name}: {client.model_states(name)}"
        time.sleep(0.02)


def lease_lock_is_free(layout: NodeLayout, name: str) -> bool:
    """Whether another process could take NAME's lease lock now (flock conflicts across open files)."""
    fd = os.open(layout.leases / ".locks" / name, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


@contextmanager
def own_triton_serving(folder: Path, model: str, *, config: str = IDENTITY_CONFIG) -> Iterator[TritonServer]:
    """A Triton of the test's own, serving the identity model ``model`` (of ``config``) from ``folder/models``, killed
    afterwards (a test that may crash it, or its model's stub, must not share the session's)."""
    write_model(folder / "models" / model, config=config)
    server = TritonServer(repository=folder / "models", log_path=folder / "triton.log").start()
    try:
        wait_model_ready(server, model)
        yield server
    finally:
        server.kill()
