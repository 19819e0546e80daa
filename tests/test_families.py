"""Every architecture family the README lists, as a small model written by `save_pretrained`: loaded shard by
shard, its first loss equals plain transformers' on the same rows, so coverage cannot regress silently."""

import json
import math
import subprocess
import sys

import pytest
from conftest import FIXTURES, HAS_XLA, WORKERS, _env
from model_dirs import FAMILIES, MOE_FAMILIES, family_dir, moe_dir
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from xla_shard import config
from xla_shard.data import build

pytestmark = pytest.mark.torch_version  # its subject depends on torch's version

TEXT = [f"data.path={FIXTURES / 'corpus.jsonl'}", "train.seq_len=32"]
PAIRS = [f"data.path={FIXTURES / 'nli.csv'}", "data.text_fields=[premise, hypothesis]", "train.seq_len=32",
         "model.task=sequence_classification"]
ALL = [*FAMILIES, *MOE_FAMILIES]


def _sets(family: str, directory) -> list[str]:
    task = FAMILIES[family][1] if family in FAMILIES else "causal_lm"
    return [f"model.name={directory}", *(PAIRS if task == "sequence_classification" else TEXT)]


@pytest.fixture(scope="module")
def first_losses(tmp_path_factory):
    """Each family's directory, and the first loss a backend gave for it: xla_spmd with torch_xla (one process,
    2 devices), else torch_fsdp (2 processes over gloo)."""
    root = tmp_path_factory.mktemp("families")
    dirs = {f: family_dir(root / f, f) for f in FAMILIES} | {f: moe_dir(root / f, f) for f in MOE_FAMILIES}
    backend = ["backend=xla_spmd", "cpu_devices=2"] if HAS_XLA else ["backend=torch_fsdp"]
    specs = root / "specs.json"
    specs.write_text(json.dumps([{"name": f, "sets": [*_sets(f, d), *backend]} for f, d in dirs.items()]))
    launcher = [sys.executable] if HAS_XLA else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                 "--nproc-per-node=2"]
    done = subprocess.run([*launcher, str(WORKERS / "families.py"), str(root / "losses.json"), str(specs)],
                          env=_env(), capture_output=True, text=True, timeout=1200, cwd=root)
    assert done.returncode == 0, done.stderr[-4000:]
    return dirs, json.loads((root / "losses.json").read_text())


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("family", ALL)
def test_the_first_loss_equals_plain_transformers(first_losses, family):
    dirs, losses = first_losses
    assert not isinstance(losses[family], str), losses[family]
    cfg = config.load(None, _sets(family, dirs[family]))
    auto = AutoModelForSequenceClassification if cfg.model.task == "sequence_classification" else AutoModelForCausalLM
    no_cache = {"use_cache": False} if auto is AutoModelForCausalLM else {}
    model = auto.from_pretrained(dirs[family], attn_implementation="eager", **no_cache).eval()
    import torch

    with torch.no_grad():
        want = model(**build(cfg, model.config, str(dirs[family])).train.global_batch(0)).loss.item()
    assert math.isclose(losses[family], want, rel_tol=1e-5), (family, losses[family], want)
