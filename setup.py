"""The build: pure Python, or, with ``TRITONSHARE_COMPILE=1``, the proxy's request path compiled to C by mypyc.

The proxy runs once per model pod and its CPU per request is paid on every call (issue 4). Compiled from the
same strictly typed modules, it counts ~27 % fewer instructions per REST request and ~31 % fewer per gRPC call
(docs/proxy-speed.md, "27 Nov 18:20"). The image builds it so (images/Dockerfile), as do scripts/test.sh (the
tests run against it) and scripts/setup.sh --bench (the benchmarks measure it); an install without the variable
is the same program in pure Python.

Compiled modules check the types they declare at run time, and their classes cannot be patched: what is not on
the request path stays interpreted (:data:`INTERPRETED`), the settings dataclass among them (tests and the CLI
read its field defaults from the class).
"""

from __future__ import annotations

import os
from pathlib import Path

from setuptools import setup

PROXY = Path("src/tritonshare/proxy")
INTERPRETED = {  # start-up, TLS set-up and the metrics pages: not per request
    "__init__.py",
    "settings.py",
    "server.py",
    "tls.py",
    "validity.py",
    "metrics_server.py",
    "triton_metrics.py",
    "readiness.py",
}


def compiled_modules() -> list[str]:
    return sorted(str(path) for path in PROXY.glob("*.py") if path.name not in INTERPRETED)


def groups() -> list[tuple[list[str], str]]:
    """Two shared libraries, gRPC's frame relay and the rest: built side by side on two cores (~1.5 min), each
    with one copy of mypyc's runtime (a library per module would map 33 copies: ~5 MiB more RSS per proxy)."""
    modules = compiled_modules()
    grpc = [path for path in modules if Path(path).name.startswith(("grpc", "http2", "hpack", "protobuf"))]
    return [(grpc, "tritonshare_grpc"), ([path for path in modules if path not in grpc], "tritonshare_rest")]


def extensions() -> list[object]:
    if os.environ.get("TRITONSHARE_COMPILE") != "1":
        return []
    from mypyc.build import mypycify  # a build requirement (pyproject.toml)

    return list(mypycify(compiled_modules(), opt_level="3", debug_level="0", separate=groups()))


if __name__ == "__main__":  # as setuptools runs it (tests import the lists above)
    setup(
        ext_modules=extensions(),
        options={"build_ext": {"parallel": os.cpu_count() or 1}},
    )
