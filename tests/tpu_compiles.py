"""What the tests of `xla-shard compile` share: a compile as users run it, and several configs traced and compiled
in one process (tests/workers/aot_traces.py) beside what the planner predicts."""

import json

from conftest import run_cli, run_worker, runs_args

USERS_XLA = ("XLA_FLAGS",)  # the TPU compiler as users run it, not the test harness's fast CPU compiles


def compile_json(*args):
    done = run_cli("compile", *args, "--json", drop=USERS_XLA)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def traces(*args, runs, cwd) -> list[dict]:
    done = run_worker("aot_traces.py", *args, *runs_args(runs), cwd=cwd, env={"XLA_FLAGS": ""})
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(results) == len(runs)
    return results
