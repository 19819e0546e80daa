"""What every manifest records of the run beside its tensors, and the checks a resume makes against it: that it
goes on with the same frozen base, the same reference and the same learning-rate warm-up rule."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from xla_shard.checkpoint import hf_dir
from xla_shard.errors import ConfigError
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
