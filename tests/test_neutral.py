"""Installing xla_shard changes nothing for other libraries: a plain transformers.Trainer run in a process that
imported and used xla_shard does what it does alone."""

import json
import os
import re
import subprocess
import sys

import pytest

from tests.conftest import HAS_XLA, REPO, WORKERS, _env

pytestmark = pytest.mark.torch_version  # its subject depends on torch's version

# With torch_xla importable, transformers itself moves a Trainer onto the XLA device (and its fused AdamW
# refuses XLA tensors); USE_TORCH_XLA=0 is the opt-out the README gives. xla_shard's own part then is to tell
# torch_xla which PJRT device it is on, before transformers imports it: those two variables, nothing else.
XLA_VARIABLES = {"PJRT_DEVICE", "TF_CPP_MIN_LOG_LEVEL"}


def _plain_trainer(model_dir, mode: str) -> dict:
    env = _env()
    if HAS_XLA:
        env["USE_TORCH_XLA"] = "0"
    done = subprocess.run([sys.executable, str(WORKERS / "plain_trainer.py"), str(model_dir), mode], env=env,
                          capture_output=True, text=True, timeout=600, cwd=os.path.dirname(model_dir))
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.e2e
def test_a_plain_transformers_trainer_runs_as_without_xla_shard(model_dirs):
    alone = _plain_trainer(model_dirs.llama, "without")
    beside = _plain_trainer(model_dirs.llama, "with")
    assert alone["device"] == beside["device"] == "cpu"
    assert len(alone["losses"]) == 3 and beside["losses"] == alone["losses"]
    changed = beside["changed"]
    if HAS_XLA:
        assert set(changed) <= {"environ"}
        before, after = changed.get("environ", [{}, {}])
        assert {key for key in set(before) | set(after) if before.get(key) != after.get(key)} <= XLA_VARIABLES
    else:
        assert changed == {}, "the base install changed the process for other libraries"


def _imports_torch_xla(*args: str) -> bool:
    """Whether `xla-shard ARGS` imported torch_xla (Python's own import log), after it succeeded."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "xla_shard.cli", *args], env=_env(),
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    return any(line.rsplit("|", 1)[-1].strip() == "torch_xla" for line in done.stderr.splitlines())


@pytest.mark.xla
@pytest.mark.e2e
def test_commands_that_do_not_run_on_xla_leave_torch_xla_unloaded(tmp_path):
    """transformers (through accelerate) imports torch_xla wherever it is installed, ~3 s a process; the plan,
    the renderings, checkpoint commands and a torch_fsdp config check never run on it, and keep it out."""
    tiny = ["--set", "model=tiny-llama"]
    assert not _imports_torch_xla("plan", *tiny, "--devices", "8", "--accelerator", "h100")
    assert not _imports_torch_xla("ckpt", "list", str(tmp_path))
    assert not _imports_torch_xla("gcp", "render", str(REPO / "scripts/configs/tpu_v4_spmd.yaml"), "--target",
                                  "tpu-vm")
    assert not _imports_torch_xla("config", "check", *tiny, "--set", "backend=torch_fsdp")
    assert _imports_torch_xla("config", "check", *tiny, "--set", "backend=xla_spmd")  # the log would show it


@pytest.mark.xla
@pytest.mark.e2e
def test_the_readme_names_what_trl_does_beside_torch_xla_and_its_opt_out(model_dirs, tmp_path):
    """What the README's "Which install" says of TRL where torch_xla is importable (true of transformers, not
    of xla_shard, which this process never imports): the run fails on the XLA device transformers picked, with
    the error the README quotes (its first sentence: the rest lists what the failing library supports, which
    changes by release); USE_TORCH_XLA=0 trains."""
    program = (
        "from datasets import Dataset\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n"
        "from trl import SFTConfig, SFTTrainer\nimport sys\n"
        "model = AutoModelForCausalLM.from_pretrained(sys.argv[1])\n"
        "rows = Dataset.from_list([{'text': 'a b c d e f g h'}] * 4)\n"
        "args = SFTConfig(output_dir=sys.argv[2], max_steps=1, per_device_train_batch_size=2, report_to=[], "
        "use_cpu=True, bf16=False)\n"
        "SFTTrainer(model=model, args=args, train_dataset=rows, "
        "processing_class=AutoTokenizer.from_pretrained(sys.argv[1])).train()\n")

    def trl(**env: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", program, str(model_dirs.llama), str(tmp_path)],
                              env={**_env(), **env}, capture_output=True, text=True, timeout=600)

    readme = (REPO / "README.md").read_text()
    beside = trl()
    raised = [line for line in beside.stderr.splitlines() if re.match(r"\w+(Error|Exception): ", line)]
    assert beside.returncode != 0 and raised, beside.stderr[-3000:]
    said = raised[-1].split(": ", 1)[1].split(". ")[0]
    assert f"`{said}" in readme and "USE_TORCH_XLA=0" in readme, raised[-1]
    opted_out = trl(USE_TORCH_XLA="0")
    assert opted_out.returncode == 0, opted_out.stderr[-3000:]
