"""Hardware monitor: GPU utilisation and memory through pynvml where an NVIDIA driver answers,
CPU load through psutil otherwise (and always, for the host).

How live load enters the runtime: every step's record carries the readings (`cpu_percent`,
`gpu_percent`) next to its measured phase times. What the scheduler prices with is the live step
cost model (`live_cost.LiveStepCost`), which follows the load from the step times themselves; the
readings are there to show the load beside them (stats, the serving dashboard). One monitor per
process (`acquire_monitor`): the readings are machine-wide.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import psutil


@dataclass(frozen=True)
class LoadReading:
    cpu_percent: float  # host CPU load since the previous reading, all cores
    gpu_percent: float | None  # NVIDIA GPU utilisation (device 0), None without a driver
    gpu_memory_used_bytes: int | None


class Monitor:
    """Load readings sampled by a daemon thread every `period` seconds, so the decode step only
    reads the latest one (no psutil or NVML call on the hot path). NVML is probed once and skipped
    when absent. `close()` stops the thread; an unclosed monitor dies with the process."""

    def __init__(self, gpu_index: int = 0, period: float = 0.25) -> None:
        self._nvml_handle = _nvml_handle(gpu_index)
        self.period = period
        psutil.cpu_percent(interval=None)  # prime the counter: the first reading is since now
        self._latest = LoadReading(0.0, None, None)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="dspark-monitor", daemon=True)
        self._thread.start()

    @property
    def has_gpu(self) -> bool:
        return self._nvml_handle is not None

    def sample(self) -> LoadReading:
        """The most recent reading (at most `period` old)."""
        return self._latest

    def read_now(self) -> LoadReading:
        gpu, memory = None, None
        if self._nvml_handle is not None:
            import pynvml

            gpu = float(pynvml.nvmlDeviceGetUtilizationRates(self._nvml_handle).gpu)
            memory = int(pynvml.nvmlDeviceGetMemoryInfo(self._nvml_handle).used)
        return LoadReading(psutil.cpu_percent(interval=None), gpu, memory)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(self.period):
            self._latest = self.read_now()  # one reference swap: readers never see a torn reading


# The process's monitors, by GPU index, with their users. One, shared: the readings are machine-wide, and
# psutil.cpu_percent(None) keeps one process-wide baseline, so two monitors would each read the load since the
# other's last reading. (A runtime built over a shared backend, as the bench's load sweep builds one a run, left
# a sampling thread behind: 40 after 40 runs, each waking 4 times a second on a 2-core machine.)
_shared: dict[int, tuple[Monitor, int]] = {}
_shared_lock = threading.Lock()


def acquire_monitor(gpu_index: int = 0) -> Monitor:
    """The process's monitor of `gpu_index`, started by its first user; give it back with `release_monitor`."""
    with _shared_lock:
        monitor, users = _shared.get(gpu_index, (None, 0))
        if monitor is None:
            monitor = Monitor(gpu_index)
        _shared[gpu_index] = (monitor, users + 1)
        return monitor


def release_monitor(monitor: Monitor) -> None:
    """One user of `monitor` is done; its last stops the thread (a monitor not shared is closed)."""
    with _shared_lock:
        for index, (shared, users) in _shared.items():
            if shared is monitor:
                if users > 1:
                    _shared[index] = (shared, users - 1)
                    return
                del _shared[index]
                break
    monitor.close()


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
