"""The step `xla-shard train` runs for a config, traced by torch_xla on as many virtual CPU devices as the target
slice has, and left unrun: its HloModuleProto is what the TPU compiler gets.

It is the trainer's own step (`Trainer.step`: micro-batches, token weights, mixed precision, clipping, the
optimizer, the backend's shardings for the plan), on the config's own data, with the model built from its
config on the meta device (no weights read). The parameters and the optimizer's state are placeholders:
XLA tensors with no storage, laid out by the backend's own shardings (annotated on their values; the compiler
side moves each annotation onto the program's parameter). The optimizer's state is made as a resume makes it,
so the traced program is the one every step after the first repeats. No step runs and nothing is allocated at
the model's size: only the batch and the model's buffers hold host memory. Nothing is written.
"""

from __future__ import annotations

import base64
import contextlib
import math
import os
import re
import tempfile
from dataclasses import dataclass

import torch

from xla_shard.aot import compiler, generation, memory
from xla_shard.aot.generation import GenerationTrace
from xla_shard.config.load import validate
from xla_shard.config.schema import ShardConfig
from xla_shard.errors import UserError


@dataclass
class Trace:
    proto: bytes
    devices: int
    plan: str
    # Bytes per device of what the step takes as arguments, as the trace shards them.
    parameters: int
    optimizer_state: int
    batch: int
    updated: int  # of those, what the step writes back in place (trained parameters, optimizer state)
    model_flops: float  # per step, all devices: PaLM's count, as the trainer's MFU
    loop_trips: int = 1  # iterations of the program's loops: the scanned layers (1: no loop)
    reference: int = 0  # bytes per device of a frozen reference model's parameters (DPO's), an argument too
    causal_flops: float = 0.0  # per step, all devices: MaxText's count (causal attention at half)
    dims: memory.Dims | None = None  # the model's dimensions, to name the compiler's buffers
    generation: GenerationTrace | None = None  # an online method's generation programs (`aot.generation`)

    @property
    def kernels(self) -> int:
        """Pallas (Mosaic) kernels in the step (flash attention and the MoE experts' grouped matmuls, forward
        and backward; a kernel the traced program calls from several places counts once). Counted in the
        traced program: the compiled one also holds kernels the TPU compiler writes itself (TPU7x's
        `online-softmax` for eager attention)."""
        return self.proto.count(b"tpu_custom_call")

    @property
    def kernel_kinds(self) -> dict[str, int]:
        """The Pallas kernels by what they compute, read from the names their Mosaic bodies carry."""
        kinds: dict[str, int] = {}
        for body in re.findall(rb'"body": ?"([A-Za-z0-9+/=]+)"', self.proto):
            code = base64.b64decode(body)
            kind = next((kind for kind, name in _KERNEL_NAMES if name.search(code)), "other")
            kinds[kind] = kinds.get(kind, 0) + 1
        return kinds


# A Pallas kernel's kind, by the name its Mosaic body carries (the function jax's kernel builds), matched whole:
# the body is binary, and three letters such as `gmm` also turn up by chance inside other kernels' bytes.
_KERNEL_NAMES = [(kind, re.compile(rb"(?<![A-Za-z0-9])" + name + rb"(?![A-Za-z0-9])")) for kind, name in (
    ("splash attention (the sequence axis)", rb"splash_mha_[a-z_]+"),
    ("flash attention", rb"_?flash_attention[a-z_]*"),
    ("MoE grouped matmuls", rb"t?gmm"))]


def step_config(cfg: ShardConfig, devices: int, workdir: str) -> ShardConfig:
    """The config as traced: xla_spmd on `devices` virtual devices, random init, nothing written but in
    `workdir`, no evaluation."""
    data = cfg.model_dump(mode="json", by_alias=True, exclude_unset=True)  # as written: validated as it was
    data.update(backend="xla_spmd", output_dir=workdir)
    data.setdefault("model", {})["init"] = "random"
    data.setdefault("checkpoint", {})["dir"] = None
    data.setdefault("train", {}).update(tensorboard=False, steps=max(2, cfg.train.steps or 2), epochs=None,
                                        eval_every=None)
    # The slice's device count, past the 64 a CPU run may ask for: these devices hold placeholders, not data.
    return validate(data).model_copy(update={"cpu_devices": devices})


@contextlib.contextmanager
def traced_trainer(cfg: ShardConfig, tpu: compiler.Slice, placeholders: bool = True):
    """The trainer `xla-shard train` would run for `cfg`, set up on as many virtual devices as `tpu` has, its
    parameters placeholders (unless `placeholders=False`) and its optimizer's state made as a resume makes it."""
    from xla_shard import backends
    from xla_shard.train import Trainer

    _claim_devices(tpu.count, tpu.slices)
    with tempfile.TemporaryDirectory(prefix="xla_shard_compile_") as workdir:
        traced = step_config(cfg, tpu.count, workdir)
        backend = backends.create(traced)
        backend.placeholders, backend.traced_for, backend.traced_slices = placeholders, "tpu", tpu.slices
        trainer = Trainer(traced, backend).setup()
        _optimizer_state(trainer)
        yield trainer


def _optimizer_tensors(trainer) -> list[torch.Tensor]:
    return [v for s in trainer.optimizer.state.values() for v in s.values()
            if isinstance(v, torch.Tensor) and v.device.type == "xla"]


def resting_bytes(trainer) -> tuple[int, int]:
    """(parameters, optimizer state) bytes per device, from their shardings: what a device holds between steps."""
    return (sum(_device_bytes(t) for t in trainer.model.parameters()),
            sum(_device_bytes(t) for t in _optimizer_tensors(trainer)))


