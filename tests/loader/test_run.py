"""``run(settings)`` end to end in this process: a real Triton (POLL, 1 s), models from local paths and
archives. Every failure is driven by a real condition and leaves nothing new in the repository or staging
(except, by design, a folder Triton is still LOADING at the deadline)."""

from __future__ import annotations

import logging
import os
import shutil
import tarfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from tests.support.install import model_ready, own_triton_serving, wait_model_ready
from tests.support.models import BROKEN_MODEL, IDENTITY_CONFIG, IDENTITY_MODEL, write_model
from tests.support.ports import free_port
from tests.support.storage import make_tar
from tests.support.triton import TritonServer
from tritonshare.common.errors import (
    ExitCode,
    InstallConflict,
    InsufficientSpace,
    InvalidModel,
    ReadinessTimeout,
    SourceNotFound,
    TritonLoadFailed,
    TritonshareError,
    UnsafeArchive,
)
from tritonshare.common.layout import NodeLayout
from tritonshare.common.lease import Holder, LeaseStore
from tritonshare.common.repository import RECORD_FILE, read_record
from tritonshare.common.triton import TritonClient
from tritonshare.loader.run import run
from tritonshare.loader.settings import LoaderSettings
from tritonshare.loader.sources.base import display_uri

pytestmark = pytest.mark.triton

# initialize() takes long enough that a short deadline finds the model LOADING, deterministically
SLOW_INIT_MODEL = "import time\n\n\n" + IDENTITY_MODEL.replace(
    "class TritonPythonModel:\n", "class TritonPythonModel:\n    def initialize(self, args):\n        time.sleep(5)\n\n"
)


def settings(layout: NodeLayout, triton: TritonServer, source: Path | str, name: str, **kw: object) -> LoaderSettings:
    base: dict[str, object] = {"timeout_s": 60.0, "poll_interval_s": 0.1, "termination_log": None}
    return LoaderSettings(source=str(source), name=name, layout=layout, triton_url=triton.url, **{**base, **kw})  # type: ignore[arg-type]


def node_entries(layout: NodeLayout) -> set[str]:
    return {f"models/{n}" for n in os.listdir(layout.repository)} | {f"staging/{n}" for n in os.listdir(layout.staging)}


def infer_identity(triton: TritonServer, name: str) -> None:
    client = httpclient.InferenceServerClient(triton.url.removeprefix("http://"), network_timeout=30)
    try:
        data = np.arange(6, dtype=np.float32)
        tensor = httpclient.InferInput("INPUT0", [6], "FP32")
        tensor.set_data_from_numpy(data)
        np.testing.assert_array_equal(client.infer(name, [tensor]).as_numpy("OUTPUT0"), data)
    finally:
        client.close()


def expect_failure(
    error: type[TritonshareError], code: ExitCode, match: str, layout: NodeLayout, conf: LoaderSettings
) -> TritonshareError:
    before = node_entries(layout)
    with pytest.raises(error, match=match) as info:
        run(conf)
    assert info.value.exit_code == code
    assert node_entries(layout) == before, "a failed load left something in the repository or staging"
    return info.value


def test_a_local_folder_is_installed_named_and_served(
    layout: NodeLayout, triton: TritonServer, model_name: str, tmp_path: Path, cleanup: list[str]
) -> None:
    source = write_model(tmp_path / "exported", name="exported-under-another-name")
    before = node_entries(layout)
    cleanup.append(model_name)
    assert run(settings(layout, triton, source, model_name)) == ExitCode.OK
    infer_identity(triton, model_name)
    installed = layout.model_dir(model_name)
    assert (installed / "config.pbtxt").read_text().startswith(f'name: "{model_name}"\n')
    assert node_entries(layout) == before | {f"models/{model_name}"}  # no staging leftovers
    record = read_record(installed)
    assert record is not None and record.source == str(source) and len(record.digest) == 64


def test_an_archive_with_a_wrapping_folder_is_unpacked_and_served(
    layout: NodeLayout, triton: TritonServer, model_name: str, tmp_path: Path, cleanup: list[str]
) -> None:
    archive = make_tar(write_model(tmp_path / "resnet"), tmp_path / "resnet.tar.gz", arcname="resnet")
    cleanup.append(model_name)
    assert run(settings(layout, triton, archive, model_name)) == ExitCode.OK
    infer_identity(triton, model_name)
    assert sorted(os.listdir(layout.model_dir(model_name))) == ["1", "config.pbtxt", RECORD_FILE]


