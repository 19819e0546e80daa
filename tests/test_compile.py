"""train.compile: torch.compile of each wrapped block on the FSDP2 path (here FSDP2 over gloo, 2 processes),
against the same run in eager mode, with clipping and gradient accumulation; and refused where it cannot run."""

import json

import pytest

from xla_shard import backends, config
from xla_shard.errors import ConfigError

pytestmark = [pytest.mark.torch_version, pytest.mark.fsdp2]  # torch.compile of FSDP2's blocks

COMMON = ["backend=torch_fsdp", "cpu_devices=2", "train.steps=4", "train.max_grad_norm=0.5",
          "train.grad_accum_steps=2", "checkpoint.every_steps=2", "checkpoint.keep_last=2"]


def _train(cli, root, *sets):
    done = cli("train", "scripts/configs/tiny_llama_cpu.yaml",
               *[arg for s in [*COMMON, f"output_dir={root}", f"checkpoint.dir={root / 'ckpt'}", *sets]
                 for arg in ("--set", s)])
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from tests.conftest import run_cli

    root = tmp_path_factory.mktemp("compile")
    return root, {mode: _train(run_cli, root / mode, f"train.compile={mode == 'compiled'}")
                  for mode in ("eager", "compiled")}


@pytest.mark.slow
def test_compiled_blocks_train_as_eager_with_clipping_and_accumulation(runs):
    _, records = runs
    eager, compiled = records["eager"], records["compiled"]
    assert "compilations" not in eager[0]
    assert compiled[0]["compilations"] > 0, "train.compile compiled nothing"
    assert not any("recompiles" in r for r in compiled), "the compiled step is not static"
    assert [r["step"] for r in compiled] == [1, 2, 3, 4]
    for want, got in zip(eager, compiled):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-4, abs=1e-4), got["step"]
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4, abs=1e-4), got["step"]
    assert eager[0]["grad_norm"] > 0.5, "clipping must clip for the comparison to cover it"


@pytest.mark.slow
def test_a_compiled_run_resumes_exactly(runs, cli):
    root, records = runs
    resumed = _train(cli, root / "resumed", "train.compile=true",
                     f"checkpoint.resume={root / 'compiled' / 'ckpt' / 'step-00000002'}")
    assert [r["step"] for r in resumed] == [3, 4]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in records["compiled"][2:]]


@pytest.mark.parametrize("name", ["xla_spmd", "xla_fsdp"])
def test_torch_xla_backends_refuse_compile_naming_key_and_backend(name):
    cfg = config.load(None, [f"backend={name}", "cpu_devices=1", "train.compile=true"])
    with pytest.raises(ConfigError) as raised:
        backends.create(cfg)
    assert (raised.value.key, raised.value.backend) == ("train.compile", name)
    assert "XLA graph" in str(raised.value)
