"""The model a config asks for is the model that trains: the attention kernel is a choice that every backend
honours (never overwritten), and eager and SDPA compute the same thing."""

import json
import math

import pytest
import torch

from tests.conftest import run_cli
from xla_shard import config
from xla_shard.errors import ConfigError
from xla_shard.models import build_model

pytestmark = pytest.mark.torch_version  # its subject depends on torch's version


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-gpt2", "tiny-bert"])
def test_eager_and_sdpa_agree_and_the_choice_is_kept(preset):
    batch = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    losses = {}
    for kernel in ("eager", "sdpa"):
        model = build_model(config.load(None, [f"model={preset}", f"model.attn_implementation={kernel}"]).model, 0)
        assert model.config._attn_implementation == kernel
        losses[kernel] = model.eval()(input_ids=batch, labels=batch).loss.item()
    assert math.isclose(losses["eager"], losses["sdpa"], rel_tol=1e-5), losses


def test_attention_through_overrides_is_refused_naming_the_key():
    with pytest.raises(ConfigError) as raised:
        config.load(None, ["model.overrides={attn_implementation: sdpa}"])
    assert raised.value.key == "model.overrides" and "model.attn_implementation" in str(raised.value)


@pytest.mark.parametrize("overrides, head_dim", [
    ("{hidden_size: 256}", 64), ("{hidden_size: 256, num_attention_heads: 8}", 32),
    ("{hidden_size: 256, head_dim: 8}", 8), ("{num_hidden_layers: 1}", 16)])
def test_overridden_widths_of_a_saved_config_derive_its_head_dim_again(model_dirs, overrides, head_dim):
    """tests/model_dirs.py's Llama stores head_dim 16 (64 / 4 heads): widening it through model.overrides gives
    the head_dim the new widths derive (it kept 16: an 8B shape built on it had an eighth of its attention), and
    a head_dim the overrides name stays."""
    from xla_shard.models import model_config

    cfg = config.load(None, [f"model.name={model_dirs.llama}", f"model.overrides={overrides}"])
    assert model_config(cfg.model).head_dim == head_dim


def test_a_head_dim_set_apart_from_the_widths_stays_when_they_change(tmp_path):
    from transformers import LlamaConfig

    from xla_shard.models import model_config

    LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=32, num_key_value_heads=2, vocab_size=64,
                intermediate_size=32, num_hidden_layers=1).save_pretrained(tmp_path)
    cfg = config.load(None, [f"model.name={tmp_path}", "model.init=random", "model.overrides={hidden_size: 128}"])
    assert model_config(cfg.model).head_dim == 32


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("backend, sets, extra", [
    pytest.param("xla_spmd", ["backend=xla_spmd", "cpu_devices=4"], [], marks=pytest.mark.xla),
    ("torch_fsdp", ["backend=torch_fsdp"], ["--nproc-per-node", "2"]),
])
def test_sdpa_trains_on_the_backends_like_eager(tmp_path, backend, sets, extra):
    common = ["model=tiny-llama", "train.seq_len=32", "train.steps=2", "train.optimizer=sgd", "train.lr=0.5", *sets]
    losses = {}
    for kernel in ("eager", "sdpa"):
        out = tmp_path / kernel
        done = run_cli("train", *[a for s in common + [f"model.attn_implementation={kernel}", f"output_dir={out}"]
                                  for a in ("--set", s)], *extra)
        assert done.returncode == 0, done.stderr[-3000:]
        losses[kernel] = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    for eager, sdpa in zip(losses["eager"], losses["sdpa"]):
        assert math.isclose(eager, sdpa, rel_tol=1e-4), (backend, losses)


def test_auto_attention_is_the_fast_kernel_of_each_device():
    from xla_shard.attention import choose

    chosen = [choose("auto", device) for device in ("tpu", "cuda", "cpu", "xla_cpu", None)]
    assert chosen == ["xla_pallas", "sdpa_packed", "sdpa_packed", "eager", "eager"]
    assert choose("eager", "cpu") == "eager"  # what the user names is used as named
    section = config.load(None, ["model=tiny-llama"]).model
    assert build_model(section, 0, accelerator="cpu").config._attn_implementation == "sdpa_packed"


def test_auto_attention_is_eager_for_a_model_the_fused_kernels_do_not_compute(tmp_path):
    """Gemma 2 soft-caps its scores, which SDPA and the flash kernels do not: transformers refuses SDPA for it,
    and `auto` takes eager on every device (a named kernel is still refused, not swapped)."""
    from transformers import Gemma2Config

    Gemma2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=16, vocab_size=64).save_pretrained(tmp_path)
    section = config.load(None, [f"model.name={tmp_path}", "model.init=random"]).model
    assert {build_model(section, 0, accelerator=device).config._attn_implementation
            for device in ("cpu", "cuda", "tpu")} == {"eager"}
    named = config.load(None, [f"model.name={tmp_path}", "model.init=random", "model.attn_implementation=sdpa"])
    with pytest.raises(ConfigError, match="model.attn_implementation"):
        build_model(named.model, 0, accelerator="cpu")


