"""Launchers and their workers live and die together: a SIGKILLed `xla-shard train` leaves no process behind
to go on training and committing checkpoints next to the run that replaces it."""

import json
import os
import signal
import time
from pathlib import Path

import pytest

from tests.conftest import start_cli

pytestmark = [pytest.mark.serial, pytest.mark.slow, pytest.mark.torch_version]


def _processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, state) of every process, from /proc."""
    table = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2:].split()
        table[int(stat.parent.name)] = (int(fields[1]), fields[0])
    return table


def _descendants(root: int) -> set[int]:
    table, found, frontier = _processes(), set(), {root}
    while frontier:
        children = {pid for pid, (parent, _) in table.items() if parent in frontier} - found
        found |= children
        frontier = children
    return found


def _alive(pids: set[int]) -> set[int]:
    table = _processes()
    return {pid for pid in pids if pid in table and table[pid][1] != "Z"}


@pytest.mark.e2e
@pytest.mark.parametrize("backend, sets, extra", [
    ("torch_fsdp", ["backend=torch_fsdp"], ["--nproc-per-node", "2"]),  # torchrun and its 2 workers
    pytest.param("xla_fsdp", ["backend=xla_fsdp", "cpu_devices=1"], [], marks=pytest.mark.xla),  # xmp.spawn's
])
def test_sigkill_of_the_launcher_takes_its_workers_with_it(tmp_path, backend, sets, extra):
    run, ckpt = tmp_path / "run", tmp_path / "ckpt"
    args = ["train", "scripts/configs/tiny_llama_cpu.yaml", *extra, "--set", "train.steps=100000",
            "--set", f"output_dir={run}", "--set", f"checkpoint.dir={ckpt}", "--set", "checkpoint.every_steps=1",
            "--set", "fsdp.activation_checkpointing=false", *[a for s in sets for a in ("--set", s)]]
    launcher = start_cli(*args, log=tmp_path / "log")
    workers: set[int] = set()
    try:
        deadline = time.monotonic() + 300
        while not (run / "metrics.jsonl").exists() or not (run / "metrics.jsonl").read_text().strip():
            assert launcher.poll() is None, (tmp_path / "log").read_text()[-3000:]
            assert time.monotonic() < deadline, "training never logged a step"
            time.sleep(0.1)
        workers = _descendants(launcher.pid)
        assert workers, "the launcher has no worker processes"
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + 30
        while _alive(workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(workers), f"{backend}: workers {sorted(_alive(workers))} outlived their launcher"
        steps = sorted(p.name for p in ckpt.glob("step-*"))
        time.sleep(3)
        assert sorted(p.name for p in ckpt.glob("step-*")) == steps  # nobody is writing any more
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert records and records[-1]["backend"] == backend
    finally:
        for pid in _alive(workers | {launcher.pid}):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.e2e
@pytest.mark.parametrize("backend, extra, stop", [
    # torchrun's agent forwards what its launcher gets; torch starts each worker in a session of its own
    pytest.param("torch_fsdp", ["--nproc-per-node", "2"], signal.SIGTERM, marks=pytest.mark.fsdp2),
    pytest.param("torch_fsdp", ["--nproc-per-node", "2"], signal.SIGINT, marks=pytest.mark.fsdp2),
    # xmp.spawn's child trains in threads: its parent takes the signal and passes it on
    pytest.param("xla_fsdp", ["--set", "cpu_devices=1"], signal.SIGINT, marks=pytest.mark.xla),
])
def test_a_stop_signal_saves_and_exits_with_one_line_and_its_status(tmp_path, backend, extra, stop):
    """SIGTERM (sent to the launcher) and Ctrl-C (SIGINT to the whole process group, as a terminal sends it)
    stop every worker after the same step with a committed checkpoint, said in one line, no traceback; the
    launcher exits 128 + the signal: 143 restarts under train_loop.sh, 130 (the user's Ctrl-C) does not."""
    run, ckpt = tmp_path / "run", tmp_path / "ckpt"
    launcher = start_cli("train", "scripts/configs/tiny_llama_cpu.yaml", *extra, "--set", f"backend={backend}",
                         "--set", "train.steps=100000", "--set", f"output_dir={run}", "--set",
                         f"checkpoint.dir={ckpt}", "--set", "checkpoint.every_steps=1000", log=tmp_path / "log",
                         own_group=True)
    try:
        deadline = time.monotonic() + 300
        while not (run / "metrics.jsonl").exists() or len((run / "metrics.jsonl").read_text().splitlines()) < 2:
            assert launcher.poll() is None, (tmp_path / "log").read_text()[-3000:]
            assert time.monotonic() < deadline, "training never logged two steps"
            time.sleep(0.1)
        if stop == signal.SIGINT:
            os.killpg(launcher.pid, stop)
        else:
            launcher.send_signal(stop)
        assert launcher.wait(timeout=120) == 128 + stop, (tmp_path / "log").read_text()[-3000:]
        log = (tmp_path / "log").read_text()
        said = [line for line in log.splitlines() if "stopped" in line]
        step = len((run / "metrics.jsonl").read_text().splitlines())
        assert said == [f"xla-shard: {stop.name}: stopped after step {step}; checkpoint committed, rerun the same "
                        "command to resume"], log[-3000:]
        assert "Traceback" not in log and "KeyboardInterrupt" not in log, log[-3000:]
        assert (ckpt / f"step-{step:08d}" / "manifest.json").exists()
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
