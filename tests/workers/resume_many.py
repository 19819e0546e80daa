"""Resume the same checkpoint N times in one process, each time into a fresh optimizer (whose state the load
creates, sharded, on the device, the way a resumed run does), and check every load gives back the same state.

Usage: resume_many.py CHECKPOINT_URL N [KEY=VALUE ...]
Prints `loaded N times` when every load succeeded and matched the first.
"""

import sys

import torch

from xla_shard import config
from xla_shard.schedule import make_optimizer
from xla_shard.train import Trainer


def main(url: str, times: str, *overrides: str) -> None:
    cfg = config.load(None, [f"checkpoint.dir={url.rsplit('/', 1)[0]}", f"checkpoint.resume={url}", *overrides])
    trainer = Trainer(cfg).setup()
    backend, ckpt = trainer.backend, trainer.checkpointer
    reference = None
    for attempt in range(int(times)):
        optimizer = backend.prepare_optimizer(make_optimizer(trainer.model.parameters(), cfg.train))
        assert ckpt.restore(trainer.model, optimizer) == trainer.start_step > 0
        state = {t.name: backend.state.full_tensor(v) for t, v in _tensors(backend, trainer.model, optimizer)}
        if reference is None:
            reference = state
        assert all(torch.equal(reference[k], state[k]) for k in reference), f"load {attempt} differs"
    print(f"loaded {times} times", flush=True)


def _tensors(backend, model, optimizer):
    for name, param in backend.state.named_parameters(model):
        yield type("T", (), {"name": f"model/{name}"}), param
        for key, value in optimizer.state[param].items():
            if torch.is_tensor(value) and value.dim():
                yield type("T", (), {"name": f"optim/{name}/{key}"}), value


if __name__ == "__main__":
    main(*sys.argv[1:])
