"""Hardware monitor: GPU utilisation and memory through pynvml where an NVIDIA driver answers,
CPU load through psutil otherwise (and always, for the host).

How live load enters the runtime: every step's record carries the readings (`cpu_percent`,
`gpu_percent`) next to its measured phase times. The scheduler's capacity estimate SPS(B)
comes from the step cost model; `BatchEngine.refit_cost_model()` refits that model on the steps
actually timed under the current load, so a busy machine shifts the per-request versus
per-token balance the scheduler sees. (A uniform slowdown alone scales SPS by a constant,
which does not change Algorithm 1's choices — only the predicted tokens/s in the stats.)
"""

from __future__ import annotations

from dataclasses import dataclass

import psutil


@dataclass(frozen=True)
class LoadReading:
    cpu_percent: float  # host CPU load since the previous reading, all cores
    gpu_percent: float | None  # NVIDIA GPU utilisation (device 0), None without a driver
    gpu_memory_used_bytes: int | None


class Monitor:
    """Cheap non-blocking readings; NVML is probed once and skipped when absent."""

    def __init__(self, gpu_index: int = 0) -> None:
        self._nvml_handle = _nvml_handle(gpu_index)
        psutil.cpu_percent(interval=None)  # prime the counter: the first reading is since now

    @property
    def has_gpu(self) -> bool:
        return self._nvml_handle is not None

    def sample(self) -> LoadReading:
        gpu, memory = None, None
        if self._nvml_handle is not None:
            import pynvml

            gpu = float(pynvml.nvmlDeviceGetUtilizationRates(self._nvml_handle).gpu)
            memory = int(pynvml.nvmlDeviceGetMemoryInfo(self._nvml_handle).used)
        return LoadReading(psutil.cpu_percent(interval=None), gpu, memory)


def _nvml_handle(index: int):
    try:
        import pynvml  # nvidia-ml-py, in the `tensorrt` extra
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        return pynvml.nvmlDeviceGetHandleByIndex(index)
    except pynvml.NVMLError:
        return None