def test_a_second_load_of_the_same_source_reuses_the_install_without_downloading(
    layout: NodeLayout,
    triton: TritonServer,
    model_name: str,
    tmp_path: Path,
    cleanup: list[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    source = write_model(tmp_path / "m")
    cleanup.append(model_name)
    run(settings(layout, triton, source, model_name))
    first = read_record(layout.model_dir(model_name))

    def no_download(path: Path) -> int:  # only measured right before downloading
        raise AssertionError("the restarted loader went on to download")

    caplog.set_level(logging.INFO, logger="tritonshare")
    assert run(settings(layout, triton, source, model_name), disk_free=no_download) == ExitCode.OK
    assert read_record(layout.model_dir(model_name)) == first  # same install, same installed_at
    assert f"{model_name} already holds {source} as installed at" in caplog.text
    infer_identity(triton, model_name)


def test_a_name_installed_from_another_source_is_a_conflict_and_keeps_serving(
    layout: NodeLayout, triton: TritonServer, model_name: str, tmp_path: Path, cleanup: list[str]
) -> None:
    cleanup.append(model_name)
    run(settings(layout, triton, write_model(tmp_path / "a"), model_name))
    other = write_model(tmp_path / "b")
    expect_failure(InstallConflict, ExitCode.INSTALL_CONFLICT, rf"holds '{model_name}' installed from .*/a, not .*/b",
                   layout, settings(layout, triton, other, model_name))  # fmt: skip
    infer_identity(triton, model_name)


def test_a_name_whose_pods_are_gone_is_taken_over_by_a_new_source(
    layout: NodeLayout, triton: TritonServer, model_name: str, tmp_path: Path, cleanup: list[str]
) -> None:
    # Pod A installed version a, then was killed without SIGTERM: its lease stopped being refreshed, 11 min ago.
    cleanup.append(model_name)
    assert run(settings(layout, triton, write_model(tmp_path / "a"), model_name, holder=POD_A)) == ExitCode.OK
    LeaseStore(layout.leases, clock=lambda: time.time() - 660).acquire(model_name, POD_A)  # its last heartbeat
    newer = write_model(tmp_path / "b")
    conf = settings(layout, triton, newer, model_name, holder=POD_B, lease_ttl_s=1.0)
    assert run(conf) == ExitCode.OK  # not 14: nobody uses version a any more (judged by the default TTL)
    assert read_record(layout.model_dir(model_name)).source.endswith("/b")  # type: ignore[union-attr]
    assert [lease.holder.uid for lease in LeaseStore(layout.leases).leases(model_name)] == [POD_B.uid]
    infer_identity(triton, model_name)
    LeaseStore(layout.leases).forget(model_name, POD_B)


def test_a_take_over_publishes_only_once_triton_stops_serving_the_old_install(
    layout: NodeLayout, triton: TritonServer, model_name: str, tmp_path: Path, cleanup: list[str]
) -> None:
    """Triton serves the old install until its next poll after its folder left: a folder published before then
    was answered "ready" by the old model (exit 0 at once for a broken model Triton never loaded)."""
    cleanup.append(model_name)
    assert run(settings(layout, triton, write_model(tmp_path / "a"), model_name, holder=POD_A)) == ExitCode.OK
    LeaseStore(layout.leases, clock=lambda: time.time() - 660).acquire(model_name, POD_A)  # killed 11 min ago
    conf = settings(layout, triton, write_model(tmp_path / "b", model_py=BROKEN_MODEL), model_name, holder=POD_B)
    with pytest.raises(TritonLoadFailed, match="this model refuses to load"):
        run(conf)
    assert not layout.model_dir(model_name).exists()  # the old install taken over, the broken one taken back out
    assert not model_ready(triton, model_name)


@pytest.mark.parametrize(
    "why", ["pod A's lease is fresh", "pod A's lease is older than B's TTL, not A's", "installed by hand just now"]
)
def test_a_name_in_use_or_just_installed_is_not_taken_over(
    layout: NodeLayout, triton: TritonServer, model_name: str, tmp_path: Path, cleanup: list[str], why: str
) -> None:
    cleanup.append(model_name)
    holder = None if "by hand" in why else POD_A
    assert run(settings(layout, triton, write_model(tmp_path / "a"), model_name, holder=holder)) == ExitCode.OK
    if "B's TTL" in why:  # pod A heartbeats every 60 s (TTL 600 s); pod B runs with a TTL of 30 s
        LeaseStore(layout.leases, clock=lambda: time.time() - 45).acquire(model_name, POD_A)
    conf_b = settings(layout, triton, write_model(tmp_path / "b"), model_name, holder=POD_B, lease_ttl_s=30.0)
    error = expect_failure(InstallConflict, ExitCode.INSTALL_CONFLICT,
                           rf"holds '{model_name}' installed from .*/a, not .*/b", layout, conf_b)  # fmt: skip
    if holder is not None:  # A's lease is fresh (by the default TTL): "unload it first" would take A's model
        assert f"it is in use by {POD_A}: choose another --name, or delete those pods first" in str(error)
        assert "unload it first" not in str(error)
    else:
        assert "unload it first (tritonshare unload" in str(error)
    infer_identity(triton, model_name)
    LeaseStore(layout.leases).forget(model_name, POD_A)


def test_a_model_larger_than_the_free_space_is_refused_before_downloading(
    layout: NodeLayout, triton: TritonServer, model_name: str, tmp_path: Path
) -> None:
    source = write_model(tmp_path / "m", padding_bytes=3 << 20)
    conf = settings(layout, triton, source, model_name)
    before = node_entries(layout)
    with pytest.raises(InsufficientSpace, match=r"the model is 3\.0 MiB but .*staging has 1\.0 MiB free") as info:
        run(conf, disk_free=lambda path: 1 << 20)
    assert info.value.exit_code == ExitCode.INSUFFICIENT_SPACE
    assert node_entries(layout) == before


def test_a_folder_that_is_not_a_model_is_refused(
    layout: NodeLayout, triton: TritonServer, model_name: str, tmp_path: Path
) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "model.onnx").write_bytes(b"onnx")
    expect_failure(InvalidModel, ExitCode.SOURCE_PERMANENT, r"not a Triton model .* found model.onnx",
                   layout, settings(layout, triton, tmp_path / "m", model_name))  # fmt: skip


def test_an_archive_with_a_member_climbing_out_is_refused(
    layout: NodeLayout, triton: TritonServer, model_name: str, tmp_path: Path
) -> None:
    archive = make_tar(write_model(tmp_path / "m"), tmp_path / "m.tar.gz")
    with tarfile.open(tmp_path / "evil.tar.gz", "w:gz") as tar:
        with tarfile.open(archive) as good:
            for member in good.getmembers():
                tar.addfile(member, good.extractfile(member))
        tar.add(tmp_path / "m" / "config.pbtxt", arcname="../../escaped.pbtxt")
    expect_failure(UnsafeArchive, ExitCode.SOURCE_PERMANENT, r"evil.tar.gz: member '../../escaped.pbtxt' is refused",
                   layout, settings(layout, triton, tmp_path / "evil.tar.gz", model_name))  # fmt: skip
    assert not list(layout.staging.parent.rglob("escaped.pbtxt"))


def test_an_archive_whose_link_a_later_link_carries_out_is_refused_and_writes_nothing_outside(
    layout: NodeLayout, triton: TritonServer, model_name: str, tmp_path: Path
) -> None:
    # ``config.pbtxt -> c/c/c/../../../victim.pbtxt`` stays inside while ``c`` does not exist; the member
    # ``c -> .`` makes it lead from staging/WORKSPACE/unpacked/ to the node folder, whose file the config edit
    # would have rewritten through the link
    victim = layout.staging.parent / "victim.pbtxt"
    victim.write_text('backend: "python"\n')
    up = os.path.relpath(layout.staging.parent, layout.staging / "workspace" / "unpacked")
    assert up == "../../..", up  # the test's premise: three levels, three ``c/..`` pairs
    archive = tmp_path / "evil.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(write_model(tmp_path / "m") / "1", arcname="1")
        link = tarfile.TarInfo("config.pbtxt")
        link.type, link.linkname = tarfile.SYMTYPE, "c/c/c/../../../victim.pbtxt"
        tar.addfile(link)
        loop = tarfile.TarInfo("c")
        loop.type, loop.linkname = tarfile.SYMTYPE, "."
        tar.addfile(loop)
    expect_failure(UnsafeArchive, ExitCode.SOURCE_PERMANENT, r"evil.tar.gz: 'config.pbtxt' links to .* leads outside",
                   layout, settings(layout, triton, archive, model_name))  # fmt: skip
    assert victim.read_text() == 'backend: "python"\n'


def test_a_missing_source_is_not_found(
    layout: NodeLayout, triton: TritonServer, model_name: str, tmp_path: Path
) -> None:
    expect_failure(SourceNotFound, ExitCode.SOURCE_PERMANENT, r"no-such-model: no such file or folder",
                   layout, settings(layout, triton, tmp_path / "no-such-model", model_name))  # fmt: skip


def test_a_model_triton_fails_to_load_is_reported_and_taken_back_out(
    layout: NodeLayout, triton: TritonServer, model_name: str, tmp_path: Path
) -> None:
    source = write_model(tmp_path / "m", model_py=BROKEN_MODEL)
    expect_failure(TritonLoadFailed, ExitCode.TRITON_LOAD_FAILED, r"tritonshare-test: this model refuses to load",
                   layout, settings(layout, triton, source, model_name))  # fmt: skip


def test_triton_down_fails_before_downloading(layout: NodeLayout, model_name: str, tmp_path: Path) -> None:
    down = f"http://127.0.0.1:{free_port()}"
    conf = LoaderSettings(source=str(write_model(tmp_path / "m")), name=model_name, layout=layout, triton_url=down,
                          timeout_s=0.5, poll_interval_s=0.1, termination_log=None)  # fmt: skip
    expect_failure(ReadinessTimeout, ExitCode.READINESS_TIMEOUT, rf"Triton is not reachable .*{down}", layout, conf)


def test_a_deadline_before_triton_picks_the_model_up_takes_it_back_out(
    layout: NodeLayout, triton: TritonServer, model_name: str, tmp_path: Path, cleanup: list[str]
) -> None:
    source = write_model(tmp_path / "m")
    before = node_entries(layout)
    cleanup.append(model_name)
    with pytest.raises(ReadinessTimeout, match=rf"{model_name} is not ready 0\.\d s after publishing") as info:
        run(settings(layout, triton, source, model_name, timeout_s=0.0))
    assert info.value.exit_code == ExitCode.READINESS_TIMEOUT
    if "Triton is LOADING it" in str(info.value):  # Triton's poll came within those milliseconds: by design
        assert node_entries(layout) == before | {f"models/{model_name}"}
    else:
        assert node_entries(layout) == before


def test_a_deadline_while_triton_is_loading_leaves_the_folder_in_place(
    layout: NodeLayout, triton: TritonServer, model_name: str, tmp_path: Path, cleanup: list[str]
) -> None:
    """REFERENCE §2: removing a folder Triton is loading hangs POLL for every model."""
    source = write_model(tmp_path / "m", model_py=SLOW_INIT_MODEL)
    before = node_entries(layout)
    cleanup.append(model_name)
    with pytest.raises(ReadinessTimeout, match=r"Triton is still LOADING it .* stays in the repository") as info:
        run(settings(layout, triton, source, model_name, timeout_s=2.5))
    assert f"tritonshare unload --name {model_name}" in str(info.value)
    assert node_entries(layout) == before | {f"models/{model_name}"}


def test_no_partial_folder_is_ever_visible_while_a_large_model_downloads(
    layout: NodeLayout, triton: TritonServer, model_name: str, tmp_path: Path, cleanup: list[str]
) -> None:
    source = write_model(tmp_path / "big", padding_bytes=300 << 20)
    # every file at its full size (config.pbtxt gains its name line), plus the record
    expected = {p.relative_to(source).as_posix(): p.stat().st_size for p in source.rglob("*") if p.is_file()}
    expected["config.pbtxt"] += len(f'name: "{model_name}"\n')
    target, client = layout.model_dir(model_name), TritonClient(triton.url)
    seen: list[str] = []  # what the watcher saw, one word per look
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            listed = bool(client.model_states(model_name))  # first: a folder, once there, stays
            try:
                files = {p.relative_to(target).as_posix(): p.stat().st_size for p in target.rglob("*") if p.is_file()}
            except FileNotFoundError:  # not published (yet)
                files = {}
            ours = {k: v for k, v in files.items() if k != RECORD_FILE}
            if files and (ours != expected or RECORD_FILE not in files):
                seen.append(f"partial:{sorted(files.items())}")
            seen.append("complete" if files else ("listed-without-folder" if listed else "absent"))

    watcher = threading.Thread(target=watch, daemon=True)
    cleanup.append(model_name)
    watcher.start()
    try:
        assert run(settings(layout, triton, source, model_name)) == ExitCode.OK
    finally:
        done.set()
        watcher.join(10)
    assert not [s for s in seen if s.startswith("partial") or s == "listed-without-folder"], seen[:5]
    assert seen.count("absent") >= 10 and seen.count("complete") >= 1  # it watched during the download
    infer_identity(triton, model_name)


@pytest.mark.parametrize(
    ("uri", "recorded"),
    [
        ("https://user:secret@host/m.tgz?x=1", "https://host/m.tgz?x=…"),
        (
            "https://host/m.tgz?X-Amz-Credential=a&X-Amz-Signature=b",
            "https://host/m.tgz?X-Amz-Credential=…&X-Amz-Signature=…",
        ),
        ("http://host:8080/m.tgz#frag", "http://host:8080/m.tgz"),
        ("s3://bucket/team/m", "s3://bucket/team/m"),
        ("/models/m", "/models/m"),
    ],
)
def test_credentials_in_a_source_uri_are_never_recorded_on_the_node(uri: str, recorded: str) -> None:
    assert display_uri(uri) == recorded


# ---- a failed load and other pods: only what this loader published, and no one else holds, is taken out ----

POD_A, POD_B = Holder(uid="run-pod-a"), Holder(uid="run-pod-b")


@pytest.fixture
def bare_triton(tmp_path: Path) -> Iterator[TritonServer]:
    """A second real Triton over an empty repository: it answers but lists none of the node's models, as
    the node's Triton does while it restarts and reloads its repository."""
    (tmp_path / "bare").mkdir()
    server = TritonServer(repository=tmp_path / "bare", log_path=tmp_path / "bare-triton.log").start()
    yield server
    server.stop()


def test_a_reused_install_not_ready_in_time_stays_for_the_pod_that_installed_it(
    layout: NodeLayout,
    triton: TritonServer,
    bare_triton: TritonServer,
    model_name: str,
    tmp_path: Path,
    cleanup: list[str],
) -> None:
    source = write_model(tmp_path / "m")
    leases = LeaseStore(layout.leases)
    cleanup.append(model_name)
    try:
        assert run(settings(layout, triton, source, model_name, holder=POD_A)) == ExitCode.OK
        with pytest.raises(ReadinessTimeout) as info:
            run(settings(layout, bare_triton, source, model_name, holder=POD_B, timeout_s=1.0))
        assert info.value.exit_code == ExitCode.READINESS_TIMEOUT
        message = str(info.value)
        assert "is not ready 1." in message and "s after finding it already installed (reused)" in message
        assert "stays in the repository: this load reused it" in message
        infer_identity(triton, model_name)  # pod A's model is still served
        assert [lease.holder.uid for lease in leases.leases(model_name)] == [POD_A.uid]
    finally:
        leases.forget(model_name, POD_A)  # so that cleanup takes the model out


def test_a_deadline_while_another_pods_lease_is_fresh_leaves_the_folder_to_that_pod(
    layout: NodeLayout, triton: TritonServer, model_name: str, tmp_path: Path, cleanup: list[str]
) -> None:
    source = write_model(tmp_path / "m")
    leases = LeaseStore(layout.leases)
    leases.acquire(model_name, POD_B)  # pod B came while pod A downloaded; it will reuse A's install
    cleanup.append(model_name)
    try:
        with pytest.raises(ReadinessTimeout, match=r"stays in the repository: another pod's lease on it is fresh"):
            run(settings(layout, triton, source, model_name, holder=POD_A, timeout_s=0.0))
        wait_model_ready(triton, model_name)
        infer_identity(triton, model_name)  # pod B gets its model
        assert [lease.holder.uid for lease in leases.leases(model_name)] == [POD_B.uid]
    finally:
        leases.forget(model_name, POD_B)


def test_a_pod_whose_load_fails_takes_its_own_install_out(
    layout: NodeLayout, triton: TritonServer, model_name: str, tmp_path: Path
) -> None:
    source = write_model(tmp_path / "m", model_py=BROKEN_MODEL)
    expect_failure(TritonLoadFailed, ExitCode.TRITON_LOAD_FAILED, r"this model refuses to load",
                   layout, settings(layout, triton, source, model_name, holder=POD_A))  # fmt: skip
    assert LeaseStore(layout.leases).leases(model_name) == []


@pytest.mark.parametrize(
    "folders",
    [("99999999999999999999",), ("1", "99999999999999999999"), ("1", "-99999999999999999999x")],
    ids=["beyond-int64", "beside-version-1", "signed-with-a-suffix"],
)
def test_a_folder_triton_would_read_as_a_version_beyond_int64_is_refused_and_triton_lives_on(
    tmp_path: Path, model_name: str, folders: tuple[str, ...]
) -> None:
    """Triton 2.51 reads a model's sub-folder names with std::stoll and catches only invalid_argument: a name
    whose leading number does not fit in int64 (``99999999999999999999``, ``-99999999999999999999x``) aborts the
    whole server at its next poll (std::out_of_range, SIGABRT) — every tenant of the node down, and again at each
    restart, as the folder stays in its repository. The loader must refuse such a model (exit 10) before
    publishing it. A Triton of its own: the shared one must not die when this fails."""
    layout = NodeLayout(repository=tmp_path / "models", staging=tmp_path / "staging", leases=tmp_path / "leases")
    layout.repository.mkdir()
    layout.staging.mkdir()
    source = write_model(tmp_path / "m")
    (source / "1").rename(source / "weights")
    for folder in folders:
        shutil.copytree(source / "weights", source / folder)
    own = TritonServer(repository=layout.repository, log_path=tmp_path / "triton.log").start()
    try:
        conf = settings(layout, own, source, model_name, timeout_s=5.0)
        error = expect_failure(InvalidModel, ExitCode.SOURCE_PERMANENT, "99999999999999999999", layout, conf)
        assert "int64" in str(error)
        time.sleep(2.5)  # two of Triton's polls
        assert own.live(), f"Triton died:\n{own.log_tail(10)}"
    finally:
        own.stop()


WARMUP = (
    'model_warmup [ { name: "w" batch_size: 1 inputs { key: "INPUT0" value { data_type: TYPE_FP32 dims: DIMS '
    "zero_data: true } } } ]\n"
)


@pytest.mark.parametrize(
    ("config", "why"),
    [
        (IDENTITY_CONFIG + WARMUP.replace("DIMS", "[ 1000000000000 ]"), "model_warmup 'w', input 'INPUT0'"),
        (IDENTITY_CONFIG + WARMUP.replace("DIMS", "[ 6 ]").replace("batch_size: 1", "batch_size: 2147483647"),
         "model_warmup 'w' has batch_size 2147483647"),
        (IDENTITY_CONFIG + WARMUP.replace("DIMS", "[ 6 ]").replace("batch_size: 1", "batch_size: 1 count: 4294967295"),
         "runs 4294967295 times a batch of 1"),
        (IDENTITY_CONFIG.replace("max_batch_size: 0", "max_batch_size: 2147483647") + "sequence_batching { }\n",
         "max_batch_size 2147483647 with sequence_batching"),
        (IDENTITY_CONFIG.replace("max_batch_size: 0", "max_batch_size: 8")
         + "sequence_batching { oldest { max_candidate_sequences: 2147483647 } }\n", "max_candidate_sequences"),
        (IDENTITY_CONFIG + WARMUP.replace("DIMS", "[ 6 ]").replace("zero_data: true",
                                                                  f'input_data_file: "{"../" * 12}proc/self/fd/9"'),
         "leads out of the model folder"),
        (IDENTITY_CONFIG.replace("dims: [ -1 ] } ]\ninstance",
                                 f'dims: [ -1 ] label_filename: "{"../" * 12}proc/self/fd/9" }} ]\ninstance'),
         "label_filename .* leads out of the model folder"),
    ],
    ids=["warmup-data", "warmup-batch", "warmup-count", "sequence-slots", "oldest-candidates", "warmup-file",
         "labels"],
)  # fmt: skip
def test_a_config_that_takes_triton_down_at_load_is_refused_and_triton_lives_on(
    tmp_path: Path, model_name: str, config: str, why: str
) -> None:
    """Published, each of these took the real Triton 2.51 here down with every model on it (SIGSEGV filling warmup
    data it could not allocate; std::bad_alloc making sequence slots), or kept it loading for good (a warmup
    batch_size built request by request, past 3 GiB in seconds; a warmup count of 2**32 - 1) while POLL waits: no
    other model loaded. A warmup data file or an output's labels read from Triton's own pipe (/proc/self/fd/9)
    aborted it too. The loader refuses them (exit 10) before publishing; a Triton of its own, serving a neighbour,
    which must still answer afterwards."""
    layout = NodeLayout(repository=tmp_path / "models", staging=tmp_path / "staging", leases=tmp_path / "leases")
    layout.staging.mkdir()
    with own_triton_serving(tmp_path, "neighbour") as own:
        source = write_model(tmp_path / "m", config=config)
        conf = settings(layout, own, source, model_name, timeout_s=5.0)
        expect_failure(InvalidModel, ExitCode.SOURCE_PERMANENT, why, layout, conf)
        time.sleep(2.5)  # two of Triton's polls
        assert own.live(), f"Triton died:\n{own.log_tail(10)}"
        infer_identity(own, "neighbour")


def test_a_backend_library_in_the_model_is_refused_and_triton_lives_on(tmp_path: Path, model_name: str) -> None:
    """Triton 2.51 loads a model's backend library from the model's own folder before its backend directory, into
    its own process: a libtriton_onnxruntime.so shipped at the model's top whose constructor aborts took the real
    Triton down with every model on it (and would at every restart). The loader refuses such a model (exit 10)
    before publishing; a Triton of its own, serving a neighbour, which must still answer afterwards."""
    layout = NodeLayout(repository=tmp_path / "models", staging=tmp_path / "staging", leases=tmp_path / "leases")
    layout.staging.mkdir()
    with own_triton_serving(tmp_path, "neighbour") as own:
        source = write_model(tmp_path / "m", config=IDENTITY_CONFIG.replace('"python"', '"onnxruntime"'))
        (source / "libtriton_onnxruntime.so").write_bytes(b"\x7fELF")
        conf = settings(layout, own, source, model_name, timeout_s=5.0)
        expect_failure(InvalidModel, ExitCode.SOURCE_PERMANENT, "libtriton_onnxruntime.so is where Triton looks",
                       layout, conf)  # fmt: skip
        time.sleep(2.5)  # two of Triton's polls
        assert own.live(), f"Triton died:\n{own.log_tail(10)}"
        infer_identity(own, "neighbour")


def test_a_model_whose_only_version_folder_triton_ignores_is_refused_before_publishing(
    layout: NodeLayout, triton: TritonServer, model_name: str, tmp_path: Path
) -> None:
    """Triton ignores a version folder whose name has a leading zero (``01/``): a model with no other is never
    loaded, and its index does not even list it — the load waited its whole deadline and blamed Triton's
    --model-repository (exit 13). The loader knows it before publishing: exit 10, saying why."""
    source = write_model(tmp_path / "m")
    (source / "1").rename(source / "01")
    expect_failure(InvalidModel, ExitCode.SOURCE_PERMANENT, r"01/.*leading zero",
                   layout, settings(layout, triton, source, model_name, timeout_s=10.0))  # fmt: skip


def test_a_link_to_nothing_where_the_folder_would_be_is_a_conflict_found_before_downloading(
    layout: NodeLayout, triton: TritonServer, model_name: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A link in the repository is an operator's (a linked model), even one whose target is gone (an unmounted
    volume): NAME is taken. The loader took the name for free (``exists()`` follows links), downloaded the
    whole model, then failed to rename onto the link with ENOTDIR — exit 1, "check the node's disk"."""
    caplog.set_level(logging.INFO, logger="tritonshare")
    link = layout.model_dir(model_name)
    os.symlink(tmp_path / "unmounted", link)
    try:
        expect_failure(InstallConflict, ExitCode.INSTALL_CONFLICT, r"exists but was not installed by tritonshare",
                       layout, settings(layout, triton, write_model(tmp_path / "m"), model_name))  # fmt: skip
        assert "phase download" not in caplog.text
        assert os.readlink(link) == str(tmp_path / "unmounted")  # the operator's link stays as it was
    finally:
        link.unlink()


def test_a_local_model_whose_version_folder_is_a_link_inside_it_is_installed_whole_and_served(
    layout: NodeLayout, triton: TritonServer, model_name: str, tmp_path: Path, cleanup: list[str]
) -> None:
    """A volume's model whose ``1`` links to ``v1`` beside it: the loader listed the link but not what it led
    to, and refused the model for having no version folder (exit 10) though it has one."""
    source = write_model(tmp_path / "m")
    (source / "1").rename(source / "v1")
    os.symlink("v1", source / "1")
    cleanup.append(model_name)
    run(settings(layout, triton, source, model_name))
    installed = layout.model_dir(model_name) / "1"
    assert installed.is_dir() and not installed.is_symlink()  # the files themselves, not a link into the volume
    infer_identity(triton, model_name)


@pytest.mark.parametrize(
    "policy",
    ["version_policy { specific { versions: [5] } }", "version_policy { latest { num_versions: 0 } }"],
    ids=["specific-version-absent", "latest-none"],
)
def test_a_model_whose_version_policy_leaves_triton_no_version_is_refused_before_publishing(
    layout: NodeLayout, triton: TritonServer, model_name: str, tmp_path: Path, policy: str
) -> None:
    """Triton fails such a model at every poll ("at least one version must be available under the version
    policy") without listing it in its index: the load waited out its whole deadline and blamed Triton's
    --model-repository (exit 13). The loader can tell from the config and the folders: exit 10, saying so."""
    source = write_model(tmp_path / "m")
    (source / "config.pbtxt").write_text((source / "config.pbtxt").read_text() + policy + "\n")
    expect_failure(InvalidModel, ExitCode.SOURCE_PERMANENT, r"version policy .* no version",
                   layout, settings(layout, triton, source, model_name, timeout_s=10.0))  # fmt: skip


def test_a_model_whose_version_policy_names_a_version_it_has_is_served(
    layout: NodeLayout, triton: TritonServer, model_name: str, tmp_path: Path, cleanup: list[str]
) -> None:
    source = write_model(tmp_path / "m")
    shutil.copytree(source / "1", source / "3")
    text = (source / "config.pbtxt").read_text()
    (source / "config.pbtxt").write_text(text + "version_policy { specific { versions: [3, 7] } }\n")
    cleanup.append(model_name)
    run(settings(layout, triton, source, model_name))
    infer_identity(triton, model_name)


@pytest.mark.parametrize(
    "links",
    [{"x": "x"}, {"a": "b", "b": "a"}, {"weights": "1/gone.bin"}],
    ids=["to-itself", "to-each-other", "to-a-member-it-lacks"],
)
def test_an_archive_whose_link_leads_nowhere_is_refused_before_triton_polls_it(
    layout: NodeLayout, triton: TritonServer, model_name: str, tmp_path: Path, links: dict[str, str]
) -> None:
    """A link in the model folder that resolves to nothing (round in a loop, or to a member the archive lacks)
    stays "inside" by its path, so it passed; Triton cannot stat it, fails the model's poll for good ("Poll
    failed for model directory") and never lists it, and the load waited out its deadline (exit 13)."""
    with tarfile.open(tmp_path / "m.tar", "w") as tar:
        tar.add(write_model(tmp_path / "m"), arcname=".")
        for name, target in links.items():
            link = tarfile.TarInfo(name)
            link.type, link.linkname = tarfile.SYMTYPE, target
            tar.addfile(link)
    expect_failure(UnsafeArchive, ExitCode.SOURCE_PERMANENT, r"leads to nothing",
                   layout, settings(layout, triton, tmp_path / "m.tar", model_name, timeout_s=10.0))  # fmt: skip
