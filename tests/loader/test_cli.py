"""``tritonshare load`` as a pod runs it: the console script in a subprocess, real storage servers, the real
Triton. Each test checks the exit code, the one-line termination message, and that the repository and
staging hold nothing new after a failure."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from tests.support.models import BROKEN_MODEL, write_model
from tests.support.mounts import two_mounts
from tests.support.ports import free_port
from tests.support.storage import HttpFileServer, MotoS3, RcloneS3, make_tar
from tests.support.triton import REPO_ROOT, TritonServer
from tritonshare.common.errors import ExitCode
from tritonshare.common.layout import NodeLayout

pytestmark = [pytest.mark.triton, pytest.mark.storage]

TRITONSHARE = REPO_ROOT / ".venv" / "bin" / "tritonshare"


@dataclass(frozen=True)
class Outcome:
    code: int
    log: str  # the command's stderr
    message: str  # the termination-message file, "" when not written


def load(layout: NodeLayout, triton_url: str, source: str, name: str, tmp_path: Path, *extra: str,
         env: dict[str, str] | None = None) -> Outcome:  # fmt: skip
    termination = tmp_path / f"termination-{name}"
    cmd = [
        str(TRITONSHARE), "load", source, "--name", name, "--repository", str(layout.repository),
        "--staging", str(layout.staging), "--triton-url", triton_url, "--termination-log", str(termination),
        "--timeout-s", "60", "--retries", "1", *extra,
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env or dict(os.environ), capture_output=True, text=True, timeout=110)
    message = termination.read_text() if termination.exists() else ""
    return Outcome(proc.returncode, proc.stderr, message)


def node_entries(layout: NodeLayout) -> set[str]:
    return {f"models/{n}" for n in os.listdir(layout.repository)} | {f"staging/{n}" for n in os.listdir(layout.staging)}


def infer_identity(triton: TritonServer, name: str) -> None:
    client = httpclient.InferenceServerClient(triton.url.removeprefix("http://"), network_timeout=30)
    try:
        data = np.array([1.5, -2.0, 3.25], dtype=np.float32)
        tensor = httpclient.InferInput("INPUT0", [3], "FP32")
        tensor.set_data_from_numpy(data)
        np.testing.assert_array_equal(client.infer(name, [tensor]).as_numpy("OUTPUT0"), data)
    finally:
        client.close()


def failed(outcome: Outcome, code: ExitCode, *fragments: str) -> None:
    assert outcome.code == code, outcome.log
    for fragment in fragments:
        assert fragment in outcome.message, outcome.message
    assert outcome.message.count("\n") == 1  # one line, as the pod status shows it


# ---- the same model from every kind of source ---------------------------------------------------------


def _from_s3(request: pytest.FixtureRequest, model: Path) -> str:
    return str(request.getfixturevalue("s3_server").serve(model, prefix="team/identity"))


def _from_gs(request: pytest.FixtureRequest, model: Path) -> str:
    return str(request.getfixturevalue("gcs_server").serve(model, prefix="team/identity"))


def _from_http_archive(request: pytest.FixtureRequest, model: Path) -> str:
    archive = make_tar(model, model.parent / "identity.tar.gz", arcname="identity")
    return str(request.getfixturevalue("http_server").serve(archive))


def _from_path(request: pytest.FixtureRequest, model: Path) -> str:
    return str(model)


SOURCE_KINDS = {"s3": _from_s3, "gs": _from_gs, "http-archive": _from_http_archive, "path": _from_path}


@pytest.mark.parametrize("kind", list(SOURCE_KINDS))
def test_the_same_model_loads_from_every_kind_of_source_and_answers(
    kind: str, request: pytest.FixtureRequest, layout: NodeLayout, triton: TritonServer, model_name: str,
    tmp_path: Path, cleanup: list[str],
) -> None:  # fmt: skip
    source = SOURCE_KINDS[kind](request, write_model(tmp_path / "identity"))
    before = node_entries(layout)
    cleanup.append(model_name)
    outcome = load(layout, triton.url, source, model_name, tmp_path)
    assert outcome.code == ExitCode.OK, outcome.log
    assert outcome.message == ""
    assert f"{model_name} is ready (installed)" in outcome.log and "phase download took" in outcome.log
    infer_identity(triton, model_name)
    assert node_entries(layout) == before | {f"models/{model_name}"}


def test_a_restarted_loader_reuses_the_install(
    layout: NodeLayout, triton: TritonServer, model_name: str, tmp_path: Path, cleanup: list[str]
) -> None:
    source = str(write_model(tmp_path / "identity"))
    cleanup.append(model_name)
    assert load(layout, triton.url, source, model_name, tmp_path).code == ExitCode.OK
    again = load(layout, triton.url, source, model_name, tmp_path)
    assert again.code == ExitCode.OK, again.log
    assert "reusing it, nothing to download" in again.log and "phase download" not in again.log


# ---- every exit code from a real condition ------------------------------------------------------------


def test_a_missing_object_exits_10(
    s3_server: MotoS3, layout: NodeLayout, triton: TritonServer, model_name: str, tmp_path: Path
) -> None:
    served = s3_server.serve(write_model(tmp_path / "identity"), prefix="team/identity")
    before = node_entries(layout)
    outcome = load(layout, triton.url, served + "-v2", model_name, tmp_path)
    failed(outcome, ExitCode.SOURCE_PERMANENT, "s3://models/team/identity-v2", "check the bucket")
    assert node_entries(layout) == before


def test_denied_credentials_exit_10(
    rclone_s3_server: RcloneS3, layout: NodeLayout, triton: TritonServer, model_name: str, tmp_path: Path
) -> None:
    uri = rclone_s3_server.place(write_model(tmp_path / "identity"))
    env = {**os.environ, "AWS_SECRET_ACCESS_KEY": "not-the-secret"}
    before = node_entries(layout)
    outcome = load(layout, triton.url, uri, model_name, tmp_path, env=env)
    failed(outcome, ExitCode.SOURCE_PERMANENT, uri, "access denied", "credentials")
    assert node_entries(layout) == before


def test_a_folder_that_is_not_a_model_exits_10(
    layout: NodeLayout, triton: TritonServer, model_name: str, tmp_path: Path
) -> None:
    (tmp_path / "weights").mkdir()
    (tmp_path / "weights" / "model.onnx").write_bytes(b"onnx")
    before = node_entries(layout)
    outcome = load(layout, triton.url, str(tmp_path / "weights"), model_name, tmp_path)
    failed(outcome, ExitCode.SOURCE_PERMANENT, "not a Triton model", "found model.onnx")
    assert node_entries(layout) == before


def test_an_archive_with_a_member_climbing_out_exits_10(
    http_server: HttpFileServer, layout: NodeLayout, triton: TritonServer, model_name: str, tmp_path: Path
) -> None:
    model = write_model(tmp_path / "identity")
    archive = make_tar(model, tmp_path / "evil.tgz", arcname="../../identity")
    before = node_entries(layout)
    outcome = load(layout, triton.url, http_server.serve(archive), model_name, tmp_path)
    failed(outcome, ExitCode.SOURCE_PERMANENT, "evil.tgz: member '../../identity/", "is refused")
    assert node_entries(layout) == before
    assert not (layout.staging.parent / "identity").exists()


LOGIN_PAGE = "<!DOCTYPE html>\n<html><head><title>Sign in</title></head><body><form>…</form></body></html>\n"


@pytest.mark.parametrize("name", ["model.tar.gz", "model.zip"])  # unpacked as it arrives; unpacked once landed
def test_an_html_page_served_for_an_archive_exits_10_naming_the_url(
    name: str, http_server: HttpFileServer, layout: NodeLayout, triton: TritonServer, model_name: str, tmp_path: Path
) -> None:
    """A login or error page answered with 200 at the archive's URL: the message names the URL, not the
    loader's own file, and says what came instead."""
    page = tmp_path / name
    page.write_text(LOGIN_PAGE)
    url = http_server.serve(page)
    before = node_entries(layout)
    outcome = load(layout, triton.url, url, model_name, tmp_path)
    expected = name.removeprefix("model")
    failed(outcome, ExitCode.SOURCE_PERMANENT, f"{url}: not a readable", "<title>Sign in</title>",
           f"the server answered an HTML page, not a {expected}: check the URL and its access")  # fmt: skip
    assert node_entries(layout) == before


