"""Native PyTorch FSDP2 (`fully_shard`), one process per device via torchrun: NCCL on GPUs and gloo on CPUs
(torch_fsdp), `tpu_dist` on TPUs through TorchTPU (torch_tpu). The two backends are this code under another
device profile (`fsdp2_devices`)."""

from __future__ import annotations

import contextlib
import functools
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

from xla_shard import launch, lm_head, sequence
from xla_shard.backends import fsdp2_devices
from xla_shard.backends.base import (Backend, Compiled, apply_activation_checkpointing, on_meta, prepare,
                                     split_sequences)
from xla_shard.backends.fsdp2_devices import DeviceProfile
from xla_shard.backends.processes import GroupProcesses, forming_a_group, meet_as_one_run
from xla_shard.backends.state import BackendState, pack_bytes, unpack_bytes
from xla_shard.capabilities import Capabilities
from xla_shard.checkpoint.contract import Box, Chunk
from xla_shard.config.schema import ShardingStrategy
from xla_shard.errors import ConfigError, one_line
from xla_shard.plan import ShardingPlan
from xla_shard.wrap import checkpoint_targets, wrap_targets


class Fsdp2State(BackendState):
    """DTensor shards are boxes at the offset DTensor computes; replicas other than the first write nothing."""

    def full_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().cpu()

    @staticmethod
    def _local_box(tensor: DTensor) -> Box:
        shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
        return tuple(offset), tuple(shape)

    def local_chunks(self, tensor: torch.Tensor) -> list[Chunk]:
        if not isinstance(tensor, DTensor):
            return super().local_chunks(tensor)
        coordinate = tensor.device_mesh.get_coordinate()
        if any(isinstance(p, Replicate) and coordinate[dim] != 0 for dim, p in enumerate(tensor.placements)):
            return []  # another replica writes this box
        local = tensor.to_local()
        if local.numel() == 0:
            return []
        return [(self._local_box(tensor)[0], local.detach().to("cpu", copy=True))]

    def local_boxes(self, tensor: torch.Tensor) -> list[Box]:
        if not isinstance(tensor, DTensor):
            return super().local_boxes(tensor)
        return [self._local_box(tensor)] if tensor.to_local().numel() else []

    @torch.no_grad()
    def fill_local(self, tensor: torch.Tensor, values: list[torch.Tensor]) -> None:
        if isinstance(tensor, DTensor):
            if values:
                tensor.to_local().copy_(values[0])
        else:
            tensor.copy_(values[0])

    def rng_state(self) -> dict:
        state = super().rng_state()
        backend = self.backend
        device_state = backend.profile.get_rng_state(backend.device)
        if device_state is not None:
            state[backend.device.type] = pack_bytes(device_state)
        return state

    def set_rng_state(self, state: dict) -> None:
        super().set_rng_state(state)
        backend = self.backend
        if backend.device.type in state and backend.device.type != "cpu":
            backend.profile.set_rng_state(unpack_bytes(state[backend.device.type]), backend.device)


