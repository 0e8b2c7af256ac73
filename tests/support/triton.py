"""A real Triton server from the nvidia-pytriton wheel, started as a subprocess on free ports
(REFERENCE §1). It lives in a venv of its own (``.venv-triton``: nvidia-pytriton pins numpy<2)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.children import die_with_parent, vm_kib
from tests.support.ports import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]
SHM = Path("/dev/shm")


def triton_venv() -> Path:
    return Path(os.environ.get("TRITONSHARE_TEST_TRITON_VENV", REPO_ROOT / ".venv-triton"))


def _site_packages(venv: Path) -> Path:
    out = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import site; print(site.getsitepackages()[0])"],
        check=True,
        capture_output=True,
        text=True,
    )
    return Path(out.stdout.strip())


def triton_available() -> bool:
    return (triton_venv() / "bin" / "python").exists()


@dataclass
class TritonServer:
    repository: Path
    log_path: Path
    poll_secs: int = 1
    http_port: int = field(default_factory=free_port)
    grpc_port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    mode: str = "poll"
    process: subprocess.Popen[bytes] | None = None
    # The names of this server's Python backend regions in /dev/shm (a Triton killed, or crashed, leaves its
    # stubs' regions there for good, 1 MiB or more each: hundreds in a run of the suite, until removed)
    shm_prefix: str = field(default_factory=lambda: f"tritonshare-test-{uuid.uuid4().hex[:12]}-")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def command(self) -> tuple[list[str], dict[str, str]]:
        venv = triton_venv()
        sp = _site_packages(venv)
        ts = sp / "pytriton" / "tritonserver"
        vpy = subprocess.run(
            [str(venv / "bin" / "python"), "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
        stub = ts / "backends" / "python" / "triton_python_backend_stub"
        if not stub.exists():
            shutil.copy(ts / "python_backend_stubs" / vpy / "triton_python_backend_stub", stub)
        env = dict(os.environ)
        env.update(
            PATH=f"{venv / 'bin'}:{env.get('PATH', '')}",
            VIRTUAL_ENV=str(venv),
            PYTHONDONTWRITEBYTECODE="1",
            LD_LIBRARY_PATH=str(sp / "nvidia_pytriton.libs"),
        )
        env.pop("PYTHONPATH", None)
        cmd = [
            str(ts / "bin" / "tritonserver"),
            f"--model-repository={self.repository}",
            f"--model-control-mode={self.mode}",
            f"--backend-directory={ts / 'backends'}",
            f"--http-port={self.http_port}",
            f"--grpc-port={self.grpc_port}",
            f"--metrics-port={self.metrics_port}",
            "--allow-cpu-metrics=false",
            "--exit-on-error=false",
            "--log-verbose=0",
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
        ]
        if self.mode == "poll":
            cmd.append(f"--repository-poll-secs={self.poll_secs}")
        return cmd, env

    def start(self, timeout_s: float = 60.0) -> TritonServer:
        cmd, env = self.command()
        log = open(self.log_path, "ab")
        self.process = subprocess.Popen(
            cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent
        )
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"Triton exited with {self.process.returncode}; log:\n{self.log_tail()}")
            if self.live():
                return self
            time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"Triton not live after {timeout_s}s; log:\n{self.log_tail()}")

    def live(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/v2/health/live", timeout=1) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        elif self.process:  # Triton died under the test: its stubs may outlive it
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
        self.process = None
        self.remove_regions()

    def kill(self) -> None:
        """SIGKILL Triton and its Python backend stubs (its process group): for a server of the test's own, whose
        graceful stop would take seconds, or a crash under test — the group even when Triton itself has died (its
        stubs outlive it, and ignore SIGTERM)."""
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        self.process = None
        self.remove_regions()

    def regions(self) -> list[Path]:
        """This server's Python backend regions in /dev/shm."""
        return sorted(SHM.glob(f"{self.shm_prefix}*"))

    def remove_regions(self) -> None:
        for region in self.regions():
            region.unlink(missing_ok=True)

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def rss_mib(self) -> int:
        """Triton's resident memory now (VmRSS), in MiB."""
        assert self.process is not None
        return vm_kib(self.process.pid, "VmRSS") // 1024
