"""Which build of tritonshare the tests run: the source tree (pure Python) or the one scripts/test.sh compiles
(setup.py, mypyc), which it puts first on PYTHONPATH and names in ``TRITONSHARE_TEST_BUILD=compiled``."""

from __future__ import annotations

import importlib.util
import os
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path
from types import ModuleType

from tests.support.triton import REPO_ROOT

EXPECTED = os.environ.get("TRITONSHARE_TEST_BUILD", "source")  # "compiled" under scripts/test.sh


def setup_script() -> ModuleType:
    """The repository's setup.py as a module (its lists of compiled and interpreted modules; it builds nothing
    when imported)."""
    spec = importlib.util.spec_from_file_location("tritonshare_setup", REPO_ROOT / "setup.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def is_compiled(module: ModuleType) -> bool:
    return Path(module.__file__ or "").name.endswith(tuple(EXTENSION_SUFFIXES))


def running_compiled() -> bool:
    """Whether the proxy's request path imported here is the compiled one."""
    from tritonshare.proxy import rest_connection

    return is_compiled(rest_connection)
