"""A throwaway node for fault scripts: the node folder (repository, staging, leases), a real Triton polling it,
and the checks that say what Triton made of the models put there."""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from tests.support.triton import TritonServer

from tritonshare.common.errors import TritonUnavailable
from tritonshare.common.layout import NodeLayout
from tritonshare.common.triton import ModelState, TritonClient
from tritonshare.common.unload import UnloadSettings, unload_model

TRITONSHARE = str(Path(sys.executable).parent / "tritonshare")
SETTLED = frozenset({"READY", "UNAVAILABLE"})


@dataclass(frozen=True)
class Node:
    root: Path

    @property
    def layout(self) -> NodeLayout:
        return NodeLayout(repository=self.root / "models", staging=self.root / "staging")

    @property
    def leases(self) -> Path:
        return self.root / "leases"

    def create(self) -> Node:
        for path in (self.layout.repository, self.layout.staging, self.leases):
            path.mkdir(parents=True, exist_ok=True)
        return self


@dataclass(frozen=True)
class LoadOutcome:
    code: int
    log: str  # the loader's stderr
    message: str  # its termination message ("" when none was written)
    seconds: float


def run_load(node: Node, triton_url: str, source: str, name: str, *extra: str, timeout_s: float = 110) -> LoadOutcome:
    """``tritonshare load SOURCE --name NAME`` into ``node``, as an init container runs it."""
    # Not in the node folder: that disk may be the one that is full.
    termination = Path(tempfile.gettempdir()) / f"tritonshare-termination-{uuid.uuid4().hex}"
    cmd = [
        TRITONSHARE, "load", source, "--name", name,
        "--repository", str(node.layout.repository), "--staging", str(node.layout.staging),
        "--triton-url", triton_url, "--termination-log", str(termination), *extra,
    ]  # fmt: skip
    started = time.monotonic()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    seconds = time.monotonic() - started
    message = termination.read_text() if termination.exists() else ""
    termination.unlink(missing_ok=True)
    return LoadOutcome(out.returncode, out.stderr, message, seconds)


def entries(node: Node) -> set[str]:
    """What the repository and staging hold, as ``models/NAME`` and ``staging/ENTRY``."""
    layout = node.layout
    return {f"models/{p.name}" for p in layout.repository.iterdir()} | {
        f"staging/{p.name}" for p in layout.staging.iterdir()
    }


def start_triton(node: Node, *, attempts: int = 3) -> TritonServer:
    """A Triton polling the node's repository. Started again (on new ports) if it dies while starting: the
    Python backend on this kind of machine now and then aborts at model start-up with
    ``boost::interprocess::lock_exception``, which is Triton's trouble, not the fault being measured."""
    for attempt in range(1, attempts + 1):
        server = TritonServer(repository=node.layout.repository, log_path=node.root / "triton.log")
        try:
            return server.start()
        except RuntimeError:
            if attempt == attempts:
                raise
            print(f"Triton died while starting (attempt {attempt} of {attempts}); starting it again", flush=True)
    raise AssertionError("unreachable")


def settle(client: TritonClient, name: str, *, timeout_s: float = 60.0) -> str:
    """Wait until Triton's index says READY or UNAVAILABLE for ``name``; returns the state (or the last
    state seen, when the deadline passes first)."""
    deadline = time.monotonic() + timeout_s
    state = ""
    while time.monotonic() < deadline:
        state = _state(client, name)
        if state in SETTLED:
            return state
        time.sleep(0.1)
    return state or "NOT SEEN"


def _state(client: TritonClient, name: str) -> str:
    try:
        states: list[ModelState] = client.model_states(name)
    except TritonUnavailable:
        return ""
    return states[0].state if states else ""


def remove(node: Node, triton: TritonServer, name: str) -> bool:
    """Unload ``name`` as the proxy would (never mid-load); True when Triton stopped serving it."""
    result = unload_model(UnloadSettings(name=name, layout=node.layout, triton_url=triton.url, timeout_s=60))
    return result.unloaded


# Triton's own words for a model it could not load (model_lifecycle.cc, model_repository_manager.cc).
_FAILURE = re.compile(r"^E\d{4} .*|.*(failed to load|Poll failed|unexpected directory name|not found).*")


def failure_lines(log_text: str, names: set[str]) -> list[str]:
    """Lines of Triton's log that report a failure about one of ``names``."""
    out = []
    for line in log_text.splitlines():
        if _FAILURE.match(line) and any(f"'{name}'" in line or f"/{name}/" in line for name in names):
            out.append(line)
    return out


def loaded_count(log_text: str, names: set[str]) -> int:
    """How many times Triton logged ``successfully loaded 'NAME'`` for one of ``names``."""
    found = re.findall(r"successfully loaded '([^']+)'", log_text)
    return sum(1 for name in found if name in names)


def run_gc(node: Node, triton: TritonServer, *, ttl_s: float, manage: str) -> subprocess.CompletedProcess[str]:
    """One pass of ``tritonshare gc --once`` over the node, for the model NAMEs matching ``manage``."""
    cmd = [
        TRITONSHARE, "gc", "--once",
        "--repository", str(node.layout.repository), "--staging", str(node.layout.staging),
        "--leases", str(node.leases), "--triton-url", triton.url, "--lease-ttl-s", str(ttl_s),
        "--manage", manage, "--termination-log", str(node.root / "gc-termination"),
    ]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)