def test_a_damaged_archive_exits_10_naming_its_url_not_the_loaders_file(
    http_server: HttpFileServer, layout: NodeLayout, triton: TritonServer, model_name: str, tmp_path: Path
) -> None:
    damaged = tmp_path / "model.tar.gz"
    damaged.write_bytes(b"\x1f\x8b\x08\x00" + bytes(range(256)) * 4)  # a gzip header, then no deflate stream
    url = http_server.serve(damaged)
    outcome = load(layout, triton.url, url, model_name, tmp_path)
    failed(outcome, ExitCode.SOURCE_PERMANENT, f"{url}: not a readable tar archive", "check the file")
    assert "HTML" not in outcome.message


def test_a_model_triton_rejects_exits_12_with_tritons_reason(
    layout: NodeLayout, triton: TritonServer, model_name: str, tmp_path: Path
) -> None:
    source = str(write_model(tmp_path / "broken", model_py=BROKEN_MODEL))
    before = node_entries(layout)
    outcome = load(layout, triton.url, source, model_name, tmp_path)
    failed(outcome, ExitCode.TRITON_LOAD_FAILED, f"Triton failed to load {model_name}",
           "RuntimeError: tritonshare-test: this model refuses to load")  # fmt: skip
    assert node_entries(layout) == before
    assert f"took {model_name} back out of the repository" in outcome.log


