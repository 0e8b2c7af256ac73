"""Loader download benchmark: tritonshare's download path, s5cmd and kserve-storage side by side.

Starts a local S3 server (``rclone serve s3`` over a temporary folder: fast, and it checks signatures
like real S3), creates two models — one 200 MiB file, and 200 files of 256 KiB — and downloads each
with every tool in a fresh process, several times. Prints MiB/s (whole process wall time: start-up,
listing, transfer, verification — what an init container costs) and each process's peak RSS.

    scripts/setup.sh --bench                      # .venv-bench: s5cmd, kserve-storage, rclone
    .venv/bin/python bench/loader_bench.py        # --runs 3 --concurrency 16 --big-mib 200 ...

Not a test: figures depend on the machine. The bar set for the loader: ≥ 1.0x s5cmd on many small files,
≥ 0.8x on one big file, ≥ 3x kserve-storage, peak RSS ≤ 100 MiB.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests.support.storage starts the server

from tests.support.storage import RcloneS3  # noqa: E402

BENCH_VENV = REPO / ".venv-bench"
MIB = 1 << 20
KSERVE = "import sys; from kserve_storage import Storage; Storage.download(sys.argv[1], sys.argv[2])"


@dataclass(frozen=True)
class Run:
    seconds: float
    cpu_seconds: float  # user + system of the process: what it costs a shared node, whatever the load
    peak_rss_mib: float


Command = Callable[[str, Path, argparse.Namespace], list[str]]


def tritonshare_command(uri: str, dest: Path, args: argparse.Namespace) -> list[str]:
    return [sys.executable, __file__, "download", uri, str(dest), "--concurrency", str(args.concurrency)]


def tritonshare_unverified_command(uri: str, dest: Path, args: argparse.Namespace) -> list[str]:
    """The same without the checksum pass (sizes still checked): what verification costs."""
    return tritonshare_command(uri, dest, args) + ["--no-checksums"]


def s5cmd_command(uri: str, dest: Path, args: argparse.Namespace) -> list[str]:
    return [str(BENCH_VENV / "bin" / "s5cmd"), "--endpoint-url", args.endpoint, "cp", f"{uri}/*", f"{dest}/"]


def kserve_command(uri: str, dest: Path, args: argparse.Namespace) -> list[str]:
    return [str(BENCH_VENV / "bin" / "python"), "-c", KSERVE, uri, str(dest)]


TOOLS: dict[str, Command] = {
    "tritonshare": tritonshare_command,
    "tritonshare-nosum": tritonshare_unverified_command,
    "s5cmd": s5cmd_command,
    "kserve-storage": kserve_command,
}


def download(uri: str, dest: Path, concurrency: int, checksums: bool) -> None:
    """The child process for tritonshare: list, then download, exactly as ``tritonshare load`` does."""
    from tritonshare.loader.download import DownloadOptions, download_all, list_objects
    from tritonshare.loader.sources import open_source

    options = DownloadOptions(concurrency=concurrency, verify_checksums=checksums)
    source = open_source(uri)
    try:
        download_all(source, list_objects(source, options), dest, options)
    finally:
        source.close()


def write_models(root: Path, args: argparse.Namespace) -> dict[str, int]:
    """Two models in bucket ``models``: ``big`` (one file) and ``small`` (many files). Sizes by model."""
    block = os.urandom(MIB)
    big = root / "models" / "big" / "1"
    big.mkdir(parents=True)
    with open(big / "model.bin", "wb") as fh:
        for i in range(args.big_mib):
            fh.write(block[i % 251 :] + block[: i % 251])  # distinct blocks, no compression shortcuts
    small = root / "models" / "small" / "1"
    small.mkdir(parents=True)
    for i in range(args.small_count):
        (small / f"part-{i:04d}.bin").write_bytes(os.urandom(args.small_kib * 1024))
    return {
        f"1 x {args.big_mib} MiB": args.big_mib * MIB,
        f"{args.small_count} x {args.small_kib} KiB": args.small_count * args.small_kib * 1024,
    }


def timed(command: list[str], env: dict[str, str]) -> Run:
    started = time.perf_counter()
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    assert process.stderr is not None
    errors = process.stderr.read()
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - started
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        raise RuntimeError(f"{command[0]} failed ({process.returncode}): {errors.decode()[-2000:]}")
    return Run(seconds=seconds, cpu_seconds=usage.ru_utime + usage.ru_stime, peak_rss_mib=usage.ru_maxrss / 1024)


def warm_up(server: RcloneS3) -> None:
    """List every object once: rclone computes and caches the MD5 ETags, as a real store has them."""
    for page in server.client.get_paginator("list_objects_v2").paginate(Bucket="models"):
        assert page.get("KeyCount", 0) > 0


def tree_size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def measure(tool: str, uri: str, size: int, work: Path, env: dict[str, str], args: argparse.Namespace) -> Run:
    dest = work / "dest"
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir()
    run = timed(TOOLS[tool](uri, dest, args), env)
    if tree_size(dest) != size:
        raise RuntimeError(f"{tool} downloaded {tree_size(dest)} bytes of {size} from {uri}")
    shutil.rmtree(dest)
    return run


def report(rows: list[tuple[str, str, int, list[Run]]]) -> None:
    print("\n| model | tool | MiB/s (median) | seconds | CPU seconds | peak RSS MiB | speed vs s5cmd |")
    print("|---|---|---:|---:|---:|---:|---:|")
    s5 = {model: statistics.median(r.seconds for r in runs) for model, tool, _, runs in rows if tool == "s5cmd"}
    for model, tool, size, runs in rows:
        seconds = statistics.median(r.seconds for r in runs)
        ratio = f"{s5[model] / seconds:.2f}x" if model in s5 else "-"
        cpu = statistics.median(r.cpu_seconds for r in runs)
        rss = max(r.peak_rss_mib for r in runs)
        print(f"| {model} | {tool} | {size / MIB / seconds:.0f} | {seconds:.2f} | {cpu:.2f} | {rss:.0f} | {ratio} |")


def bench(args: argparse.Namespace) -> None:
    missing = [p for p in (BENCH_VENV / "bin" / "s5cmd", BENCH_VENV / "bin" / "python") if not p.exists()]
    if missing and {"s5cmd", "kserve-storage"} & set(args.tools):
        sys.exit(f"missing {', '.join(map(str, missing))} — run scripts/setup.sh --bench")
    with tempfile.TemporaryDirectory(prefix="loader-bench-") as tmp:
        work = Path(tmp)
        models = write_models(work / "s3", args)
        server = RcloneS3(work / "s3", cache_hashes=True).start()
        env = dict(os.environ) | server.env() | {"AWS_EC2_METADATA_DISABLED": "true"}
        args.endpoint = server.endpoint
        try:
            warm_up(server)
            rows = []
            for (model, size), prefix in zip(models.items(), ("big", "small"), strict=True):
                runs: dict[str, list[Run]] = {tool: [] for tool in args.tools}
                for _ in range(args.runs):  # tools take turns, so a burst of load elsewhere hits them alike
                    for tool in args.tools:
                        runs[tool].append(measure(tool, f"s3://models/{prefix}", size, work, env, args))
                for tool in args.tools:
                    rows.append((model, tool, size, runs[tool]))
                    print(f"{model:>16} {tool:>14}: " + ", ".join(f"{r.seconds:.2f}s" for r in runs[tool]), flush=True)
        finally:
            server.stop()
    report(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command")
    child = sub.add_parser("download", help="(internal) one tritonshare download, run as a child process")
    child.add_argument("uri")
    child.add_argument("dest", type=Path)
    child.add_argument("--concurrency", type=int, default=16)
    child.add_argument("--no-checksums", dest="checksums", action="store_false")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=16, help="tritonshare's --concurrency")
    parser.add_argument("--big-mib", type=int, default=200)
    parser.add_argument("--small-count", type=int, default=200)
    parser.add_argument("--small-kib", type=int, default=256)
    parser.add_argument("--tools", nargs="+", default=list(TOOLS), choices=list(TOOLS))
    args = parser.parse_args()
    if args.command == "download":
        download(args.uri, args.dest, args.concurrency, args.checksums)
    else:
        bench(args)


if __name__ == "__main__":
    main()
