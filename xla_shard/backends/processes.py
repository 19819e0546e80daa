"""Who this process is among a run's processes, and how they agree. The backend's runtime decides which kind a
run has: one process per host needs no agreement (the base class); torchrun and `xmp.spawn` runs override the
collective parts in their backend's module."""

from __future__ import annotations

import contextlib


class Processes:
    """`count` processes that write checkpoint shards, this one being `index`; one process per host, so the
    host's processes never wait for each other."""

    def __init__(self, index: int = 0, count: int = 1):
        self.index, self.count = index, count

    @property
    def is_main(self) -> bool:
        """The one process that commits manifests, applies retention and logs."""
        return self.index == 0

    @property
    def writer(self) -> tuple[int, int]:
        """(index, count) of the processes that write checkpoint shards."""
        return self.index, self.count

    @property
    def local_leader(self) -> bool:
        """The first process on this host."""
        return True

    def barrier(self) -> None:
        """Wait for every process."""

    def any_rank(self, flag: bool) -> bool:
        """True on every process if `flag` is set on any, so that all stop at the same step (preemption)."""
        return flag

    def lost_peer(self, error: BaseException) -> str | None:
        """If `error` says another node's processes went away mid-collective, why (one line); else None."""
        return None

    def total(self, count: int) -> int:
        """The sum of `count` over every process (labelled tokens of a step, to weight the loss by)."""
        return count

    @contextlib.contextmanager
    def main_first(self):
        """The block runs on this host's first process before the others, which then find what it cached
        (tokenized data) instead of racing it to write the same files."""
        if not self.local_leader:
            self.barrier()
        try:
            yield
        finally:
            if self.local_leader:
                self.barrier()