class SequencePieces(lm_head.Partials):
    """The chunked loss over a sequence split between processes: each scores its piece (the targets reordered
    and cut alike), and the scores are gathered whole, so every process of the group computes the row's loss.
    Their gradients sum over the group (each process's loss is the row's), and FSDP's mean over the processes
    divides that by the group's size again: each row counts once."""

    def __init__(self, shards: int):
        self.shards = shards

    def pieces(self, hidden: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return hidden, sequence.piece(sequence.reorder(targets, self.shards))

    def joined(self, scores: torch.Tensor) -> torch.Tensor:
        return sequence.restore(sequence.gathered(scores, 1), self.shards)


# FSDP2 holds integer parameters (QLoRA's 4-bit base) from pytorch/pytorch#178075: torch 2.13 has it, 2.9 not.
_INTEGER_PARAMS = torch.torch_version.TorchVersion(torch.__version__) >= (2, 13)


class TorchFsdpBackend(Backend):
    capabilities = Capabilities(
        "torch_fsdp", launcher="torchrun", platforms=("cuda", "cpu"), unit="torchrun processes",
        gathers_model_to_generate=True, inference_engine=None,
        offload_params=None,  # FSDP2's CPUOffloadPolicy, on a machine with GPUs
        nonuniform_triple="FSDP2 keeps gradients and optimizer state in the parameters' DTensor layout and cannot "
                          "shard them wider: pytorch/pytorch#148257",
        group_after_forward=None, compile=None, varying_shapes=True,  # fully_shard(reshard_after_forward=k)
        context=None, context_attention="SDPA over keys and values all-gathered in a process group",
        context_attention_keeps=("auto", "sdpa", "sdpa_packed"),  # `xla_shard.sequence`
        # FSDP2 shards the 4-bit layers' uint8 parameters by block and never casts them
        quantization=None if _INTEGER_PARAMS else (f"FSDP2 in torch {torch.__version__} cannot hold the 4-bit "
                                                   "layers' uint8 parameters (pytorch/pytorch#178075); use torch "
                                                   "2.13 or newer"))
    wrapper_prefixes = ("module",)  # DistributedDataParallel (NO_SHARD); fully_shard keeps names as they are
    state_type = Fsdp2State

    @property
    def profile(self) -> DeviceProfile:
        """A GPU where this machine has one, else the CPU."""
        return fsdp2_devices.CUDA if fsdp2_devices.CUDA.present() else fsdp2_devices.CPU

    def setup(self, plan: ShardingPlan) -> None:
        super().setup(plan)
        sequence.split_over(None)
        if plan.context > 1:
            # consecutive ranks split a sequence: inside one fully_shard group, so the axis adds no state
            with forming_a_group():
                group, _ = dist.new_subgroups(group_size=plan.context)
            sequence.split_over(group)
            self.processes.sequence_shards = plan.context
            self.partials = SequencePieces(plan.context)

    def check(self) -> None:
        super().check()
        if self.cfg.fsdp.offload_params and not self.profile.offload:
            self.capabilities.refuse("fsdp.offload_params", "moves parameters from GPU memory to the host; with "
                                     "no CUDA GPU here they are in host memory already: set it to false")

    def advisories(self) -> list[str]:
        if fsdp2_devices.TPU.loaded() and not fsdp2_devices.TPU.present():
            return ["TorchTPU is installed, and torch loads it with every `import torch` (device-backend autoload); "
                    "with no TPU here its runtime asks the GCP metadata server for one at the first backward, 30 "
                    "tries a key. Set TORCH_DEVICE_BACKEND_AUTOLOAD=0 (or uninstall torch_tpu) on this machine"]
        return []

    def local_device_count(self) -> int | None:
        """The processes torchrun starts per node where the command line does not say."""
        return torch.cuda.device_count() if self.profile is fsdp2_devices.CUDA else self.cfg.cpu_devices

    def expected_devices(self, nproc_per_node: int | None = None) -> int | None:
        """Inside torchrun, its world; before it, the processes the launcher will start, per node."""
        if launch.torchrun_worker():
            return int(os.environ.get("WORLD_SIZE", "1"))
        nproc = nproc_per_node or self.cfg.launch.nproc_per_node or self.local_device_count()
        if nproc is None:
            return None
        if nproc < 1:
            raise ConfigError(None, f"--nproc-per-node {nproc}: need at least one process")
        return nproc * self.cfg.launch.nnodes

    def start(self) -> None:
        profile = self.profile
        profile.import_runtime()
        self.device, self.device_kind = profile.select(int(os.environ.get("LOCAL_RANK", "0")))
        if not dist.is_initialized():
            # launch.timeout_s bounds every collective: a node that died stops the others after that long at most
            try:
                meet_as_one_run({**self.cfg.run_identity(), "launch.nnodes": self.cfg.launch.nnodes,
                                 "launch.nproc_per_node": int(os.environ.get("LOCAL_WORLD_SIZE", "1"))},
                                self.cfg.launch.timeout_s)  # node 0's store may be gone (its run over) by now
                with forming_a_group():
                    dist.init_process_group(profile.process_group,
                                            timeout=timedelta(seconds=self.cfg.launch.timeout_s))
            except dist.DistError as exc:
                if not launch.several_nodes():
                    raise
                node = os.environ.get("GROUP_RANK", "?")
                raise launch.PeerLost(f"node {node}: the nodes' processes did not all form one group within "
                                      f"launch.timeout_s={self.cfg.launch.timeout_s:g} (a node stopped, or was "
                                      f"started otherwise): {one_line(exc)[:200]}") from None
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.num_devices = self.world
        self.processes = GroupProcesses(self.rank, self.world, self.device)

    def wrap(self, model: nn.Module) -> nn.Module:
        fsdp = self.cfg.fsdp
        prepare(self, model)
        if self.plan.context > 1:  # an MoE router loss is refused under it when the model is built
            split_sequences(self, model, sequence.TORCH_CONTEXT)
        if fsdp.activation_checkpointing:
            # Non-reentrant checkpointing: kwargs and tensors nested in tuples get exact gradients.
            apply_activation_checkpointing(checkpoint_targets(model, fsdp),
                                           functools.partial(checkpoint, use_reentrant=False))
        units = wrap_targets(model, fsdp)
        if len({p.dtype for p in model.parameters()}) > 1:  # fp32 adapters over a bf16 base (model.lora)
            units = self.method.adapter.trained_modules(model) + units
        if self.cfg.train.compile:
            self._compile(units or [model])
        empty = on_meta(model)  # to be filled by a pretrained load: shard first, then allocate only the shards
        if not empty or self.data_parallel:
            model = self.to_device(model)
        if self.data_parallel and not any(p.requires_grad for p in model.parameters()):
            return model  # a frozen model (DPO's reference), which DistributedDataParallel refuses: replicas as is
        if self.data_parallel:
            device_ids = [self.device.index] if self.device.type != "cpu" else None
            return DistributedDataParallel(model, device_ids=device_ids,
                                           bucket_cap_mb=fsdp.bucket_cap_mb)
        kwargs = dict(mesh=self._mesh(), reshard_after_forward=self.plan.reshard_after_forward)
        if fsdp.bf16_activations:  # parameters cast to bf16 once per unit: the stream follows them
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if fsdp.offload_params:
            kwargs["offload_policy"] = CPUOffloadPolicy()
        for module in units:
            fully_shard(module, **kwargs)
        fully_shard(model, **kwargs)
        if empty:  # offloaded shards live in host memory
            model = self.to_device(model, "cpu" if fsdp.offload_params else None)
        return model

    def _compile(self, modules: list[nn.Module]) -> None:
        """torch.compile in place (`Module.compile`: parameter names stay as they are, so checkpoints and
        pretrained loads do not see it), before sharding as torchtitan does: FSDP2's hooks run outside the
        compiled graphs (dynamo skips them). Dynamo traces activation checkpointing as one region that may not
        change Python state outside it; a block's forward does (transformers' layers, through the `kernels`
        library, set and reset a context variable each call), and the whole block would fall back to eager. As
        torchtitan does, the recompute in backward skips those Python side effects (its tensors are the same)."""
        if hasattr(torch._dynamo.config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):  # torch >= 2.10
            torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
        for module in modules:
            module.compile(backend=self.profile.compile_backend)

    @property
    def data_parallel(self) -> bool:
        """NO_SHARD runs as DDP. Every other strategy runs FSDP2, on one device too: the same mixed-precision
        numerics (parameters cast once per unit, fp32 reduce) whatever the process count, and on one GPU 9%
        faster than DDP with autocast (bench/cuda_mfu.py)."""
        return self.plan.strategy is ShardingStrategy.NO_SHARD

    def _mesh(self):
        with forming_a_group():  # a hybrid mesh forms a group per dimension
            if self.plan.hybrid:
                return self.profile.mesh((self.plan.replicas, self.plan.shard), ("replicate", "shard"))
            return self.profile.mesh((self.world,), ("shard",))

    def place(self, rows):
        if self.plan.context > 1 and isinstance(rows, dict):
            rows = sequence.pieces_of(rows, self.cfg.train.seq_len)
        return super().place(rows)

    def forward_context(self):
        # FSDP2's MixedPrecisionPolicy casts parameters for bf16 activations; DDP (NO_SHARD), and an fp32 stream
        # (fsdp.activation_dtype: float32, fp32 parameters gathered), compute in bf16 under autocast.
        fsdp = self.cfg.fsdp
        enabled = fsdp.mixed_precision == "bf16" and (self.data_parallel or not fsdp.bf16_activations)
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=enabled)

    @contextlib.contextmanager
    def generation_context(self, model: nn.Module):
        """Sampling runs a forward per token, and FSDP2 would all-gather (and free) every unit each time. The units
        stay gathered for the whole generation instead, as TRL gathers a ZeRO-3 policy to generate: one all-gather
        a unit per rollout, the whole model's parameters held meanwhile (the plan counts them)."""
        with self.forward_context(), _gathered_throughout(model):
            yield self.place

    @contextlib.contextmanager
    def grad_sync(self, model: nn.Module, enabled: bool):
        """FSDP2 skips the gradient reduce-scatter (DDP the all-reduce) on all but the last micro-batch."""
        if isinstance(model, FSDPModule):
            model.set_requires_gradient_sync(enabled)
            yield
        elif isinstance(model, DistributedDataParallel) and not enabled:
            with model.no_sync():
                yield
        else:
            yield

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        norm = super().clip_grad_norm(model, max_norm)  # over DTensor shards: the global norm, as a DTensor
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    def mean_loss(self, loss: torch.Tensor) -> float:
        total = loss.detach().float().clone()
        dist.all_reduce(total)
        return total.item() / self.world

    def compilations(self) -> Compiled | None:
        """Graphs torch.compile made so far in this process (train.compile), else None."""
        if not self.cfg.train.compile:
            return None
        from torch._dynamo.utils import calculate_time_spent, counters

        return Compiled(counters["stats"]["unique_graphs"], calculate_time_spent()["total_wall_time"])

    def local_bytes(self, tensors: list[torch.Tensor]) -> list[int]:
        def local(t: torch.Tensor) -> torch.Tensor:
            return t.to_local() if isinstance(t, DTensor) else t
        return [local(t).numel() * t.element_size() for t in tensors]

    def unit_type(self) -> type[nn.Module]:
        return FSDPModule

    @property
    def accelerator(self) -> str:
        return self.profile.accelerator

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


