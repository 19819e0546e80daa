"""Who this process is among a run's processes, and how they agree. The backend's runtime decides which kind a
run has: one process on one host needs no agreement (the base class); processes joined by a torch.distributed
group (torchrun's, or the hosts of a multi-host SPMD run) agree through it (`GroupProcesses`); `xmp.spawn`'s
override the collective parts in their backend's module."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from xla_shard import launch
from xla_shard.errors import ConfigError, one_line


@contextlib.contextmanager
def forming_a_group():
    """Wraps the forming of a torch.distributed group: torch 2.9's gloo prints every rank's connection count to
    standard output as a group forms (`printConnectivityInfo`, a line per process per group). Newer gloo logs
    that at INFO under GLOO_LOG_LEVEL (default WARN), so the same variable decides here: unless it is INFO or
    DEBUG, this process's standard output goes nowhere while the group forms (the file descriptor itself:
    gloo writes from C++)."""
    if os.environ.get("GLOO_LOG_LEVEL", "").upper() in ("INFO", "DEBUG"):
        yield
        return
    sys.stdout.flush()
    kept = os.dup(1)
    try:
        with open(os.devnull, "w") as nowhere:
            os.dup2(nowhere.fileno(), 1)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(kept, 1)
        os.close(kept)


class Processes:
    """`count` processes that write checkpoint shards, this one being `index`; one process per host, so the
    host's processes never wait for each other."""

    def __init__(self, index: int = 0, count: int = 1):
        self.index, self.count = index, count
        self.sequence_shards = 1  # consecutive processes that split each of the same rows' sequences (torch_fsdp)

    @property
    def is_main(self) -> bool:
        """The one process that commits manifests, applies retention and logs."""
        return self.index == 0

    @property
    def writer(self) -> tuple[int, int]:
        """(index, count) of the processes that write checkpoint shards."""
        return self.index, self.count

    @property
    def batch_part(self) -> tuple[int, int]:
        """(index, count): this process reads part `index` of `count` equal parts of every micro-batch's rows,
        as it writes its own checkpoint shards: a process per device its device's rows, an SPMD host its
        devices' (the backend's `place` makes them its devices' rows of the global batch). Processes that split
        each sequence between them read the same rows."""
        return self.index // self.sequence_shards, self.count // self.sequence_shards

    @property
    def local_leader(self) -> bool:
        """The first process on this host."""
        return True

    def barrier(self) -> None:
        """Wait for every process."""

    def any_rank(self, flag: bool) -> bool:
        """True on every process if `flag` is set on any, so that all take the same branch (a failed read)."""
        return flag

    def lost_peer(self, error: BaseException) -> str | None:
        """If `error` says another node's processes went away mid-collective, why (one line); else None."""
        return None

    def total(self, counts: list[int]) -> list[int]:
        """`counts` summed element by element over every process (labelled tokens of each micro-batch of a
        step, to weight the loss by)."""
        return list(counts)

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


class GroupProcesses(Processes):
    """Processes joined by the default torch.distributed process group: torchrun's (one per device) or, in a
    multi-host SPMD run, one per host over gloo. A collective on the group is how they agree."""

    def __init__(self, index: int, count: int, device: torch.device):
        super().__init__(index, count)
        self.device = device  # NCCL reduces on the GPU

    @property
    def local_leader(self) -> bool:
        return int(os.environ.get("LOCAL_RANK", "0")) == 0

    def barrier(self) -> None:
        dist.barrier()

    def any_rank(self, flag: bool) -> bool:
        value = torch.tensor([int(flag)], device=self.device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item())

    def lost_peer(self, error: BaseException) -> str | None:
        """A collective that failed because a peer closed its connection or stopped answering (gloo says so in
        a RuntimeError, NCCL in a DistBackendError): another node's processes, or on one node a worker that
        already stopped (one that met a user error, whose one line the launcher prints)."""
        if self.count < 2 or not isinstance(error, RuntimeError):
            return None
        text = str(error)
        if not isinstance(error, dist.DistBackendError) and not any(
                sign in text for sign in ("closed by peer", "reset by peer", "Timed out", "timed out", "Broken pipe")):
            return None
        return one_line(text.splitlines()[-1] if text.strip() else type(error).__name__)[:300]

    def total(self, counts: list[int]) -> list[int]:
        value = torch.tensor(counts, device=self.device)
        dist.all_reduce(value)
        return value.tolist()


def meet_as_one_run(settings: dict[str, Any], timeout_s: float) -> None:
    """Before a multi-node torchrun run's processes form their group, refuse what the group would not notice:
    two nodes started with the same launch.node_rank (the group would pair either), and nodes whose settings
    differ (a node told launch.nnodes=3 joins node 0's world of 2 and trains). Each worker counts itself in at
    its rank on torchrun's store, and checks its `settings` ({dotted key: value}) against rank 0's."""
    if not launch.several_nodes():  # one node: nothing to disagree with
        return
    rank, group_rank = int(os.environ["RANK"]), int(os.environ.get("GROUP_RANK", "0"))
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(seconds=timeout_s))
    if store.add(f"xla_shard/rank/{rank}", 1) > 1:
        raise ConfigError("launch.node_rank", f"{group_rank} is taken: another node started with the same "
                                              "launch.node_rank; give each node its own (0..launch.nnodes-1)")
    mine = json.dumps(settings, sort_keys=True)
    if rank == 0:
        store.set("xla_shard/settings", mine)
        return
    store.wait(["xla_shard/settings"])
    theirs = json.loads(store.get("xla_shard/settings"))
    for key in sorted(settings.keys() | theirs.keys()):
        if settings.get(key) != theirs.get(key):
            raise ConfigError(key, f"is {settings.get(key)!r} on node {group_rank} but {theirs.get(key)!r} on node 0: "
                                   "every node runs the same config")