def test_a_field_the_schema_does_not_know_exits_10_or_with_lenient_checking_reaches_triton(
    layout: NodeLayout, triton: TritonServer, model_name: str, tmp_path: Path, cleanup: list[str]
) -> None:
    from tests.support.models import IDENTITY_CONFIG

    source = str(write_model(tmp_path / "newer", config=IDENTITY_CONFIG + "model_future_option: true\n"))
    before = node_entries(layout)
    strict = load(layout, triton.url, source, model_name, tmp_path)
    failed(strict, ExitCode.SOURCE_PERMANENT, "config.pbtxt: line", "has no field 'model_future_option'")
    assert node_entries(layout) == before

    # Lenient: published for Triton to judge. Triton 2.51 does not know the field either: it never reports the
    # model ready, so the load runs into its deadline (a newer Triton that knows the field would serve it).
    lenient = load(layout, triton.url, source, model_name, tmp_path, "--config-check", "lenient", "--timeout-s", "3")
    assert "'model_future_option'" in lenient.log and "passed to Triton unchecked" in lenient.log
    failed(lenient, ExitCode.READINESS_TIMEOUT, f"{model_name} is not ready")
    assert "phase publish took" in lenient.log
    cleanup.append(model_name)  # removed after the test


def test_triton_down_exits_13(layout: NodeLayout, model_name: str, tmp_path: Path) -> None:
    down = f"http://127.0.0.1:{free_port()}"
    before = node_entries(layout)
    outcome = load(layout, down, str(write_model(tmp_path / "identity")), model_name, tmp_path, "--timeout-s", "1")
    failed(outcome, ExitCode.READINESS_TIMEOUT, "Triton is not reachable after 1.", down, "--triton-url")
    assert node_entries(layout) == before
    assert "phase download" not in outcome.log  # nothing was fetched for a Triton that is not there


def test_a_tiny_deadline_exits_13(layout: NodeLayout, triton: TritonServer, model_name: str, tmp_path: Path,
                                  cleanup: list[str]) -> None:  # fmt: skip
    cleanup.append(model_name)
    before = node_entries(layout)
    outcome = load(layout, triton.url, str(write_model(tmp_path / "identity")), model_name, tmp_path,
                   "--timeout-s", "0.05")  # fmt: skip
    failed(outcome, ExitCode.READINESS_TIMEOUT, f"{model_name} is not ready 0.")
    if "Triton is LOADING it" in outcome.message:  # Triton's poll came within the deadline: it stays, by design
        assert node_entries(layout) == before | {f"models/{model_name}"}
    else:
        assert node_entries(layout) == before


def test_a_name_holding_another_model_exits_14_and_the_model_keeps_serving(
    layout: NodeLayout, triton: TritonServer, model_name: str, tmp_path: Path, cleanup: list[str]
) -> None:
    cleanup.append(model_name)
    first = str(write_model(tmp_path / "first"))
    assert load(layout, triton.url, first, model_name, tmp_path).code == ExitCode.OK
    before = node_entries(layout)
    outcome = load(layout, triton.url, str(write_model(tmp_path / "second")), model_name, tmp_path)
    failed(outcome, ExitCode.INSTALL_CONFLICT, f"installed from {first}", f"tritonshare unload --name {model_name}")
    assert node_entries(layout) == before
    infer_identity(triton, model_name)


def test_staging_and_repository_on_two_mounts_exit_2_before_anything_is_fetched(
    triton: TritonServer, http_server: HttpFileServer, tmp_path: Path
) -> None:
    archive = make_tar(write_model(tmp_path / "identity"), tmp_path / "identity.tar.gz", arcname="identity")
    source = http_server.serve(archive)
    with two_mounts(tmp_path / "node") as layout:
        outcome = load(layout, triton.url, source, "identity", tmp_path)
        failed(outcome, ExitCode.USAGE, "are separate mounts of one filesystem", "mount one volume holding both")
        assert node_entries(layout) == set()
    assert http_server.requests == []  # found before the download, not at the publishing rename after it


def test_an_invalid_name_is_a_usage_error(layout: NodeLayout, triton: TritonServer, tmp_path: Path) -> None:
    outcome = load(layout, triton.url, str(tmp_path), "../escape", tmp_path)
    assert outcome.code == ExitCode.USAGE
    assert "model name '../escape' is not valid" in outcome.log
