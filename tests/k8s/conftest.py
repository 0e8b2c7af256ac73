"""Every overlay, and every component on top of both bases, built once per session."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.k8s.kustomize import K8S, Build, build, build_with_components, components, overlays

TRITON_BASE = K8S / "base" / "triton"
MODEL_BASE = K8S / "base" / "model"

OVERLAYS = [p.name for p in overlays()]
COMPONENTS = [p.name for p in components()]
BUILDS = [f"overlays/{n}" for n in OVERLAYS] + [f"components/{n}" for n in COMPONENTS]


@pytest.fixture(scope="session")
def builds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Build]:
    """Overlays as they are; each component on the Triton and model bases together, so every component is
    built and validated on its own, also where no overlay uses it."""

    def component(comp: Path, tmp: Path) -> Build:
        return build_with_components(tmp, [TRITON_BASE, MODEL_BASE], [comp])

    # made here, not in the threads: TempPathFactory is not thread-safe (run alone, the k8s tests raced
    # on creating the session's base folder: "component-advertise is not a normalized and relative path")
    folders = {p: tmp_path_factory.mktemp(f"component-{p.name}") for p in components()}
    with ThreadPoolExecutor(max_workers=4) as pool:  # kubectl processes; the GIL is not in the way
        built = {f"overlays/{p.name}": pool.submit(build, p) for p in overlays()}
        built |= {f"components/{p.name}": pool.submit(component, p, tmp) for p, tmp in folders.items()}
        return {name: future.result() for name, future in built.items()}


@pytest.fixture(scope="session")
def overlay_builds(builds: dict[str, Build]) -> dict[str, Build]:
    return {k.removeprefix("overlays/"): b for k, b in builds.items() if k.startswith("overlays/")}