@contextlib.contextmanager
def _gathered_throughout(model: nn.Module):
    """FSDP2's units gathered once for the whole generation, and its forward hooks off meanwhile: a token's forward
    is then the model's own (FSDP2's pre- and post-forward hooks, run for every unit at every token, cost ~13% of
    a small model's GRPO step on a CPU, and would only confirm that the units are gathered). The units are
    unsharded up front with their parameter groups' post-forward mesh cleared (None: keep them gathered), as
    `FSDPModule.set_reshard_after_forward(False)` sets it; that call cannot set back an int or the root's own
    setting, so the groups' values are kept and restored here, with the hooks, and each unit resharded once.
    Where FSDP2 keeps its groups or hooks elsewhere (another torch), the forwards gather as they always do."""
    units = [module for module in model.modules() if isinstance(module, FSDPModule)]
    root = model._get_fsdp_state() if isinstance(model, FSDPModule) else None
    if not units or not hasattr(root, "_lazy_init"):
        yield
        return
    root._lazy_init()  # the root decides its own setting at its first forward: before ours
    groups = [group for unit in units for group in _param_groups(unit)]
    kept = [group.post_forward_mesh_info for group in groups]
    for group in groups:
        group.post_forward_mesh_info = None
    hooks = _forward_hooks(units) if groups else None
    try:
        if hooks is not None:
            for unit in units:
                unit.unshard()
            hooks.remove()
        yield
    finally:
        if hooks is not None:
            hooks.restore()
        for group, info in zip(groups, kept):
            group.post_forward_mesh_info = info
        for unit in units:
            unit.reshard()


