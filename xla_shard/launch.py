"""How training processes start, and how they stop together.

A launcher runs an entry point (a function returning the exit status, given by the CLI) the way a backend's
capabilities say: in this process, under torchrun (one process per device), or in torch_xla's `xmp.spawn`.
Every worker process dies with the process that started it (the kernel's parent-death signal), so killing a
launcher, even with SIGKILL, never leaves workers training and committing checkpoints beside the run that
replaces it. A stop signal (SIGTERM, Ctrl-C) reaches every worker once, and each stops by itself
(`preemption`). Nothing here imports the rest of xla_shard but `errors` and `preemption`: the entry point is
handed in.
"""

from __future__ import annotations

import math
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from xla_shard import preemption
from xla_shard.errors import ConfigError, Problems, UserError

Entry = Callable[[], int]  # runs the job in this process; the exit status

# Exit status after a SIGTERM stop with the checkpoint committed (128 + SIGTERM, as a shell reports it):
# scripts/train_loop.sh restarts on it, and the restart resumes.
PREEMPTED_EXIT = 143
# Exit status after Ctrl-C (128 + SIGINT): the user stopped the run; train_loop.sh does not restart it.
INTERRUPTED_EXIT = 130
# Exit status of a user error (bad config, damaged input): one line, and a restart would only repeat it.
USER_ERROR_EXIT = 2
# Set by the torchrun launcher (whose process runs the elastic agent): the parent its workers must outlive.
LAUNCHER_PID = "XLA_SHARD_LAUNCHER_PID"
# Set by the torchrun launcher: the directory where its workers leave their user error's one line.
WORKER_ERRORS = "XLA_SHARD_WORKER_ERRORS"
_PR_SET_PDEATHSIG = 1


class PeerLost(Exception):
    """Another node's processes went away mid-run: this node stops too (one line, exit 1); restarting every
    node resumes from the last committed checkpoint."""


class Launcher(Protocol):
    def start(self, entry: Entry) -> int:
        """Run `entry` in the processes this launcher starts; the exit status for the CLI."""


@dataclass(frozen=True)
class InProcess:
    """One process drives every local device (SPMD)."""

    def start(self, entry: Entry) -> int:
        return entry()


@dataclass(frozen=True)
class Nodes:
    """This node among a multi-node run's: torchrun's static rendezvous at `endpoint`, whose store node 0
    serves, so that the ranks follow the nodes (node 0 holds rank 0, which logs and commits checkpoints, and
    node r holds ranks r*nproc..); the nodes wait `timeout_s` for each other to join. (c10d's dynamic
    rendezvous numbers the nodes in the order they join, and elastic restarts are not used here.)"""

    count: int
    rank: int | None
    endpoint: str | None
    rdzv_id: str = "xla_shard"
    timeout_s: float = 600.0

    def torchrun_args(self) -> list[str]:
        if self.rank is None or self.endpoint is None:
            raise ConfigError("launch", f"launch.nnodes={self.count}: set launch.node_rank (0..{self.count - 1}; 0 on "
                                        "the node serving the rendezvous) and launch.rdzv_endpoint (HOST:PORT of node "
                                        "0) on every node, e.g. --set launch.node_rank=1", backend="torch_fsdp")
        return [f"--nnodes={self.count}", f"--node-rank={self.rank}", "--rdzv-backend=static",
                f"--rdzv-endpoint={self.endpoint}", f"--rdzv-id={self.rdzv_id}",
                f"--rdzv-conf=timeout={math.ceil(self.timeout_s)}", "--max-restarts=0"]

    def wait_for_node_0(self) -> None:
        """On a node other than 0, wait (up to launch.timeout_s) for node 0's rendezvous port to accept, before
        torch's rendezvous tries it: torch's client retries print some 40 lines of C++ socket errors, with their
        frames, before the one line below says what they mean."""
        if not self.rank or self.endpoint is None:
            return
        host, _, port = self.endpoint.rpartition(":")
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                with socket.create_connection((host.strip("[]"), int(port)), timeout=min(5.0, self.timeout_s)):
                    return
            except OSError:
                if time.monotonic() >= deadline:
                    break
                time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
        raise self._no_node_0()

    def _no_node_0(self) -> PeerLost:
        return PeerLost(f"node {self.rank}: node 0 did not serve the rendezvous at launch.rdzv_endpoint="
                        f"{self.endpoint} within launch.timeout_s={self.timeout_s:g}: start node 0 "
                        "(launch.node_rank=0) there, or check the address")

    def explain_failure(self, exc: BaseException) -> None:
        """Raise the one line that says why the nodes did not meet, for torch's rendezvous errors (any other
        returns): a port in use is the user's to change (exit 2); a node that never came is not (exit 1)."""
        from torch.distributed import DistError
        from torch.distributed.elastic.rendezvous import RendezvousError

        if not isinstance(exc, (DistError, RendezvousError, TimeoutError)):
            return
        text = " ".join(str(exc).split())
        within = f"within launch.timeout_s={self.timeout_s:g}"
        if "EADDRINUSE" in text or "address already in use" in text:
            raise ConfigError("launch.rdzv_endpoint", f"{self.endpoint}: the port is already in use on node 0 (another "
                                                      "run, or another node 0?); choose a free port on every node")
        if "waiting for clients" in text:
            joined = text.split("Timed out", 1)[-1]
            raise PeerLost(f"node 0: not every node joined at launch.rdzv_endpoint={self.endpoint} {within} "
                           f"({joined.split('. ', 1)[-1].rstrip('.') or text[:160]}): start every node of "
                           f"launch.nnodes={self.count}, each with its launch.node_rank, naming this endpoint")
        if self.rank:
            raise self._no_node_0()
        raise PeerLost(f"node 0: the nodes did not meet at launch.rdzv_endpoint={self.endpoint} {within}: {text[:200]}")


