"""torch_xla FSDPv1 (`XlaFullyShardedDataParallel`): one process per device, launched by `xmp.spawn`.

On XLA's CPU client only world size 1 runs: every cross-replica collective dies in XLA's CPU rendezvous
(threads arrive with different op ids; torch_xla's own CPU CI skips those tests), so multi-replica FSDPv1 is a
TPU-only path.
"""

from __future__ import annotations

import functools
import inspect
import math

import torch
from torch import nn

from xla_shard.backends import xla_common
from xla_shard.backends.base import prepare
from xla_shard.backends.processes import Processes
from xla_shard.backends.state import BackendState, optimizer_state
from xla_shard.capabilities import Capabilities
from xla_shard.checkpoint.contract import StateTensor, range_to_boxes
from xla_shard.methods import GENERATION, REFERENCE_MODEL
from xla_shard.config.schema import ShardingStrategy

_HYBRID = "needs a 2-D mesh; use backend xla_spmd (replica x fsdp mesh) for hybrid sharding"


class XlaProcesses(Processes):
    """`xmp.spawn`'s processes, one per device: torch_xla's rendezvous and mesh_reduce are how they agree."""

    @property
    def local_leader(self) -> bool:
        import torch_xla.runtime as xr

        return xr.local_ordinal() == 0

    def barrier(self) -> None:
        import torch_xla.core.xla_model as xm

        if self.count > 1:
            xm.rendezvous("xla_shard.barrier")

    def any_rank(self, flag: bool) -> bool:
        import torch_xla.core.xla_model as xm

        return flag if self.count == 1 else xm.mesh_reduce("preempt", flag, any)

    def total(self, counts: list[int]) -> list[int]:
        import torch_xla.core.xla_model as xm

        if self.count == 1:
            return list(counts)
        return xm.mesh_reduce("tokens", list(counts), lambda every: [sum(column) for column in zip(*every)])


class FsdpV1State(BackendState):
    """Each FSDPv1 parameter is a 1-D shard: rank r holds elements [r*L, (r+1)*L) of the original parameter
    flattened (or, with flatten_parameters, of several originals laid end to end), then padding. Each
    original's part of that range is a contiguous run of its elements, which is a few boxes of its shape."""

    def _pieces(self, module_name: str, module, shard) -> list[tuple[str, tuple[int, ...], int, int, int]]:
        """(original name, shape, start in the shard, start in the original's elements, count) per original."""
        prefix = f"{module_name}." if module_name else ""
        flat = module.module  # XlaFlattenParamsWrapper
        base = shard._orig_name.rsplit(".", 1)
        if base[-1].startswith("flat_param_"):
            names, shapes, numels = flat.metadata(int(base[-1][len("flat_param_"):]))
            owner = f"{prefix}{base[0]}." if len(base) == 2 else prefix
            originals = [(f"{owner}{n}", tuple(sh), n_el) for n, sh, n_el in zip(names, shapes, numels)]
        else:
            originals = [(f"{prefix}{shard._orig_name}", tuple(shard._orig_size), math.prod(shard._orig_size))]
        length = shard.numel()
        rank = self.backend.rank
        lo, hi = rank * length, (rank + 1) * length  # this rank's range of the full flat parameter
        pieces, start = [], 0
        for name, shape, numel in originals:
            a, b = max(lo, start), min(hi, start + numel)
            if a < b:
                pieces.append((self.canonical(name), shape, a - lo, a - start, b - a))
            start += numel
        return pieces

    def tensors(self, model, optimizer=None, stored=None) -> list[StateTensor]:
        from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel

        tensors = []
        for module_name, module in model.named_modules():
            if not isinstance(module, XlaFullyShardedDataParallel):
                continue
            module_name = self.canonical(module_name)
            for shard in module.sharded_params:
                pieces = self._pieces(module_name, module, shard)
                host = functools.lru_cache(maxsize=None)(lambda t: t.detach().cpu())
                opt_state = optimizer.state[shard] if optimizer is not None else None
                for name, shape, at, first, count in pieces:
                    tensors.append(self._piece(f"model/{name}", shard, shape, at, first, count, host))
                    if opt_state is None:
                        continue
                    for key, value in optimizer_state(opt_state, name, stored, shape,
                                                      lambda shard=shard: torch.zeros_like(shard)):
                        if value.dim() == 0:
                            tensors += self.state_tensors([f"optim/{name}/{key}"], value, stacked=False)
                        else:
                            tensors.append(self._piece(f"optim/{name}/{key}", value, shape, at, first, count, host))
        return tensors

    def _piece(self, name, tensor, shape, at, first, count, host) -> StateTensor:
        boxes = range_to_boxes(shape, first, first + count)

        def chunks():
            data, out, pos = host(tensor), [], at
            for offsets, sizes in boxes:
                n = math.prod(sizes)
                out.append((offsets, data[pos:pos + n].reshape(sizes).clone()))
                pos += n
            return out

        @torch.no_grad()
        def fill(values):
            flat = torch.cat([v.reshape(-1) for v in values]).to(tensor.dtype)
            tensor[at:at + count].copy_(flat.to(tensor.device))

        return StateTensor(name, shape, tensor.dtype, chunks, lambda: boxes, fill)


