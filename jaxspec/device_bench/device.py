"""What the campaign runs on: the device, its driver, the software, and the memory
bandwidth that bounds a decode step (the floor every AR row is compared with)."""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
from pathlib import Path

import jax

# Peak memory bandwidth by device kind (vendors' data sheets, GB/s), matched in order
# against jax.devices()[0].device_kind; the first pattern that matches wins.
BANDWIDTH_GBS: tuple[tuple[str, float, str], ...] = (
    (r"\bH200\b", 4800, "H200 (HBM3e)"),
    (r"\bH100\b.*\bPCIe\b", 2000, "H100 PCIe (HBM2e)"),
    (r"\bH100\b.*\bNVL\b", 3900, "H100 NVL (HBM3)"),
    (r"\bH100\b", 3350, "H100 SXM (HBM3)"),
    (r"\bA100\b.*80GB.*PCIe", 1935, "A100 80GB PCIe (HBM2e)"),
    (r"\bA100\b.*80GB", 2039, "A100 80GB SXM (HBM2e)"),
    (r"\bA100\b", 1555, "A100 40GB (HBM2)"),
    (r"\bL40S\b", 864, "L40S (GDDR6)"),
    (r"\bA10G\b", 600, "A10G (GDDR6)"),
    (r"\bL4\b", 300, "L4 (GDDR6)"),
    (r"\bV100\b", 900, "V100 (HBM2)"),
    (r"^TPU v4\b", 1200, "TPU v4 (HBM2)"),
    (r"^TPU v5 lite\b", 819, "TPU v5e (HBM2e)"),
    (r"^TPU v5\b", 2765, "TPU v5p (HBM2e)"),
    (r"^TPU v6 lite\b", 1640, "TPU v6e (HBM)"),
)


def bandwidth(kind: str, given_gbs: float | None = None) -> tuple[float | None, str]:
    """-> (GB/s or None, where the number comes from or why there is none)."""
    if given_gbs is not None:
        return given_gbs, "given (--bandwidth-gbs)"
    for pattern, gbs, label in BANDWIDTH_GBS:
        if re.search(pattern, kind):
            return float(gbs), f"data sheet: {label}"
    return None, f"device kind {kind!r} is not in the bandwidth table; pass --bandwidth-gbs"


def floor_ms(n_bytes: float, gbs: float | None) -> float | None:
    """Time to read n_bytes once at gbs GB/s, in ms (None without a bandwidth)."""
    return None if gbs is None else n_bytes / (gbs * 1e9) * 1e3


def driver_version() -> tuple[str | None, str]:
    """-> (the NVIDIA driver version or None, where it comes from or why there is none)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None, "no nvidia-smi on PATH"
    try:
        done = subprocess.run(
            [smi, "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"nvidia-smi failed: {e}"
    lines = done.stdout.split()
    if done.returncode or not lines:
        return None, f"nvidia-smi exited {done.returncode}: {done.stderr.strip()[:200]}"
    return lines[0], "nvidia-smi"


def source_commit() -> str | None:
    """The checkout's commit (with "+changes" when the work tree differs), None outside git."""
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=30,
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if head.returncode:
        return None
    return head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def device_info(given_gbs: float | None = None) -> dict:
    """The first device (kind, platform, memory), the driver, and the bandwidth floor's GB/s."""
    device = jax.devices()[0]
    stats = device.memory_stats() or {}
    gbs, gbs_source = bandwidth(device.device_kind, given_gbs)
    driver, driver_source = driver_version()
    return {
        "kind": device.device_kind,
        "platform": device.platform,
        "count": jax.device_count(),
        "memory_bytes": stats.get("bytes_limit"),
        "driver": driver,
        "driver_source": driver_source,
        "bandwidth_gbs": gbs,
        "bandwidth_source": gbs_source,
    }


def software_info() -> dict:
    import jaxlib

    return {
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "backend": jax.default_backend(),
        "python": platform.python_version(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "jaxspec_commit": source_commit(),
    }
