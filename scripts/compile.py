"""Install tritonshare with its proxy compiled by mypyc (setup.py, ``TRITONSHARE_COMPILE=1``), as the image does,
for one interpreter — again only when the sources changed since the last build there.

    python scripts/compile.py --python .venv/bin/python --target .build/compiled   # a folder for PYTHONPATH
    python scripts/compile.py --python .venv-opt/bin/python --venv                 # into that venv itself
    python scripts/compile.py --python .venv-opt/bin/python --venv --check         # exit 1 when it is stale

scripts/test.sh runs the tests against the first (the pure-Python source tree stays what a developer edits);
scripts/setup.sh --bench builds the second, which the benchmarks measure and check with the third (bench/target.py).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STAMP = ".tritonshare-source"  # in the target folder, or the venv: the sources' hash it was built from


def source_hash() -> str:
    """What the build depends on: setup.py, pyproject.toml and every file of the package."""
    digest = hashlib.sha256()
    files = [REPO / "setup.py", REPO / "pyproject.toml", *sorted((REPO / "src" / "tritonshare").rglob("*.py"))]
    for path in files:
        digest.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def stamp_of(python: Path, target: Path | None) -> Path:
    return (target if target is not None else python.parent.parent) / STAMP


def build(python: Path, target: Path | None) -> None:
    # setuptools builds in the tree (build/) and packs whatever its last builds left there: start clean
    shutil.rmtree(REPO / "build", ignore_errors=True)
    env = {**os.environ, "TRITONSHARE_COMPILE": "1"}
    command = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps"]
    if target is not None:
        shutil.rmtree(target, ignore_errors=True)
        command += ["--target", str(target)]
    else:
        command += ["--force-reinstall"]
    subprocess.run([*command, str(REPO)], env=env, check=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", type=Path, required=True, help="the interpreter to build for")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--target", type=Path, help="install into this folder (rebuilt whole)")
    where.add_argument("--venv", action="store_true", help="install into the interpreter's venv")
    parser.add_argument("--check", action="store_true", help="only say whether the build is current (exit 1: no)")
    args = parser.parse_args()
    target = args.target.resolve() if args.target is not None else None
    stamp, wanted = stamp_of(args.python, target), source_hash()
    current = stamp.exists() and stamp.read_text().strip() == wanted
    if args.check or current:
        if not current:
            print(f"{stamp.parent}: tritonshare's compiled build is older than the sources", file=sys.stderr)
        return 0 if current else 1
    print(f"compiling tritonshare's proxy (mypyc) for {args.python} into {stamp.parent}", file=sys.stderr)
    build(args.python, target)
    stamp.write_text(wanted + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
