"""The one small interface every backend implements; the runner and checkpointing speak only this.

What a backend can run is its `capabilities` (data, checked once in `check` and read by the planner and the
launcher), so this base class never names a subclass and no code outside a backend compares a backend's name.
Lifecycle: `check` (the config, before anything starts), `start` (the runtime: devices, processes), then
`setup(plan)` with the plan `planner.settle` made for those devices.

Two parts live beside it, each its own object: `backend.processes` (who this process is among the run's, and
how they agree: `backends.processes`) and `backend.state` (the sharded training state checkpoints and
pretrained loads read and fill: `backends.state`).
"""

from __future__ import annotations

import abc
import contextlib
import types
from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple

import torch
from torch import nn

from xla_shard import lm_head
from xla_shard.backends.processes import Processes
from xla_shard.backends.state import BackendState
from xla_shard.capabilities import Capabilities
from xla_shard.config.schema import ShardConfig
from xla_shard.data import Batch, local_rows
from xla_shard.methods import Method, method_for
from xla_shard.plan import ShardingPlan
from xla_shard.wrap import cast_activations

CheckpointFn = Callable[..., Any]


class Compiled(NamedTuple):
    """What a process has compiled so far: graphs, and the wall seconds compiling them took."""

    graphs: int
    seconds: float


