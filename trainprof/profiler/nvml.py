"""NVML (nvidia-ml-py) as the telemetry sampler's source on a CUDA device: one reader per metric, each
left out with NVML's reason where the device does not support it (see profiler/telemetry.py for the
metrics, the thread and the per-step aggregation)."""

from __future__ import annotations

import time
from typing import Any, Callable

NVLINK_ALL_LINKS = 0xFFFFFFFF  # nvmlFieldValue_t.scopeId: the sum over every link (nvml.h)


class _Counter:
    """A cumulative NVML field (bytes or KiB) turned into GB/s between two reads; None on the first read
    and when the counter went backwards (wrapped or reset)."""

    def __init__(self, read: Callable[[], tuple[float, float]], bytes_per_unit: float) -> None:
        self._read, self._scale = read, bytes_per_unit
        self._prev: tuple[float, float] | None = None

    def __call__(self) -> float | None:
        t_s, value = self._read()
        prev, self._prev = self._prev, (t_s, value)
        if prev is None or value < prev[1] or t_s <= prev[0]:
            return None
        return (value - prev[1]) * self._scale / (t_s - prev[0]) / 1e9


class NvmlSource:
    """NVML readers for one CUDA device. A metric whose first read fails is left out, with NVML's
    reason in `unavailable`; one that fails later is dropped then, with the reason."""

    def __init__(self, pynvml: Any, handle: Any, name: str) -> None:
        self.nvml, self.handle = pynvml, handle
        version = getattr(pynvml, "__version__", None) or _dist_version("nvidia-ml-py")
        self.description = f"NVML via nvidia-ml-py {version} on {name}"
        self.how: dict[str, str] = {}
        self.unavailable: dict[str, str] = {}
        self._readers: dict[str, Callable[[], float | None]] = {}
        for metric, (how, make) in self._catalog().items():
            try:
                reader = make()
                reader()  # the first read says whether the device supports it
            except Exception as err:  # noqa: BLE001  NVMLError_NotSupported and kin: listed, not raised
                self.unavailable[metric] = f"{how}: {type(err).__name__}: {err}"
                continue
            self._readers[metric] = reader
            self.how[metric] = f"{how}: {reader.how}" if hasattr(reader, "how") else how

    def _catalog(self) -> dict[str, tuple[str, Callable[[], Callable[[], float | None]]]]:
        nv, h = self.nvml, self.handle
        util = lambda key: lambda: float(getattr(nv.nvmlDeviceGetUtilizationRates(h), key))  # noqa: E731
        return {
            "sm_clock_mhz": ("nvmlDeviceGetClockInfo(NVML_CLOCK_SM)",
                             lambda: lambda: float(nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM))),
            "mem_clock_mhz": ("nvmlDeviceGetClockInfo(NVML_CLOCK_MEM)",
                              lambda: lambda: float(nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_MEM))),
            "power_w": ("nvmlDeviceGetPowerUsage / 1000 (board power; on Ampere and newer the driver's "
                        "average over the last second)", lambda: lambda: nv.nvmlDeviceGetPowerUsage(h) / 1e3),
            "temperature_c": ("nvmlDeviceGetTemperature(NVML_TEMPERATURE_GPU)",
                              lambda: lambda: float(nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU))),
            "gpu_util_pct": ("nvmlDeviceGetUtilizationRates().gpu: share of the driver's last sample period "
                             "(1/6 to 1 s) in which a kernel ran", lambda: util("gpu")),
            "mem_util_pct": ("nvmlDeviceGetUtilizationRates().memory: share of that period in which device "
                             "memory was read or written", lambda: util("memory")),
            "pcie_tx_gbps": ("PCIe transmit (NVML_FI_DEV_PCIE_COUNT_TX_BYTES)",
                             lambda: self._pcie(nv.NVML_FI_DEV_PCIE_COUNT_TX_BYTES, nv.NVML_PCIE_UTIL_TX_BYTES)),
            "pcie_rx_gbps": ("PCIe receive (NVML_FI_DEV_PCIE_COUNT_RX_BYTES)",
                             lambda: self._pcie(nv.NVML_FI_DEV_PCIE_COUNT_RX_BYTES, nv.NVML_PCIE_UTIL_RX_BYTES)),
            "nvlink_tx_gbps": ("NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX over all links (KiB), differenced",
                               lambda: self._nvlink(nv.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX)),
            "nvlink_rx_gbps": ("NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX over all links (KiB), differenced",
                               lambda: self._nvlink(nv.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX)),
        }

    def _field(self, field_id: int, scope: int | None = None) -> Callable[[], tuple[float, float]]:
        """A reader of one NVML field value: (seconds, value), the driver's timestamp when it gives one."""
        nv, h = self.nvml, self.handle
        request = [(field_id, scope) if scope is not None else field_id]

        def read() -> tuple[float, float]:
            (v,) = nv.nvmlDeviceGetFieldValues(h, request)
            if v.nvmlReturn != nv.NVML_SUCCESS:
                raise nv.NVMLError(v.nvmlReturn)
            t = v.timestamp / 1e6 if v.timestamp > 0 else time.perf_counter()
            return t, float(v.value.ullVal)
        return read

    def _pcie(self, field_id: int, util_counter: int) -> Callable[[], float | None]:
        """PCIe bytes from the cumulative counter field; where the device lacks it, NVML's own throughput
        reading (which samples 20 ms inside the call, on this thread, not the training thread)."""
        try:
            counter = self._field(field_id)
            counter()
            reader: Any = _Counter(counter, 1.0)
            reader.how = "NVML byte counter field, differenced between samples"
        except Exception:  # noqa: BLE001
            nv, h = self.nvml, self.handle

            def reader() -> float:
                return nv.nvmlDeviceGetPcieThroughput(h, util_counter) * 1e3 / 1e9  # KB/s -> GB/s
            reader.how = "nvmlDeviceGetPcieThroughput (KB/s over 20 ms; the device has no byte counter field)"
        return reader

    def _nvlink(self, field_id: int) -> _Counter:
        links = self._field(self.nvml.NVML_FI_DEV_NVLINK_LINK_COUNT)()[1]
        if links <= 0:
            raise RuntimeError("NVML reports no NVLink link on this device (NVML_FI_DEV_NVLINK_LINK_COUNT = 0)")
        return _Counter(self._field(field_id, NVLINK_ALL_LINKS), 1024.0)

    def read(self) -> dict[str, float | None]:
        out: dict[str, float | None] = {}
        for metric, reader in list(self._readers.items()):
            try:
                out[metric] = reader()
            except Exception as err:  # noqa: BLE001  one metric failing mid-run is dropped, the rest go on
                del self._readers[metric]
                self.unavailable[metric] = f"failed during the run: {type(err).__name__}: {err}"
        return out

    def close(self) -> None:
        self.nvml.nvmlShutdown()


