"""`DeviceMonitor`: GPU utilisation from NVML; nothing without a GPU."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from typing import Any

from laneserve.server.log_events import log_event
from laneserve.server.memory import session_gpu, session_gpu_id
from laneserve.server.providers import CUDA
from laneserve.server.telemetry.logs import log


class DeviceMonitor:
    """GPU utilisation from NVML, for the GPU the session runs on (`session_gpu`)."""

    def __init__(self, nvml: Any, handle: Any) -> None:
        self._nvml = nvml
        self._handle = handle

    @classmethod
    def open(cls, providers: Sequence[str]) -> DeviceMonitor | None:
        """The monitor, or None when the session is not on a GPU or NVML cannot be used."""
        if CUDA not in providers:
            return None
        try:
            import pynvml  # noqa: PLC0415 - only where a GPU is in use

            pynvml.nvmlInit()
        except Exception as error:  # noqa: BLE001 - any NVML failure: no utilisation figure
            log_event(
                log,
                logging.WARNING,
                "nvml_unavailable",
                f"NVML unavailable, no device utilisation: {error}",
                error=str(error),
            )
            return None
        first = session_gpu_id()
        try:
            handle = session_gpu(pynvml)
        except pynvml.NVMLError as error:
            log_event(
                log,
                logging.WARNING,
                "nvml_unavailable",
                f"NVML cannot open GPU {first!r}, no device utilisation: {error}",
                gpu=first,
                error=str(error),
            )
            pynvml.nvmlShutdown()
            return None
        return cls(pynvml, handle)

    def utilization(self) -> float | None:
        try:
            return float(self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu) / 100
        except self._nvml.NVMLError:
            return None

    def close(self) -> None:
        with contextlib.suppress(self._nvml.NVMLError):
            self._nvml.nvmlShutdown()
