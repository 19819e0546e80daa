"""Host memory of this process, for the load and export reports (Linux /proc; zeros elsewhere), and the unit
they print it in."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass


def status_bytes(field: str) -> int:
    """VmRSS (now) or VmHWM (peak) of this process; unlike ru_maxrss, the peak does not inherit the RSS of
    a parent that forked us."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def available_bytes() -> int:
    """Memory the kernel says can be given to this process without swapping (MemAvailable); 0 if unknown."""
    try:
        with open("/proc/meminfo") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


@dataclass
class PeakGrowth:
    """How far this process's resident memory rose above where it stood when the block began: `bytes` for
    data, `code_bytes` for pages of files mapped in meanwhile (libraries whose code ran for the first time: a
    process's first torch operations page in some 8 MiB of it), which are not data and are not counted in
    `bytes`."""

    bytes: int = 0
    code_bytes: int = 0


@contextlib.contextmanager
def peak_growth():
    """Resets the kernel's high-water mark (so an earlier, higher peak does not hide this one), then measures
    the peak within the block against the resident size at its start. File-backed pages are seldom dropped
    once mapped, so their growth by the end is taken off the peak as code."""
    with contextlib.suppress(OSError):
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
    growth = PeakGrowth()
    start, files = status_bytes("VmRSS"), status_bytes("RssFile")
    try:
        yield growth
    finally:
        growth.code_bytes = max(0, status_bytes("RssFile") - files)
        growth.bytes = max(0, status_bytes("VmHWM") - start - growth.code_bytes)

def mib(n: int) -> str:
    """Bytes as the reports print them: MiB, with two decimals below 10 MiB (a LoRA adapter is a few)."""
    return f"{n / 2**20:,.{2 if n < 10 * 2**20 else 1}f} MiB"
