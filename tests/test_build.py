"""The build the tests run is the one they mean to: scripts/test.sh runs them against the proxy compiled as the
image ships it (setup.py, mypyc), a plain ``pytest`` against the source tree — never a mix of the two, and never
a compiled module left in the source tree, where it would shadow the code being edited."""

from __future__ import annotations

import importlib
from importlib.machinery import EXTENSION_SUFFIXES

import pytest

from tests.support.build import EXPECTED, is_compiled, setup_script
from tests.support.triton import REPO_ROOT

SETUP = setup_script()
PROXY = REPO_ROOT / "src" / "tritonshare" / "proxy"


def _module(path: str) -> str:
    return path.removeprefix("src/").removesuffix(".py").replace("/", ".")


def test_setup_names_only_proxy_modules_that_exist() -> None:
    assert all((PROXY / name).is_file() for name in SETUP.INTERPRETED), SETUP.INTERPRETED
    compiled = SETUP.compiled_modules()
    assert (
        "src/tritonshare/proxy/rest_connection.py" in compiled and "src/tritonshare/proxy/settings.py" not in compiled
    )
    assert len(compiled) + len(SETUP.INTERPRETED) == len(list(PROXY.glob("*.py")))


def test_no_compiled_module_is_left_in_the_source_tree() -> None:
    left = [path for suffix in EXTENSION_SUFFIXES for path in (REPO_ROOT / "src").rglob(f"*{suffix}")]
    assert not left, f"compiled modules in src/ shadow the .py beside them: remove them ({left[:3]})"


@pytest.mark.parametrize("path", SETUP.compiled_modules())
def test_each_module_setup_compiles_is_imported_as_the_build_expected_says(path: str) -> None:
    module = importlib.import_module(_module(path))
    assert is_compiled(module) == (EXPECTED == "compiled"), (EXPECTED, module.__file__)


@pytest.mark.parametrize("name", sorted(SETUP.INTERPRETED))
def test_the_interpreted_modules_stay_python(name: str) -> None:
    module = importlib.import_module(_module(f"src/tritonshare/proxy/{name}").removesuffix(".__init__"))
    assert not is_compiled(module), module.__file__
