"""Host memory of this process, for the load and export reports (Linux /proc; zeros elsewhere)."""

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


@dataclass
class PeakGrowth:
    """How far this process's resident memory rose above where it stood when the block began."""

    bytes: int = 0


@contextlib.contextmanager
def peak_growth():
    """Resets the kernel's high-water mark (so an earlier, higher peak does not hide this one), then measures
    the peak within the block against the resident size at its start."""
    with contextlib.suppress(OSError):
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
    growth = PeakGrowth()
    start = status_bytes("VmRSS")
    try:
        yield growth
    finally:
        growth.bytes = max(0, status_bytes("VmHWM") - start)
