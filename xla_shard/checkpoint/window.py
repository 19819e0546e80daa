"""Whether an emergency save fits in the time a preempted machine is given.

A spot or preemptible Compute Engine VM (a TPU VM, a GPU VM) gets 30 seconds between its ACPI soft-off (the
SIGTERM the trainer sees) and its end; on GKE the kubelet's graceful node shutdown splits those 30 seconds, 15 for
the workload's pods and 15 for system pods, whatever the pod's terminationGracePeriodSeconds (GKE 1.35 lets a node
pool's system config raise the window to 120 seconds). On demand or reserved capacity is not preempted: the pod's
or the trainer's own grace (`checkpoint.preemption_grace_s`) is the window.

What a stop takes: the step in flight, then each writer's share of the checkpoint written at the rate a save of
this run measured (every manifest records its slowest writer: `write_record`), or one the user gives.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from xla_shard.checkpoint import layout
from xla_shard.checkpoint.manifest import CheckpointError, committed_steps, read_manifest
from xla_shard.io.storage import Storage, StorageError

SPOT_WINDOW_S = 30.0  # Compute Engine's preemption notice
GKE_SPOT_POD_WINDOW_S = 15.0  # the pods' half of it under GKE's graceful node shutdown
# A writer's rate where no save of the run has been measured: gcsfs's one stream from one host, as this project's
# benchmark measured a save against a GCS emulator over loopback (43-46 MiB/s, bench/checkpoint_io.py): low, so
# that an estimate errs towards "does not fit". `--write-mib-s` gives yours.
ASSUMED_WRITE_MIB_S = 45.0
READ_WITHIN_S = 3.0  # how long `plan` and `gcp render` wait for a checkpoint's record of its rate
# Bytes a trained parameter's checkpoint holds beside its fp32 value: AdamW's two moments; SGD (no momentum) none.
_OPTIMIZER_BYTES = {"adamw": 8, "sgd": 0}


def state_bytes(params: int, trained: int | None, optimizer: str, frozen_saved: bool = False,
                frozen_bytes: int = 4) -> int:
    """A checkpoint's bytes: each trained parameter in fp32 with its optimizer state; the frozen base (LoRA) only
    where the checkpoint holds it."""
    trained = params if trained is None else trained
    frozen = (params - trained) * frozen_bytes if frozen_saved else 0
    return trained * (4 + _OPTIMIZER_BYTES.get(optimizer, 8)) + frozen


def write_record(indexes: list[dict]) -> dict[str, Any] | None:
    """What a manifest records of its save: the slowest writer's seconds and the largest writer's bytes."""
    timed = [index for index in indexes if isinstance(index.get("write_s"), (int, float))]
    if not timed:
        return None
    return {"seconds": max(index["write_s"] for index in timed), "bytes": max(index["bytes"] for index in timed),
            "writers": len(indexes)}


@dataclass(frozen=True)
class Rate:
    mib_s: float
    source: str  # where it comes from, for the sentence that uses it


def measured_rate(checkpoint_dir: str | None, retry_deadline_s: float = 10.0) -> Rate | None:
    """A writer's rate in the newest committed checkpoint under `checkpoint_dir` that recorded its save; None
    where there is none (or it cannot be read: an estimate is not worth a failure)."""
    if not checkpoint_dir:
        return None
    try:
        storage = Storage(checkpoint_dir, retry_deadline_s)
        for step in reversed(committed_steps(storage)):
            manifest = read_manifest(storage, layout.step_dir(step))
            record = manifest.data.get("write")
            if record and record["seconds"] > 0:
                return Rate(record["bytes"] / record["seconds"] / 2**20, f"measured by the save of {manifest.url}")
    except (CheckpointError, StorageError, OSError):  # nothing readable measured: an estimate is not worth a failure
        return None
    return None


def window_s(target: str, provisioning: str, grace_s: float) -> tuple[float, str]:
    """(seconds between SIGTERM and the kill, why) for a deployment target and its capacity."""
    if provisioning in ("spot", "preemptible"):
        if target == "gke":
            return GKE_SPOT_POD_WINDOW_S, (f"GKE's graceful node shutdown gives a {provisioning} node's pods "
                                           f"{GKE_SPOT_POD_WINDOW_S:g} s")
        return SPOT_WINDOW_S, f"a {provisioning} VM gets {SPOT_WINDOW_S:g} s of notice"
    return grace_s, f"{provisioning} capacity is not preempted; checkpoint.preemption_grace_s is {grace_s:g} s"


@dataclass(frozen=True)
class Estimate:
    writer_bytes: float
    writers: int
    rate: Rate
    step_s: float = 0.0  # the step in flight when the signal comes

    @property
    def seconds(self) -> float:
        return self.step_s + self.writer_bytes / (self.rate.mib_s * 2**20)

    def against(self, window: float, why: str, grace_s: float, every_steps: int) -> tuple[bool, str]:
        """(fits, one sentence): the stop's time against the platform's window and the trainer's own grace."""
        limit = min(window, grace_s)
        fits = self.seconds <= limit
        said = (f"an emergency save writes {self.writer_bytes / 2**30:.2f} GiB per writer ({self.writers} writer(s)) "
                f"at {self.rate.mib_s:.0f} MiB/s ({self.rate.source})"
                + (f" after a {self.step_s:.1f} s step" if self.step_s else "")
                + f": about {self.seconds:.0f} s, against {limit:g} s ({why}"
                + (f"; checkpoint.preemption_grace_s {grace_s:g} s" if grace_s < window else "") + ")")
        if fits:
            return True, said + ": it fits"
        return False, (said + f": it does not fit, so a preemption loses the steps since the last checkpoint "
                              f"(checkpoint.every_steps {every_steps})")


def say(cfg, target: str, params: int, trained: int | None, frozen_bytes: int, writers: int, step_s: float,
        rate: Rate) -> tuple[bool, str]:
    """(fits, the sentence `plan` and `gcp render` print) for `cfg` deployed to `target` ("tpu-vm", "gke", ...):
    the checkpoint's bytes from the model's parameters (`trained`: LoRA's, whose checkpoints hold them alone)."""
    frozen_saved = trained is None
    total = state_bytes(params, trained, cfg.train.optimizer, frozen_saved, frozen_bytes)
    estimate = Estimate(total / writers, writers, rate, step_s)
    window, why = window_s(target, cfg.deploy.provisioning, cfg.checkpoint.preemption_grace_s)
    return estimate.against(window, why, cfg.checkpoint.preemption_grace_s, cfg.checkpoint.every_steps)


def rate_for(cfg, given_mib_s: float | None, within_s: float = READ_WITHIN_S) -> Rate:
    """The rate an estimate uses: the one given; else the one this run's checkpoints measured, if their storage
    answers within `within_s` (a bucket this machine has no credentials for may not answer soon); else assumed."""
    if given_mib_s:
        return Rate(given_mib_s, "--write-mib-s")
    found: list[Rate | None] = []
    reader = threading.Thread(target=lambda: found.append(measured_rate(cfg.checkpoint.dir)), daemon=True)
    reader.start()
    reader.join(within_s)
    if found and found[0] is not None:
        return found[0]
    why = "no save of this run measured yet" if found else f"{cfg.checkpoint.dir} did not answer within {within_s:g} s"
    return Rate(ASSUMED_WRITE_MIB_S, f"assumed: {why}; --write-mib-s gives yours")
