"""Which tritonshare the benchmarks measure.

The image runs tritonshare on python:3.11-slim's CPython, built with PGO and LTO, with the proxy's request path
compiled (setup.py); a CPython built from source without them (pyenv's default) runs pure-Python loops ~20-25 %
slower. ``scripts/setup.sh --bench`` makes ``.venv-opt``, tritonshare built as the image builds it on an optimized
interpreter, and the benchmarks measure that one when it exists (else ``.venv``, the source tree);
``TRITONSHARE_BENCH_VENV`` names another venv (a path, or a folder name in the repository).
"""

from __future__ import annotations

import functools
import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DESCRIBE = (  # whether the interpreter runs from a shared libpython (position-independent code, slower) or not
    "import sys; shared = 'libpython' in open('/proc/self/maps').read(); "
    "print(sys.version.split()[0], sys._base_executable, 'libpython shared' if shared else 'libpython linked in')"
)


def venv() -> Path:
    named = os.environ.get("TRITONSHARE_BENCH_VENV")
    if named:
        return REPO / named
    optimized = REPO / ".venv-opt"
    if not (optimized / "bin" / "tritonshare").exists():
        return REPO / ".venv"
    current()
    return optimized


@functools.cache
def current() -> None:
    """.venv-opt holds a build of tritonshare (the proxy compiled, scripts/compile.py), not the source tree: refuse
    to measure one older than the sources."""
    check = [str(REPO / ".venv-opt" / "bin" / "python"), str(REPO / "scripts" / "compile.py")]
    if subprocess.run([*check, "--python", check[0], "--venv", "--check"]).returncode:
        raise SystemExit(".venv-opt's tritonshare is older than the sources: run scripts/setup.sh --bench")


def python() -> Path:
    return venv() / "bin" / "python"


def describe(folder: Path | None = None) -> str:
    """``<venv>: Python <version> <base interpreter> libpython shared|static``, for the benchmark's header."""
    folder = folder or venv()
    done = subprocess.run([str(folder / "bin" / "python"), "-c", DESCRIBE], capture_output=True, text=True, check=True)
    return f"{folder.name}: Python {done.stdout.strip()}"


if __name__ == "__main__":  # bench/proxy_bench.sh: `python bench/target.py VENV` describes VENV
    import sys

    print(describe(REPO / sys.argv[1] if len(sys.argv) > 1 else None))
