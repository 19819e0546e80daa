"""Stop signals: SIGTERM (a spot VM being reclaimed, `kill`, Kubernetes) and a first Ctrl-C (SIGINT) become a
request to stop after the current step; a second Ctrl-C stops at once.

On a request the trainer finishes or takes a checkpoint within `checkpoint.preemption_grace_s` and exits
cleanly (128 + the signal's number), so the restarted job resumes from it. The handlers only set a flag (Python
code must not block in a handler), except the second SIGINT's, which raises KeyboardInterrupt as Python's own
does. Outside the training loop a SIGINT is Python's KeyboardInterrupt, recorded so that the process can say
one line for it (and for what its peers' exit did to it) instead of tracebacks.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time

_interrupted = threading.Event()  # this process has had a SIGINT


def interrupted() -> bool:
    """True once this process has had a SIGINT (Ctrl-C)."""
    return _interrupted.is_set()


def record_interrupts() -> None:
    """Record every SIGINT this process gets, and raise KeyboardInterrupt for it as Python does (main thread
    only: signals reach it alone)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _interrupt)


def _interrupt(signum, frame) -> None:
    _interrupted.set()
    raise KeyboardInterrupt


SIGNALS = (signal.SIGTERM, signal.SIGINT)
STOPPED_AT_ONCE = ("interrupted (Ctrl-C): stopped at once, nothing saved since the last committed checkpoint "
                   "(rerun the same command to resume from it)")
# Where a launcher whose workers take no signals asks them to stop: a file holding the signal's name.
STOP_FILE = "XLA_SHARD_STOP_FILE"


def _received(signum: int, guards: list[PreemptionGuard]) -> None:
    """Tell `guards` of a stop signal. After a Ctrl-C, any further stop signal stops at once (KeyboardInterrupt):
    a second Ctrl-C, or the SIGTERM torchrun's agent sends its workers when its launcher had a second one."""
    if _interrupted.is_set() and any(guard.requested for guard in guards):
        raise KeyboardInterrupt
    if signum == signal.SIGINT:
        _interrupted.set()
    for guard in guards:
        guard.request(signal.Signals(signum))


@contextlib.contextmanager
def stops_passed_by_file():
    """While the block runs the workers of a launcher that cannot pass signals on (`xmp.spawn`: its child runs
    one training thread per device, and no code of ours in its main thread, where Python runs handlers), this
    process takes the stop signals and writes the first one's name to a file the workers' guards read
    (STOP_FILE, in their environment). A second Ctrl-C ends this process at once, and the workers with it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    import tempfile

    folder = tempfile.mkdtemp(prefix="xla_shard_stop_")
    path = os.path.join(folder, "signal")
    asked = PreemptionGuard(0.0)

    def handle(signum, frame) -> None:
        try:
            _received(signum, [asked])
        except KeyboardInterrupt:  # not raised: leaving the executor's block would wait for the workers
            print(f"xla-shard: {STOPPED_AT_ONCE}", file=sys.stderr, flush=True)
            os._exit(128 + signal.SIGINT)
        if not os.path.exists(path):
            with open(path + ".tmp", "w") as file:
                file.write(signal.Signals(signum).name)
            os.replace(path + ".tmp", path)

    os.environ[STOP_FILE] = path
    previous = {sig: signal.signal(sig, handle) for sig in SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        os.environ.pop(STOP_FILE, None)
        import shutil

        shutil.rmtree(folder, ignore_errors=True)


class PreemptionGuard:

    def __init__(self, grace_s: float):
        self.grace_s = grace_s
        self.received_at: float | None = None
        self.signal: signal.Signals | None = None  # the first stop signal received
        self._previous: dict[signal.Signals, object] = {}

    def __enter__(self) -> PreemptionGuard:
        if threading.current_thread() is threading.main_thread():  # Python runs handlers there only
            self._previous = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}

    def _handle(self, signum, frame) -> None:
        _received(signum, [self])

    def request(self, sig: signal.Signals) -> None:
        if self.received_at is None:
            self.received_at = time.monotonic()
            self.signal = sig

    @property
    def requested(self) -> bool:
        if self.received_at is None and os.environ.get(STOP_FILE):
            with contextlib.suppress(OSError, ValueError, KeyError):
                with open(os.environ[STOP_FILE]) as file:
                    self.request(signal.Signals[file.read().strip()])
        return self.received_at is not None

    def remaining_s(self) -> float:
        if self.received_at is None:
            return self.grace_s
        return max(0.0, self.grace_s - (time.monotonic() - self.received_at))