@dataclass(frozen=True)
class Torchrun:
    """torchrun with `nproc` workers on this node, each a `python -m xla_shard.worker` that trains the run this
    launcher settled (`settled`: the resolved config, as YAML), so the workers never repeat the launcher's
    checks. Under a torchrun someone else started (the command is itself a worker), the entry point runs
    here, dying with torchrun. One node: `--standalone`; several (`nodes`): every node runs `xla-shard train`
    with its `launch.node_rank`, meeting at node 0's static rendezvous (`Nodes`)."""

    nproc: int
    settled: str
    nodes: Nodes | None = None
    grace_s: float = 120.0  # checkpoint.preemption_grace_s: how long a stopping worker may take to save

    def start(self, entry: Entry) -> int:
        if torchrun_worker():
            as_torchrun_worker()
            exit_without_finalizing(exit_status(entry))
        if self.nodes is None:
            return run_torchrun(self.nproc, self.settled, ["--standalone"], self.grace_s)
        try:
            args = self.nodes.torchrun_args()
            self.nodes.wait_for_node_0()
            return run_torchrun(self.nproc, self.settled, args, self.grace_s)
        except Exception as exc:
            self.nodes.explain_failure(exc)
            raise


@dataclass(frozen=True)
class XmpSpawn:
    """torch_xla's `xmp.spawn`: one process per local device. `prepare` sets the runtime's environment first
    (the workers read it as torch_xla starts in them)."""

    prepare: Callable[[], None] = field(default=lambda: None)

    def start(self, entry: Entry) -> int:
        self.prepare()
        import torch_xla.distributed.xla_multiprocessing as xmp

        with preemption.stops_passed_by_file():
            xmp.spawn(_spawned, args=(entry, os.getpid()))
        return 0


def refuse_nproc_flag(kind: str, nproc_per_node: int | None, backend: str) -> None:
    """`--nproc-per-node` is the CLI's flag for torchrun's process count; other launchers start what the
    runtime needs."""
    if nproc_per_node is not None and kind != "torchrun":
        raise ConfigError(None, f"--nproc-per-node is torchrun's process count (backend torch_fsdp); {backend} runs "
                                "one process per host (on a CPU, cpu_devices sets its devices)")


def pick(kind: str, *, settled: str = "", nproc: int | None = None, nodes: Nodes | None = None,
         prepare: Callable[[], None] = lambda: None, grace_s: float = 120.0) -> Launcher:
    """The launcher a backend's capabilities name (`Capabilities.launcher`); `settled`: the resolved config
    (YAML) that processes it starts train; `nproc`: the processes torchrun starts on this node; `nodes`: this
    node's place in a multi-node run; `grace_s`: how long workers stopping on a signal may take to save."""
    if kind == "torchrun":
        if nproc is None:
            raise ValueError("torchrun needs its process count")
        return Torchrun(nproc, settled, nodes if nodes and nodes.count > 1 else None, grace_s)
    if kind == "xmp_spawn":
        return XmpSpawn(prepare)
    return InProcess()


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


