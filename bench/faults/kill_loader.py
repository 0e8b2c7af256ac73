"""kill -9 of ``tritonshare load`` at random moments: does a partial model ever reach Triton?

Each run starts ``tritonshare load`` for a fresh NAME from one of four sources (a small and a large model, each
as a local folder and as a .tar.gz on a local HTTP server) and SIGKILLs it after a random delay, uniform over
the time a full load of that source takes (measured first). Then:

- ``repository/NAME`` is either absent or complete: every file byte for byte as the source has it,
  ``config.pbtxt`` with the NAME line added, and an install record naming the source;
- a folder that is there is left to Triton, which must report it READY (never UNAVAILABLE), then it is
  unloaded the way the proxy does, so Triton does not fill up with hundreds of models;
- at the end, Triton's log holds no failure line naming any run's model, and one pass of
  ``tritonshare gc --once`` leaves staging empty.

Where each kill landed is read from the loader's log (the last ``phase X took`` line before the kill).

Run from the repository root::

    .venv/bin/python -m bench.faults.kill_loader --runs 200 [--large-mib 24] [--seed 1]
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import re
import signal
import subprocess
import tarfile
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from bench.faults.node import TRITONSHARE, Node, failure_lines, loaded_count, remove, run_gc, settle, start_triton
from tests.support.models import write_model
from tests.support.storage import HttpFileServer
from tests.support.triton import TritonServer

from tritonshare.common.repository import RECORD_FILE, read_record
from tritonshare.common.triton import TritonClient

PREFIX = "kill-"  # every NAME this script installs starts with it (gc's --manage pattern)

# The phase a loader was in, from the last phase it logged as finished (tritonshare.loader.run).
NEXT_PHASE = {
    "": "start",
    "triton": "list",
    "list": "space",
    "space": "download",
    "download": "unpack/check",
    "unpack": "check",
    "check": "publish",
    "publish": "load",
    "load": "finished",
}
_PHASE_DONE = re.compile(r"phase (\w+) took")


@dataclass(frozen=True)
class SourceKind:
    label: str
    uri: str
    model: Path  # the model folder as the source holds it (config.pbtxt without a name line)


@dataclass
class Tally:
    runs: int = 0
    killed: int = 0  # the loader was still running at the kill
    phases: Counter[str] = field(default_factory=Counter)
    folders: int = 0  # runs that left repository/NAME
    complete: int = 0
    problems: list[str] = field(default_factory=list)
    states: Counter[str] = field(default_factory=Counter)  # Triton's verdict on the folders left
    staging_after_runs: int = 0
    staging_after_gc: int = 0
    triton_failures: list[str] = field(default_factory=list)
    triton_loads: int = 0
    gc_removed: int = 0
    names: set[str] = field(default_factory=set)

    @property
    def passed(self) -> bool:
        return (
            not self.problems
            and self.complete == self.folders
            and set(self.states) <= {"READY"}
            and not self.triton_failures
            and self.staging_after_gc == 0
        )

    def lines(self) -> list[str]:
        phases = ", ".join(f"{phase} {count}" for phase, count in sorted(self.phases.items()))
        states = ", ".join(f"{state} {count}" for state, count in sorted(self.states.items())) or "none"
        return [
            f"runs: {self.runs}, killed while running: {self.killed}, finished before the kill: "
            f"{self.runs - self.killed}",
            f"kill landed in phase: {phases}",
            f"repository folders left by a killed loader: {self.folders}, complete byte for byte: {self.complete}, "
            f"partial: {self.folders - self.complete}",
            f"Triton's verdict on them: {states}; 'successfully loaded' lines: {self.triton_loads}; "
            f"failure lines naming a run's model: {len(self.triton_failures)}",
            f"staging entries after the runs: {self.staging_after_runs}, removed by gc: {self.gc_removed}, "
            f"left after gc: {self.staging_after_gc}",
            f"RESULT: {'PASS' if self.passed else 'FAIL'}",
        ]


# ---------------------------------------------------------------------------------------------- sources


def make_sources(root: Path, http: HttpFileServer, *, large_bytes: int, small_files: int) -> list[SourceKind]:
    """A small identity model and a large one (random weights + many small files), each as a folder and as a
    .tar.gz served over HTTP."""
    small = write_model(root / "small")
    large = write_model(root / "large")
    with open(large / "1" / "weights.bin", "wb") as fh:
        for _ in range(large_bytes >> 20):
            fh.write(os.urandom(1 << 20))
        fh.write(os.urandom(large_bytes & ((1 << 20) - 1)))
    for i in range(small_files):
        (large / "1" / f"vocab-{i:03d}.txt").write_bytes(os.urandom(2048))
    kinds = [SourceKind("path-small", str(small), small), SourceKind("path-large", str(large), large)]
    for label, folder in (("http-small", small), ("http-large", large)):
        archive = root / f"{label}.tar.gz"
        with tarfile.open(archive, "w:gz", compresslevel=1) as tar:
            tar.add(folder, arcname=label)
        kinds.append(SourceKind(label, http.serve(archive), folder))
    return kinds


# ---------------------------------------------------------------------------------------------- one run


def start_load(node: Node, triton: TritonServer, kind: SourceKind, name: str, log: Path) -> subprocess.Popen[bytes]:
    cmd = [
        TRITONSHARE, "load", kind.uri, "--name", name,
        "--repository", str(node.layout.repository), "--staging", str(node.layout.staging),
        "--triton-url", triton.url, "--termination-log", str(log.with_suffix(".termination")),
        "--timeout-s", "60", "--retries", "1",
    ]  # fmt: skip
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)


@dataclass(frozen=True)
class Span:
    """Seconds after its start at which an unkilled load of a source made its staging folder, published its
    model folder, and exited."""

    staged_s: float
    publish_s: float
    total_s: float


@dataclass(frozen=True)
class Moment:
    """When to kill: ``delay_s`` after the loader started, or after its staging folder appeared."""

    after_staging: bool
    delay_s: float


def draw(span: Span, rng: random.Random, run: int) -> Moment:
    """Three kinds of moment, in turn: anywhere in the whole load; while the loader works in staging (download,
    unpack, check, publish: where a partial folder could arise); anywhere before the publish."""
    kind = run % 3
    if kind == 0:
        return Moment(False, rng.uniform(0.0, span.total_s))
    if kind == 1:
        return Moment(True, rng.uniform(0.0, 1.2 * max(span.publish_s - span.staged_s, 0.01)))
    return Moment(False, rng.uniform(0.0, 1.1 * span.publish_s))


def measure(node: Node, triton: TritonServer, kind: SourceKind, logs: Path) -> Span:
    """Load ``kind`` once without a kill, watching staging and the repository."""
    name = f"{PREFIX}calibrate-{kind.label}"
    started = time.monotonic()
    process = start_load(node, triton, kind, name, logs / f"{name}.log")
    staged = published = 0.0
    while process.poll() is None:
        now = time.monotonic() - started
        if not staged and staging_of(node, name):
            staged = now
        if not published and node.layout.model_dir(name).exists():
            published = now
        time.sleep(0.002)
    total = time.monotonic() - started
    if process.returncode != 0:
        raise RuntimeError(f"calibration load of {kind.uri} exited {process.returncode}: "
                           f"{(logs / f'{name}.log').read_text()}")  # fmt: skip
    remove(node, triton, name)
    published = published or total
    return Span(staged_s=staged or published, publish_s=published, total_s=total)


def calibrate(
    node: Node, triton: TritonServer, kinds: list[SourceKind], logs: Path, repeats: int = 2
) -> dict[str, Span]:
    """The quickest of ``repeats`` unkilled loads of each source, field by field (the first load after Triton
    starts is slow)."""
    spans = {}
    for kind in kinds:
        seen = [measure(node, triton, kind, logs) for _ in range(repeats)]
        spans[kind.label] = Span(
            staged_s=min(s.staged_s for s in seen),
            publish_s=min(s.publish_s for s in seen),
            total_s=min(s.total_s for s in seen),
        )
    return spans


def staging_of(node: Node, name: str) -> list[str]:
    return [entry for entry in os.listdir(node.layout.staging) if entry.startswith(f"{name}.")]


def wait_for_staging(node: Node, name: str, process: subprocess.Popen[bytes], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while process.poll() is None and not staging_of(node, name) and time.monotonic() < deadline:
        time.sleep(0.001)


def kill_once(
    node: Node, triton: TritonServer, kind: SourceKind, name: str, moment: Moment, logs: Path, tally: Tally
) -> None:
    log = logs / f"{name}.log"
    process = start_load(node, triton, kind, name, log)
    if moment.after_staging:
        wait_for_staging(node, name, process)
    time.sleep(moment.delay_s)
    still_running = process.poll() is None
    process.send_signal(signal.SIGKILL)
    process.wait()
    tally.runs += 1
    tally.names.add(name)
    if still_running:
        tally.killed += 1
        tally.phases[phase_at_kill(log.read_text(errors="replace"))] += 1
    judge_folder(node, triton, kind, name, tally)


def loader_added(files: set[str]) -> set[str]:
    """Files the loader adds to a model by design: its install record, and a plain ``__pycache__`` file beside
    each Python module (so Triton writes no bytecode into the published folder)."""
    caches = {(Path(rel).parent / "__pycache__").as_posix() for rel in files if rel.endswith(".py")}
    return {RECORD_FILE} | caches


def phase_at_kill(log_text: str) -> str:
    done = _PHASE_DONE.findall(log_text)
    return NEXT_PHASE.get(done[-1] if done else "", "?")


def judge_folder(node: Node, triton: TritonServer, kind: SourceKind, name: str, tally: Tally) -> None:
    folder = node.layout.model_dir(name)
    if not folder.exists():
        return
    tally.folders += 1
    problem = installed_problem(folder, kind, name)
    if problem is None:
        tally.complete += 1
    else:
        tally.problems.append(f"{name}: {problem}")
    tally.states[settle(TritonClient(triton.url), name)] += 1
    if not remove(node, triton, name):
        tally.problems.append(f"{name}: Triton still serves it after unload")


def installed_problem(folder: Path, kind: SourceKind, name: str) -> str | None:
    """None when ``folder`` is exactly what installing ``kind`` as ``name`` must give; else what differs."""
    expected = {p.relative_to(kind.model).as_posix() for p in kind.model.rglob("*") if p.is_file()}
    found = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
    missing = sorted((expected | {RECORD_FILE}) - found)
    extra = sorted(found - expected - loader_added(expected))
    if missing or extra:
        return f"files differ: missing {missing[:5]}, extra {extra[:5]}"
    for rel in sorted(expected):
        want = (kind.model / rel).read_bytes()
        if rel == "config.pbtxt":
            want = f'name: "{name}"\n'.encode() + want
        if (folder / rel).read_bytes() != want:
            return f"{rel} differs from the source"
    record = read_record(folder)
    if record is None or record.name != name or record.source != kind.uri:
        return f"install record {record} does not name {name} from {kind.uri}"
    return None


# ---------------------------------------------------------------------------------------------- the figure


def finish(node: Node, triton: TritonServer, tally: Tally, *, ttl_s: float = 1.0) -> None:
    """Triton's log, then one gc pass over what the killed loaders left in staging."""
    log = triton.log_text()
    tally.triton_failures = failure_lines(log, tally.names)
    tally.triton_loads = loaded_count(log, tally.names)
    leftovers = mine(node.layout.staging)
    tally.staging_after_runs = len(leftovers)
    time.sleep(ttl_s + 0.5)  # every leftover is older than the TTL
    gc = run_gc(node, triton, ttl_s=ttl_s, manage=f"{PREFIX}*")
    if gc.returncode != 0:
        tally.problems.append(f"gc exited {gc.returncode}: {gc.stderr[-2000:]}")
    tally.gc_removed = len(leftovers) - len(mine(node.layout.staging))
    tally.staging_after_gc = len(mine(node.layout.staging))
    stray = [p.name for p in node.layout.repository.iterdir() if p.name.startswith(PREFIX)]
    if stray:
        tally.problems.append(f"models left in the repository after the runs: {stray}")