def _dist_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "?"


def open_nvml(device: Any) -> tuple[NvmlSource | None, str | None]:
    """NVML readers for a torch CUDA device, or (None, why not)."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return None, (f"the device is {device.type}: GPU telemetry (NVML clocks, power, temperature, utilization, "
                      "PCIe and NVLink throughput) exists only for CUDA devices")
    try:
        import pynvml
    except ImportError as err:
        return None, f"nvidia-ml-py is not installed ({err}); `pip install nvidia-ml-py` gives NVML telemetry"
    try:
        pynvml.nvmlInit()
    except Exception as err:  # noqa: BLE001  NVMLError_LibraryNotFound, _DriverNotLoaded, ...
        return None, f"NVML could not start: {type(err).__name__}: {err}"
    try:
        handle = _nvml_handle(pynvml, device)
        return NvmlSource(pynvml, handle, torch.cuda.get_device_name(device)), None
    except Exception as err:  # noqa: BLE001
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass
        return None, f"NVML has no handle for {device}: {type(err).__name__}: {err}"


def _nvml_handle(pynvml: Any, device: Any) -> Any:
    """The NVML device of a torch device: by its UUID (immune to CUDA_VISIBLE_DEVICES and to NVML's
    PCI-bus order), else by torch's mapping of CUDA_VISIBLE_DEVICES to NVML indices."""
    import torch

    try:
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        return pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}")
    except Exception:  # noqa: BLE001  fall back to the index mapping
        return pynvml.nvmlDeviceGetHandleByIndex(torch.cuda._get_nvml_device_index(device))
