"""How much GPU memory this node's Triton has: NVML, or a fixed amount the operator states.

NVML sees the GPUs of the container it runs in (the device plugin mounts only the allocated ones), so the
advertise init container requests the same GPUs as Triton and sums their memory. MIG and vGPU slices are
not visible that way (NVML reports the parent GPU's memory): their size is passed with ``--gpu-memory-mib``.
"""

from __future__ import annotations

import importlib
import logging
from types import ModuleType
from typing import Any, Protocol

from tritonshare.common.errors import TritonshareError

logger = logging.getLogger(__name__)

MIB = 1 << 20


class GpuUnavailable(TritonshareError):
    """GPU memory could not be read on this node (no driver, no NVML, no device)."""


class GpuMemoryReader(Protocol):
    """Total GPU memory of the GPUs this node's Triton uses, in MiB."""

    def total_mib(self) -> int: ...


class FixedMemory:
    """The operator's figure (MIG or vGPU slices, or a cap below the physical size)."""

    def __init__(self, mib: int) -> None:
        if mib <= 0:
            raise ValueError(f"GPU memory must be a positive number of MiB, not {mib}")
        self.mib = mib

    def total_mib(self) -> int:
        return self.mib


class NvmlMemory:
    """Sum of ``nvmlDeviceGetMemoryInfo(...).total`` over every device NVML can see.

    nvidia-ml-py (module ``pynvml``) is imported on first use: it is the optional ``gpu`` extra.
    """

    def __init__(self, module: str = "pynvml") -> None:
        self._module = module

    def total_mib(self) -> int:
        nvml = self._load()
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            raise GpuUnavailable(f"no NVIDIA driver/NVML on this node ({exc}) — pass --gpu-memory-mib") from exc
        try:
            return _sum_devices(nvml)
        except nvml.NVMLError as exc:
            raise GpuUnavailable(f"NVML could not read GPU memory ({exc}) — pass --gpu-memory-mib") from exc
        finally:
            _shutdown(nvml)

    def _load(self) -> ModuleType:
        try:
            # Typed as a plain module: nvidia-ml-py ships no type information.
            return importlib.import_module(self._module)
        except ImportError as exc:
            raise GpuUnavailable(
                f"nvidia-ml-py ({self._module}) is not installed — install tritonshare[gpu], or pass --gpu-memory-mib"
            ) from exc


def _sum_devices(nvml: Any) -> int:
    count = int(nvml.nvmlDeviceGetCount())
    if count == 0:
        raise GpuUnavailable(
            "NVML sees no GPU in this container — request the same GPUs as Triton, or pass --gpu-memory-mib"
        )
    total = 0
    for index in range(count):
        info = nvml.nvmlDeviceGetMemoryInfo(nvml.nvmlDeviceGetHandleByIndex(index))
        total += int(info.total)
    logger.info("NVML: %d GPU(s), %d MiB of memory in all", count, total // MIB)
    return total // MIB


def _shutdown(nvml: Any) -> None:
    try:
        nvml.nvmlShutdown()
    except nvml.NVMLError as exc:  # the reading is done; a failed shutdown changes nothing
        logger.debug("nvmlShutdown failed: %s", exc)
