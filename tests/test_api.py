"""The public API as the README shows it: its "Use from Python" program runs as written, and resumes."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, _env

pytestmark = pytest.mark.slow


def _readme_program() -> str:
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Use from Python", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_readme_program_trains_checkpoints_and_resumes(tmp_path: Path):
    program = tmp_path / "my_loop.py"
    program.write_text(_readme_program())

    def run() -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(program)], cwd=tmp_path, env=_env(), capture_output=True,
                              text=True, timeout=600)

    first = run()
    assert first.returncode == 0, first.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"^step \d+ loss (\S+)$", first.stdout, re.M)]
    assert re.findall(r"^step (\d+) loss", first.stdout, re.M) == ["1", "2", "3", "4"]
    assert all(loss == loss and 0 < loss < 10 for loss in losses)
    assert (tmp_path / "runs/my_loop/ckpt/step-00000004/manifest.json").exists()
    second = run()
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from runs/my_loop/ckpt/step-00000004 at step 4" in second.stdout
    assert "step 1 loss" not in second.stdout


def test_import_xla_shard_is_light_and_lazy():
    done = subprocess.run([sys.executable, "-c", "import sys, xla_shard; xla_shard.load_config; "
                                                 "print(sorted(m for m in ('torch', 'torch_xla') if m in sys.modules))"],
                          env=_env(), capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "[]", done.stderr
