"""Which tritonshare the benchmarks measure.

The image runs tritonshare on python:3.11-slim's CPython, built with PGO and LTO; a CPython built from source
without them (pyenv's default) runs pure-Python loops ~20-25 % slower. ``scripts/setup.sh --bench`` makes ``.venv-opt``,
tritonshare on an optimized build, and the benchmarks measure that one when it exists (else ``.venv``);
``TRITONSHARE_BENCH_VENV`` names another venv (a path, or a folder name in the repository).
"""

from __future__ import annotations

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
    return optimized if (optimized / "bin" / "tritonshare").exists() else REPO / ".venv"


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
