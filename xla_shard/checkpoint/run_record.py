"""What every manifest records of the run beside its tensors, and the checks a resume makes against it: that it
goes on with the same run (its identity keys), the same frozen base, the same reference and the same
learning-rate warm-up rule; and what a rerun of a finished run says."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

from xla_shard.checkpoint import hf_dir, layout
from xla_shard.checkpoint.manifest import CheckpointError, Manifest, committed_steps, read_manifest
from xla_shard.config.schema import ShardConfig
from xla_shard.errors import ConfigError
from xla_shard.io.storage import Storage, StorageError
from xla_shard.schedule import EARLIER_WARMUP_RULE, WARMUP_RULE


@dataclasses.dataclass
class RunRecord:
    """The frozen base a LoRA run adapts and the frozen reference an objective compares against (DPO's, GRPO's),
    each {"directory", "files": hf_dir.identity}; and the learning-rate warm-up rule (`schedule.WARMUP_RULE`) the
    run started with. None: not recorded (nothing of the kind, or a checkpoint from before the key).

    A resumed run's record is filled from the checkpoint's (`restored`) by `go_on_with_*`, each refusing, naming
    the key, what would change the run under it. `weights`: the `pretrained.PretrainedWeights` the run reads the
    base or reference from; `writes`: whether this process writes manifests (only it records an identity)."""

    base: dict[str, Any] | None = None
    reference: dict[str, Any] | None = None
    lr_warmup_rule: str | None = None

    def to_manifest(self) -> dict[str, Any]:
        return {key: value for key, value in dataclasses.asdict(self).items() if value is not None}

    @classmethod
    def from_manifest(cls, data: dict[str, Any]) -> RunRecord:
        return cls(**{field.name: data.get(field.name) for field in dataclasses.fields(cls)})

    def go_on_with_base(self, restored: RunRecord, step: int, weights, writes: bool, log: Callable[[str], None]
                        ) -> None:
        """A resume over a frozen base (LoRA) reads that base from model.name again: it must be the base the
        checkpoint's adapters were trained on (the same bytes, as far as `hf_dir.identity` tells), not merely
        its shapes."""
        differs = _differs(restored.base, weights, "base", step, log)
        if differs:
            raise ConfigError("model.name", f"{differs}: the adapters of the step-{step} checkpoint were trained on "
                                            f"another base ({restored.base.get('directory')}); point model.name at "
                                            "that base, or start a new run in another checkpoint.dir")
        if restored.base is not None:
            self.base = restored.base
        elif writes:
            self.base = weights.identity()

    def go_on_with_reference(self, restored: RunRecord | None, step: int, key: str, weights, writes: bool,
                             log: Callable[[str], None]) -> None:
        """A resume reads the reference again: it must be the one the run started with, or the objective changes
        under the run without a word (`restored` None: a fresh run, whose reference is recorded). `key`: the
        config key that names the reference."""
        recorded = restored.reference if restored is not None else None
        differs = _differs(recorded, weights, "reference", step, log) if restored is not None else None
        if differs:
            raise ConfigError(key, f"{differs}: the step-{step} checkpoint was trained against another reference "
                                   f"({recorded.get('directory')}); restore those weights, or start a new run in "
                                   "another checkpoint.dir")
        if writes:
            self.reference = recorded if recorded is not None else weights.identity()

    def go_on_with_warmup_rule(self, restored: RunRecord | None, step: int, warmup_steps: int,
                               log: Callable[[str], None]) -> str:
        """The warm-up rule the run goes on with, recorded: a fresh run's (`restored` None) is transformers'; a
        resumed one keeps its checkpoint's, and one written before the rule was recorded went a step ahead
        (said, where it matters)."""
        rule = WARMUP_RULE if restored is None else restored.lr_warmup_rule
        if rule is None:
            if step < warmup_steps:
                log(f"the step-{step} checkpoint was written under the earlier learning-rate warm-up rule, lr x "
                    f"{EARLIER_WARMUP_RULE}; the rest of this run's warm-up keeps to it")
            rule = EARLIER_WARMUP_RULE
        if rule not in (WARMUP_RULE, EARLIER_WARMUP_RULE):
            raise ConfigError("checkpoint.resume", f"the step-{step} checkpoint's learning-rate warm-up rule {rule!r} "
                                                   "is not one this xla_shard knows")
        self.lr_warmup_rule = rule
        return rule


def _differs(recorded: dict | None, weights, what: str, step: int, log: Callable[[str], None]) -> str | None:
    """What differs between the directory `weights` reads and a checkpoint's record of its `what` (None: nothing;
    or no record, from an older xla_shard: said, the directory taken unchecked)."""
    if recorded is None:
        log(f"the step-{step} checkpoint records no identity of its {what} (written by an older xla_shard): "
            f"{weights.source.directory} is taken as that {what} unchecked")
        return None
    return hf_dir.identity_mismatch(recorded["files"], weights.storage, weights.manifest)


def changed_identity(manifest: Manifest, identity: dict[str, Any]) -> tuple[str, str] | None:
    """(key, why) for the first run-identity key whose value differs from the one `manifest`'s run was written
    with; None when resuming it would continue the same run."""
    saved = manifest.data["config"]
    defaults = None
    for key, value in identity.items():
        section, _, field = key.partition(".")
        if isinstance(saved.get(section), dict) and field not in saved[section]:
            # a key added since that checkpoint was written: it was written with the key's default
            defaults = defaults or ShardConfig().run_identity()
            was = defaults[key]
        else:
            was = _dotted(saved, key)
        if key in ShardConfig.PLACE_KEYS:
            was, value = _local_place(was), _local_place(value)
        if was != value:
            return key, (f"is {value!r} but the checkpoint {manifest.url} was written with {was!r}; resuming would "
                         "not continue that run (use another checkpoint.dir to start a new one)")
    return None


def _local_place(value: Any) -> Any:
    """A local path that exists as the real path it names (a relative one from here); anything else as it is."""
    if isinstance(value, str) and "://" not in value and os.path.exists(value):
        return os.path.realpath(value)
    return value


def nothing_to_train(cfg: ShardConfig) -> str | None:
    """What a rerun of a finished run says before anything starts (no process, no model, no device): the newest
    committed checkpoint of this same run already reaches train.steps. None when there may be something to
    train, or only the training can tell: a run counted in epochs (its steps come from the data), another
    run's checkpoint (refused by name when resumed), or one that does not read (resume falls back past it)."""
    section = cfg.checkpoint
    if not section.dir or section.resume != "auto" or cfg.train.epochs:
        return None
    try:
        storage = Storage(section.dir, section.retry_deadline_s)
        steps = committed_steps(storage)
        if not steps or steps[-1] != cfg.train.steps:
            return None
        manifest = read_manifest(storage, layout.step_dir(steps[-1]))
    except (CheckpointError, StorageError):  # said by the run itself, which reads it again
        return None
    if changed_identity(manifest, cfg.run_identity()):
        return None
    return finished_message(steps[-1], "train.steps", cfg.train.steps, cfg.train.steps)


def finished_message(step: int, key: str, value: float, total: int) -> str:
    return (f"the checkpoint at step {step} already reaches {key}={value:g} ({total} steps); nothing to train "
            f"(raise {key} to continue)")


def _dotted(data: dict, key: str) -> Any:
    for part in key.split("."):
        data = data.get(part) if isinstance(data, dict) else None
    return data