@pytest.mark.parametrize("kernel, device",
                         [("xla_pallas", "cpu"), ("xla_pallas", "cuda"), ("flash_attention_2", "cpu")])
def test_a_kernel_the_device_lacks_is_refused_naming_the_key(kernel, device):
    section = config.load(None, ["model=tiny-llama", f"model.attn_implementation={kernel}"]).model
    with pytest.raises(ConfigError) as raised:
        build_model(section, 0, accelerator=device)
    assert raised.value.key == "model.attn_implementation" and kernel in str(raised.value)


@pytest.mark.xla
def test_xla_pallas_feeds_the_pallas_kernel_what_it_expects(monkeypatch):
    """The TPU kernel cannot run here; in its place, the math it computes (causal softmax attention over
    [batch, heads, seq, dim] with equal head counts). The model with `xla_pallas` must then equal eager: heads
    repeated for grouped-query attention, scale passed, layout transposed back. Padded batches take SDPA."""
    from torch_xla.experimental import custom_kernel

    calls = []

    def pallas_math(q, k, v, causal=False, sm_scale=1.0, partition_spec=None, mesh=None, **_):
        assert q.shape == k.shape == v.shape and causal
        calls.append(q.shape)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=sm_scale)

    monkeypatch.setattr(custom_kernel, "flash_attention", pallas_math)
    batch = torch.randint(0, 256, (2, 128), generator=torch.Generator().manual_seed(2))
    padded = torch.ones_like(batch)
    padded[1, 100:] = 0
    losses = {}
    for kernel in ("eager", "xla_pallas"):
        model = build_model(config.load(None, ["model=tiny-llama", f"model.attn_implementation={kernel}"]).model, 0)
        model.eval()
        losses[kernel] = (model(input_ids=batch, labels=batch).loss.item(),
                          model(input_ids=batch, attention_mask=padded, labels=batch).loss.item())
    assert len(calls) == 2 and calls[0] == (2, 4, 128, 16)  # both layers, 2 kv heads repeated to 4
    for eager, flash in zip(losses["eager"], losses["xla_pallas"]):
        assert math.isclose(eager, flash, rel_tol=1e-5), losses


def _kernel_math(calls):
    """What the Pallas kernel computes (causal softmax attention, within a segment where it is given segment ids),
    in its place: it runs only on a TPU."""
    def kernel(q, k, v, causal=False, q_segment_ids=None, kv_segment_ids=None, sm_scale=1.0, partition_spec=None,
               mesh=None, **_):
        assert q.shape == k.shape == v.shape and causal
        calls.append((q.shape, q_segment_ids))
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril()
        if q_segment_ids is not None:
            mask = mask & (q_segment_ids[:, :, None] == kv_segment_ids[:, None, :]).unsqueeze(1)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=sm_scale)

    return kernel


@pytest.mark.xla
def test_packed_rows_reach_the_kernel_with_segment_ids_and_give_each_examples_logits(monkeypatch):
    """Rows packing several examples, each with positions from 0: under `xla_pallas` no [rows, 1, tokens, tokens]
    mask is built (the mask function gives none), the kernel gets segment ids from the positions, and each
    example's logits are those it has alone (eager); a padded batch still takes SDPA with its mask."""
    from torch_xla.experimental import custom_kernel

    calls = []
    monkeypatch.setattr(custom_kernel, "flash_attention", _kernel_math(calls))
    lengths = [[40, 88], [128], [30, 50, 48]]  # three rows of 128 tokens
    ids = torch.randint(3, 256, (3, 128), generator=torch.Generator().manual_seed(5))
    positions = torch.tensor([[p for n in row for p in range(n)] for row in lengths])
    models = {kernel: build_model(config.load(None, ["model=tiny-llama", f"model.attn_implementation={kernel}"]
                                              ).model, 0).eval() for kernel in ("eager", "xla_pallas")}
    with torch.no_grad():
        packed = models["xla_pallas"](input_ids=ids, position_ids=positions).logits
        for row, sizes in enumerate(lengths):
            start = 0
            for n in sizes:
                alone = models["eager"](input_ids=ids[row:row + 1, start:start + n]).logits[0]
                torch.testing.assert_close(packed[row, start:start + n], alone, rtol=1e-5, atol=1e-5)
                start += n
    (shape, documents), *_ = calls
    assert documents.tolist()[2] == [0] * 30 + [1] * 50 + [2] * 48 and documents.dtype == torch.int32


