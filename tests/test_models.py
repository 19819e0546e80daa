"""The model a config asks for is the model that trains: the attention kernel is a choice that every backend
honours (never overwritten), and eager and SDPA compute the same thing."""

import json
import math

import pytest
import torch

from tests.conftest import run_cli
from xla_shard import config
from xla_shard.errors import ConfigError
from xla_shard.models import build_model


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-gpt2", "tiny-bert"])
def test_eager_and_sdpa_agree_and_the_choice_is_kept(preset):
    batch = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    losses = {}
    for kernel in ("eager", "sdpa"):
        model = build_model(config.load(None, [f"model={preset}", f"model.attn_implementation={kernel}"]).model, 0)
        assert model.config._attn_implementation == kernel
        losses[kernel] = model.eval()(input_ids=batch, labels=batch).loss.item()
    assert math.isclose(losses["eager"], losses["sdpa"], rel_tol=1e-5), losses


def test_attention_through_overrides_is_refused_naming_the_key():
    with pytest.raises(ConfigError) as raised:
        config.load(None, ["model.overrides={attn_implementation: sdpa}"])
    assert raised.value.key == "model.overrides" and "model.attn_implementation" in str(raised.value)


@pytest.mark.slow
@pytest.mark.parametrize("backend, sets, extra", [
    ("xla_spmd", ["backend=xla_spmd", "cpu_devices=4"], []),
    ("torch_fsdp", ["backend=torch_fsdp"], ["--nproc-per-node", "2"]),
])
def test_sdpa_trains_on_the_backends_like_eager(tmp_path, backend, sets, extra):
    common = ["model=tiny-llama", "train.seq_len=32", "train.steps=2", "train.optimizer=sgd", "train.lr=0.5", *sets]
    losses = {}
    for kernel in ("eager", "sdpa"):
        out = tmp_path / kernel
        done = run_cli("train", *[a for s in common + [f"model.attn_implementation={kernel}", f"output_dir={out}"]
                                  for a in ("--set", s)], *extra)
        assert done.returncode == 0, done.stderr[-3000:]
        losses[kernel] = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    for eager, sdpa in zip(losses["eager"], losses["sdpa"]):
        assert math.isclose(eager, sdpa, rel_tol=1e-4), (backend, losses)
