"""Train a few steps under each of several (P, G, OS) triples in one xla_spmd process and save, per triple,
what the cost model predicts next to what was measured (bench/measure.py: compare).

Usage: triples.py OUT.pt DUMP_DIR P/G/OS [P/G/OS ...] -- KEY=VALUE ...
XLA_FLAGS must point XLA's HLO dump at DUMP_DIR (set by the caller, before XLA starts).
"""

import dataclasses
import sys

import torch

from bench.measure import compare


def main(out: str, dump: str, *args: str) -> None:
    split = args.index("--")
    triples = [tuple(int(d) for d in t.split("/")) for t in args[:split]]
    rows = compare(list(args[split + 1:]), triples, steps=4, hlo_dump=dump)
    torch.save([dataclasses.asdict(row) for row in rows], out)


if __name__ == "__main__":
    main(*sys.argv[1:])
