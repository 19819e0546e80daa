"""How fast the CLI answers what needs no training: `--help`, a config with a mistake, a missing file.

    python bench/cli_answers.py [--repeat 5]

Each command runs in a fresh process, as a user types it, `--repeat` times; printed are the medians beside a bare
interpreter start and `import torch` (what any command that trains pays first), with the ratios. The target is
under 2 s for each: the CLI reads the config before it imports torch or transformers.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGET_S = 2.0


def _median_s(command: list[str], repeat: int, expect_rc: int) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True)
        times.append(time.perf_counter() - started)
        if done.returncode != expect_rc:
            raise SystemExit(f"{' '.join(command)}: exit {done.returncode}, expected {expect_rc}\n{done.stderr}")
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    cli = [sys.executable, "-m", "xla_shard.cli"]
    with tempfile.TemporaryDirectory() as tmp:
        mistake = Path(tmp, "mistake.yaml")
        mistake.write_text("backend: xla_spmd\ntrain: {stepz: 3}\n")
        references = {"python -c pass": ([sys.executable, "-c", "pass"], 0),
                      "python -c 'import torch'": ([sys.executable, "-c", "import torch"], 0)}
        commands = {"xla-shard --help": (cli + ["--help"], 0),
                    "xla-shard config check (a wrong key)": (cli + ["config", "check", str(mistake)], 2),
                    "xla-shard train (a missing file)": (cli + ["train", str(Path(tmp, "missing.yaml"))], 2)}
        measured = {name: _median_s(command, args.repeat, rc) for name, (command, rc) in {**references,
                                                                                          **commands}.items()}
    bare, torch_import = measured["python -c pass"], measured["python -c 'import torch'"]
    print(f"median of {args.repeat} fresh processes each")
    print("| command | s | / bare python | / import torch | under 2 s |")
    print("|---|---|---|---|---|")
    for name, seconds in measured.items():
        verdict = "" if name in references else ("yes" if seconds < TARGET_S else "NO")
        print(f"| {name} | {seconds:.2f} | {seconds / bare:.1f} | {seconds / torch_import:.2f} | {verdict} |")


if __name__ == "__main__":
    main()