class _StashedHooks:
    """FSDP2's forward hooks on its units, taken out of the modules' hook dictionaries and put back in their
    places (the dictionaries' order is the hooks' order)."""

    def __init__(self, handles: list):
        self.handles = handles
        self.dicts = {id(d): d for h in handles for ref in (h.hooks_dict_ref, *h.extra_dict_ref)
                      if (d := ref()) is not None}
        self.saved: dict[int, list] = {}

    def remove(self) -> None:
        self.saved = {key: list(d.items()) for key, d in self.dicts.items()}
        for handle in self.handles:
            handle.remove()

    def restore(self) -> None:
        for key, d in self.dicts.items():
            added = [(k, v) for k, v in d.items() if k not in dict(self.saved.get(key, ()))]
            d.clear()
            d.update(self.saved.get(key, ()))
            d.update(added)


def _forward_hooks(units: list) -> _StashedHooks | None:
    """The handles of FSDP2's forward hooks on `units` (a multi-module unit's handle holds one per module), or
    None where this torch keeps them otherwise."""
    handles = []
    for unit in units:
        state = unit._get_fsdp_state()
        for name in ("_pre_forward_hook_handle", "_post_forward_hook_handle"):
            handle = getattr(state, name, None)
            for one in getattr(handle, "handles", (handle,)):
                if not hasattr(one, "hooks_dict_ref"):
                    return None
                handles.append(one)
    return _StashedHooks(list({id(h): h for h in handles}.values()))


def _param_groups(unit: FSDPModule) -> list:
    state = unit._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)  # newer torch: a list
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [] if group is None else [group]
    return [group for group in groups if hasattr(group, "post_forward_mesh_info")]
