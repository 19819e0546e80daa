"""The torch_fsdp backend on real GPUs: NCCL, bf16 mixed precision, a pretrained model loaded shard by shard
into GPU memory, and a bitwise resume. Skipped where there is no CUDA GPU (CI); run on a GPU machine with
`python -m pytest -m cuda tests/test_cuda.py`."""

import json
import math

import pytest
import torch
from conftest import run_cli, run_load_probe
from model_dirs import assemble, stored_tensors

pytestmark = [pytest.mark.torch_version, pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_a_pretrained_model_loads_into_gpu_memory_bitwise(model_dirs, tmp_path):
    nproc = torch.cuda.device_count()
    saved = run_load_probe(tmp_path / "probe", f"model.name={model_dirs.llama}", "backend=torch_fsdp",
                           "train.seq_len=32", f"train.global_batch_size={8 * nproc}", nproc=nproc)
    stored, held = stored_tensors(model_dirs.llama), assemble(saved)
    assert all(torch.equal(held[name], stored[name]) for name in stored)
    assert sum(p["report"]["bytes_read"] for p in saved) == sum(t.numel() * t.element_size() for t in stored.values())


def test_bf16_training_over_nccl_resumes_bitwise(model_dirs, tmp_path):
    nproc = torch.cuda.device_count()
    common = [f"model.name={model_dirs.llama}", "backend=torch_fsdp", "fsdp.mixed_precision=bf16",
              "train.seq_len=64", f"train.global_batch_size={8 * nproc}", "train.lr=1e-3"]

    def train(out, steps, *more):
        sets = common + [f"output_dir={out}", f"checkpoint.dir={out}/ckpt", "checkpoint.every_steps=2",
                         f"train.steps={steps}", *more]
        done = run_cli("train", *[a for s in sets for a in ("--set", s)], "--nproc-per-node", str(nproc))
        assert done.returncode == 0, done.stderr[-3000:]
        assert "torch_fsdp on" in done.stderr and "cpu device" not in done.stderr
        return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]

    whole = train(tmp_path / "whole", 4)
    assert all(math.isfinite(loss) for loss in whole) and whole[-1] < whole[0]
    train(tmp_path / "split", 2)
    resumed = train(tmp_path / "split", 4)
    assert resumed[-2:] == whole[-2:], (whole, resumed)


def test_packed_rows_run_one_variable_length_flash_call_exact_against_each_example_alone(monkeypatch):
    """`sdpa_packed` on CUDA in bf16: the batch's documents in one `varlen_attn` call (no SDPA call, no mask),
    each example's logits those it has alone (SDPA's flash kernel, bf16)."""
    varlen = pytest.importorskip("torch.nn.attention.varlen")
    from xla_shard import config
    from xla_shard.models import build_model

    calls = []
    real = varlen.varlen_attn
    monkeypatch.setattr(varlen, "varlen_attn", lambda *a, **k: calls.append(a[3].tolist()) or real(*a, **k))
    lengths = [[40, 88], [128], [30, 50, 48]]
    ids = torch.randint(3, 256, (3, 128), generator=torch.Generator().manual_seed(5)).cuda()
    positions = torch.tensor([[p for n in row for p in range(n)] for row in lengths]).cuda()
    model = build_model(config.load(None, ["model=tiny-llama", "model.attn_implementation=sdpa_packed"]).model,
                        0).cuda().to(torch.bfloat16)
    packed = model(input_ids=ids, position_ids=positions).logits
    assert calls and calls[0] == [0, 40, 128, 256, 286, 336, 384]
    model.config._attn_implementation = "sdpa"
    for row, sizes in enumerate(lengths):
        start = 0
        for n in sizes:
            alone = model(input_ids=ids[row:row + 1, start:start + n]).logits[0]
            torch.testing.assert_close(packed[row, start:start + n].float(), alone.float(), rtol=2e-2, atol=2e-2)
            start += n
