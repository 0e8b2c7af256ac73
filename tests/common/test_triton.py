"""TritonClient and unload_model against a real Triton."""

from __future__ import annotations

import pytest

from tests.support.install import install_model, model_ready
from tests.support.ports import free_port
from tests.support.triton import TritonServer
from tritonshare.common.errors import TritonUnavailable
from tritonshare.common.layout import NodeLayout
from tritonshare.common.triton import TritonClient
from tritonshare.common.unload import UnloadSettings, unload_model


def test_client_reads_liveness_readiness_and_index(triton: TritonServer, layout: NodeLayout, model_name: str) -> None:
    install_model(layout, triton, model_name)
    client = TritonClient(triton.url)
    assert client.server_live()
    assert client.model_ready(model_name)
    assert not client.model_ready(model_name + "-absent")
    states = client.model_states(model_name)
    assert [s.state for s in states] == ["READY"]


def test_client_names_the_url_when_triton_is_down() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(TritonUnavailable, match=url):
        TritonClient(url, timeout_s=1).server_live()


def test_unload_removes_the_folder_and_triton_stops_serving(
    triton: TritonServer, layout: NodeLayout, model_name: str
) -> None:
    install_model(layout, triton, model_name)
    before = set(layout.staging.iterdir())
    result = unload_model(UnloadSettings(name=model_name, layout=layout, triton_url=triton.url, timeout_s=30))
    assert result.removed and result.unloaded
    assert not layout.model_dir(model_name).exists()
    assert not model_ready(triton, model_name)
    assert set(layout.staging.iterdir()) == before  # the renamed-out copy was deleted


def test_unload_of_an_absent_model_is_a_quiet_success(
    triton: TritonServer, layout: NodeLayout, model_name: str
) -> None:
    result = unload_model(UnloadSettings(name=model_name, layout=layout, triton_url=triton.url, timeout_s=5))
    assert not result.removed and result.unloaded
