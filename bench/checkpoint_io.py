"""Checkpoint throughput against raw fsspec writes/reads of the same bytes, and async vs sync blocking time.

    python bench/checkpoint_io.py [--mib 256] [--tensors 32] [--repeats 3]

For each target (a local directory, and gs:// on a gcp-storage-emulator this script starts on loopback):
  save  xla_shard `Checkpointer.save` (encode, checksum, upload, index, commit)  vs  raw `fs.pipe_file` /
        local write of the same bytes as one object: the same parallelism (one writer, one stream).
  load  xla_shard `ChunkReader` (ranged reads, crc32 per chunk, assembly)  vs  raw `fs.cat_file` of that file.
Ratios are raw time / xla_shard time (throughput ratio; target >= 0.8). Then, on the local target, the time
`save` blocks the training thread with `checkpoint.async` on, against a synchronous save (target <= 0.1),
and the host memory an export needs against the largest tensor. Median of --repeats, interleaved.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from gcs_emulator import GcsEmulator

from xla_shard.checkpoint import Checkpointer, ChunkReader, layout, read_manifest
from xla_shard.checkpoint.contract import StateTensor
from xla_shard.config.schema import CheckpointSection
from xla_shard.io.device import declare_xla_device
from xla_shard.io.storage import Storage


class HostState:
    """The `ShardedState` of plain host tensors: one writer that owns every box (what a backend provides)."""

    writer, is_main = (0, 1), True

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.held = tensors

    def tensors(self, model, optimizer, stored=None):
        return [StateTensor(f"model/{n}", tuple(t.shape), t.dtype, lambda t=t: [((0,) * t.dim(), t.clone())],
                            lambda t=t: [((0,) * t.dim(), tuple(t.shape))], lambda v, t=t: t.copy_(v[0]))
                for n, t in self.held.items()]

    def rng_state(self):
        return {}

    def set_rng_state(self, state):
        pass

    def any_rank(self, flag):
        return flag

    def describe(self):
        return {"backend": "bench", "num_devices": 1, "plan": None, "config": {}}

    def run_identity(self):
        return {}


def _model():
    """A tiny transformers model, so that manifests carry a config.json for `ckpt export` (its own weights are
    not what is saved: HostState hands out the benchmark's tensors)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1))


def _time(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_target(url: str, tensors: dict[str, torch.Tensor], repeats: int) -> dict[str, float]:
    section = CheckpointSection(dir=url, async_save=False, keep_last=repeats)  # no deletes inside the timing
    checkpointer = Checkpointer(section, HostState(tensors), log=lambda _: None)
    model = _model()
    raw = Storage(url + "/raw")
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    blob = b"".join(bytes(layout.tensor_bytes(t)) for t in tensors.values())
    times = {"save": [], "raw_save": [], "load": [], "raw_load": []}
    for step in range(1, repeats + 1):
        times["raw_save"].append(_time(lambda: raw.write(f"blob-{step}", blob)))
        times["save"].append(_time(lambda: checkpointer.save(step, model, None)))
        storage = Storage(f"{url}/{layout.step_dir(step)}")
        manifest = read_manifest(storage)
        reader = ChunkReader(storage, manifest)
        requests = [(n, ((0,) * len(m["shape"]), tuple(m["shape"]))) for n, m in manifest.tensors.items()]
        times["raw_load"].append(_time(lambda: raw.read_bytes(f"blob-{step}")))
        times["load"].append(_time(lambda: reader.read(requests)))
        raw.remove_tree(f"blob-{step}")
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"MiB": nbytes / 2**20, **med,
            "save_MiB_s": nbytes / 2**20 / med["save"], "raw_save_MiB_s": nbytes / 2**20 / med["raw_save"],
            "load_MiB_s": nbytes / 2**20 / med["load"], "raw_load_MiB_s": nbytes / 2**20 / med["raw_load"],
            "save_ratio": med["raw_save"] / med["save"], "load_ratio": med["raw_load"] / med["load"]}


def bench_async(url: str, tensors: dict[str, torch.Tensor], repeats: int) -> dict[str, float]:
    state = HostState(tensors)
    sync = Checkpointer(CheckpointSection(dir=url + "/sync", async_save=False, keep_last=1), state,
                        log=lambda _: None)
    asyn = Checkpointer(CheckpointSection(dir=url + "/async", async_save=True, keep_last=1), state,
                        log=lambda _: None)
    model = _model()
    sync_s, async_s = [], []
    for step in range(1, repeats + 1):
        sync_s.append(_time(lambda: sync.save(step, model, None)))
        async_s.append(_time(lambda: asyn.save(step, model, None)))
        asyn.wait()
    return {"sync_save_s": statistics.median(sync_s), "async_blocking_s": statistics.median(async_s),
            "ratio": statistics.median(async_s) / statistics.median(sync_s)}


def bench_export(url: str) -> str:
    """In a fresh process, so its peak RSS is the export's."""
    with tempfile.TemporaryDirectory() as out:
        done = subprocess.run([sys.executable, "-m", "xla_shard.cli", "ckpt", "export", url, "--to", out],
                              capture_output=True, text=True, check=True)
    return done.stdout.strip()


def main(argv=None) -> None:
    declare_xla_device()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="total state size")
    parser.add_argument("--tensors", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    rows = args.mib * 2**20 // 4 // args.tensors // 1024
    tensors = {f"layer{i}.weight": torch.randn(rows, 1024) for i in range(args.tensors)}
    with tempfile.TemporaryDirectory() as tmp:
        emulator = GcsEmulator(tmp, bucket="bench").start()
        os.environ.update(emulator.env())
        gs_url = emulator.url("ckpt")
        try:
            for label, url in (("local", os.path.join(tmp, "local")), ("gs (emulator)", gs_url)):
                r = bench_target(url, tensors, args.repeats)
                print(f"{label:>14}: {r['MiB']:.0f} MiB  save {r['save_MiB_s']:7.1f} MiB/s vs raw "
                      f"{r['raw_save_MiB_s']:7.1f} (ratio {r['save_ratio']:.2f})  load {r['load_MiB_s']:7.1f} MiB/s "
                      f"vs raw {r['raw_load_MiB_s']:7.1f} (ratio {r['load_ratio']:.2f})")
            a = bench_async(os.path.join(tmp, "async"), tensors, args.repeats)
            print(f"{'async (local)':>14}: save blocks {a['async_blocking_s'] * 1e3:.1f} ms vs synchronous "
                  f"{a['sync_save_s'] * 1e3:.1f} ms (ratio {a['ratio']:.3f})")
            print(f"{'export':>14}: {bench_export(os.path.join(tmp, 'local'))}")
        finally:
            emulator.stop()


if __name__ == "__main__":
    main()
