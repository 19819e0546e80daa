"""torch_xla SPMD FSDPv2 (`SpmdFullyShardedDataParallel`): one process per host, devices sharded by a mesh.

Parameters, gradients and optimizer state each get their own sharding (the plan's P/G/OS triple, AMSP-style),
on one mesh whose axes nest, outermost first:

    replica (N/OS) x optimizer (OS/G) x grads (G/P) x fsdp (P)

A parameter's largest dimension is split over `fsdp` (FSDPv2's rule), its gradient's over `fsdp` x `grads`,
its AdamW state's over `fsdp` x `grads` x `optimizer`: each device's optimizer-state shard lies inside its
gradient shard, which lies inside its parameter shard. XLA's partitioner then emits what the triple implies
(gathers over P, a gradient reduce-scatter over G and all-reduce across the rest, the updated shard gathered
from OS back to P). Consecutive device ids are the closest devices, so the inner axes stay on the fast links;
on a multi-slice pod a HybridMesh puts the slices on the outermost axes (DCN). The batch is split over all
four axes. A named strategy is the uniform triple: FULL_SHARD N/N/N, HYBRID_SHARD k/k/k (N/k replicas),
NO_SHARD 1/1/1.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from xla_shard import sequence
from xla_shard.backends import xla_common, xla_generation, xla_scan
from xla_shard.backends.base import on_meta, prepare, retie, split_sequences
from xla_shard.backends.processes import GroupProcesses, Processes, forming_a_group
from xla_shard.backends.state import BackendState
from xla_shard.capabilities import Capabilities
from xla_shard.checkpoint.contract import Box, Chunk
from xla_shard.config.schema import ShardingStrategy

MESH_AXES = ("replica", "optimizer", "grads", "fsdp", "context")  # outermost (slowest links) first
ROW_AXES = MESH_AXES[:-1]  # what a batch's rows are split over; `context` splits each row's tokens
_NOT_UNDER_SPMD = ("is not expressible under SPMD (XLA's partitioner schedules the all-gathers); use FULL_SHARD, "
                   "HYBRID_SHARD or NO_SHARD")


def slices_outermost(shape: tuple[int, ...], slices: int) -> tuple[int, ...] | None:
    """How many slices each mesh axis spans (HybridMesh's dcn_mesh_shape), the outermost axes taking them
    first; None if the axis sizes cannot split the slice count."""
    dcn, left = [], slices
    for size in shape:
        dcn.append(math.gcd(size, left))
        left //= dcn[-1]
    return tuple(dcn) if left == 1 else None


def placeholder(like: torch.Tensor) -> torch.Tensor:
    """An XLA tensor shaped as `like` with no buffer (torch_xla's `create_placeholder_tensor`): traced, never read."""
    from torch_xla.core.xla_builder import create_placeholder_tensor

    return create_placeholder_tensor(tuple(like.shape), like.dtype)


def annotator(mesh, spec: tuple) -> Callable[[torch.Tensor], None]:
    """`xs.mark_sharding(tensor, mesh, spec)` with the spec resolved once, for annotations made every step.

    torch_xla 2.9's `mark_sharding` tries to import jax and torchax on every call (0.63 ms per call measured on a
    2-core host without them installed: failed imports are not cached) and wraps its result in an
    XLAShardedTensor; the C++ annotation it ends in takes 6 us. Made per gradient per step, that overhead was
    FULL_SHARD's 7% over raw FSDPv2 (bench/step_overhead.py); the compiled program is the same either way."""
    import torch_xla

    op_sharding, mark = mesh.get_op_sharding(spec), torch_xla._XLAC._xla_mark_sharding
    return lambda tensor: mark(tensor, op_sharding)


class _UsedWhole(torch.autograd.Function):
    """A sharded weight gathered whole for its use (forward), its gradient annotated with the gradient's own
    sharding (backward): FSDP's all-gather and reduce-scatter, spelt for XLA's partitioner inside a loop body
    that AOTAutograd traces (torch_xla's `aot_mark_sharding` op, as `mark_sharding_with_gradients` uses)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, mesh: str, grads: str) -> torch.Tensor:
        from torch_xla.distributed.spmd.xla_sharding import _aot_mark_sharding

        ctx.mesh, ctx.grads = mesh, grads
        return _aot_mark_sharding(tensor, mesh, str((None,) * tensor.dim()))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        from torch_xla.distributed.spmd.xla_sharding import _aot_mark_sharding

        return _aot_mark_sharding(grad, ctx.mesh, ctx.grads), None, None


def _annotated(tensor: torch.Tensor, sharding) -> torch.Tensor:
    """A copy of `tensor` whose value is annotated with `sharding` (an OpSharding), as XLA's partitioner is to lay
    it out. Annotated rather than marked: marking lays out data, and refuses a tensor already laid out."""
    import torch_xla

    copy = tensor.clone()
    torch_xla._XLAC._xla_annotate_custom_sharding(copy, sharding)
    return copy


class GenerationPlacer:
    """Where a generation's tensors go on xla_spmd: rows over the generation mesh's `rows` axis (each host's rows
    on its own devices), everything else whole. `layout_program`: the traced program that lays the weights out
    (`xla-shard compile`; None where it ran)."""

    def __init__(self, backend, mesh):
        self.backend, self.mesh = backend, mesh
        self.layout_program: bytes | None = None

    def __call__(self, rows):
        return {key: self._one(value) for key, value in rows.items()} if isinstance(rows, dict) else self._one(rows)

    def spec(self, tensor: torch.Tensor) -> tuple:
        return (("rows",) + (None,) * (tensor.dim() - 1)) if tensor.dim() else ()

    def laid_out(self, tensor: torch.Tensor) -> torch.Tensor:
        """A device tensor (a placeholder) annotated with the layout a generation's tensor of its rows has."""
        return _annotated(tensor, self.mesh.get_op_sharding(self.spec(tensor)))

    def _one(self, tensor: torch.Tensor) -> torch.Tensor:
        import torch_xla.core.xla_model as xm
        import torch_xla.distributed.spmd as xs

        backend = self.backend
        if backend.processes.count > 1:
            sharding = xs.ShardingSpec(self.mesh, self.spec(tensor), minibatch=True)
            return xm.send_cpu_data_to_device(tensor, backend.device, input_sharding=sharding)[0]
        placed = tensor.to(backend.device)
        xs.mark_sharding(placed, self.mesh, self.spec(placed))
        return placed


class _Gathered(torch.autograd.Function):
    """A sharded weight whole on every device (forward), its gradient annotated with the gradient's own layout
    (backward): one gather, and one reduction where the gradient arrives summed."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, whole, grads) -> torch.Tensor:
        ctx.grads = grads
        return _annotated(tensor, whole)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _annotated(grad, ctx.grads), None, None


class _Moved(torch.autograd.Function):
    """A tensor laid out by each of `layouts` in turn (forward), and its gradient the same way back (backward).
    Left unannotated, the gradient's way back is the partitioner's to choose: for the embedding's rows on
    several slices it gathered every device's rows over DCN and kept its own columns, where the way forward was
    an all-to-all inside the slice."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, layouts) -> torch.Tensor:
        ctx.layouts = layouts
        for layout in layouts:
            tensor = _annotated(tensor, layout)
        return tensor

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        for layout in reversed(ctx.layouts):
            grad = _annotated(grad, layout)
        return grad, None


class SpmdPartials(xla_common.XlaPartials):
    """The chunked loss under SPMD (`lm_head.Partials`): each device scores its own rows against the head's
    weight gathered whole once (`_Gathered`), and keeps its partial sum of the weight's gradient until one sum
    over the devices after the last chunk. Where the gradient's layout splits one dimension over every device,
    that sum is an all-to-all of each device's partial sum, a block per device, and a local sum: a
    reduce-scatter's bytes. Left to itself, the partitioner keeps the head split over the vocabulary and gathers
    every chunk's hidden states from all devices (on Llama-3-8B's shape, 3 GiB more gathers per step), or
    reduce-scatters the weight's gradient once per chunk (32 times the bytes); a sum over devices left to the
    TPU compiler is an all-reduce of the whole table (docs/planner.md)."""

    def __init__(self, backend: XlaSpmdBackend):
        self.backend = backend
        self.devices = backend.num_devices
        self.shards = backend.plan.context
        # what the chunked loss's rows are split over: a row's tokens are split over `context`, and scored as
        # that many rows of their own (`lm_head.Scorer`)
        self.axes = MESH_AXES if self.shards > 1 else ROW_AXES

    def pieces(self, hidden: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A split sequence's pieces scored as rows of their own, the targets reordered alike."""
        if self.shards == 1:
            return hidden, targets
        rows, tokens = targets.shape
        return (hidden.reshape(rows * self.shards, tokens // self.shards, *hidden.shape[2:]),
                sequence.reorder(targets, self.shards).reshape(rows * self.shards, tokens // self.shards))

    def joined(self, scores: torch.Tensor) -> torch.Tensor:
        if self.shards == 1:
            return scores
        return sequence.restore(scores.reshape(scores.shape[0] // self.shards, -1), self.shards)

    def _split(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        spec = [None] * tensor.dim()
        spec[dim] = self.axes
        return _annotated(tensor, self.backend.mesh.get_op_sharding(tuple(spec)))

    def rows(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._split(tensor.reshape(self.devices, tensor.shape[0] // self.devices, *tensor.shape[1:]), 0)

    def whole(self, param: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        layouts, mesh = self.backend.layouts.get(param), self.backend.mesh
        if layouts is None or self.backend.plan.params == 1:
            return param.to(dtype)
        return _Gathered.apply(param.to(dtype), mesh.get_op_sharding((None,) * param.dim()),
                               mesh.get_op_sharding(layouts.grads))

    def hold(self, partial: torch.Tensor) -> None:
        import torch_xla

        spec = (self.axes,) + (None,) * (partial.dim() - 1)
        torch_xla._XLAC._xla_annotate_custom_sharding(partial, self.backend.mesh.get_op_sharding(spec))

    def summed(self, partial: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
        layouts, mesh = self.backend.layouts.get(param), self.backend.mesh
        split = next((d for d, axes in enumerate(layouts.grads) if axes is not None), None) if layouts else None
        shape = partial.shape[1:]
        if split is None:
            return partial.sum(0)  # the gradient is not split: the sum is XLA's to lay out
        axes = layouts.grads[split]
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        blocks = math.prod(mesh.mesh_shape[mesh.axis_names.index(axis)] for axis in axes)
        if shape[split] % blocks:
            return partial.sum(0)
        # each device's partial sums of one block, from the devices the gradient is split over; replicas (the
        # axes it is not split over) keep theirs, summed over them afterwards: an all-reduce of a block
        spec = [None] * (partial.dim() + 1)
        spec[0] = tuple(axis for axis in self.axes if axis not in axes) or None
        spec[1 + split] = axes
        moved = partial.reshape(self.devices, *shape[:split], blocks, shape[split] // blocks, *shape[split + 1:])
        return _annotated(moved, mesh.get_op_sharding(tuple(spec))).sum(0).reshape(shape)


@dataclass(frozen=True)
class Layouts:
    """One parameter's partition specs over `MESH_AXES`: nested, so every shard lies inside the one before."""

    params: tuple
    grads: tuple
    optimizer: tuple

    @classmethod
    def of(cls, param: torch.Tensor, stacked: bool = False, dim: int | None = None,
           axes: tuple[str, ...] = ("fsdp",)) -> Layouts:
        """FSDPv2's rule: the largest dimension is split (or `dim`, where given), over `axes` (`fsdp`, and
        `context` where the sequence is split: parameters span it). A stacked parameter ([layers, ...], scanned
        layers) is split inside each layer, as that layer alone would be: the scan slices the first dimension."""
        from torch_xla.experimental.spmd_fully_sharded_data_parallel import _prepare_spmd_partition_spec

        shape, lead = tuple(param.shape), int(stacked)
        if dim is None:
            # FSDPv2's own rule (the largest dim), asked of one layer's shape for a stack.
            spec = _prepare_spmd_partition_spec(torch.empty(shape[lead:], device="meta"), shard_maximal=True)
            if not spec:
                return cls((None,) * len(shape), (None,) * len(shape), (None,) * len(shape))  # replicated
            dim = lead + spec.index("fsdp")

        def over(*names):
            return tuple((names if len(names) > 1 else names[0]) if d == dim else None for d in range(len(shape)))

        return cls(over(*axes), over(*axes, "grads"), over(*axes, "grads", "optimizer"))


class SpmdState(BackendState):
    """Each host reads and writes the shards on its own devices; a stacked tensor (scanned layers) goes out as
    its layers."""

    def layer_names(self, model: nn.Module) -> dict[str, list[str]]:
        return xla_scan.layer_names(model, self.canonical)

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

        backend = self.backend
        zeros = placeholder(param) if backend.placeholders else torch.zeros_like(param)
        layouts = backend.layouts.get(param)
        if layouts:
            backend.mark(zeros, layouts.optimizer)
        if not backend.placeholders:
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


class XlaSpmdBackend(xla_common.XlaBackend):
    capabilities = Capabilities(
        "xla_spmd", launcher="in_process", platforms=("tpu", "cpu"), torch_xla=True,
        offload_params=xla_common.XlaBackend.NO_OFFLOAD,
        strategies={ShardingStrategy.SHARD_GRAD_OP: _NOT_UNDER_SPMD,
                    ShardingStrategy.HYBRID_SHARD_ZERO2: _NOT_UNDER_SPMD},
        nonuniform_triple=None,  # per-tensor annotations: any nested triple
        group_after_forward="XLA's partitioner decides what it keeps from forward for backward",
        scan_layers=None, gathers_per_tensor=True, reduces_every_micro_batch=True,
        context=None, context_attention="splash attention on TPUs, eager attention elsewhere",
        context_attention_keeps=("auto", "eager", "xla_pallas"),
        gathers_model_to_generate=True, generation_split=None,
        experts=xla_common.XlaBackend.EXPERTS, router_aux_loss=xla_common.XlaBackend.ROUTER_AUX_LOSS,
        quantization=None)  # the 4-bit layers' uint8 parameters sharded by block like any other
    wrapper_prefixes = ("_orig_module",)
    state_type = SpmdState

    def check(self) -> None:
        super().check()
        if self.cfg.fsdp.scan_layers:
            xla_common.check_jax_interop(xla_scan.KEY, "torch_xla's scan under SPMD", "set it to false")
        if self.cfg.mesh.context > 1:
            xla_common.check_jax_interop("mesh.context", "the sequence axis (splash attention's TPU kernel)",
                                         "set it to 1")

    def start(self) -> None:
        self.configure()
        import torch_xla
        import torch_xla.runtime as xr

        xr.use_spmd()
        xla_common.import_torchax_quietly()
        # FSDPv2 hangs a gradient barrier hook on the root too; transformers' ModelOutput root cannot take it.
        warnings.filterwarnings("ignore", message="For backward hooks to be called")
        # ... and where the layers' inputs need no gradient (a frozen embedding under LoRA) torch says the hook
        # fires for the outputs' gradients: the barrier still covers the step's gradients.
        warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed")
        self.num_devices = xr.global_runtime_device_count()
        self.local_devices = xr.addressable_runtime_device_count()
        self.device = torch_xla.device()
        self.device_kind = xla_common.device_kind()
        # Each host writes the shards on its own devices, and reads its part of every batch.
        self.processes = self._host_processes(xr.process_index(), xr.process_count())
        self.layouts: dict[torch.Tensor, Layouts] = {}
        self._split_dims: dict[nn.Parameter, int] = {}  # parameters split along another dim than the largest
        self._row_marks: dict[tuple, Callable[[torch.Tensor], None]] = {}  # by tensor rank and token dim
        self._host_rows: dict[tuple, object] = {}  # the same: minibatch input shardings (several hosts)
        self._generating = False  # inside `generation_context`: training's annotations of activations are off
        # One program over every device: one loss, nothing averaged over processes.
        self.rank, self.world = 0, 1
        self._batch_axes = ROW_AXES

    @staticmethod
    def _host_processes(index: int, count: int) -> Processes:
        """Several hosts agree (barriers, preemption, token counts) over a gloo group whose rendezvous is
        torch_xla's `xla://`: rank = process_index, world = process_count, the master found from the TPU
        metadata (or MASTER_ADDR), as torch_xla's distributed checkpointing does."""
        if count == 1:
            return Processes()
        import torch.distributed as dist
        import torch_xla.distributed.xla_backend  # noqa: F401  (registers xla://)

        if not dist.is_initialized():
            with forming_a_group():
                dist.init_process_group("gloo", init_method="xla://")
        return GroupProcesses(index, count, torch.device("cpu"))

    def setup(self, plan) -> None:
        import torch_xla.distributed.spmd as xs

        super().setup(plan)
        self.mesh = self._build_mesh()
        xs.set_global_mesh(self.mesh)
        self.partials = SpmdPartials(self)
        # a parameter's P devices are fsdp x context: the sequence axis adds no state per device
        self._param_axes = ("fsdp", "context") if plan.context > 1 else ("fsdp",)

    def _build_mesh(self):
        """The plan's mesh. On a multi-slice TPU pod, torch_xla's HybridMesh with the slices as the outermost
        axes (DCN) and the physical ICI order inside each slice; otherwise devices in id order. Traced for
        several slices (`xla-shard compile --slices`), the program's devices are jax's, listed slice by slice,
        each in its own order: ids in order put the slices outermost."""
        import torch_xla.distributed.spmd as xs
        import torch_xla.runtime as xr

        p, g, o, n, c = self.plan.params, self.plan.grads, self.plan.optimizer, self.num_devices, self.plan.context
        shape = (n // o, o // g, g // p, p // c, c)
        attributes = xr.global_runtime_device_attributes() if xla_common.on_tpu() else []
        slices = self.traced_slices if self.traced_for else len({a.get("slice_index", 0) for a in attributes}) or 1
        if slices == 1:
            return xs.Mesh(np.arange(n), shape, MESH_AXES)
        dcn = slices_outermost(shape, slices)
        if dcn is None:
            self.capabilities.refuse(
                "fsdp.sharding", f"{self.plan.triple} on {slices} slices: the slices must split the outer mesh axes "
                                 f"{dict(zip(MESH_AXES, shape))} (outermost first), so that only those cross DCN")
        if self.traced_for:
            return xs.Mesh(np.arange(n), shape, MESH_AXES)
        return xs.HybridMesh(ici_mesh_shape=tuple(a // b for a, b in zip(shape, dcn)), dcn_mesh_shape=dcn,
                             axis_names=MESH_AXES)

    def wrap(self, model: nn.Module) -> nn.Module:
        import torch_xla.distributed.spmd as xs
        from torch_xla.experimental.spmd_fully_sharded_data_parallel import SpmdFullyShardedDataParallel

        prepare(self, model)
        if self.plan.context > 1:
            split_sequences(self, model, sequence.XLA_CONTEXT)
        if self.cfg.fsdp.scan_layers:
            # Activation checkpointing happens inside the scan; the root wrapper marks every parameter with
            # FSDPv2's rule, as each layer's own wrapper would have.
            xla_scan.scan_stack(model, self.cfg.fsdp, checkpoint=self.cfg.fsdp.activation_checkpointing)
            policy = None
        else:
            policy = self.prepare_wrap(model)
        model = self.to_device(model)
        stacked = xla_scan.stacked_parameters(model)
        self._split_dims = self._split_by_width(model) if self.plan.params == self.plan.grads > 1 else {}
        if self._split_dims:
            self._lookup_by_width(model)
        if self.placeholders:  # FSDPv2 would mark them itself, which a placeholder refuses
            for param in model.parameters():
                self.mark(param, self._layouts_of(param, stacked).params)
        if self.plan.params == 1:
            wrapped = model  # replicated parameters; the sharded batch makes it data-parallel
        else:
            own_rule = stacked | {p for p in model.parameters() if p in self._split_dims}
            if self.plan.context > 1:
                own_rule = set(model.parameters())  # over fsdp x context, where FSDPv2 would take fsdp alone
            for param in own_rule - self._marked(model):  # FSDPv2 marks only the parameters nobody has marked yet
                xs.mark_sharding(param, self.mesh, self._layouts_of(param, stacked).params)
            wrapped = SpmdFullyShardedDataParallel(
                model, mesh=self.mesh, shard_output=self._shard_output, auto_wrap_policy=policy,
                extra_data_axis="replica")
        if not self.plan.replicate_only:
            self._annotate(wrapped, stacked)
        if self.plan.params > 1:
            self._gather_scanned_layers(wrapped)
        return wrapped

    def _split_by_width(self, model: nn.Module) -> dict[nn.Parameter, int]:
        """Parameters split along another dimension than FSDPv2's largest: the input embedding and the output head
        along their width (hidden), where they do not share one table, as MaxText shards them. Split over its
        vocabulary, the embedding's lookup needs the whole table on every device (XLA gathers it, in fp32) and its
        gradient, a scatter-add, is all-reduced whole; split over its width, each device looks up its columns of
        every row and the rows move to their devices (an all-to-all of the looked-up activations, in bf16 under
        bf16 activations), and the gradient stays where its columns are. The head, gathered whole for the loss
        either way, is split as the embedding is: XLA otherwise lays their update's shared broadcasts out for one
        and moves them for the other (376 MiB of all-to-alls a step on Llama-3-8B's shape). Only where gradients
        are split as parameters are (G = P): split further, each device's columns would need their gradient
        summed from the rows of the devices that share them, which is what splitting over the vocabulary does."""
        embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        weight = getattr(embedding, "weight", None)
        if not isinstance(weight, nn.Parameter) or weight.dim() != 2 or (head is not None and head.weight is weight):
            return {}
        split = {weight: 1}
        head_weight = getattr(head, "weight", None)
        if isinstance(head_weight, nn.Parameter) and head_weight.shape == weight.shape:
            split[head_weight] = 1
        return split

    def _lookup_by_width(self, model: nn.Module) -> None:
        """The embedding's output annotated as the table is split, over its width, then a copy of it by rows, as
        the layers take it: XLA moves the looked-up rows to their devices between the two, after the cast the
        output gets under bf16 activations (an all-to-all in bf16, not in fp32), and their gradient back in bf16
        before the scatter-add, which stays in fp32 on each device's columns."""
        width = Layouts.of(model.get_input_embeddings().weight, dim=1, axes=self._param_axes).params[1]
        width = (width,) if isinstance(width, str) else tuple(width)
        rows = tuple(axis for axis in self._batch_axes if axis not in width)  # replicas keep their own rows
        layouts = [(rows or None, None, width)]
        if self.plan.context > 1 and sequence.CONTEXT_AXIS in width:
            # Under the sequence axis the width is split over the row axes and the sequence axis too: the rows'
            # axes move first (an all-to-all over them), then the sequence axis to the tokens (another). Moved
            # at once, XLA gathered every device's looked-up rows of the whole batch, then sliced its own (2 GiB
            # on Llama-3-8B's shape at 64K tokens, and as much again for the gradient).
            layouts.append((self._batch_axes, None, tuple(a for a in width if a not in self._batch_axes)))
        layouts.append(self._token_spec(3))
        shardings = tuple(self.mesh.get_op_sharding(layout) for layout in layouts)

        def split_by_width(module, args, output):
            if self._generating or not (isinstance(output, torch.Tensor) and output.dim() == 3):
                return output
            return _Moved.apply(output, shardings)

        model.get_input_embeddings().register_forward_hook(split_by_width)

    def _layouts_of(self, param: torch.Tensor, stacked: set[nn.Parameter]) -> Layouts:
        return Layouts.of(param, stacked=param in stacked, dim=self._split_dims.get(param), axes=self._param_axes)

    def _gather_scanned_layers(self, model: nn.Module) -> None:
        """Inside a scanned loop, each layer's weights are used whole and their gradients leave reduce-scattered,
        as FSDP does. Left to itself, the partitioner keeps the loop's weight slices sharded and moves the
        activations instead (windowed einsums: a ring of collective-permutes per matmul): on a Llama-3-8B
        shape on v5p-64, 199 GiB of collectives per device per step, against 32 GiB so annotated (docs/planner.md)."""
        mesh = str(self.mesh)
        for stack in (m for m in model.modules() if isinstance(m, xla_scan.ScannedLayers)):
            for name, param in stack.named_parameters():
                grads = str(Layouts.of(param, stacked=True, axes=self._param_axes).grads[1:])
                stack.in_layer[name] = lambda t, grads=grads: _UsedWhole.apply(t, mesh, grads)

    def to_device(self, model: nn.Module, device=None) -> nn.Module:
        """With `placeholders`, a model on the meta device gets placeholders for parameters, not storage."""
        if not (self.placeholders and on_meta(model)):
            return super().to_device(model, device)
        return retie(model._apply(lambda t: placeholder(t) if t.is_meta else t.to(self.device)))

    def mark(self, tensor: torch.Tensor, spec: tuple) -> None:
        """Lay out a parameter or optimizer state by `spec`. A placeholder cannot be laid out (`mark_sharding`
        finds no data): its value is annotated with the sharding instead, which `xla-shard compile` moves onto
        the program's parameter before compiling (`aot.compiler`)."""
        import torch_xla
        import torch_xla.distributed.spmd as xs

        if self.placeholders:
            torch_xla._XLAC._xla_annotate_custom_sharding(tensor, self.mesh.get_op_sharding(spec))
        else:
            xs.mark_sharding(tensor, self.mesh, spec)

    @staticmethod
    def _marked(model: nn.Module) -> set[nn.Parameter]:
        import torch_xla

        return {p for p in model.parameters() if torch_xla._XLAC._get_xla_sharding_spec(p)}

    def _annotate(self, model: nn.Module, stacked: set[nn.Parameter]) -> None:
        """Give each parameter its layouts. FSDPv2 has marked the parameters (P > 1); replicated ones are
        marked here, or XLA would let them take the optimizer state's sharding after the first update. Left
        alone, GSPMD also materialises gradients replicated (an all-reduce, full size on every device):
        annotating each gradient turns that into a reduce-scatter over G devices (and an all-reduce of the
        shard across the other N/G). With micro-batches that happens for each one: XLA's sharding propagation
        carries the annotation back through the accumulation (leaving the earlier micro-batches unannotated
        changes nothing, measured), so the gradient traffic is k times FSDP2's, which reduces once."""
        def shard(spec):
            mark = annotator(self.mesh, spec)
            return lambda param: mark(param.grad)

        marked = self._marked(model)
        for param in model.parameters():
            layouts = self.layouts[param] = self._layouts_of(param, stacked)
            if param not in marked:  # by FSDPv2 (P > 1), or as placeholders
                self.mark(param, layouts.params)
            if param.requires_grad:  # frozen weights (LoRA's base) have no gradient
                param.register_post_accumulate_grad_hook(shard(layouts.grads))

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Where the plan shards optimizer state apart from the parameters, the optimizer's per-parameter state
        (AdamW's exp_avg, exp_avg_sq) is annotated with its own layout once, right after the step that creates
        it (before that step's graph is compiled), so XLA keeps it sharded over OS devices; in-place updates
        keep the annotation, and the parameter keeps its own (P), so the updated shard is gathered back to it.

        Under a uniform triple (FULL_SHARD, HYBRID_SHARD) nothing is annotated: the state takes its parameter's
        layout through the update by itself. Annotating it after every step, as this once did, made FULL_SHARD's
        step 1.31x raw FSDPv2's instead of 1.07x (bench/step_overhead.py, 4 XLA CPU devices)."""
        import torch_xla.distributed.spmd as xs

        if self.plan.replicate_only or self.plan.uniform:
            return optimizer
        annotated: set[int] = set()

        def shard_state(opt, args, kwargs) -> None:
            for param, state in opt.state.items():
                layouts = self.layouts.get(param)
                for value in state.values():
                    if (layouts and isinstance(value, torch.Tensor) and id(value) not in annotated
                            and value.shape == param.shape and value.device.type == "xla"):
                        xs.mark_sharding(value, self.mesh, layouts.optimizer)
                        annotated.add(id(value))

        optimizer.register_step_post_hook(shard_state)
        return optimizer

    def _token_spec(self, rank: int, tokens: int | None = 1) -> tuple:
        """A batch tensor's layout: rows over the row axes, and its tokens (dim `tokens`: 1 for hidden states,
        the last for a row's ids) over the sequence axis where it splits them."""
        spec = [self._batch_axes] + [None] * (rank - 1)
        if tokens is not None and 0 < tokens < rank and self.plan.context > 1:
            spec[tokens] = "context"
        return tuple(spec)

    def _by_rows(self, tensor: torch.Tensor, tokens: int | None = 1) -> None:
        """Shard a tensor by its rows over the row axes (and its tokens over the sequence axis)."""
        key = (tensor.dim(), tokens)
        if key not in self._row_marks:
            self._row_marks[key] = annotator(self.mesh, self._token_spec(tensor.dim(), tokens))
        self._row_marks[key](tensor)

    def _shard_output(self, output, mesh) -> None:
        """Inner layers return hidden states, the root a ModelOutput: shard whichever tensor leads, by batch."""
        if self._generating:  # the generation mesh's inputs and weights lay its activations out
            return
        self._by_rows(output if isinstance(output, torch.Tensor) else (
            output[0] if isinstance(output, tuple) else output.logits))

    def place(self, rows):
        """The host's rows, as the global batch sharded by rows over every device of the mesh. One host holds
        the whole batch and marks it; several hand torch_xla their parts as minibatch input shardings, which
        it lays out as one global tensor (each host's rows on its own devices; nothing crosses hosts)."""
        if isinstance(rows, dict):
            rows = sequence.reorder_rows(rows, self.plan.context, self.cfg.train.seq_len)
            return {key: self._place_one(value) for key, value in rows.items()}
        return self._place_one(rows)

    def _place_one(self, rows: torch.Tensor) -> torch.Tensor:
        tokens = rows.dim() - 1 if rows.dim() >= 2 and rows.shape[-1] == self.cfg.train.seq_len else None
        if self.processes.count > 1:
            return self._place_host_rows(rows, tokens)
        batch = rows.to(self.device)
        self._by_rows(batch, tokens)
        return batch

    def _place_host_rows(self, rows: torch.Tensor, tokens: int | None = None) -> torch.Tensor:
        import torch_xla.core.xla_model as xm
        import torch_xla.distributed.spmd as xs

        key = (rows.dim(), tokens)
        if key not in self._host_rows:
            self._host_rows[key] = xs.ShardingSpec(self.mesh, self._token_spec(rows.dim(), tokens), minibatch=True)
        return xm.send_cpu_data_to_device(rows, self.device, input_sharding=self._host_rows[key])[0]

    def forward_context(self):
        return torch.autocast("xla", dtype=torch.bfloat16, enabled=self.cfg.fsdp.mixed_precision == "bf16")

    @contextlib.contextmanager
    def generation_context(self, model: nn.Module):
        """A generation runs on a copy of the weights in the layout it generates in (`xla_generation`, split over
        plan.generation devices): laid out once, in one program, for every token of it; training's weights are
        untouched meanwhile and the copies dropped after. Yields how its prompts are placed: rows over the
        generation mesh's first axis (`GenerationPlacer`). With `placeholders` (`xla-shard compile`) the layout's
        program is traced, not run, and the copies are placeholders laid out as it leaves them."""
        import torch_xla
        import torch_xla.distributed.spmd as xs

        split, devices = self.plan.generation, self.num_devices
        mesh = xs.Mesh(np.arange(devices), (devices // split, split), ("rows", "split"))
        lora = self.cfg.model.lora
        # the linears' weights in the dtype autocast computes them in (DoRA reads its base weight's norms: kept)
        cast = self.cfg.fsdp.mixed_precision == "bf16" and not (lora is not None and lora.use_dora)
        whole = xla_generation.kept_whole(model)
        owners, copies, shardings = [], {}, {}
        with torch.no_grad():
            for name, module in model.named_modules():
                for key, param in module._parameters.items():
                    if param is None:
                        continue
                    owners.append((module, key, param))
                    if id(param) in copies:
                        continue  # tied: one copy
                    copy = param.detach()
                    if cast and isinstance(module, nn.Linear) and copy.is_floating_point():
                        copy = copy.to(torch.bfloat16)
                    spec = (None,) * copy.dim() if split == 1 else \
                        xla_generation.split_spec(name, module, key, param, whole, "split")
                    shardings[id(param)] = mesh.get_op_sharding(spec)
                    copies[id(param)] = _annotated(copy, shardings[id(param)])
        placer = GenerationPlacer(self, mesh)
        if self.placeholders:
            placer.layout_program = torch_xla._XLAC._get_xla_tensors_hlo_proto(list(copies.values()))
            copies = {key: _annotated(placeholder(copy), shardings[key]) for key, copy in copies.items()}
        else:
            torch_xla.sync()  # the one program that lays every weight out for the generation
        laid = {key: nn.Parameter(copy, requires_grad=False) for key, copy in copies.items()}
        for module, key, param in owners:
            module._parameters[key] = laid[id(param)]
        self._generating = True
        try:
            with self.forward_context():
                yield placer
        finally:
            self._generating = False
            for module, key, param in owners:
                module._parameters[key] = param

    def mean_loss(self, loss: torch.Tensor) -> float:
        return loss.item()  # already the global-batch mean: SPMD computes one global program

    def to_host(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        """Reading a sharded result gathers it in a program torch_xla compiles at every read; copies marked
        replicated while still pending are gathered inside one program of their own, compiled once."""
        import torch_xla.distributed.spmd as xs

        copies = [tensor.clone() for tensor in tensors]
        for copy in copies:
            xs.mark_sharding(copy, self.mesh, (None,) * copy.dim())
        self.after_step()
        return [copy.cpu() for copy in copies]

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
