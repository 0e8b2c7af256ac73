"""The loader takes its pod's lease before it looks at repository/NAME, and keeps it only on success."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.models import BROKEN_MODEL, write_model
from tests.support.triton import TritonServer
from tritonshare.common.errors import InstallConflict, TritonLoadFailed
from tritonshare.common.layout import NodeLayout
from tritonshare.common.lease import Holder, LeaseStore
from tritonshare.loader.run import run
from tritonshare.loader.settings import LoaderSettings

POD_A, POD_B = Holder(uid="pod-a-uid"), Holder(uid="pod-b-uid")


def _load(layout: NodeLayout, triton: TritonServer, source: Path, name: str, holder: Holder) -> int:
    settings = LoaderSettings(
        source=str(source),
        name=name,
        layout=layout,
        triton_url=triton.url,
        holder=holder,
        timeout_s=60,
        termination_log=None,
    )
    return run(settings)


def test_two_pods_of_one_model_hold_one_install(
    triton: TritonServer, layout: NodeLayout, model_name: str, tmp_path: Path
) -> None:
    source = write_model(tmp_path / "src")
    assert _load(layout, triton, source, model_name, POD_A) == 0
    assert _load(layout, triton, source, model_name, POD_B) == 0
    leases = LeaseStore(layout.leases)
    assert sorted(lease.holder.uid for lease in leases.fresh(model_name)) == ["pod-a-uid", "pod-b-uid"]
    other = write_model(tmp_path / "other", padding_bytes=10)
    with pytest.raises(InstallConflict):
        _load(layout, triton, other, model_name, Holder(uid="pod-c-uid"))
    assert sorted(lease.holder.uid for lease in leases.leases(model_name)) == ["pod-a-uid", "pod-b-uid"]


def test_a_failed_load_leaves_no_lease(
    triton: TritonServer, layout: NodeLayout, model_name: str, tmp_path: Path
) -> None:
    source = write_model(tmp_path / "src", model_py=BROKEN_MODEL)
    with pytest.raises(TritonLoadFailed):
        _load(layout, triton, source, model_name, POD_A)
    assert LeaseStore(layout.leases).leases(model_name) == []
