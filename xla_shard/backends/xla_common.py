"""What both torch_xla backends share: the `XlaBackend` base class (runtime, the step cut, compile counts, the
wrap policy), and exact activation checkpointing.

torch_xla is imported lazily: the PJRT environment must be set before the first import. It is imported only
by the XLA backends, so that another TPU runtime can plug in behind the same interface.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
from collections.abc import Callable

import torch
import torch.utils._pytree as pytree
from torch import nn

from xla_shard import lm_head
from xla_shard.backends.base import Backend, Compiled, apply_activation_checkpointing
from xla_shard.errors import ConfigError
from xla_shard.io.device import on_tpu
from xla_shard.wrap import checkpoint_targets, wrap_targets


def configure_runtime(cpu_devices: int) -> None:
    """PJRT on the TPU when there is one, else XLA's CPU client with `cpu_devices` virtual devices."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # XLA's per-compile GSPMD deprecation warnings
    if on_tpu():
        os.environ.setdefault("PJRT_DEVICE", "TPU")
    else:
        os.environ.setdefault("PJRT_DEVICE", "CPU")
        os.environ.setdefault("CPU_NUM_DEVICES", str(cpu_devices))


@contextlib.contextmanager
def absl_quiet():
    """flax's import warns through absl that TensorFlow is absent, which nothing here needs."""
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)
    try:
        yield
    finally:
        absl.setLevel(level)


def import_torchax_quietly() -> None:
    """torch_xla's `mark_sharding` imports the torchax copy in its wheel (and through it flax) when jax is
    installed, at the first call: do it here, without flax's TensorFlow warning."""
    if importlib.util.find_spec("jax") is None:
        return
    with absl_quiet(), contextlib.suppress(ImportError):
        import torchax  # noqa: F401


def check_jax_interop(key: str, feature: str, remedy: str) -> None:
    """Features that call jax kernels from torch_xla (scan's backward, the splash attention of the sequence axis)
    go through the torchax copy in torch_xla's wheel, which imports flax: torch_xla only asserts "Jax is required"
    at the first step, so say it before anything is built."""
    try:
        with absl_quiet():
            import jax  # noqa: F401
            import torchax  # noqa: F401
    except ImportError as exc:
        raise ConfigError(key, f"{feature} needs jax and flax ({exc.name} is not installed): "
                               f"pip install 'xla_shard[scan]' (or [aot] for xla-shard compile), or {remedy}") from None


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def oversubscribed(devices: int, cores: int) -> str | None:
    """XLA's CPU client runs each virtual device's share of a step on its own threads and meets at every
    collective; with more devices than cores they wait on each other (measured on 2 cores: 4 devices gave steps
    alternating 0.7 s and 7-14 s, with "rendezvous may be stuck" lines, where 2 were steady)."""
    if devices <= cores:
        return None
    return (f"cpu_devices={devices} is more than the {cores} CPU core(s) this process may use: the virtual XLA "
            f"devices will contend and steps can stall; set cpu_devices to {cores} or fewer (it must still divide "
            "the batch and the mesh)")


def xla_installed() -> bool:
    return importlib.util.find_spec("torch_xla") is not None


def device_kind() -> str:
    import torch_xla.runtime as xr

    kind = xr.device_type() or "CPU"
    if kind == "TPU":
        accelerator = os.environ.get("TPU_ACCELERATOR_TYPE", "")
        return f"tpu {accelerator}".strip()
    return kind.lower()


def compilations() -> Compiled:
    import torch_xla.debug.metrics as met

    data = met.metric_data("CompileTime")  # (count, total nanoseconds, samples)
    return Compiled(int(data[0]), data[1] / 1e9) if data else Compiled(0, 0.0)


class XlaPartials(lm_head.Partials):
    """XLA orders the chunked loss's chunks by optimization barriers (`lm_head.Partials.barrier`)."""

    orders = True

    def barrier(self, tensors: list[torch.Tensor]) -> None:
        import torch_xla.core.xla_model as xm

        xm.optimization_barrier_(tensors)


