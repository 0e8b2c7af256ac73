"""The toolkit image: images/Dockerfile has the shape the conventions ask for, its build context is the
package and nothing else, and the package installed exactly as the Dockerfile's build stage installs it
runs every command.

No Docker engine here (REFERENCE §5): the build stage's own RUN lines run against a scratch folder standing
in for the image's /. The dependency layer is cached under pytest's cache folder keyed like Docker's layer
cache (the instructions and the files they copy), so only the code layer is rebuilt on a code change.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.k8s.dockerfile import (
    Dockerfile,
    StageRun,
    checkpoint,
    context_files,
    expand,
    ignore_rules,
    ignored,
    layer_key,
)
from tests.k8s.kustomize import Build, container, containers, environment
from tests.k8s.workloads import TRITONSHARE_IMAGE, triton_of
from tests.support.ports import free_port, wait_port
from tests.support.triton import REPO_ROOT
from tritonshare import __version__
from tritonshare.cli import main as cli

DOCKERFILE = REPO_ROOT / "images" / "Dockerfile"
DOCKERIGNORE = REPO_ROOT / ".dockerignore"
LOCK = REPO_ROOT / "images" / "requirements.lock"


@pytest.fixture(scope="session")
def dockerfile() -> Dockerfile:
    return Dockerfile.parse(DOCKERFILE.read_text())


def _uid_gid(dockerfile: Dockerfile) -> tuple[int, int]:
    users = dockerfile.stages[-1].all("USER")
    assert users, "the runtime stage sets no USER: the image would run as root"
    match = re.fullmatch(r"(\d+):(\d+)", users[-1].value)
    assert match, f"USER {users[-1].value!r} must be numeric UID:GID, so runAsNonRoot can be verified"
    return int(match[1]), int(match[2])


# --- shape -------------------------------------------------------------------------------------------------


def test_dockerfile_is_multi_stage_with_a_slim_non_root_runtime(dockerfile: Dockerfile) -> None:
    build, runtime = dockerfile.stage("build"), dockerfile.stages[-1]
    assert len(dockerfile.stages) >= 2 and runtime is not build
    assert runtime.base == build.base, "the venv is copied between stages: both must share one interpreter"
    assert "slim" in expand(runtime.base, dockerfile.defaults()), f"runtime base {runtime.base} is not slim"
    assert not runtime.all("RUN"), "the runtime stage installs nothing; the build stage does"
    copies = runtime.all("COPY")
    assert copies and all(c.value.startswith("--from=build ") for c in copies), "runtime copies from build only"
    uid, _ = _uid_gid(dockerfile)
    assert uid != 0
    entrypoint = runtime.all("ENTRYPOINT")
    assert entrypoint and entrypoint[-1].exec_form() == ["tritonshare"], (
        'ENTRYPOINT must be the exec form ["tritonshare"]: a shell in between would swallow SIGTERM'
    )


def test_dependencies_install_before_the_code_is_copied(dockerfile: Dockerfile) -> None:
    steps = dockerfile.stage("build").instructions
    code = next(n for n, i in enumerate(steps) if i.keyword == "COPY" and i.value.split()[0].startswith("src"))
    deps = next(n for n, i in enumerate(steps) if i.keyword == "RUN" and "requirements" in i.value)
    pyproject = next(n for n, i in enumerate(steps) if i.keyword == "COPY" and "pyproject.toml" in i.value)
    assert pyproject < deps < code, "copy pyproject.toml, install dependencies, then copy the code"
    assert checkpoint(dockerfile.stage("build")) == deps, "the dependency layer is the last one before the code"
    assert "--no-deps" in steps[-1].value, "the code layer must not re-resolve dependencies"


def test_image_user_owns_the_node_folder(dockerfile: Dockerfile, builds: dict[str, Build]) -> None:
    """The manifests run the image as its USER, and hand the node folder to that UID."""
    uid, gid = _uid_gid(dockerfile)
    daemonset = triton_of(builds["overlays/gpu"])
    node_folder = next(c for c in containers(daemonset) if c.name == "node-folder")
    assert node_folder.spec["command"][:2] == ["chown", f"{uid}:{gid}"], node_folder.spec["command"]
    for name, b in builds.items():
        for workload in b.workloads():
            for c in containers(workload):
                if TRITONSHARE_IMAGE.match(c.spec["image"]):
                    assert (c.effective("runAsUser"), c.effective("runAsGroup")) == (uid, gid), f"{name}: {c.where}"


def test_build_context_is_the_package_only() -> None:
    files = context_files(REPO_ROOT, DOCKERIGNORE.read_text())
    assert {f.split("/")[0] for f in files} == {"pyproject.toml", "setup.py", "README.md", "images", "src"}, sorted(
        files
    )[:20]
    assert [f for f in files if f.startswith("images/")] == ["images/requirements.lock"]
    assert {"src/tritonshare/cli.py", "src/tritonshare/py.typed"} <= set(files)
    generated = [f for f in files if re.search(r"__pycache__|\.py[cod]$|\.egg-info/", f)]
    assert not generated, f".dockerignore lets generated files into the image: {generated[:5]}"


def test_dockerignore_rules_behave_like_dockers() -> None:
    """The context check above is only as good as this matcher."""
    rules = ignore_rules("*\n!src/\n**/__pycache__\n!keep/**/*.txt\n")
    assert ignored("tests/test_x.py", rules) and ignored(".venv/bin/python", rules)
    assert not ignored("src/pkg/mod.py", rules)
    assert ignored("src/pkg/__pycache__/mod.cpython-311.pyc", rules)
    assert not ignored("keep/a/b/c.txt", rules) and ignored("keep/a/b/c.bin", rules)


# --- the installed image -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Image:
    venv: Path
    env: dict[str, str]  # the runtime stage's environment, paths mapped to the scratch image
    entrypoint: list[str]

    def run(self, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """The entrypoint with ``args``, in the image's environment plus ``env`` (a container's)."""
        return subprocess.run(
            [*self.entrypoint, *args],
            env=self.env | (env or {}),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # another pytest session may build the same layer
        yield


def _base_env(scratch: Path) -> dict[str, str]:
    """What the python base image offers: `python` (this interpreter's base, the same 3.x) on PATH."""
    bin_dir = scratch / "base-bin"
    bin_dir.mkdir(exist_ok=True)
    if not (bin_dir / "python").exists():
        (bin_dir / "python").symlink_to(getattr(sys, "_base_executable", sys.executable))
    return {"PATH": f"{bin_dir}:/usr/local/bin:/usr/bin:/bin", "HOME": str(scratch), "LANG": "C.UTF-8"}


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:  # the cache and the temporary folder on different filesystems
        shutil.copy2(source, target)


@pytest.fixture(scope="session")
def image(request: pytest.FixtureRequest, dockerfile: Dockerfile) -> Image:
    """The build stage run as Docker would with its layer cache: the dependency layer is rebuilt when its
    instructions or pyproject.toml change, the code layer when anything it copies changes."""
    stage = dockerfile.stage("build")
    files = context_files(REPO_ROOT, DOCKERIGNORE.read_text())
    cut, extra = checkpoint(stage), f"{sys.version}{dockerfile.defaults()}"
    deps = Path(request.config.cache.mkdir("tritonshare-image")) / layer_key(stage, cut, REPO_ROOT, files, extra)
    built = deps / "images" / layer_key(stage, len(stage.instructions) - 1, REPO_ROOT, files, extra)
    with _locked(deps.parent / f"{deps.name}.lock"):
        if not (deps / "state.json").exists():
            for stale in deps.parent.iterdir():  # dependency layers of an older pyproject.toml/Dockerfile
                if stale.is_dir() and stale != deps:
                    shutil.rmtree(stale, ignore_errors=True)
            _dependency_layer(dockerfile, files, cut, deps)
        if not (built / "done").exists():
            _code_layer(dockerfile, files, cut, deps, built)
    return _runtime(dockerfile, built / "venv", _base_env(built))


def _dependency_layer(dockerfile: Dockerfile, files: list[str], cut: int, layer: Path) -> None:
    shutil.rmtree(layer, ignore_errors=True)
    layer.mkdir(parents=True)
    run = StageRun(REPO_ROOT, files, layer / "root", dict(dockerfile.defaults()), _base_env(layer))
    for instruction in dockerfile.stage("build").instructions[: cut + 1]:
        run.apply(instruction, {"VENV": str(layer / "venv")}, [])
    state = {"variables": run.variables, "env": run.env, "workdir": run.workdir}
    (layer / "state.json").write_text(json.dumps(state))


def _code_layer(dockerfile: Dockerfile, files: list[str], cut: int, deps: Path, image: Path) -> None:
    for old in sorted((deps / "images").glob("*"), key=lambda p: p.stat().st_mtime)[:-2]:
        shutil.rmtree(old, ignore_errors=True)  # keep the two latest code layers
    shutil.rmtree(image, ignore_errors=True)
    for part in ("root", "venv"):  # a copy of the dependency layer (hard links: pip replaces, never edits)
        shutil.copytree(deps / part, image / part, symlinks=True, copy_function=_link_or_copy)
    state = json.loads((deps / "state.json").read_text())
    venv = str(image / "venv")
    run = StageRun(REPO_ROOT, files, image / "root", state["variables"] | {"VENV": venv}, state["env"])
    run.workdir = state["workdir"]
    for instruction in dockerfile.stage("build").instructions[cut + 1 :]:
        run.apply(instruction, {"VENV": venv}, [])
    (image / "done").touch()


def _runtime(dockerfile: Dockerfile, venv: Path, base_env: dict[str, str]) -> Image:
    runtime = dockerfile.stages[-1]
    variables = dockerfile.defaults() | {"VENV": str(venv)}
    env = dict(base_env)
    for instruction in runtime.instructions:
        if instruction.keyword == "ENV":
            for assignment in shlex.split(expand(instruction.value, variables | env)):
                name, _, value = assignment.partition("=")
                env[name] = value
    entrypoint = runtime.all("ENTRYPOINT")[-1].exec_form()
    assert entrypoint
    return Image(venv=venv, env=env, entrypoint=entrypoint)


# The first run downloads the dependencies from PyPI, as `docker build` would; later runs reuse the layer.
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_installed_image_runs_every_command(image: Image) -> None:
    for args in (["--help"], *([sub, "--help"] for sub in sorted(cli.commands))):
        proc = image.run(*args)
        assert proc.returncode == 0, f"tritonshare {' '.join(args)} failed in the image:\n{proc.stderr[-2000:]}"
        assert "Usage: tritonshare" in proc.stdout, proc.stdout[:500]
    version = image.run("--version")
    assert version.returncode == 0 and version.stdout.split()[-1] == __version__


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_image_holds_exactly_the_locked_dependencies(image: Image) -> None:
    """Without the lock an image built later takes whatever PyPI has newest: untested versions in production."""
    locked = {line.strip() for line in LOCK.read_text().splitlines() if line.strip() and not line.startswith("#")}
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+==[^=\s]+", pin) for pin in locked), "pins only: name==version"
    freeze = subprocess.run(
        [str(image.venv / "bin" / "python"), "-m", "pip", "freeze", "--exclude", "tritonshare"],
        env=image.env, capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    installed = {line.strip() for line in freeze.stdout.splitlines() if line.strip()}
    assert installed == locked, (
        f"the image's venv and images/requirements.lock differ: installed, not locked {sorted(installed - locked)}; "
        f"locked, not installed {sorted(locked - installed)} (refresh the lock: its header says how)"
    )


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_image_runs_the_installed_package_not_the_source_tree(image: Image) -> None:
    python = image.venv / "bin" / "python"
    probe = "import tritonshare, sys; print(tritonshare.__file__); print(sys.prefix)"
    proc = subprocess.run([str(python), "-c", probe], env=image.env, capture_output=True, text=True, check=True)
    module, prefix = proc.stdout.split()
    assert Path(module).is_relative_to(image.venv), f"imported {module}, not the installed copy"
    assert Path(prefix) == image.venv
    assert (Path(module).parent / "py.typed").exists(), "the typing marker is missing from the wheel"
    site = Path(module).parent.parent
    assert not [p.name for p in site.glob("__editable__*")], "an editable install, not the image's copy"
    assert os.access(image.venv / "bin" / "tritonshare", os.X_OK)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_image_ships_the_proxy_compiled(image: Image) -> None:
    """The image's proxy is the compiled one setup.py builds (its request path; the rest stays Python), and it
    serves: the installed modules are extension modules, and the proxy starts and answers as it must."""
    python = image.venv / "bin" / "python"
    probe = "from tritonshare.proxy import rest_connection as r, grpc_connection as g, settings as s; "
    probe += "print(r.__file__, g.__file__, s.__file__)"
    proc = subprocess.run([str(python), "-c", probe], env=image.env, capture_output=True, text=True, check=True)
    rest, grpc, settings = proc.stdout.split()
    assert rest.endswith(".so") and grpc.endswith(".so"), proc.stdout
    assert settings.endswith(".py"), "the settings stay Python (setup.py: INTERPRETED)"
    http, grpc_port = free_port(), free_port()
    command = [*image.entrypoint, "proxy", "--name", "own", "--host", "127.0.0.1", "--triton-url", "http://127.0.0.1:9",
               "--triton-grpc", "127.0.0.1:9", "--http-port", str(http), "--grpc-port", str(grpc_port),
               "--metrics-port", "0", "--no-unload"]  # fmt: skip
    proxy = subprocess.Popen(command, env=image.env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_port(http)
        answers = {}
        for path in ("/v2/models/other/infer", "/v2/repository/index", "/v2/models/own/infer"):
            request = urllib.request.Request(f"http://127.0.0.1:{http}{path}", data=b"{}", method="POST")
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(request, timeout=10)
            answers[path] = refused.value.code
            refused.value.close()
        # another model: not found (as if absent); an admin API: forbidden; its own: Triton is not there
        assert answers == {"/v2/models/other/infer": 404, "/v2/repository/index": 403, "/v2/models/own/infer": 503}
    finally:
        proxy.terminate()
        said = proxy.communicate(timeout=30)[1]
    assert proxy.returncode == 0, said[-2000:]  # drained and exited on SIGTERM


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_image_reads_gpu_memory_for_advertise(image: Image, builds: dict[str, Build], tmp_path: Path) -> None:
    """The advertise init container, as the gpu overlay runs it, reaches NVML in the image. Without
    nvidia-ml-py it logs "not installed" and, being --best-effort, exits 0: the node never advertises
    tritonshare.io/gpu-memory and every model pod requesting it stays Pending."""
    python = image.venv / "bin" / "python"
    probe = "import pynvml; print(pynvml.__file__)"
    proc = subprocess.run([str(python), "-c", probe], env=image.env, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, f"the image cannot import pynvml (nvidia-ml-py):\n{proc.stderr[-1000:]}"
    assert Path(proc.stdout.strip()).is_relative_to(image.venv), proc.stdout

    b = builds["overlays/gpu"]
    advertise = container(triton_of(b), "advertise")
    message = tmp_path / "termination-log"
    env = environment(advertise, b).values | {
        "TRITONSHARE_KUBE_API_URL": "http://127.0.0.1:9",  # nothing listens: NVML is read before the API is asked
        "TRITONSHARE_TERMINATION_LOG": str(message),
    }
    run = image.run(*advertise.spec["args"], env=env)
    assert run.returncode == 0, f"advertise is --best-effort in the overlay:\n{run.stderr[-2000:]}"
    reason = message.read_text()  # no GPU here: NVML's error; on a GPU machine: the API server's
    assert reason.startswith("not advertised: "), reason
    assert "nvidia-ml-py" not in reason, f"the image's advertise cannot read GPU memory: {reason}"
