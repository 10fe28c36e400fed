"""Hardware peaks from trainprof/profiles/accelerators.yaml (every figure cites its datasheet there): dense
compute for MFU and memory bandwidth for decode. An unknown device gets no figure and a reason; there is
never a fallback to another device's figure."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import yaml

PEAKS_FILE = Path(__file__).resolve().parents[1] / "profiles" / "accelerators.yaml"

# compute dtype -> the peak key that applies (fp32 matmuls on tensor cores run as TF32 when allowed)
_PEAK_KEY = {"bf16": "peak_bf16_dense_tflops", "fp16": "peak_fp16_dense_tflops",
             "tf32": "peak_tf32_dense_tflops", "fp32": "peak_fp32_tflops"}


@functools.lru_cache(maxsize=1)
def _table() -> list[dict[str, Any]]:
    return yaml.safe_load(PEAKS_FILE.read_text())["accelerators"]


def dense_peak(device_name: str, device_type: str, dtype: str) -> tuple[dict[str, Any] | None, str]:
    """The dense peak for a device and compute dtype.

    Args:
        device_name: torch.cuda.get_device_name() on GPU, the processor name on CPU.
        device_type: "cuda" or "cpu".
        dtype: "bf16" | "fp16" | "tf32" | "fp32".
    Returns:
        ({tflops, key, source, accelerator} or None, reason when None else "").
    """
    if device_type != "cuda":
        return None, (f"no dense peak is known for the CPU '{device_name}' (it depends on SKU, clock and ISA); "
                      "achieved TFLOP/s is reported instead")
    key = _PEAK_KEY.get(dtype)
    for entry in _table():
        if device_name in entry.get("match", []):
            figure = entry.get(key) if key else None
            if figure is None:
                return None, f"{entry['name']} has no {key or dtype} figure in {PEAKS_FILE.name}"
            return {"tflops": float(figure["value"]), "key": key, "source": figure["source"],
                    "accelerator": entry["name"]}, ""
    return None, (f"device '{device_name}' is not in {PEAKS_FILE.name}; add its dense {dtype} peak with a "
                  "datasheet source to get MFU")


def memory_bandwidth(device_name: str, device_type: str) -> tuple[dict[str, Any] | None, str]:
    """The device memory bandwidth (HBM) for a device, for decode bandwidth utilization.

    Args:
        device_name: torch.cuda.get_device_name() on GPU, the processor name on CPU.
        device_type: "cuda" or "cpu".
    Returns:
        ({gbps, source, accelerator} or None, reason when None else ""); gbps is 1e9 bytes/s.
    """
    if device_type != "cuda":
        return None, (f"no memory bandwidth is known for the CPU '{device_name}' (it depends on the DIMMs, "
                      "channels and sockets); achieved GB/s is reported instead")
    for entry in _table():
        if device_name in entry.get("match", []):
            figure = entry.get("hbm_gbps")
            if figure is None:
                return None, f"{entry['name']} has no hbm_gbps figure in {PEAKS_FILE.name}"
            return {"gbps": float(figure["value"]), "source": figure["source"], "accelerator": entry["name"]}, ""
    return None, (f"device '{device_name}' is not in {PEAKS_FILE.name}; add its hbm_gbps with a datasheet "
                  "source to get bandwidth utilization")