class XlaBackend(Backend):
    """torch_xla, either way: lazy graphs cut once per step, compilations counted, no CPU offload."""

    partials = XlaPartials()

    NO_OFFLOAD = "torch_xla FSDP has no CPU offload"
    # MoE experts off a TPU: one gather and batched matmuls, static shapes, one graph (transformers' grouped_mm
    # counts tokens per expert with an integer histc, which XLA does not lower). On a TPU, or traced for one,
    # they run as Pallas grouped matmuls instead (`xla_shard.experts`): batched_mm's per-pair weights do not fit.
    EXPERTS = "batched_mm"
    ROUTER_AUX_LOSS = ("transformers counts each expert's tokens for the router's load-balancing loss with an "
                       "integer histc on XLA devices, which XLA does not lower")

    def check_runtime(self) -> None:
        if not xla_installed():
            self.capabilities.refuse("backend", "needs torch_xla, which is not installed: pip install "
                                     "'xla_shard[xla]' (CPU) or 'xla_shard[tpu]' (a Cloud TPU VM); both pin torch "
                                     "2.9. On the newest torch use torch_fsdp, or torch_tpu on a TPU")

    def configure(self) -> None:
        configure_runtime(self.cfg.cpu_devices)

    def advisories(self) -> list[str]:
        if on_tpu():
            return []
        warning = oversubscribed(int(os.environ.get("CPU_NUM_DEVICES", self.cfg.cpu_devices)), usable_cores())
        return [warning] if warning else []

    def expected_devices(self, nproc_per_node: int | None = None) -> int | None:
        return None if on_tpu() else self.cfg.cpu_devices  # XLA's CPU client: cpu_devices virtual devices

    @property
    def accelerator(self) -> str:
        return "tpu" if on_tpu() or self.traced_for == "tpu" else "xla_cpu"

    def after_step(self) -> None:
        import torch_xla

        torch_xla.sync()


    def compilations(self) -> Compiled:
        return compilations()

    def traced_program(self, run_step: Callable[[], torch.Tensor], updated: Callable[[], list[torch.Tensor]]) -> bytes:
        """The HloModuleProto of a step, traced and not run: `run_step` with the step's cut (`after_step`)
        left out, so its graph stays pending, then the program that computes its loss and the tensors
        `updated()` names (parameters, optimizer state). What `xla-shard compile` hands the TPU compiler."""
        import torch_xla

        self.after_step = lambda: None  # this instance only: the class's sync is back below
        try:
            loss = run_step()
        finally:
            del self.after_step
        program = torch_xla._XLAC._get_xla_tensors_hlo_proto([loss, *updated()])
        # Never run: a later step (or another trace in this process) must not execute it, placeholders and all.
        torch_xla._XLAC._clear_pending_irs(str(self.device))
        return program

    def prepare_wrap(self, model: nn.Module):
        """Apply activation checkpointing (before sharding, so the wrapper's hooks stay outside the recomputed
        region) and return the auto-wrap policy both torch_xla wrappers take, or None to wrap only the root."""
        fsdp = self.cfg.fsdp
        if fsdp.activation_checkpointing:
            apply_activation_checkpointing(checkpoint_targets(model, fsdp), xla_checkpoint)
        targets = {id(m) for m in wrap_targets(model, fsdp)}
        if not targets:
            return None

        def policy(module, recurse, **_):
            return recurse or id(module) in targets

        return policy


def xla_checkpoint(function, *args, **kwargs):
    """Activation checkpointing for XLA with exact gradients.

    torch_xla's `checkpoint_module` passes kwargs through its reentrant autograd Function as opaque objects,
    so a tensor that requires grad inside them (or nested in a tuple) gets no gradient, and when no positional
    input requires grad it quietly runs without checkpointing. Here every tensor leaf of (args, kwargs) is an
    autograd input, a zero-size anchor that requires grad makes backward run whatever the inputs are, and an
    optimization barrier keeps XLA from merging the recomputation into the forward (which would make
    checkpointing save nothing). Exactness is tested against the uncheckpointed gradients on every backend.
    """
    leaves, spec = pytree.tree_flatten((args, kwargs))
    tensor_at = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]

    def run(*tensors):
        filled = list(leaves)
        for index, tensor in zip(tensor_at, tensors):
            filled[index] = tensor
        call_args, call_kwargs = pytree.tree_unflatten(filled, spec)
        return function(*call_args, **call_kwargs)

    anchor = torch.empty(0, requires_grad=True)
    return _XlaCheckpoint.apply(run, anchor, *[leaves[i] for i in tensor_at])


class _XlaCheckpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run, anchor, *tensors):
        import torch_xla.core.xla_model as xm

        ctx.run = run
        ctx.xla_rng = xm.get_rng_state()
        ctx.cpu_rng = torch.get_rng_state()
        ctx.autocast = (torch.is_autocast_enabled("xla"), torch.get_autocast_dtype("xla"))
        ctx.save_for_backward(*tensors)
        with torch.no_grad():
            return run(*tensors)

    @staticmethod
    def backward(ctx, *grad_outputs):
        import torch_xla.core.xla_model as xm

        inputs = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        xm.optimization_barrier_([t for t in inputs] + [g for g in grad_outputs if isinstance(g, torch.Tensor)])
        with torch.random.fork_rng(devices=[]), xm.fork_rng():
            xm.set_rng_state(ctx.xla_rng)
            torch.set_rng_state(ctx.cpu_rng)
            enabled, dtype = ctx.autocast
            with torch.enable_grad(), torch.autocast("xla", enabled=enabled, dtype=dtype):
                outputs = ctx.run(*inputs)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grad_outputs)
                 if isinstance(o, torch.Tensor) and o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None) + tuple(t.grad if t.requires_grad else None for t in inputs)