def trace(cfg: ShardConfig, tpu: compiler.Slice, placeholders: bool = True) -> Trace:
    """The step for the slice `tpu` the program is compiled for (and an online method's generation programs).
    `placeholders=False` traces with real parameters and state (host memory at the model's size): the
    reference a test holds the placeholders' program to."""
    from xla_shard.backends import xla_scan

    with traced_trainer(cfg, tpu, placeholders) as trainer:
        backend = trainer.backend
        batch = sum(t.numel() * t.element_size() for rows in trainer.micro_batches(1) for t in rows.values())
        trained = [p for p in trainer.model.parameters() if p.requires_grad]
        states = _optimizer_tensors(trainer)
        # Measured before tracing, from the shardings (no data read: that would run the pending step).
        frozen = [] if trainer.objective.reference is None else list(trainer.objective.reference.parameters())
        params, state = resting_bytes(trainer)
        updated, reference = (sum(_device_bytes(t) for t in tensors) for tensors in (trained, frozen))
        stacked = xla_scan.stacked_parameters(trainer.model)
        trips = next(iter(stacked)).shape[0] if stacked else 1
        with compiler.kernels_lowered_for(tpu):
            proto = backend.traced_program(lambda: trainer.step(1), lambda: [*trained, *states])
            # (real parameters: the generation's layout program would run, not be traced; only the step is held)
            generating = generation.trace(trainer) if placeholders else None
        tokens = trainer.objective.tokens_per_step(cfg.train)
        config = trainer.model.config
        causal = trainer.flops_per_token - causal_attention_discount(config, cfg.train.seq_len)
        return Trace(proto, backend.num_devices, str(backend.plan), params, state, batch // backend.num_devices,
                     updated + state, trainer.flops_per_token * tokens, trips, reference, causal * tokens,
                     _dims(config, cfg.train.seq_len, backend.num_devices, backend.plan.context), generating)


def causal_attention_discount(config, seq_len: int) -> float:
    """FLOPs per token PaLM's count gives attention beyond MaxText's: PaLM counts the scores and their use for
    every pair of positions (12 x layers x hidden x tokens), MaxText for the causal half."""
    return 6.0 * config.num_hidden_layers * config.hidden_size * seq_len


def _dims(config, seq_len: int, devices: int, context: int) -> memory.Dims:
    from xla_shard.planner import attention_widths

    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    head_dim, kv_width = attention_widths(config)
    return memory.Dims(text.hidden_size, text.vocab_size, text.num_hidden_layers,
                       getattr(text, "intermediate_size", 0) or 4 * text.hidden_size, head_dim, kv_width,
                       seq_len, devices, context)


def _device_bytes(tensor: torch.Tensor) -> int:
    """Bytes of `tensor` on one device, from its sharding: its largest shard (XLA pads uneven ones to it), or
    all of it where it is not split (one device, a replicated plan). Placeholders have no shards to ask."""
    import torch_xla

    tiles = _TILES.search(torch_xla._XLAC._get_xla_sharding_spec(tensor))
    split = [int(n) for n in tiles.group(1).split(",")] if tiles else []
    split += [1] * (tensor.dim() - len(split))  # beyond the tensor's dims: replicas of each tile
    return math.prod(-(-size // n) for size, n in zip(tensor.shape, split)) * tensor.element_size()


_TILES = re.compile(r"devices=\[([0-9,]+)\]")  # an OpSharding's tile counts per dimension


def _optimizer_state(trainer) -> None:
    """The optimizer's state, made as a resume makes it (zeros laid out as the backend shards them), so that the
    traced step is the one every step after the first repeats, without running one (which would hold the
    activations in host memory). Which state the optimizer keeps is learnt from one step on a 2-element tensor."""
    from xla_shard.schedule import make_optimizer

    optimizer = trainer.optimizer
    probe = torch.nn.Parameter(torch.zeros(2))
    probe.grad = torch.zeros(2)
    replica = make_optimizer([probe], trainer.cfg.train)  # the run's optimizer, as the trainer makes it
    replica.step()
    kept = {key: value.dim() > 0 for key, value in replica.state[probe].items() if torch.is_tensor(value)}
    state = trainer.backend.state
    layers = state.layer_names(trainer.model)  # a stacked parameter (scan_layers) keeps state per layer
    stored = {}
    for name, param in state.named_parameters(trainer.model):
        if not param.requires_grad:
            continue
        first, shape = (layers[name][0], tuple(param.shape[1:])) if name in layers else (name, tuple(param.shape))
        for key, per_element in kept.items():
            stored[f"optim/{first}/{key}"] = (shape if per_element else (), replica.state[probe][key].dtype)
    state.tensors(trainer.model, optimizer, stored=stored)  # creates what is missing


# torch indexes a device with 8 bits: its autograd engine cannot run a backward over 128 or more of them.
MAX_DEVICES = 127


def _claim_devices(devices: int, slices: int = 1) -> None:
    """XLA's CPU client takes its device count once per process, when torch_xla starts."""
    import sys

    if devices > MAX_DEVICES:
        held = f"the {slices} slices have" if slices > 1 else "the slice has"
        raise UserError(f"{held} {devices} devices; the step is traced on as many virtual devices, and torch "
                        f"traces a backward over at most {MAX_DEVICES} (an 8-bit device index): compile for at "
                        "most 64 devices, a smaller slice or fewer slices (per device, they hold at least as much)")

    have = os.environ.get("CPU_NUM_DEVICES")
    if "torch_xla" in sys.modules and have and int(have) != devices:
        raise UserError(f"this process's XLA runtime already has {have} devices; compiling for {devices} needs a "
                        "fresh process")
    os.environ["PJRT_DEVICE"], os.environ["CPU_NUM_DEVICES"] = "CPU", str(devices)
