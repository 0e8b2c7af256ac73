"""Reading GPU memory: the real NVML reader on this GPU-less machine, and its arithmetic against a stand-in
``pynvml`` module written by the test (no GPU exists here to read)."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from tritonshare.node.gpu import FixedMemory, GpuUnavailable, NvmlMemory

# Implements the five pynvml calls NvmlMemory makes; memory per device in bytes from DEVICES.
FAKE_NVML = """\
from types import SimpleNamespace

DEVICES = {devices!r}
calls = []


class NVMLError(Exception):
    pass


def nvmlInit():
    calls.append("init")


def nvmlShutdown():
    calls.append("shutdown")


def nvmlDeviceGetCount():
    return len(DEVICES)


def nvmlDeviceGetHandleByIndex(index):
    return index


def nvmlDeviceGetMemoryInfo(handle):
    if DEVICES[handle] is None:
        raise NVMLError("GPU is lost")
    return SimpleNamespace(total=DEVICES[handle], free=0, used=0)
"""


def fake_nvml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, devices: list[int | None]) -> str:
    name = f"fake_nvml_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(FAKE_NVML.format(devices=devices))
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_real_nvml_without_a_gpu_says_to_pass_the_size() -> None:
    # This machine has no NVIDIA driver: libnvidia-ml.so is missing.
    with pytest.raises(GpuUnavailable, match="no NVIDIA driver/NVML on this node .* — pass --gpu-memory-mib"):
        NvmlMemory().total_mib()


def test_missing_nvidia_ml_py_names_the_extra() -> None:
    with pytest.raises(GpuUnavailable, match=r"not installed — install tritonshare\[gpu\], or pass --gpu-memory-mib"):
        NvmlMemory(module="pynvml_is_not_installed").total_mib()


def test_memory_of_all_visible_gpus_is_summed_in_mib(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a100_80g, a10_24g = 85899345920, 25757220864
    module = fake_nvml(tmp_path, monkeypatch, [a100_80g, a10_24g])

    assert NvmlMemory(module=module).total_mib() == 81920 + 24564

    nvml = __import__(module)
    assert nvml.calls == ["init", "shutdown"]


def test_no_visible_gpu_says_to_request_triton_s_gpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    module = fake_nvml(tmp_path, monkeypatch, [])

    with pytest.raises(GpuUnavailable, match="NVML sees no GPU in this container — request the same GPUs as Triton"):
        NvmlMemory(module=module).total_mib()
    assert __import__(module).calls == ["init", "shutdown"]


def test_a_failing_device_is_reported_and_nvml_shut_down(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    module = fake_nvml(tmp_path, monkeypatch, [1 << 30, None])

    with pytest.raises(GpuUnavailable, match=r"NVML could not read GPU memory \(GPU is lost\)"):
        NvmlMemory(module=module).total_mib()
    assert __import__(module).calls == ["init", "shutdown"]


def test_fixed_memory_is_what_the_operator_said() -> None:
    assert FixedMemory(4864).total_mib() == 4864
    with pytest.raises(ValueError, match="positive number of MiB"):
        FixedMemory(0)
