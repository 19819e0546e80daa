"""The public API as the manual shows it: the program of docs/python.md runs as written, and resumes."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, _env

def _manual_program() -> str:
    """The program of docs/python.md (the README links it)."""
    page = (REPO / "docs" / "python.md").read_text()
    return re.search(r"```python\n(.*?)```", page, re.S).group(1)


@pytest.mark.xla
@pytest.mark.e2e
@pytest.mark.slow
def test_the_manual_program_trains_evaluates_and_resumes_exactly(tmp_path: Path, model_dirs):
    """The manual's own loop, with its model directory and data file: run whole in one directory; in another,
    stopped after step 2 and run again. The resumed run continues at step 3 (extra state included) and prints
    the whole run's losses, learning rates, gradient norms and evaluations."""
    import shutil

    program = _manual_program()
    stop_after_two = program.replace("for step in range(start, train.steps):", "for step in range(start, 2):")
    assert stop_after_two != program

    def run(folder: Path, text: str) -> subprocess.CompletedProcess:
        folder.mkdir(exist_ok=True)
        if not (folder / "my-llama").exists():
            shutil.copytree(model_dirs.llama, folder / "my-llama")
            shutil.copy(REPO / "tests/fixtures/corpus.jsonl", folder / "corpus.jsonl")
        (folder / "my_loop.py").write_text(text)
        done = subprocess.run([sys.executable, "my_loop.py"], cwd=folder, env=_env(), capture_output=True,
                              text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        return done

    def lines(out: str) -> list[str]:
        return [line for line in out.splitlines() if line.startswith(("step ", "best "))]

    whole = lines(run(tmp_path / "whole", program).stdout)
    assert [line.split()[1] for line in whole if line.startswith("step")] == ["1", "2", "2", "3", "4", "4"]
    rates = [float(line.split()[5]) for line in whole if " lr " in line]
    # one warm-up step, from 0 as transformers' schedulers start it, then cosine decay from lr
    assert len(rates) == 4 and rates[0] == 0.0 and rates[1] == 1e-3 and rates[1] > rates[2] > rates[3]
    assert "over" in whole[2] and whole[2].endswith(" rows")
    first = run(tmp_path / "resumed", stop_after_two)
    assert lines(first.stdout)[:3] == whole[:3]
    second = run(tmp_path / "resumed", program)
    assert "resumed from runs/my_loop/ckpt/step-00000002 at step 2" in second.stdout + second.stderr
    assert lines(second.stdout) == whole[3:]  # steps 3 and 4, the evaluation and the best over all four steps
    assert (tmp_path / "resumed/runs/my_loop/ckpt/step-00000004/manifest.json").exists()


@pytest.mark.xla
@pytest.mark.e2e
@pytest.mark.slow
def test_restore_refuses_a_checkpoint_without_the_extra_state_it_asks_for(tmp_path: Path, model_dirs):
    program = _manual_program().replace("for step in range(start, train.steps):", "for step in range(start, 1):")
    without = program.replace('extra={"best": best})  # sharded', 'extra=None)  # sharded')
    assert without != program
    import shutil

    shutil.copytree(model_dirs.llama, tmp_path / "my-llama")
    shutil.copy(REPO / "tests/fixtures/corpus.jsonl", tmp_path / "corpus.jsonl")
    for text, code in ((without, 0), (program, 2)):
        (tmp_path / "my_loop.py").write_text(text)
        done = subprocess.run([sys.executable, "my_loop.py"], cwd=tmp_path, env=_env(), capture_output=True,
                              text=True, timeout=600)
        if code == 0:
            assert done.returncode == 0, done.stderr[-3000:]
    assert "holds no extra state 'best' (it has: none)" in done.stderr, done.stderr[-2000:]


@pytest.mark.parametrize("source", ["none", "cfg"])
def test_evaluate_without_an_evaluation_set_is_one_line_naming_the_key(model_dirs, source):
    import xla_shard

    # the config's own data, which holds no evaluation rows (synthetic tokens: nothing tokenized, in the unit budget)
    cfg = xla_shard.load_config(None, [f"model.name={model_dirs.llama}", "data.path=synthetic"])
    eval_source = None if source == "none" else xla_shard.build_data(cfg).eval
    with pytest.raises(xla_shard.ConfigError) as refused:
        xla_shard.evaluate(None, None, eval_source, cfg)
    assert refused.value.key == "data.eval_path" and "\n" not in str(refused.value)


@pytest.mark.e2e
def test_import_xla_shard_is_light_and_lazy():
    done = subprocess.run([sys.executable, "-c", "import sys, xla_shard; xla_shard.load_config; "
                                                 "print(sorted(m for m in ('torch', 'torch_xla') "
                                                 "if m in sys.modules))"],
                          env=_env(), capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "[]", done.stderr