class Backend(abc.ABC):
    capabilities: ClassVar[Capabilities]
    # Module names its wrappers insert into parameter names; removed so every backend saves the same names.
    wrapper_prefixes: ClassVar[tuple[str, ...]] = ()
    state_type: ClassVar[type[BackendState]] = BackendState  # where this backend's shards are
    # Parameters and optimizer state without storage: a step that is traced and compiled, never run
    # (`xla-shard compile`). Only a backend that can trace without data sets it (xla_spmd).
    placeholders = False
    # The device a step that is traced, never run here, is compiled for ('tpu': `xla-shard compile`): what runs
    # there (its attention kernel) is traced. None: the step runs on this machine's devices.
    traced_for: str | None = None
    traced_slices = 1  # the slices (over DCN) of what it is compiled for: their devices listed slice by slice
    # How the devices share the chunked loss's work (`lm_head.Partials`): eager and FSDP need nothing of it.
    partials: lm_head.Partials = lm_head.Partials()

    def __init__(self, cfg: ShardConfig, method: Method | None = None):
        self.cfg = cfg
        # The run's method (None: the config's), for what it needs of this backend and how its adapter shards.
        self.method = method if method is not None else method_for(cfg)
        self.rank = 0  # this process's data-parallel rank
        self.world = 1  # data-parallel processes, each with its own loss (SPMD: 1, one program over every host)
        self.device = torch.device("cpu")
        self.device_kind = "cpu"
        self.num_devices = 1  # devices the model is sharded over, all processes together
        self.local_devices = 1  # devices this process drives
        self.plan: ShardingPlan | None = None  # given to setup, settled for the devices start found
        self.processes = Processes()  # start replaces it with the runtime's
        self.state = self.state_type(self)

    @property
    def name(self) -> str:
        return self.capabilities.name

    # ---- decided before anything heavy runs -------------------------------------------------------
    def check(self) -> None:
        """Reject, with a ConfigError naming key and backend, every option this backend cannot honour."""
        self.capabilities.check(self.cfg)
        from xla_shard.methods import INFERENCE_ENGINE

        if INFERENCE_ENGINE in self.method.needs and self.capabilities.inference_engine:
            self.capabilities.refuse("method", f"{self.method.name} needs {INFERENCE_ENGINE}, and "
                                               f"{self.capabilities.inference_engine}")

    def check_runtime(self) -> None:
        """Refuse, naming `backend`, to start where this machine lacks what the backend runs on (its package, its
        device). Apart from `check`: a config is checked, planned and rendered for a TPU on a machine without one."""

    def advisories(self) -> list[str]:
        """Warnings about how this run is set up (not errors), printed once it has started."""
        return []

    def expected_devices(self, nproc_per_node: int | None = None) -> int | None:
        """Devices the run will have, if known before the runtime starts (None: only `start` can tell)."""
        return None

    def configure(self) -> None:
        """Set what the runtime reads from the environment before it starts (a launcher calls this before it
        starts other processes)."""

    # ---- lifecycle ---------------------------------------------------------------------------------
    @abc.abstractmethod
    def start(self) -> None:
        """Start the runtime (process group, devices); fill rank/world/device/device_kind/num_devices and
        `processes`."""

    def setup(self, plan: ShardingPlan) -> None:
        """Take the plan settled for `num_devices` (and build what it needs: SPMD's mesh)."""
        self.plan = plan

    @abc.abstractmethod
    def wrap(self, model: nn.Module) -> nn.Module:
        """Move the model to the device and shard it: auto-wrap, activation checkpointing, precision."""

    def shutdown(self) -> None:
        """Release the runtime (process group) once training is over."""

    def to_device(self, model: nn.Module, device: torch.device | str | None = None) -> nn.Module:
        """Move the model to this backend's device with tied parameters still tied.

        Moving to an XLA device replaces each parameter (pytorch/xla#7042), so `lm_head` of a model with
        `tie_word_embeddings` stops sharing the input embedding: it would train as a second matrix and be
        checkpointed twice. transformers re-ties after its own moves; every backend moves through here.

        A model built on the meta device (to be filled with pretrained weights) gets uninitialised storage on
        the device instead; its buffers, computed on the host when it was built, are kept."""
        if on_meta(model):
            buffers = {name: buffer.clone() for name, buffer in model.named_buffers()}
            model = model.to_empty(device=device or self.device)
            with torch.no_grad():
                for name, buffer in model.named_buffers():
                    buffer.copy_(buffers[name])
        else:
            model = model.to(self.device)
        return retie(model)

    # ---- the step ----------------------------------------------------------------------------------
    def local_batch(self, global_batch: Batch | torch.Tensor) -> Batch | torch.Tensor:
        """This process's rows of the global batch (a tensor, or a dict of them), on its device(s)."""
        return self.place(local_rows(global_batch, *self.processes.batch_part))

    def place(self, rows: Batch | torch.Tensor) -> Batch | torch.Tensor:
        """Rows this process feeds, onto its device (SPMD overrides: one batch, sharded over the mesh)."""
        if isinstance(rows, dict):
            return {key: value.to(self.device) for key, value in rows.items()}
        return rows.to(self.device)

    def grad_sync(self, model: nn.Module, enabled: bool):
        """Around a micro-batch's backward: whether gradients are reduced across processes now (the last
        micro-batch) or only accumulated locally (the others). Backends without the choice always reduce."""
        return contextlib.nullcontext()

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """Clip the global gradient norm (over every shard and process) to `max_norm`; return the norm before
        clipping, as a tensor (reading it synchronises)."""
        return torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], max_norm)

    def forward_context(self):
        """Wraps the forward pass (autocast where the backend needs it)."""
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def generation_context(self, model: nn.Module):
        """Wraps a generation's forwards (a forward a token: a method's sampling), the weights in the layout the
        backend generates in; yields how the prompts are placed for it (`place`'s signature)."""
        with self.forward_context():
            yield self.place

    def after_step(self) -> None:
        """Cut the step (XLA: materialise the graph); a no-op for eager backends."""

    def to_host(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        """Device tensors' whole values, on the host (what a method reads of its device results: completions)."""
        return [tensor.cpu() for tensor in tensors]

    @abc.abstractmethod
    def mean_loss(self, loss: torch.Tensor) -> float:
        """The global-batch mean of the loss, as a Python float (this synchronises)."""

    def compilations(self) -> Compiled | None:
        """Graphs compiled so far in this process and the seconds spent compiling them (XLA, torch.compile), or
        None where nothing is compiled."""
        return None

    # ---- introspection -----------------------------------------------------------------------------
    @abc.abstractmethod
    def local_bytes(self, tensors: list[torch.Tensor]) -> list[int]:
        """Bytes each tensor occupies on *one* device (the largest shard), for the memory report."""

    def unit_type(self) -> type[nn.Module] | None:
        """The wrapper class of a sharded unit (imported lazily: it may live in torch_xla)."""
        return None

    def sharded_units(self, model: nn.Module) -> list[str]:
        """Qualified names (wrapper prefixes removed) of the modules sharded as their own unit; '' is the root."""
        unit = self.unit_type()
        return [self.state.canonical(name) for name, module in model.named_modules()
                if unit and isinstance(module, unit)]

    @property
    def accelerator(self) -> str:
        """The kind of device the model runs on, and through which runtime (attention kernels are chosen by it):
        a key of `xla_shard.attention.AUTO`."""
        return "cuda" if self.device.type == "cuda" else "cpu"

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer over the wrapped model's parameters, made to keep its state in the plan's layout (a
        backend that shards optimizer state apart from the parameters hooks it here). Own training loops pass
        their optimizer through this too."""
        return optimizer


def prepare(backend: Backend, model: nn.Module) -> None:
    """What every backend's `wrap` does to a model before it shards it: a causal LM's loss computed chunk by
    chunk (`train.loss_chunks`, `xla_shard.lm_head`; what could not be is said by `lm_head.describe`), and its
    residual stream in bf16 (`fsdp.activation_dtype`)."""
    cfg = backend.cfg
    if cfg.model.task == "causal_lm" and cfg.train.loss_chunks != 0:
        lm_head.install(model, cfg.train.loss_chunks, cfg.train.seq_len, backend.partials)
    if cfg.fsdp.bf16_activations:
        cast_activations(model, cfg.fsdp)


def split_sequences(backend: Backend, model: nn.Module, implementation: str) -> None:
    """The sequence axis (mesh.context): attention across the split sequence through `implementation` (one of
    `xla_shard.sequence`'s), for every module sharing the model's config (DPO's reference is wrapped too)."""
    from xla_shard import sequence
    from xla_shard.pretrained import check_split_sequence

    check_split_sequence(model, backend.plan.context, backend.name)  # as preflight checked it, for your own loop
    sequence.register()
    for config in {id(m.config): m.config for m in model.modules() if hasattr(m, "config")}.values():
        config._attn_implementation = implementation


def retie(model: nn.Module) -> nn.Module:
    """Tie again what a move to another device untied (each parameter replaced: pytorch/xla#7042)."""
    if getattr(getattr(model, "config", None), "tie_word_embeddings", False) and hasattr(model, "tie_weights"):
        model.tie_weights()
    return model


def on_meta(model: nn.Module) -> bool:
    """Whether the model's parameters are still on the meta device (built to be filled by a pretrained load)."""
    return any(param.is_meta for param in model.parameters())


def apply_activation_checkpointing(modules: list[nn.Module], checkpoint_fn: CheckpointFn) -> None:
    """Route each module's forward through `checkpoint_fn(forward, *args, **kwargs)`.

    Applied before sharding, so the sharding wrapper's hooks stay outside the recomputed region: parameters
    are gathered by the wrapper in backward, then the layer body is recomputed with them.
    """
    for module in modules:
        original = module.forward

        def forward(self, *args, _original=original, **kwargs):
            if not torch.is_grad_enabled():
                return _original(*args, **kwargs)
            return checkpoint_fn(_original, *args, **kwargs)

        # Bound, not a plain attribute: wrappers such as FSDPv2 insist on a real `forward` method.
        module.forward = types.MethodType(forward, module)