def _leave_stop_signals_to_parent() -> None:
    """In `xmp.spawn`'s child, whose main thread (torch_xla's, not ours) would raise KeyboardInterrupt at the
    terminal's Ctrl-C and leave the training threads running without it: the process ignores the stop
    signals, which its parent takes and passes on (`preemption.stops_passed_by_file`). A disposition is the
    process's, so libc sets it from this (device) thread, where Python's `signal.signal` may not."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.signal.restype = ctypes.c_void_p
    for sig in preemption.SIGNALS:
        libc.signal(int(sig), ctypes.c_void_p(1))  # SIG_IGN


def exit_without_finalizing(status: int) -> None:
    """End a torchrun worker that finished (its process group destroyed, its files closed) without the
    interpreter's finalization: on torch 2.15 a gloo worker then aborted now and then in C++ teardown
    ("terminate called without an active exception", exit -6) after its run had succeeded, and torchrun
    failed the run for it."""
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def run_torchrun(nproc: int, settled: str, rendezvous: list[str] | None = None, grace_s: float = 120.0) -> int:
    """Run `nproc` workers (`xla_shard.worker`) of the settled config under torchrun (`rendezvous`: its
    arguments saying how this node meets the others, `--standalone` for one), its elastic agent in this
    process: the agent keeps this PID, so a SIGTERM sent to the launcher reaches it and it forwards it to the
    workers, giving them `grace_s` and a margin to save before it kills them (torch >= 2.10 reads that from
    the environment; torch 2.9's agent gives 30 s). Ctrl-C reaches only the launcher (torch starts each
    worker in a session of its own), which forwards it the same way. How the workers end decides the
    exit status: a user error in any worker is that worker's one line and exit 2 (each writes its line to a
    file the launcher reads; none prints it); a crash is exit 1 with the worker's own traceback above one line
    naming it; a stop on a signal is that signal's status (PREEMPTED_EXIT, INTERRUPTED_EXIT)."""
    import logging
    import shutil
    import tempfile

    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    errors = tempfile.mkdtemp(prefix="xla_shard_run_")  # the settled config in, the workers' one lines out
    settled_path = Path(errors, "settled.yaml")
    settled_path.write_text(settled)
    os.environ[LAUNCHER_PID] = str(os.getpid())
    os.environ[WORKER_ERRORS] = errors
    # The agent logs each failed worker as an error with its own stack, and a signal it forwards; what
    # happened is said below, once. Its modules' loggers each have a level of their own.
    for name in ["torch.distributed.elastic", *logging.root.manager.loggerDict]:
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    if nproc > 1:  # torchrun's own default, one OpenMP thread a worker, without the banner it prints to say so
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(math.ceil(grace_s) + 30))
    args = torchrun.parse_args([*(rendezvous or ["--standalone"]), f"--nproc-per-node={nproc}",
                                "-m", "xla_shard.worker", str(settled_path)])
    try:
        torchrun.run(args)
        return 0
    except SignalException as exc:  # forwarded, and the workers have stopped: they said how (rank 0 logs it)
        _say_interrupted(errors)
        shutil.rmtree(errors, ignore_errors=True)
        # The agent's rendezvous threads, stopped where the signal found them, may print a finalizer's
        # traceback as the interpreter ends: nothing of this process is left to finalize.
        exit_without_finalizing(128 + exc.sigval)
    except ChildFailedError as exc:
        return _workers_failed(errors, {rank: failure.exitcode for rank, failure in exc.failures.items()})
    finally:
        shutil.rmtree(errors, ignore_errors=True)


