"""The one small interface every backend implements; the runner and checkpointing speak only this.

What a backend can run is its `capabilities` (data, checked once in `check` and read by the planner and the
launcher), so this base class never names a subclass and no code outside a backend compares a backend's name.
Lifecycle: `check` (the config, before anything starts), `start` (the runtime: devices, processes), then
`setup(plan)` with the plan `planner.settle` made for those devices.
"""

from __future__ import annotations

import abc
import base64
import contextlib
import random
import types
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import torch
from torch import nn

from xla_shard.capabilities import Capabilities
from xla_shard.checkpoint.contract import Box, Chunk, StateTensor, unstack
from xla_shard.config.schema import ShardConfig
from xla_shard.data import Batch, local_rows
from xla_shard.errors import UserError
from xla_shard.plan import ShardingPlan

CheckpointFn = Callable[..., Any]


class Backend(abc.ABC):
    capabilities: ClassVar[Capabilities]
    # Module names its wrappers insert into parameter names; removed so every backend saves the same names.
    wrapper_prefixes: ClassVar[tuple[str, ...]] = ()

    def __init__(self, cfg: ShardConfig):
        self.cfg = cfg
        self.rank = 0  # this process's data-parallel rank: which rows of the global batch it feeds
        self.world = 1  # data-parallel processes (SPMD: 1 per host, devices are sharded inside)
        self.device = torch.device("cpu")
        self.device_kind = "cpu"
        self.num_devices = 1  # devices the model is sharded over, all processes together
        self.local_devices = 1  # devices this process drives
        self.plan: ShardingPlan | None = None  # given to setup, settled for the devices start found

    @property
    def name(self) -> str:
        return self.capabilities.name

    # ---- decided before anything heavy runs -------------------------------------------------------
    def check(self) -> None:
        """Reject, with a ConfigError naming key and backend, every option this backend cannot honour."""
        self.capabilities.check(self.cfg)

    def advisories(self) -> list[str]:
        """Warnings about how this run is set up (not errors), printed once it has started."""
        return []

    def reject(self, key: str, message: str) -> None:
        self.capabilities.refuse(key, message)

    def expected_devices(self, nproc_per_node: int | None = None) -> int | None:
        """Devices the run will have, if known before the runtime starts (None: only `start` can tell)."""
        return None

    def configure(self) -> None:
        """Set what the runtime reads from the environment before it starts (a launcher calls this before it
        starts other processes)."""

    # ---- lifecycle ---------------------------------------------------------------------------------
    @abc.abstractmethod
    def start(self) -> None:
        """Start the runtime (process group, devices); fill rank/world/device/device_kind/num_devices."""

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
        if getattr(getattr(model, "config", None), "tie_word_embeddings", False) and hasattr(model, "tie_weights"):
            model.tie_weights()
        return model

    # ---- the step ----------------------------------------------------------------------------------
    def local_batch(self, global_batch: Batch | torch.Tensor) -> Batch | torch.Tensor:
        """This process's rows of the global batch (a tensor, or a dict of them), on its device."""
        return self.place(local_rows(global_batch, self.rank, self.world))

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

    def after_step(self) -> None:
        """Cut the step (XLA: materialise the graph); a no-op for eager backends."""

    @abc.abstractmethod
    def mean_loss(self, loss: torch.Tensor) -> float:
        """The global-batch mean of the loss, as a Python float (this synchronises)."""

    def compilations(self) -> int | None:
        """Graph compilations so far (XLA), or None where nothing is compiled."""
        return None

    # ---- introspection -----------------------------------------------------------------------------
    @abc.abstractmethod
    def local_bytes(self, tensors: list[torch.Tensor]) -> list[int]:
        """Bytes each tensor occupies on *one* device (the largest shard), for the memory report."""

    def full_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """The whole (unsharded) value of a parameter, gradient or state, on the host.

        XLA tensors are global values already; backends whose tensors are local shards override this."""
        return tensor.detach().cpu()

    def unit_type(self) -> type[nn.Module] | None:
        """The wrapper class of a sharded unit (imported lazily: it may live in torch_xla)."""
        return None

    def sharded_units(self, model: nn.Module) -> list[str]:
        """Qualified names (wrapper prefixes removed) of the modules sharded as their own unit; '' is the root."""
        unit = self.unit_type()
        return [self.canonical(name) for name, module in model.named_modules() if unit and isinstance(module, unit)]

    def canonical(self, name: str) -> str:
        """A parameter or module name as the unwrapped model spells it."""
        return ".".join(part for part in name.split(".") if part not in self.wrapper_prefixes)

    def describe(self) -> dict[str, Any]:
        """What a manifest records about this run."""
        return {"backend": self.name, "num_devices": self.num_devices,
                "plan": self.plan.describe() if self.plan else None,
                "config": self.cfg.model_dump(mode="json", by_alias=True)}

    def run_identity(self) -> dict[str, Any]:
        return self.cfg.run_identity()

    @property
    def accelerator(self) -> str:
        """'tpu', 'cuda' or 'cpu': the kind of device the model runs on (attention kernels are chosen by it)."""
        return "cuda" if self.device.type == "cuda" else "cpu"

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def writer(self) -> tuple[int, int]:
        """(index, count) of the processes that write checkpoint shards."""
        return self.rank, self.world

    # ---- checkpoint state (the `ShardedState` protocol of xla_shard.checkpoint.contract) ------------
    def named_parameters(self, model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        for name, param in model.named_parameters():
            yield self.canonical(name), param

    def state(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
              stored: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None) -> list[StateTensor]:
        """Model parameters as `model/<name>` and optimizer state (if an optimizer is given) as
        `optim/<name>/<key>`, under the unstacked model's names (a stacked tensor is one entry per layer).

        Saving passes no `stored`; loading passes what the checkpoint holds, and optimizer state the optimizer
        has not created yet (it does so lazily at its first step) is created here, laid out like its parameter.
        """
        per_layer = self.layer_names(model)
        tensors = []
        for name, param in self.named_parameters(model):
            names = per_layer.get(name, [name])
            stacked = name in per_layer
            tensors += self._state_tensors([f"model/{n}" for n in names], param, stacked)
            if optimizer is None:
                continue
            like_shape = tuple(param.shape[1:] if stacked else param.shape)
            for key, value in optimizer_state(optimizer.state[param], names[0], stored, like_shape,
                                              lambda param=param: self.zeros_like(param)):
                tensors += self._state_tensors([f"optim/{n}/{key}" for n in names], value, stacked)
        return tensors

    def layer_names(self, model: nn.Module) -> dict[str, list[str]]:
        """The tensors kept stacked as [layers, ...] (scanned layers): stacked name -> each layer's name."""
        return {}

    def _state_tensors(self, names: list[str], tensor: torch.Tensor, stacked: bool) -> list[StateTensor]:
        whole = StateTensor(names[0], tuple(tensor.shape), tensor.dtype, lambda: self.local_chunks(tensor),
                            lambda: self.local_boxes(tensor), lambda values: self.fill_local(tensor, values))
        return unstack(whole, names) if stacked else [whole]

    def zeros_like(self, param: torch.Tensor) -> torch.Tensor:
        """A zero tensor laid out as `param`'s optimizer state (being restored before the optimizer made it)."""
        return torch.zeros_like(param)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer over the wrapped model's parameters, made to keep its state in the plan's layout (a
        backend that shards optimizer state apart from the parameters hooks it here). Own training loops pass
        their optimizer through this too."""
        return optimizer

    def local_chunks(self, tensor: torch.Tensor) -> list[Chunk]:
        """The boxes of `tensor` this process writes, copied to the host. Replicated tensors: rank 0 only."""
        if not self.is_main:
            return []
        return [((0,) * tensor.dim(), tensor.detach().to("cpu", copy=True))]

    def local_boxes(self, tensor: torch.Tensor) -> list[Box]:
        return [((0,) * tensor.dim(), tuple(tensor.shape))]

    @torch.no_grad()
    def fill_local(self, tensor: torch.Tensor, values: list[torch.Tensor]) -> None:
        tensor.copy_(values[0])

    def rng_state(self) -> dict[str, Any]:
        """This process's random number generators, JSON-serialisable (it goes into the shard index)."""
        version, internal, gauss = random.getstate()
        return {"torch": pack_bytes(torch.get_rng_state()), "python": [version, list(internal), gauss]}

    def set_rng_state(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(unpack_bytes(state["torch"]))
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))

    def any_rank(self, flag: bool) -> bool:
        """True if `flag` is set on any process, so that all stop at the same step (preemption)."""
        return flag

    @property
    def local_leader(self) -> bool:
        """The first process on this host (one process per host: always)."""
        return True

    def barrier(self) -> None:
        """Wait for every process (one process per host: nothing to wait for)."""

    @contextlib.contextmanager
    def main_first(self):
        """The block runs on this host's first process before the others, which then find what it cached
        (tokenized data) instead of racing it to write the same files."""
        if not self.local_leader:
            self.barrier()
        try:
            yield
        finally:
            if self.local_leader:
                self.barrier()


