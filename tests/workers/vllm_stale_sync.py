"""A GRPO run on the vLLM engine whose weight pushes after the first are skipped (`VllmEngine.push` made a no-op
from the second call on): the engine keeps sampling from the starting weights while the policy trains. Prints
the step the run stopped at and the error it stopped with, or that it trained to its end.

Usage: vllm_stale_sync.py KEY=VALUE ...   (config overrides)
"""

import sys

from xla_shard import config
from xla_shard.errors import UserError
from xla_shard.launch import exit_without_finalizing
from xla_shard.methods.vllm_engine import VllmEngine
from xla_shard.train import Trainer


def main(*overrides: str) -> None:
    pushed = []
    push = VllmEngine.push

    def first_push_only(self, model):
        if not pushed:
            push(self, model)
        pushed.append(True)

    VllmEngine.push = first_push_only
    trainer = Trainer(config.load(None, list(overrides))).setup()
    try:
        trainer.run()
    except UserError as stopped:
        print(f"STOPPED at push {len(pushed)}: {stopped}", flush=True)
        return
    print(f"TRAINED to the end with {len(pushed)} pushes", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
    exit_without_finalizing(0)
