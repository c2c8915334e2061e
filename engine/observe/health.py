"""GPU health from NVML (nvidia-ml-py): temperature, power, clocks, throttle reasons and ECC counts.

One monitor per node (local rank 0) reads every GPU NVML sees on the node, at start and every
`run.health_interval` steps. Readings go to `logs/health-<host>.jsonl` (and, on rank 0, into the step's
metrics record as `gpu`). A reading past a threshold (`run.max_ecc_errors_per_hour` new ECC errors within
the last hour, `run.max_gpu_temperature`) asks the run to stop gracefully; the reason names GPU and host.
Without NVML or NVIDIA GPUs the monitor says so once and stays quiet.
"""
from __future__ import annotations

import json
import time
from collections import deque
from pathlib import Path

from parallel.distributed import node_name

HOUR_S = 3600.0
# NVML clock-event (throttle) reason bits, as defined in nvml.h (nvmlClocksEventReason*).
THROTTLE_BITS = {0x1: "gpu_idle", 0x2: "applications_clocks", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
                 0x10: "sync_boost", 0x20: "sw_thermal", 0x40: "hw_thermal", 0x80: "hw_power_brake",
                 0x100: "display_clocks"}


def throttle_names(mask: int) -> list[str]:
    return [name for bit, name in THROTTLE_BITS.items() if mask & bit]


class NvmlReader:
    """Reads every GPU on this node; raises RuntimeError at construction when NVML is unusable."""

    def __init__(self):
        try:
            import pynvml
        except ImportError as exc:
            raise RuntimeError("nvidia-ml-py is not installed (pip install -e '.[gpu]')") from exc
        try:
            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
        except pynvml.NVMLError as exc:
            raise RuntimeError(f"NVML unavailable: {exc}") from exc
        if count == 0:
            raise RuntimeError("NVML reports no NVIDIA GPUs")
        self.nvml = pynvml
        self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]

    def _get(self, fn, *args):
        try:
            return fn(*args)
        except self.nvml.NVMLError:  # a field this GPU does not support (e.g. ECC on consumer cards)
            return None

    def read(self) -> list[dict]:
        n = self.nvml
        out = []
        for index, h in enumerate(self.handles):
            power = self._get(n.nvmlDeviceGetPowerUsage, h)
            limit = self._get(n.nvmlDeviceGetEnforcedPowerLimit, h)
            mask = self._get(n.nvmlDeviceGetCurrentClocksEventReasons, h)
            ecc = [self._get(n.nvmlDeviceGetTotalEccErrors, h, kind, n.NVML_VOLATILE_ECC)
                   for kind in (n.NVML_MEMORY_ERROR_TYPE_CORRECTED, n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED)]
            uuid = self._get(n.nvmlDeviceGetUUID, h)
            out.append({
                "index": index, "uuid": uuid.decode() if isinstance(uuid, bytes) else uuid,
                "temperature_c": self._get(n.nvmlDeviceGetTemperature, h, n.NVML_TEMPERATURE_GPU),
                "power_w": None if power is None else power / 1000,
                "power_limit_w": None if limit is None else limit / 1000,
                "sm_clock_mhz": self._get(n.nvmlDeviceGetClockInfo, h, n.NVML_CLOCK_SM),
                "mem_clock_mhz": self._get(n.nvmlDeviceGetClockInfo, h, n.NVML_CLOCK_MEM),
                "throttle": None if mask is None else throttle_names(mask),
                "ecc_corrected": ecc[0], "ecc_uncorrected": ecc[1],
            })
        return out


class EccWindow:
    """New ECC errors within the last hour from a cumulative (volatile) counter sampled over time."""

    def __init__(self):
        self.samples: deque = deque()  # (time, cumulative count), oldest first

    def add(self, t: float, count: int) -> int:
        self.samples.append((t, count))
        # Keep one sample at or before the window start as the baseline for the hour.
        while len(self.samples) > 1 and self.samples[1][0] <= t - HOUR_S:
            self.samples.popleft()
        return count - self.samples[0][1]


class HealthMonitor:
    def __init__(self, run_cfg, run_dir: Path, reader_factory=NvmlReader, clock=time.time, console=print):
        self.interval = run_cfg.health_interval
        self.max_ecc = run_cfg.max_ecc_errors_per_hour
        self.max_temp = run_cfg.max_gpu_temperature
        self.clock, self.host = clock, node_name()
        self.path = Path(run_dir) / "logs" / f"health-{self.host}.jsonl"
        self.windows: dict[int, EccWindow] = {}
        self.reader = None
        if self.interval <= 0:
            return
        try:
            self.reader = reader_factory()
        except RuntimeError as exc:
            console(f"GPU health: not monitored on {self.host}: {exc}")

    def due(self, step: int) -> bool:
        return self.reader is not None and step % self.interval == 0

    def check(self, step: int) -> tuple[list[dict], str]:
        """Read every GPU; return the readings and a stop reason ("" when healthy)."""
        now = self.clock()
        readings = self.reader.read()
        reasons = []
        for g in readings:
            name = f"GPU {g['index']} ({g['uuid']}) on {self.host}"
            errors = [c for c in (g["ecc_corrected"], g["ecc_uncorrected"]) if c is not None]
            if errors:
                g["ecc_new_last_hour"] = self.windows.setdefault(g["index"], EccWindow()).add(now, sum(errors))
                if self.max_ecc > 0 and g["ecc_new_last_hour"] > self.max_ecc:
                    reasons.append(f"{name}: {g['ecc_new_last_hour']} new ECC errors within the last hour "
                                   f"(run.max_ecc_errors_per_hour={self.max_ecc})")
            temp = g["temperature_c"]
            if self.max_temp > 0 and temp is not None and temp > self.max_temp:
                reasons.append(f"{name}: temperature {temp} °C above run.max_gpu_temperature={self.max_temp}")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, "time": now, "host": self.host, "gpus": readings}) + "\n")
        return readings, "; ".join(reasons)