def on_meta(model: nn.Module) -> bool:
    """Whether the model's parameters are still on the meta device (built to be filled by a pretrained load)."""
    return any(param.is_meta for param in model.parameters())


def optimizer_state(opt_state: dict, name: str, stored: dict | None, like_shape: tuple[int, ...],
                    zeros_like: Callable[[], torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """(key, tensor) of one parameter's optimizer state. Saving (`stored` None): the tensors it has. Loading:
    the keys the checkpoint holds, creating those the optimizer has not made yet (it does so lazily at its
    first step): shaped like the parameter -> `zeros_like()`, laid out like it; scalars ('step') on the host."""
    if stored is None:
        return [(k, v) for k, v in opt_state.items() if torch.is_tensor(v)]
    out = []
    for key in [k.rsplit("/", 1)[1] for k in stored if k.startswith(f"optim/{name}/")]:
        if key not in opt_state:
            shape, dtype = stored[f"optim/{name}/{key}"]
            if tuple(shape) not in (like_shape, ()):  # what optimizers keep: per-element state, or a scalar
                raise UserError(f"the checkpoint's optim/{name}/{key} is {list(shape)}, neither the "
                                      f"parameter's shape {list(like_shape)} nor a scalar: another optimizer or model")
            opt_state[key] = zeros_like() if tuple(shape) == like_shape else torch.zeros(shape, dtype=dtype)
        out.append((key, opt_state[key]))
    return out


def pack_bytes(state: torch.Tensor) -> str:
    """A byte tensor (an RNG state) as text for the JSON shard index."""
    return base64.b64encode(state.numpy().tobytes()).decode()


def unpack_bytes(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


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
