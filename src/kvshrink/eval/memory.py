"""Peak memory of the current process: RSS high-water mark (Linux /proc, with fallbacks) and the
accelerator's peak when one is used."""
from __future__ import annotations

import resource
import sys


def _proc_status_mb(field: str) -> float | None:
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024.0  # kB
    except OSError:
        pass
    return None


def reset_peak_rss() -> bool:
    """Reset the RSS high-water mark (Linux >= 4.0: writing 5 to clear_refs), so the peak of model
    loading does not hide the peak of what is measured next. False when the platform cannot."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def peak_rss_mb() -> float:
    value = _proc_status_mb("VmHWM")
    if value is not None:
        return value
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024.0 * 1024.0) if sys.platform == "darwin" else peak / 1024.0  # bytes vs kB


def current_rss_mb() -> float | None:
    value = _proc_status_mb("VmRSS")
    if value is not None:
        return value
    try:
        import psutil

        return psutil.Process().memory_info().rss / 2**20
    except ImportError:
        return None


def reset_device_peak(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def device_peak_mb(device) -> float | None:
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return None