def mine(folder: Path) -> list[Path]:
    return [p for p in folder.iterdir() if p.name.startswith(PREFIX)]


def kill_runs(
    node: Node,
    triton: TritonServer,
    kinds: list[SourceKind],
    runs: int,
    logs: Path,
    *,
    moment: Callable[[SourceKind, int], Moment],
    progress: Callable[[int, Tally], None] = lambda i, t: None,
) -> Tally:
    tally = Tally()
    for i in range(runs):
        kind = kinds[i % len(kinds)]
        kill_once(node, triton, kind, f"{PREFIX}{i:04d}-{kind.label}", moment(kind, i // len(kinds)), logs, tally)
        progress(i + 1, tally)
    finish(node, triton, tally)
    return tally


def main() -> int:
    args = _arguments()
    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)  # a killed download's reset is expected
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="tritonshare-kill-") as tmp:
        root = Path(tmp)
        node = Node(root / "node").create()
        logs = root / "logs"
        logs.mkdir()
        http = HttpFileServer(root / "http").start()
        triton = start_triton(node)
        try:
            kinds = make_sources(root / "sources", http, large_bytes=args.large_mib << 20, small_files=64)
            spans = calibrate(node, triton, kinds, logs)
            print("unkilled load, staged / published / exited at (s): "
                  + ", ".join(f"{k} {s.staged_s:.2f}/{s.publish_s:.2f}/{s.total_s:.2f}" for k, s in spans.items()),
                  flush=True)  # fmt: skip
            tally = kill_runs(
                node, triton, kinds, args.runs, logs,
                moment=lambda kind, run: draw(spans[kind.label], rng, run), progress=_progress,
            )  # fmt: skip
        finally:
            triton.stop()
            http.stop()
        print("\n".join(tally.lines()))
        for problem in tally.problems[:20] + tally.triton_failures[:20]:
            print("  " + problem)
        return 0 if tally.passed else 1


def _progress(done: int, tally: Tally) -> None:
    if done % 20 == 0:
        print(f"  {done} runs: {tally.folders} folders left, {len(tally.problems)} problems", flush=True)


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--large-mib", type=int, default=24, help="size of the large model's weights file")
    parser.add_argument("--seed", type=int, default=1)
    return parser.parse_args()


if __name__ == "__main__":
    raise SystemExit(main())
