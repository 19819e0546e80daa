"""What machine this is, asked before any runtime starts (a backend's choice, torch_xla's PJRT_DEVICE)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path


def on_tpu() -> bool:
    """A Cloud TPU VM exposes its chips as /dev/accel* (v4, v5p) or /dev/vfio (v5e, v6e)."""
    return os.environ.get("PJRT_DEVICE") == "TPU" or any(Path("/dev").glob("accel*")) or (
        Path("/dev/vfio").is_dir() and "TPU_ACCELERATOR_TYPE" in os.environ)


def declare_xla_device() -> None:
    """torch_xla reads PJRT_DEVICE when it is first imported, and transformers imports it (through accelerate)
    long before a backend configures the runtime; without it torch_xla logs a warning on every command. XLA's
    C++ log level is read then too: at 2 it drops the GSPMD deprecation warning XLA prints at every compile
    (TF_CPP_MIN_LOG_LEVEL=0 in the environment shows everything again). Without torch_xla installed it sets
    nothing: other libraries in the process see the environment as it was."""
    if importlib.util.find_spec("torch_xla") is None:
        return
    os.environ.setdefault("PJRT_DEVICE", "TPU" if on_tpu() else "CPU")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def declare_runtime(torch_xla: bool) -> None:
    """Before transformers is imported, for a run whose backend does (`torch_xla`) or does not run on torch_xla:
    accelerate and transformers import torch_xla wherever it is installed (~3 s a process, and a PJRT client
    nobody uses); USE_TORCH_XLA=0 is their switch for a native torch run. The processes a launcher starts
    inherit it."""
    if not torch_xla:
        os.environ.setdefault("USE_TORCH_XLA", "0")


def tpu_chips() -> int:
    """This host's TPU chips, counted from their device files (asking a runtime would claim them)."""
    accel = list(Path("/dev").glob("accel[0-9]*"))
    if accel:
        return len(accel)
    vfio = Path("/dev/vfio")
    return len([p for p in vfio.iterdir() if p.name.isdigit()]) if vfio.is_dir() else 0
