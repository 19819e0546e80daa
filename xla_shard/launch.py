"""How training processes start, and how they stop together.

A backend's `launch` picks one of these: train in this process, re-exec under torchrun, or torch_xla's
`xmp.spawn`. Every worker process dies with the process that started it (the kernel's parent-death signal),
so killing a launcher, even with SIGKILL, never leaves workers training and committing checkpoints beside
the run that replaces it.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

# Exit status after a SIGTERM stop with the checkpoint committed (128 + SIGTERM, as a shell reports it):
# scripts/train_loop.sh restarts on it, and the restart resumes.
PREEMPTED_EXIT = 143
# Set by the torchrun launcher before it execs (torchrun keeps its PID): the parent its workers must outlive.
LAUNCHER_PID = "XLA_SHARD_LAUNCHER_PID"
_PR_SET_PDEATHSIG = 1


def on_tpu() -> bool:
    """A Cloud TPU VM exposes its chips as /dev/accel* (v4, v5p) or /dev/vfio (v5e, v6e)."""
    return os.environ.get("PJRT_DEVICE") == "TPU" or any(Path("/dev").glob("accel*")) or (
        Path("/dev/vfio").is_dir() and "TPU_ACCELERATOR_TYPE" in os.environ)


def declare_xla_device() -> None:
    """torch_xla reads PJRT_DEVICE when it is first imported, and transformers imports it (through accelerate)
    long before a backend configures the runtime; without it torch_xla logs a warning on every command."""
    os.environ.setdefault("PJRT_DEVICE", "TPU" if on_tpu() else "CPU")


def train_here(cfg, backend=None) -> int:
    """Train in this process; the exit status for the CLI."""
    from xla_shard.train import Trainer

    trainer = Trainer(cfg, backend)
    try:
        trainer.setup().run()
    finally:
        trainer.backend.shutdown()
    return PREEMPTED_EXIT if trainer.preempted else 0


def die_with_parent(parent_pid: int | None = None) -> None:
    """Have the kernel SIGKILL this process when its parent exits, however the parent exits.

    `parent_pid` closes the race where the parent died before this call: then the process ends now. Linux
    only (elsewhere nothing happens); committed checkpoints are safe either way (the manifest is written last).
    """
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if parent_pid is not None and os.getppid() != parent_pid:
        os.kill(os.getpid(), signal.SIGKILL)


def exec_torchrun(nproc: int, argv: list[str]) -> None:
    """Replace this process by `torchrun --standalone` running the same command in `nproc` workers. torchrun
    takes this PID, so a SIGTERM sent to the launcher reaches it (and it forwards it to the workers)."""
    os.environ[LAUNCHER_PID] = str(os.getpid())
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "xla_shard.cli", *argv]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, command)


def torchrun_worker() -> bool:
    """True in a process torchrun started: it trains; its launcher is torchrun."""
    return "LOCAL_RANK" in os.environ


def as_torchrun_worker() -> None:
    parent = os.environ.get(LAUNCHER_PID)
    die_with_parent(int(parent) if parent else None)


def spawned(index: int, cfg, parent_pid: int) -> None:
    """The function `xmp.spawn` runs in each of its processes."""
    die_with_parent(parent_pid)
    status = train_here(cfg)
    if status:
        sys.exit(status)