def _workers_failed(errors: str, codes: dict[int, int]) -> int:
    """The exit status of a run whose workers failed with exit `codes` (by rank), each having left its one line,
    if it had one, in the folder `errors`: a user error is raised as the first worker's line, a peer lost is said
    once, a signal's stop is its status, and a crash names the worker whose traceback is above."""
    said = sorted(Path(errors).glob("rank-*.txt"), key=lambda p: int(p.stem.split("-")[1]))
    lost = sorted(Path(errors).glob("lost-*.txt"))
    if said:  # the others were stopped by the agent when the first failed
        raise UserError(said[0].read_text().strip()) from None
    crashed = sorted(set(codes) - {int(p.stem.split("-")[1]) for p in lost})
    if lost and not crashed:  # every failure here a peer's loss: say it once
        print(f"xla-shard: error: {lost[0].read_text().strip()}", file=sys.stderr)
        return 1
    if _say_interrupted(errors) or set(codes.values()) <= {INTERRUPTED_EXIT}:  # Ctrl-C: whatever else followed
        return INTERRUPTED_EXIT
    if set(codes.values()) == {PREEMPTED_EXIT}:
        return PREEMPTED_EXIT
    rank = crashed[0] if crashed else min(codes)
    print(f"xla-shard: worker {rank} failed (exit code {codes[rank]}); its traceback is above", file=sys.stderr)
    return 1


def _say_interrupted(errors: str) -> bool:
    """Print the first "stopped at once" line a worker handed over (`errors`: their folder); whether one did."""
    said = sorted(Path(errors).glob("interrupted-*.txt"))
    if said:
        print(f"xla-shard: {said[0].read_text().strip()}", file=sys.stderr)
    return bool(said)


def report_worker_error(message: str, kind: str = "rank") -> bool:
    """In a torchrun worker, hand a user error's one line (`kind` "rank"; "lost": a lost peer's;
    "interrupted": Ctrl-C's) to the launcher, which prints it once for all workers, instead of printing it;
    False where there is no launcher to hand it to."""
    errors = os.environ.get(WORKER_ERRORS)
    if not errors or not torchrun_worker() or not os.path.isdir(errors):
        return False
    Path(errors, f"{kind}-{int(os.environ.get('RANK', 0))}.txt").write_text(message)
    return True


def exit_status(entry: Entry) -> int:
    """Run `entry` and map how it ends to the exit status: a user error is one line and USER_ERROR_EXIT (in a
    torchrun worker handed to its launcher, which prints it once); a lost peer is one line and 1 (a restart
    helps); a bug keeps its traceback (with credentials redacted) and is 1. Ctrl-C that stopped the run at once
    is one line and INTERRUPTED_EXIT, and so is whatever failed once the user had pressed it (a peer's exit
    breaks a collective)."""
    from xla_shard.errors import one_line, redact

    preemption.record_interrupts()
    try:
        return entry() or 0
    except KeyboardInterrupt:
        return _stopped_at_once()
    except Problems as exc:  # each on a line of its own
        for line in exc.lines():
            print(f"xla-shard: error: {redact(line)}", file=sys.stderr)
        return USER_ERROR_EXIT
    except UserError as exc:
        line = redact(one_line(exc))
        if not report_worker_error(line):
            print(f"xla-shard: error: {line}", file=sys.stderr)
        return USER_ERROR_EXIT
    except PeerLost as exc:
        if preemption.interrupted():
            return _stopped_at_once()
        line = redact(one_line(exc))
        if not report_worker_error(line, kind="lost"):
            print(f"xla-shard: error: {line}", file=sys.stderr)
        return 1
    except Exception:
        if preemption.interrupted():
            return _stopped_at_once()
        import traceback

        print(redact(traceback.format_exc()), end="", file=sys.stderr)
        return 1


def _stopped_at_once() -> int:
    if not report_worker_error(preemption.STOPPED_AT_ONCE, kind="interrupted"):
        print(f"xla-shard: {preemption.STOPPED_AT_ONCE}", file=sys.stderr)
    return INTERRUPTED_EXIT


def several_nodes() -> bool:
    """True in a worker of a multi-node torchrun run."""
    return int(os.environ.get("GROUP_WORLD_SIZE", "1")) > 1


def torchrun_worker() -> bool:
    """True in a process torchrun started: it trains; its launcher is torchrun."""
    return "LOCAL_RANK" in os.environ


def as_torchrun_worker() -> None:
    parent = os.environ.get(LAUNCHER_PID)
    die_with_parent(int(parent) if parent else None)


def _spawned(index: int, entry: Entry, parent_pid: int) -> None:
    """The function `xmp.spawn` runs in each of its processes."""
    die_with_parent(parent_pid)
    _leave_stop_signals_to_parent()
    status = entry()
    if status:
        sys.exit(status)
