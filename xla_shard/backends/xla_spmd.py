"""torch_xla SPMD FSDPv2 (`SpmdFullyShardedDataParallel`): one process per host, devices sharded by a mesh.

Mesh axes are ("replica", "fsdp"): parameters are sharded over `fsdp` and replicated over `replica`, the batch
is split over both. On a multi-slice pod, `replica` is the slow (DCN) axis, which is what HYBRID_SHARD wants.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
from torch import nn

from xla_shard.backends import xla_common
from xla_shard.checkpoint.contract import Box, Chunk
from xla_shard.config.schema import ShardingStrategy

_NOT_UNDER_SPMD = ("is not expressible under SPMD (XLA's partitioner schedules the all-gathers); use FULL_SHARD, "
                   "HYBRID_SHARD or NO_SHARD")


class XlaSpmdBackend(xla_common.XlaBackend):
    name = "xla_spmd"
    wrapper_prefixes = ("_orig_module",)
    unsupported_strategies = {ShardingStrategy.SHARD_GRAD_OP: _NOT_UNDER_SPMD,
                              ShardingStrategy.HYBRID_SHARD_ZERO2: _NOT_UNDER_SPMD}

    def setup(self) -> None:
        self.configure()
        import torch_xla
        import torch_xla.distributed.spmd as xs
        import torch_xla.runtime as xr

        xr.use_spmd()
        # FSDPv2 hangs a gradient barrier hook on the root too; transformers' ModelOutput root cannot take it.
        warnings.filterwarnings("ignore", message="For backward hooks to be called")
        self.num_devices = xr.global_runtime_device_count()
        self.local_devices = xr.addressable_runtime_device_count()
        self.plan = self.resolve_plan(self.num_devices)
        self.mesh = xs.Mesh(np.arange(self.num_devices), (self.plan.replicas, self.plan.shard), ("replica", "fsdp"))
        xs.set_global_mesh(self.mesh)
        self.device = torch_xla.device()
        self.device_kind = xla_common.device_kind()
        self.host_index, self.hosts = xr.process_index(), xr.process_count()
        self._param_specs: dict[torch.Tensor, tuple] = {}
        # Every host builds the same global batch from (seed, step); mark_sharding sends each device its rows.
        self.rank, self.world = 0, 1
        self._batch_axes = ("replica", "fsdp")

    @property
    def is_main(self) -> bool:
        return self.host_index == 0

    @property
    def writer(self) -> tuple[int, int]:
        return self.host_index, self.hosts  # each host writes the shards on its own devices

    def wrap(self, model: nn.Module) -> nn.Module:
        from torch_xla.experimental.spmd_fully_sharded_data_parallel import SpmdFullyShardedDataParallel

        policy = self.prepare_wrap(model)
        if self.plan.replicate_only:
            return self.to_device(model)  # replicated parameters; the sharded batch makes it data-parallel
        wrapped = SpmdFullyShardedDataParallel(
            self.to_device(model), mesh=self.mesh, shard_output=self._shard_output, auto_wrap_policy=policy,
            extra_data_axis="replica")
        self._shard_gradients_like_params(wrapped)
        return wrapped

    def _shard_gradients_like_params(self, model: nn.Module) -> None:
        """Left alone, GSPMD materialises gradients replicated (an all-reduce, full size on every device).
        Annotating each gradient with its parameter's sharding turns that into a reduce-scatter."""
        import torch_xla.distributed.spmd as xs
        from torch_xla.experimental.spmd_fully_sharded_data_parallel import _prepare_spmd_partition_spec

        def shard_like(spec):
            def hook(param: torch.Tensor) -> None:
                xs.mark_sharding(param.grad, self.mesh, spec)
            return hook

        for param in model.parameters():
            # FSDPv2's own placement rule for parameters, computed once, so gradient and parameter shards line up.
            spec = self._param_specs[param] = _prepare_spmd_partition_spec(param, shard_maximal=True)
            param.register_post_accumulate_grad_hook(shard_like(spec))

    def _shard_output(self, output, mesh) -> None:
        """Inner layers return hidden states, the root a ModelOutput: shard whichever tensor leads, by batch."""
        import torch_xla.distributed.spmd as xs

        tensor = output if isinstance(output, torch.Tensor) else (
            output[0] if isinstance(output, tuple) else output.logits)
        xs.mark_sharding(tensor, mesh, (self._batch_axes,) + (None,) * (tensor.dim() - 1))

    def place(self, rows):
        """The host's rows (one host: the whole global batch), sharded by rows over every device of the mesh."""
        import torch_xla.distributed.spmd as xs

        if isinstance(rows, dict):
            return {key: self.place(value) for key, value in rows.items()}
        batch = rows.to(self.device)
        xs.mark_sharding(batch, self.mesh, (self._batch_axes,) + (None,) * (batch.dim() - 1))
        return batch

    def forward_context(self):
        return torch.autocast("xla", dtype=torch.bfloat16, enabled=self.cfg.fsdp.mixed_precision == "bf16")

    def mean_loss(self, loss: torch.Tensor) -> float:
        return loss.item()  # already the global-batch mean: SPMD computes one global program

    def unit_type(self) -> type[nn.Module]:
        from torch_xla.experimental.spmd_fully_sharded_data_parallel import SpmdFullyShardedDataParallel

        return SpmdFullyShardedDataParallel

    def local_bytes(self, tensors: list[torch.Tensor]) -> list[int]:
        import torch_xla
        import torch_xla.core.xla_model as xm

        xm.wait_device_ops()  # shard handles are unreadable while the step is still executing
        shards = torch_xla._XLAC._get_local_shards(list(tensors))
        return [max(data.numel() for data, _ in per_tensor) * t.element_size()
                for t, per_tensor in zip(tensors, shards)]

    # ---- checkpoint state: each host reads and writes the shards on its own devices ---------------
    @staticmethod
    def _shard_boxes(tensor: torch.Tensor) -> list[tuple[int, Box]]:
        """(replica id, box) for each local device's shard, in the runtime's device order."""
        import torch_xla
        import torch_xla.core.xla_model as xm

        # Shard indices, like shard data, are unreadable while an async execution still produces the tensor:
        # XLA aborts with "Trying to access XLA data ... while an async operation is in flight".
        xm.wait_device_ops()
        boxes = []
        for replica, indices in torch_xla._XLAC._get_local_shard_replica_and_indices([tensor])[0]:
            if indices is Ellipsis:
                boxes.append((replica, ((0,) * tensor.dim(), tuple(tensor.shape))))
            else:
                boxes.append((replica, (tuple(s.start for s in indices), tuple(s.stop - s.start for s in indices))))
        return boxes

    def local_chunks(self, tensor: torch.Tensor) -> list[Chunk]:
        if tensor.device.type != "xla":
            return super().local_chunks(tensor)
        import torch_xla
        import torch_xla.core.xla_model as xm

        xm.wait_device_ops()
        chunks, seen = [], set()
        shards = torch_xla._XLAC._get_local_shards([tensor])[0]  # host copies, one per local device
        for (data, _), (replica, (offsets, sizes)) in zip(shards, self._shard_boxes(tensor)):
            if replica != 0 or offsets in seen or 0 in sizes:
                continue
            seen.add(offsets)
            chunks.append((offsets, data[tuple(slice(0, n) for n in sizes)]))  # drop XLA's padding
        return chunks

    def local_boxes(self, tensor: torch.Tensor) -> list[Box]:
        if tensor.device.type != "xla":
            return super().local_boxes(tensor)
        return [box for _, box in self._shard_boxes(tensor)]

    @torch.no_grad()
    def fill_local(self, tensor: torch.Tensor, values: list[torch.Tensor]) -> None:
        if tensor.device.type != "xla":
            return super().fill_local(tensor, values)
        import torch_xla
        import torch_xla.core.xla_model as xm

        if all(tuple(v.shape) == tuple(tensor.shape) for v in values):
            tensor.copy_(values[0].to(tensor.device))  # replicated: no shards to place
            return
        xm.wait_device_ops()
        devices = [device for _, device in torch_xla._XLAC._get_local_shards([tensor])[0]]
        padded = [max(v.shape[d] for v in values) for d in range(tensor.dim())]  # XLA pads uneven shards
        datas = [torch.nn.functional.pad(v, [p for d in reversed(range(v.dim())) for p in (0, padded[d] - v.shape[d])])
                 for v in values]
        torch_xla._XLAC._load_local_shards(tensor, datas, devices)

    def zeros_like(self, param: torch.Tensor) -> torch.Tensor:
        import torch_xla
        import torch_xla.distributed.spmd as xs

        zeros = torch.zeros_like(param)
        spec = self._param_specs.get(param)
        if spec:
            xs.mark_sharding(zeros, self.mesh, spec)
        torch_xla.sync()  # shards exist only once the tensor is materialised
        return zeros

    def rng_state(self) -> dict:
        import torch_xla.core.xla_model as xm

        return {**super().rng_state(), "xla": int(xm.get_rng_state())}

    def set_rng_state(self, state: dict) -> None:
        import torch_xla.core.xla_model as xm

        super().set_rng_state(state)
        if "xla" in state:
            xm.set_rng_state(state["xla"])