def test_sdpa_packed_attends_each_document_alone_without_a_mask(monkeypatch):
    """Packed rows under `sdpa_packed`: SDPA runs once a document (causal, no mask: never a [rows, 1, tokens,
    tokens] one), and each example's logits and its gradients are those it has alone; a padded batch still takes
    SDPA with its mask."""
    import torch.nn.functional as F

    calls = []
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention",
                        lambda q, *a, **k: calls.append((q.shape[2], k.get("attn_mask"))) or sdpa(q, *a, **k))
    lengths = [[40, 88], [128], [30, 50, 48]]  # three rows of 128 tokens
    ids = torch.randint(3, 256, (3, 128), generator=torch.Generator().manual_seed(5))
    positions = torch.tensor([[p for n in row for p in range(n)] for row in lengths])
    models = {kernel: build_model(config.load(None, ["model=tiny-llama", f"model.attn_implementation={kernel}"]
                                              ).model, 0) for kernel in ("eager", "sdpa_packed")}
    packed = models["sdpa_packed"](input_ids=ids, position_ids=positions).logits
    layers = models["sdpa_packed"].config.num_hidden_layers
    assert sorted(length for length, _ in calls) == sorted([n for row in lengths for n in row] * layers)
    assert all(mask is None for _, mask in calls)
    weight = {kernel: model.model.layers[0].self_attn.q_proj.weight for kernel, model in models.items()}
    for row, sizes in enumerate(lengths):
        start = 0
        for n in sizes:
            alone = models["eager"](input_ids=ids[row:row + 1, start:start + n]).logits[0]
            torch.testing.assert_close(packed[row, start:start + n], alone, rtol=1e-5, atol=1e-5)
            grads = [torch.autograd.grad(logits.square().mean(), weight[kernel], retain_graph=True)[0]
                     for kernel, logits in (("sdpa_packed", packed[row, start:start + n]), ("eager", alone))]
            torch.testing.assert_close(*grads, rtol=1e-4, atol=1e-7)
            start += n
    calls.clear()
    padded = torch.ones(2, 64, dtype=torch.long)
    padded[1, 40:] = 0
    models["sdpa_packed"](input_ids=ids[:2, :64], attention_mask=padded)
    assert calls and all(length == 64 and mask is not None for length, mask in calls)


def test_the_kernels_mask_function_builds_no_mask_only_where_the_kernel_says_it_all():
    from transformers import LlamaConfig, MistralConfig

    from xla_shard.attention import documents_mask, plain_causal

    assert plain_causal(LlamaConfig()) and not plain_causal(MistralConfig(sliding_window=64))
    arguments = dict(batch_size=2, q_length=8, kv_length=8, cache_position=torch.arange(8))
    assert documents_mask(**arguments, config=LlamaConfig()) is None
    padded = torch.ones(2, 8, dtype=torch.bool)
    padded[1, 6:] = False
    assert documents_mask(**arguments, attention_mask=padded, config=LlamaConfig()).shape == (2, 1, 8, 8)
    # a sliding window is SDPA's mask to build (transformers hands it a windowed mask function; here, none to skip)
    windowed = documents_mask(**arguments, config=MistralConfig(sliding_window=4), allow_is_causal_skip=False)
    assert windowed is not None and windowed.shape == (2, 1, 8, 8)


@pytest.mark.xla
def test_xla_pallas_takes_sdpa_where_the_kernels_blocks_do_not_tile_the_sequence(monkeypatch):
    """What the TPU compiler refused (`xla-shard compile`): 64 tokens (a block narrower than 128 lanes), 640 and
    1152 (not divided by the backward's 512 and 1024 blocks). Those lengths take SDPA, once said; 128, 2048
    and 8192 compiled, and keep the kernel."""
    from torch_xla.experimental import custom_kernel

    from xla_shard.attention import tiled

    assert [n for n in (64, 128, 640, 1152, 2048, 8192) if tiled(n)] == [128, 2048, 8192]
    monkeypatch.setattr(custom_kernel, "flash_attention", lambda *a, **k: pytest.fail("the kernel was called"))
    model = build_model(config.load(None, ["model=tiny-llama", "model.attn_implementation=xla_pallas"]).model, 0)
    batch = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(2))
    with pytest.warns(UserWarning, match="do not tile 64-token sequences; SDPA runs instead"):
        model(input_ids=batch, labels=batch)


@pytest.mark.tpu
@pytest.mark.xla
def test_xla_pallas_matches_eager_on_a_tpu():
    import torch_xla

    from xla_shard.io.device import on_tpu

    if not on_tpu():
        pytest.skip("needs a Cloud TPU")
    device = torch_xla.device()
    batch = torch.randint(0, 256, (8, 128), generator=torch.Generator().manual_seed(2))
    losses = {}
    for kernel in ("eager", "xla_pallas"):
        section = config.load(None, ["model=tiny-llama", f"model.attn_implementation={kernel}"]).model
        model = build_model(section, 0, accelerator="tpu").to(device).eval()
        losses[kernel] = model(input_ids=batch.to(device), labels=batch.to(device)).loss.item()
    assert math.isclose(losses["eager"], losses["xla_pallas"], rel_tol=1e-3), losses
