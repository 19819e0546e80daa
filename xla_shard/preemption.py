"""SIGTERM (a spot VM being reclaimed, `kill`, Kubernetes) becomes a request to stop after the current step.

The trainer then finishes or takes a checkpoint within `checkpoint.preemption_grace_s` and exits cleanly, so
the restarted job resumes from it. The handler only sets a flag: Python code must not block in a handler.
"""

from __future__ import annotations

import signal
import threading
import time


class PreemptionGuard:
    def __init__(self, grace_s: float):
        self.grace_s = grace_s
        self.received_at: float | None = None
        self._previous = None

    def __enter__(self) -> PreemptionGuard:
        if threading.current_thread() is threading.main_thread():  # signals reach the main thread only
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def _handle(self, signum, frame) -> None:
        if self.received_at is None:
            self.received_at = time.monotonic()

    @property
    def requested(self) -> bool:
        return self.received_at is not None

    def remaining_s(self) -> float:
        if self.received_at is None:
            return self.grace_s
        return max(0.0, self.grace_s - (time.monotonic() - self.received_at))
