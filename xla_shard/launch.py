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
# Exit status of a user error (bad config, damaged input): one line, and a restart would only repeat it.
USER_ERROR_EXIT = 2
# Set by the torchrun launcher (whose process runs the elastic agent): the parent its workers must outlive.
LAUNCHER_PID = "XLA_SHARD_LAUNCHER_PID"
# Set by the torchrun launcher: the directory where its workers leave their user error's one line.
WORKER_ERRORS = "XLA_SHARD_WORKER_ERRORS"
_PR_SET_PDEATHSIG = 1


def on_tpu() -> bool:
    """A Cloud TPU VM exposes its chips as /dev/accel* (v4, v5p) or /dev/vfio (v5e, v6e)."""
    return os.environ.get("PJRT_DEVICE") == "TPU" or any(Path("/dev").glob("accel*")) or (
        Path("/dev/vfio").is_dir() and "TPU_ACCELERATOR_TYPE" in os.environ)


def declare_xla_device() -> None:
    """torch_xla reads PJRT_DEVICE when it is first imported, and transformers imports it (through accelerate)
    long before a backend configures the runtime; without it torch_xla logs a warning on every command. XLA's
    C++ log level is read then too: at 2 it drops the GSPMD deprecation warning XLA prints at every compile
    (TF_CPP_MIN_LOG_LEVEL=0 in the environment shows everything again)."""
    os.environ.setdefault("PJRT_DEVICE", "TPU" if on_tpu() else "CPU")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


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


def run_torchrun(nproc: int, argv: list[str]) -> int:
    """Run the same command under torchrun (`--standalone`, `nproc` workers), its elastic agent in this
    process: the agent keeps this PID, so a SIGTERM sent to the launcher reaches it and it forwards it to the
    workers. How the workers end decides the exit status: a user error in any worker is that worker's one
    line and exit 2 (each writes its line to a file the launcher reads; none prints it); a crash is exit 1
    with the worker's own traceback above one line naming it; a SIGTERM stop is PREEMPTED_EXIT."""
    import logging
    import shutil
    import tempfile

    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from xla_shard.errors import UserError

    errors = tempfile.mkdtemp(prefix="xla_shard_worker_errors_")
    os.environ[LAUNCHER_PID] = str(os.getpid())
    os.environ[WORKER_ERRORS] = errors
    # The agent logs each failed worker as an error with its own stack; what failed is said below, once.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    args = torchrun.parse_args(["--standalone", f"--nproc-per-node={nproc}", "-m", "xla_shard.cli", *argv])
    try:
        torchrun.run(args)
        return 0
    except SignalException as exc:
        print(f"xla-shard: {signal.Signals(exc.sigval).name}: the workers were stopped", file=sys.stderr)
        return PREEMPTED_EXIT if exc.sigval == signal.SIGTERM else 128 + exc.sigval
    except ChildFailedError as exc:
        said = sorted(Path(errors).glob("rank-*.txt"), key=lambda p: int(p.stem.split("-")[1]))
        codes = {rank: failure.exitcode for rank, failure in exc.failures.items()}
        if said:  # the others were stopped by the agent when the first failed
            raise UserError(said[0].read_text().strip()) from None
        if all(code == PREEMPTED_EXIT for code in codes.values()):
            return PREEMPTED_EXIT
        rank, code = min(codes.items())
        print(f"xla-shard: worker {rank} failed (exit code {code}); its traceback is above", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(errors, ignore_errors=True)


def report_worker_error(message: str) -> bool:
    """In a torchrun worker, hand a user error's one line to the launcher (which prints it once for all
    workers) instead of printing it; False where there is no launcher to hand it to."""
    errors = os.environ.get(WORKER_ERRORS)
    if not errors or not torchrun_worker() or not os.path.isdir(errors):
        return False
    Path(errors, f"rank-{int(os.environ.get('RANK', 0))}.txt").write_text(message)
    return True


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
