"""kill -9 of ``tritonshare load`` at random moments (CI's small version of ``bench/faults/kill_loader.py``):
a killed loader leaves either nothing or a complete model in the repository, Triton never fails to load one,
and one gc pass empties staging of what the killed loaders left."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
from bench.faults.kill_loader import SourceKind, calibrate, draw, installed_problem, kill_runs, make_sources
from bench.faults.node import Node

from tests.support.models import write_model
from tests.support.storage import HttpFileServer
from tests.support.triton import TritonServer
from tritonshare.common.repository import InstallRecord, write_record

pytestmark = [pytest.mark.triton, pytest.mark.slow]

RUNS = 10


def test_a_loader_killed_at_random_moments_leaves_only_complete_models(
    node: Node, triton: TritonServer, file_server: HttpFileServer, tmp_path: Path
) -> None:
    kinds = make_sources(tmp_path / "sources", file_server, large_bytes=4 << 20, small_files=16)
    kinds = [kind for kind in kinds if kind.label.endswith("-large")]  # the longest window in staging
    logs = tmp_path / "logs"
    logs.mkdir()
    spans = calibrate(node, triton, kinds, logs, repeats=1)
    rng = random.Random(20240611)

    tally = kill_runs(node, triton, kinds, RUNS, logs, moment=lambda kind, run: draw(spans[kind.label], rng, run))

    report = "\n".join(tally.lines() + tally.problems + tally.triton_failures)
    assert tally.runs == RUNS
    assert tally.killed >= RUNS // 2, report  # most kills hit a running loader, not one that had finished
    assert tally.passed, report


def _installed_copy(kind: SourceKind, folder: Path, name: str) -> Path:
    shutil.copytree(kind.model, folder)
    config = folder / "config.pbtxt"
    config.write_text(f'name: "{name}"\n' + config.read_text())
    write_record(folder, InstallRecord(name=name, source=kind.uri, digest="0" * 64))
    return folder


def test_the_completeness_check_sees_a_truncated_file_a_missing_file_and_a_foreign_record(tmp_path: Path) -> None:
    model = write_model(tmp_path / "src", padding_bytes=4096)
    kind = SourceKind("path", str(model), model)
    good = _installed_copy(kind, tmp_path / "good", "m")
    assert installed_problem(good, kind, "m") is None

    truncated = _installed_copy(kind, tmp_path / "truncated", "m")
    (truncated / "1" / "weights.bin").write_bytes((model / "1" / "weights.bin").read_bytes()[:100])
    assert installed_problem(truncated, kind, "m") == "1/weights.bin differs from the source"

    missing = _installed_copy(kind, tmp_path / "missing", "m")
    (missing / "1" / "model.py").unlink()
    assert "missing ['1/model.py']" in str(installed_problem(missing, kind, "m"))

    foreign = _installed_copy(kind, tmp_path / "foreign", "m")
    write_record(foreign, InstallRecord(name="m", source="s3://elsewhere/m", digest="0" * 64))
    assert "does not name m from" in str(installed_problem(foreign, kind, "m"))