class XlaFsdpBackend(xla_common.XlaBackend):
    capabilities = Capabilities(
        "xla_fsdp", launcher="xmp_spawn", platforms=("tpu", "cpu"), torch_xla=True, unit="replicas",
        offload_params=xla_common.XlaBackend.NO_OFFLOAD, xla_settings=None,
        strategies={ShardingStrategy.NO_SHARD: "is data parallelism; use backend xla_spmd with NO_SHARD, which runs "
                                               "it without FSDP",
                    ShardingStrategy.HYBRID_SHARD: _HYBRID, ShardingStrategy.HYBRID_SHARD_ZERO2: _HYBRID},
        nonuniform_triple="XlaFullyShardedDataParallel's gradients and optimizer state live in its flat parameter "
                          "shards",
        group_after_forward="XlaFullyShardedDataParallel's reshard_after_forward is a bool",
        scan_layers="XlaFullyShardedDataParallel gathers each layer's flat parameters in hooks, which a scanned layer "
                    "does not run",
        lora="XlaFullyShardedDataParallel flattens a unit's parameters into one shard with one requires_grad, so "
             "frozen weights and trained adapters cannot share a unit",
        experts=xla_common.XlaBackend.EXPERTS, router_aux_loss=xla_common.XlaBackend.ROUTER_AUX_LOSS)
    wrapper_prefixes = ("_fsdp_wrapped_module", "_fpw_module")
    state_type = FsdpV1State

    def check(self) -> None:
        super().check()
        self._check_xla_settings()
        method = self.method
        for need in (REFERENCE_MODEL, GENERATION):
            if need in method.needs:
                self.capabilities.refuse("method", f"{method.name} needs {need}, which xla_shard does not run as "
                                                   "XlaFullyShardedDataParallel: use xla_spmd")
        if not xla_common.on_tpu() and self.cfg.cpu_devices != 1:
            self.capabilities.refuse("cpu_devices", f"FSDPv1 runs on XLA's CPU client at 1 device only (got "
                                                    f"{self.cfg.cpu_devices}): its multi-replica collectives fail "
                                                    "there. Use xla_spmd for CPU sharding")

    def _check_xla_settings(self) -> None:
        """Each key an argument of the installed XlaFullyShardedDataParallel (without torch_xla, `check_runtime`
        refuses the run before anything could pass them on)."""
        if not self.cfg.fsdp.xla_settings or not xla_common.xla_installed():
            return
        self.configure()
        from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel

        accepted = set(inspect.signature(XlaFullyShardedDataParallel.__init__).parameters) - {"self", "module"}
        owned = {"reshard_after_forward", "compute_dtype", "auto_wrap_policy", "auto_wrapper_callable"}
        refuse = self.capabilities.refuse
        for key in self.cfg.fsdp.xla_settings:
            if key in owned:
                refuse(f"fsdp.xla_settings.{key}", "set by xla_shard from the fsdp section; remove it here")
            if key not in accepted:
                refuse(f"fsdp.xla_settings.{key}", "not an argument of XlaFullyShardedDataParallel")

    def start(self) -> None:
        self.configure()
        import torch_xla
        import torch_xla.runtime as xr

        self.device = torch_xla.device()
        self.device_kind = xla_common.device_kind()
        self.rank, self.world = xr.global_ordinal(), xr.world_size()
        self.num_devices = self.world
        self.processes = XlaProcesses(self.rank, self.world)

    def wrap(self, model: nn.Module) -> nn.Module:
        from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel

        fsdp = self.cfg.fsdp
        prepare(self, model)
        policy = self.prepare_wrap(model)
        settings = dict(fsdp.xla_settings)
        settings["reshard_after_forward"] = self.plan.reshard_after_forward
        if fsdp.bf16_activations:  # parameters cast to bf16 for compute; an fp32 stream runs under autocast
            settings["compute_dtype"] = torch.bfloat16
        return XlaFullyShardedDataParallel(self.to_device(model), auto_wrap_policy=policy, **settings)

    def forward_context(self):
        """bf16 activations: the wrapper computes with bf16 parameters (compute_dtype). An fp32 stream
        (fsdp.activation_dtype: float32) runs under autocast instead."""
        fsdp = self.cfg.fsdp
        return torch.autocast("xla", dtype=torch.bfloat16,
                              enabled=fsdp.mixed_precision == "bf16" and not fsdp.bf16_activations)

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """The root wrapper's own clipping: the norm over every rank's flat shards."""
        return model.clip_grad_norm_(max_norm)

    def mean_loss(self, loss: torch.Tensor) -> float:
        import torch_xla.core.xla_model as xm

        if self.world == 1:
            return loss.item()
        return xm.mesh_reduce("loss", loss.item(), lambda values: sum(values) / len(values))

    def unit_type(self) -> type[nn.Module]:
        from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel

        return XlaFullyShardedDataParallel

    def local_bytes(self, tensors: list[torch.Tensor]) -> list[int]:
        return [t.numel() * t.element_size() for t in tensors]
