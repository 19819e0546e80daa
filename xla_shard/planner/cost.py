"""The cost model: per-device memory and per-step communication of a sharding triple, and the step time.

A triple (P, G, OS) shards parameters over P devices, gradients over G and optimizer state over OS, nested
(P divides G divides OS divides N): each device's parameter shard contains its gradient shard, which contains
its optimizer-state shard. FULL_SHARD is N/N/N, NO_SHARD 1/1/1, HYBRID_SHARD k/k/k. The devices form a mesh
(N/OS, OS/G, G/P, P), innermost on the closest devices. A step's collectives (`collectives`), each over groups
of `size` devices `stride` apart, on a tensor of T bytes (Psi parameters, c bytes each in compute):

  parameters:  all-gather over P (stride 1) in forward, and again in backward, for every micro-batch:
               T = Psi*c per gather; backward skips the input embedding where the backend gathers per tensor
               (its gradient needs only the token ids). Kept split over k < P devices after forward, backward
               gathers over those k (stride 1) instead, and each device holds Psi*c/k until then (k = 1: whole)
  gradients:   reduce-scatter over G (stride 1), fp32: T = Psi*4
               all-reduce of the shard across the N/G replicas (stride G): T = Psi*4/G
               once per step, or per micro-batch where the backend cannot defer it (SPMD)
  update:      all-gather of the updated shard from OS back to P's layout, over OS/P (stride P): T = Psi*4/P
               (an optimizer without state, SGD, updates in the gradients' layout: over G/P)

XLA's TPU compiler (xla_spmd on a TPU: `Workload.tpu_compiler`) does otherwise, measured on the programs
libtpu compiles (docs/planner.md): it gathers matmul weights in bf16 whatever they are stored in (its
matmuls take bf16 at default precision, and the cast moves ahead of the gather; the embedding, looked up, is
gathered as stored), and reduces gradients in the compute dtype; backward does not gather again what forward
gathered last (the last layer and the head, still held when backward starts: FSDP2 keeps its root and
torchtitan its last block for the same reason); and activation checkpointing's recompute gathers the layers once
more (FSDP's backward gathers a unit once for both), but for the last layer, whose recompute and backward share
one. Scanned layers (`Workload.scanned`) are gathered once in forward and once in backward, checkpointed or
not: the backward loop's body recomputes and differentiates a layer with one gather. Where gradients split over
every device and parameters over fewer, and on v5p and v6e where they split over 64 devices or more, it
all-reduces each gradient whole (`_reduced_whole`), the embedding's in fp32; and the gradients no matmul
computes (grouped-matmul MoE experts', the input embedding's) from a few devices on, and on TPU7x those of
weights split along their last dimension (`_summed_whole`).

A ring collective sends (g-1)/g of T per device (an all-reduce twice that). A group inside one fast domain uses
the fast links; one spanning domains runs hierarchically, sending 1/d of its bytes across domains per device
(d: its devices per domain). Step time: compute at `efficiency` of peak, overlapped with communication (FSDP
prefetches the next unit), plus one unit's collectives that nothing hides; each collective also pays one
latency per ring hop, once per FSDP unit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from xla_shard.plan import Triple
from xla_shard.planner.hardware import Accelerator, WholeReductions

OPTIMIZER_BYTES = {"adamw": 8, "sgd": 0}  # fp32 exp_avg + exp_avg_sq per parameter


@dataclass(frozen=True)
class Workload:
    """What one step does, independent of sharding."""

    params: int  # all parameters (Psi)
    units: int  # FSDP units (wrapped layers + the root): collectives per step per kind
    flops_per_token: float
    tokens_per_device: int
    layers: int
    hidden: int
    seq_len: int
    intermediate: int = 0  # a layer's MLP width (0: unknown)
    compute_bytes: int = 4  # 2 with bf16 mixed precision: what parameters are gathered in
    optimizer: str = "adamw"
    activation_checkpointing: bool = False
    micro_batches: int = 1  # gradient accumulation: parameters are gathered again for each micro-batch
    embedding_params: int = 0  # the input embedding (untied): not gathered again for backward
    grad_reductions: int = 1  # gradients reduced per step: once (FSDP's no_sync), or per micro-batch (SPMD)
    # LoRA (model.lora): the parameters trained (adapters, modules trained whole); the rest is frozen, held in
    # `frozen_bytes` per parameter, with no gradient, no optimizer state and no reduction. None: all trained.
    trained_params: int | None = None
    frozen_bytes: float = 4  # QLoRA: its 4-bit layers and the rest, averaged
    vocab: int = 0  # a causal LM's logits per token (0: a classifier's few labels, left out)
    # A frozen reference model (DPO's): the parameters of one held beside the policy, sharded as its parameters
    # are (0: none held, as when it is the policy with its adapters off), and the forwards per micro-batch it
    # runs without gradient, each gathering its parameters (the policy's when none is held). Its FLOPs are in
    # flops_per_token; its activations and logits live only inside its forward and are left out.
    reference_params: int = 0
    reference_forwards: int = 0
    # XLA's TPU compiler (the module docstring): whether it compiles the step, and the parameters forward
    # gathers last, outside the embedding: the root's (the head, the final norm) and the last unit's.
    tpu_compiler: bool = False
    root_params: int = 0
    last_unit_params: int = 0
    scanned: bool = False  # fsdp.scan_layers: the layers run as one loop (one body for forward, one for backward)
    reductions: WholeReductions | None = None  # the TPU compiler's on the target chip (`Accelerator.reductions`)
    grouped_expert_params: int = 0  # MoE experts run as grouped matmuls (`xla_shard.experts`, on a TPU)
    # weights split along their last dimension: (parameters, its size, a grouped expert's), for `WholeReductions`
    last_dim_splits: tuple[tuple[int, int, bool], ...] = ()
    # xla_spmd splits an untied input embedding (and the output head) over its width where gradients are split
    # as parameters are (`by_width`): the lookup's rows move to their devices by an all-to-all (forward in the
    # compute dtype, their gradient back in fp32), the table is never gathered and its gradient summed over
    # replicas only (`xla_spmd._split_by_width`).
    embedding_by_width: bool = False
    # The causal LM's loss in chunks (`train.loss_chunks`): how many (0: the logits whole), and the output
    # head's parameters, which the TPU compiler's program gathers once and whose gradient, summed over the
    # devices once, moves by an all-to-all where gradients split over every device (`xla_spmd.SpmdPartials`).
    loss_chunks: int = 0
    head_params: int = 0
    # The sequence axis (`mesh.context`): devices each sequence is split over, and the keys' (and values')
    # width per token (KV heads x head_dim), which each layer gathers whole along the axis.
    context: int = 1
    kv_width: int = 0
    # An online method's generation (GRPO): the completions a device samples at once (its rows of the whole
    # step), each holding its keys and values for every one of seq_len positions in a static cache.
    generated_rows: float = 0.0
    generation_gathers_model: bool = False  # the backend holds the whole model gathered while it generates
    # ... its MLPs split over this many devices, as tensor parallelism splits them (`mesh.generation`): each device
    # then holds 1/split of the MLP weights (`mlp_params`), for split times the rows (their caches and logits)
    generation_split: int = 1
    mlp_params: int = 0

    def generation_bytes(self, found: dict[str, float]) -> tuple[float, float]:
        """(the static KV cache, the generation phase's bytes): between steps, with parameters and optimizer
        state at rest, no gradients and no activations, a unit's weights gathered (or the whole model's, in the
        compute dtype, where the backend holds it gathered to generate: 1/generation_split of it), the cache and
        one token's fp32 logits per row. (0, 0) without generation."""
        if not self.generated_rows:
            return 0.0, 0.0
        rows = self.generated_rows * self.generation_split
        cache = 2 * self.layers * self.kv_width * self.seq_len * rows * self.compute_bytes
        logits = 4 * rows * self.vocab
        split = self.mlp_params * (1 - 1 / self.generation_split)
        gathered = (self.params - split) * self.compute_bytes if self.generation_gathers_model else found["gathered"]
        return cache, found["params"] + found["optimizer"] + gathered + cache + logits

    def context_kv_bytes(self) -> float:
        """One layer's keys and values, whole along the sequence axis, for one micro-batch of this device's
        rows (its `tokens_per_device` are 1/context of them), in the compute dtype."""
        if self.context == 1:
            return 0.0
        return 2 * self.kv_width * self.context * self.tokens_per_device / self.micro_batches * self.compute_bytes

    @property
    def trained(self) -> int:
        return self.params if self.trained_params is None else self.trained_params

    @property
    def gather_bytes(self) -> int:
        """Bytes per parameter a gather of a weight moves."""
        return min(self.compute_bytes, 2) if self.tpu_compiler else self.compute_bytes

    @property
    def reduce_bytes(self) -> int:
        """Bytes per parameter a gradient reduction moves: fp32, or as computed where the TPU compiler reduces."""
        return self.compute_bytes if self.tpu_compiler else 4

    def activation_bytes(self) -> float:
        """Per device, for one micro-batch: Korthikanti et al.'s 34 * s * b * h bytes per layer for 16-bit
        activations (scaled for fp32), or 2 * s * b * h (each layer's input) with activation checkpointing."""
        tokens = self.tokens_per_device / self.micro_batches
        if self.activation_checkpointing:
            return 2 * tokens * self.hidden * self.layers * self.compute_bytes / 2
        if self.scanned and self.intermediate:
            # a scanned loop stacks every residual its body saves, where an unrolled program fuses some away:
            # fitted to libtpu's programs (widths 2048 and 4096, MLPs 2x-3.5x as wide; within 11%, over)
            return (25 * self.hidden + 15 * self.intermediate) * tokens * self.layers * self.compute_bytes / 2
        return self.layer_work_bytes() * self.layers

    def layer_work_bytes(self) -> float:
        """Per device, for one micro-batch: one layer's activations (34 * s * b * h bytes in 16-bit, no
        attention scores: flash attention's), what checkpointing's recompute holds for that layer's backward."""
        return 34 * self.tokens_per_device / self.micro_batches * self.hidden * self.compute_bytes / 2

    def logits_bytes(self, summed_by_all_to_all: bool = False) -> float:
        """Per device, for one micro-batch. Whole: the logits and their gradient, [tokens, vocab] each in the
        compute dtype, outside any layer (checkpointing does not drop them); what the TPU compiler held per extra
        vocabulary entry and token, parameters' share included, for small-llama on a v5p-8 (2048 tokens per
        device, vocabularies of 32k and 64k): 4.0 bytes in bf16, 7.9 in fp32. In chunks, eagerly: one chunk's
        logits in the compute dtype, their fp32 copy and its gradient. The TPU compiler fuses the upcast into the
        reductions, so one chunk's logits and their gradient in the compute dtype, beside the head whole and each
        device's partial sum of its gradient, and, where that sum moves by an all-to-all, its destination
        (small-llama, 16 x 512 tokens on a v5p-8, vocabularies of 32k and 64k: 112.1 MiB more, as here)."""
        tokens = self.tokens_per_device / self.micro_batches
        if not self.loss_chunks:
            return 2 * self.compute_bytes * tokens * self.vocab
        chunk = tokens / self.loss_chunks * self.vocab
        if not self.tpu_compiler:
            return (self.compute_bytes + 8) * chunk
        head = self.vocab * self.hidden * self.compute_bytes
        return (3 if summed_by_all_to_all else 2) * head + 2 * self.compute_bytes * chunk


@dataclass(frozen=True)
class Collective:
    """One kind of collective in a step: over groups of `size` devices `stride` apart, on `tensor_bytes` in
    all (the gathered or reduced tensor, summed over the step's calls)."""

    name: str  # "params", "params_backward", "grads", "replicas", "summed", "update", "reference"
    op: str  # all-gather | reduce-scatter | all-reduce
    size: int
    stride: int
    tensor_bytes: float
    calls: int

    @property
    def ring_bytes(self) -> float:
        """What each device sends in a ring: (g-1)/g of the tensor, twice for an all-reduce."""
        share = (self.size - 1) / self.size * self.tensor_bytes
        return 2 * share if self.op == "all-reduce" else share


def update_degree(optimizer: str, triple: Triple) -> int:
    """Devices the update is computed over: the optimizer state's (OS), or the gradients' (G) for an optimizer
    without state."""
    return triple.optimizer if OPTIMIZER_BYTES[optimizer] else triple.grads


def by_width(work: Workload, triple: Triple) -> bool:
    """Whether `triple` splits the embedding and head over their width (`Workload.embedding_by_width`): where
    parameters are split (P > 1) and gradients no further (G = P)."""
    return work.embedding_by_width and triple.params == triple.grads > 1


def _head_by_all_to_all(work: Workload, triple: Triple, devices: int | None) -> bool:
    """Whether the chunked loss's head gradient is summed by an all-to-all over the devices its gradient is
    split over (along the dimension split: its width or its vocabulary, which they divide), then all-reduced
    over the replicas, not reduced whole."""
    split = work.hidden if by_width(work, triple) else work.vocab
    return work.loss_chunks > 0 and work.head_params > 0 and devices is not None and split % triple.grads == 0


def memory(work: Workload, triple: Triple, devices: int | None = None) -> dict[str, float]:
    """Bytes per device: params, grads, optimizer, activations, logits, gathered, kept, total (`devices`: the
    run's, where known: whether the chunked loss's head gradient moves by an all-to-all)."""
    psi, c, trained = work.params, work.gather_bytes, work.trained
    p, g, os_, k = triple.params, triple.grads, triple.optimizer, triple.kept
    stored = 4 * trained + work.frozen_bytes * (psi - trained) + 4 * work.reference_params
    found = {"params": stored / p, "grads": 4 * trained / g,
             "optimizer": OPTIMIZER_BYTES[work.optimizer] * trained / os_,
             "activations": work.activation_bytes(),
             "logits": work.logits_bytes(_head_by_all_to_all(work, triple, devices)),
             # a unit in use + one prefetched (the reference's units run apart from the policy's)
             "gathered": 2 * c * max(psi, work.reference_params) / max(1, work.units - 1) if p > 1 else 0.0,
             "kept": c * psi / k if k < p else 0.0,  # every unit's parameters, held from forward for backward
             # a layer's keys and values gathered whole, and their gradients' partial sums (sequence axis)
             "context": 2 * work.context_kv_bytes()}
    if work.scanned:
        at_rest = found["params"] + found["optimizer"] + found["activations"] + found["kept"]
        found["total"] = at_rest + max(scanned_phases(work, found).values())
    else:
        found["total"] = sum(found.values())
    cache, generating = work.generation_bytes(found)
    if cache:  # generation runs apart from the step: the larger of the two phases
        found["kv_cache"], found["total"] = cache, max(found["total"], generating)
    return found


def scanned_phases(work: Workload, found: dict[str, float]) -> dict[str, float]:
    """What a scanned step holds beyond its state at rest and its checkpoints, in its two phases: the loss (the
    logits) and the backward loop (the gradients, a layer's weights gathered, its keys and values along the
    sequence axis and, checkpointed, its recomputed activations). Its peak is one phase, never both: held to
    libtpu's programs for Llama-3-8B's width on a v5p-64 at 4-32 layers and 32k-128k vocabularies (within 3%;
    a narrower model's loop phase 0.75x: docs/planner.md), where summing them, as an unrolled step's estimate
    does, had the 8B at 1.20x the compiled program."""
    loop = found["grads"] + found["gathered"] + found["context"]
    if work.activation_checkpointing:
        loop += work.layer_work_bytes()
    return {"loss": found["logits"], "loop": loop}


def collectives(work: Workload, triple: Triple, devices: int) -> list[Collective]:
    """The collectives a step of `triple` runs (those over one device left out)."""
    psi, units, micro, trained = work.params, work.units, work.micro_batches, work.trained
    p, g, k = triple.params, triple.grads, triple.kept
    c, embedding, reduced = work.gather_bytes, work.embedding_params, work.reduce_bytes * work.grad_reductions
    update = update_degree(work.optimizer, triple)
    # Forward gathers every weight; the embedding, as stored where the TPU compiler gathers it (a lookup, no
    # matmul). Backward gathers all but the embedding again, and for the TPU compiler not what forward gathered
    # last; checkpointing's recompute gathers the layers again there, the last one's shared with its backward.
    stored = (4 if work.trained_params is None else work.frozen_bytes) if work.tpu_compiler else c
    width = by_width(work, triple)
    if width:
        stored = 0  # looked up where its columns are: the rows move instead (`lookup`, below)
    # the chunked loss's head: gathered whole once a step, the same weight for every micro-batch
    head_once = work.head_params if work.loss_chunks else 0
    forward = ((psi - embedding - head_once) * c + embedding * stored) * micro + head_once * c
    # what forward gathered last and backward still holds (a scanned loop holds no layer past its iteration)
    last = 0 if work.scanned else work.last_unit_params
    # (the chunked loss's head, gathered whole once for all chunks, is held for backward whatever compiles it)
    kept = work.root_params + last if work.tpu_compiler else (work.head_params if work.loss_chunks else 0)
    again = (psi - embedding - kept) * c * micro  # backward's gather
    if work.tpu_compiler and work.activation_checkpointing and not work.scanned:
        again += (psi - embedding - work.root_params) * c * micro
    head = work.head_params if _head_by_all_to_all(work, triple, devices) and work.trained_params is None else 0
    if head and work.tpu_compiler and g < devices and p > 1:
        # with replicas, the TPU compiler gathers the chunked loss's head again for backward (v5p-8: 2/2/2; two
        # v5p-8 slices: 4/4/4), in the compute dtype; on one slice's N/N/N it keeps forward's
        again += head * work.compute_bytes * micro
    whole = _reduced_whole(work, triple, devices)
    # parameters all-reduced over every device: (compute dtype, fp32)
    summed = _summed_whole(work, whole, g, width)
    rest = trained - sum(summed)
    split_by_width = width and work.trained_params is None
    rest -= (embedding if split_by_width else 0) + head  # a gradient that stays where it is, one summed by all-to-all
    grads = rest * reduced
    if work.trained_params is None and not summed[1] and not split_by_width:
        # the embedding's gradient (a lookup's: a scatter-add into the stored weight's dtype) is reduced in fp32,
        # where the weights' are in the compute dtype
        grads += embedding * (4 - work.reduce_bytes) * work.grad_reductions
    # the sequence axis's keys and values, gathered per layer in forward, backward and checkpointing's recompute
    kv_gathers = work.layers * micro * (3 if work.activation_checkpointing else 2)
    found = [Collective("params", "all-gather", p, 1, forward + (again if k == p else 0),
                        units * micro * (2 if k == p else 1)),
             Collective("params_backward", "all-gather", k, 1, again if 1 < k < p else 0, units * micro),
             Collective("grads", "all-reduce" if whole else "reduce-scatter", g, 1, grads,
                        units * work.grad_reductions),
             # replicas sum every shard, the embedding's too (by width: its columns' whole gradient, in fp32)
             Collective("replicas", "all-reduce", devices // g, g,
                        (rest * reduced + head * work.compute_bytes * work.grad_reductions
                         + (embedding * 4 * work.grad_reductions if split_by_width else 0)) / g,
                        units * work.grad_reductions),
             Collective("summed", "all-reduce", devices, 1, (summed[0] * work.reduce_bytes + summed[1] * 4)
                        * work.grad_reductions, units * work.grad_reductions),
             Collective("update", "all-gather", update // p, p, trained * 4 / p, units),
             Collective("reference", "all-gather", p, 1, (work.reference_params or psi) * c * micro
                        * work.reference_forwards, units * micro * work.reference_forwards),
             # the looked-up rows to their devices (compute dtype) and their gradient back (fp32)
             Collective("lookup", "all-to-all", p, 1, (work.compute_bytes + 4) * work.tokens_per_device
                        * work.hidden if width else 0, 2 * micro),
             Collective("head", "all-to-all", g, 1, head * work.compute_bytes * work.grad_reductions,
                        work.grad_reductions),
             # the sequence axis: each layer's keys and values gathered whole along it in forward and again in
             # backward (and in checkpointing's recompute), their gradients' partial sums summed over it (on the
             # TPU, each device's sent to the devices whose tokens they are, then summed: xla_shard/sequence.py)
             Collective("context_kv", "all-gather", work.context, 1,
                        work.context_kv_bytes() * kv_gathers, kv_gathers),
             Collective("context_kv_grads", "all-to-all" if work.tpu_compiler else "reduce-scatter", work.context, 1,
                        work.context_kv_bytes() * work.layers * micro, work.layers * micro)]
    return [x for x in found if x.size > 1 and x.tensor_bytes > 0]


_LANES = 128  # a TPU tile's minor dimension


def _reduced_whole(work: Workload, triple: Triple, devices: int) -> bool:
    """Whether the TPU compiler all-reduces each gradient whole instead of reduce-scattering it: measured where
    gradients split over every device and parameters over fewer (1 < P < G = N: 2/4/4 on 4 devices, 2/8/8 on
    8), where the shard each device keeps is not in device order (it must lie inside its parameter shard), and
    XLA's partitioner reduces, then slices (with replicas, G < N, it reduce-scatters); and where gradients
    split over as many devices as the chip's `WholeReductions.every` or more (v5p and v6e at 64)."""
    many = work.reductions is not None and WholeReductions.reaches(work.reductions.every, triple.grads)
    return work.tpu_compiler and (1 < triple.params < triple.grads == devices or many)


def _summed_whole(work: Workload, whole: bool, grads: int, split_by_width: bool) -> tuple[int, int]:
    """The parameters whose gradients the TPU compiler all-reduces whole over every device where the rest are
    reduce-scattered (`WholeReductions`), as (in the compute dtype, in fp32): grouped experts' (their partial
    sums come from no matmul: XLA's partitioner sums them with an all-reduce and a slice), weights split along
    their last dimension (TPU7x), and the input embedding's, in fp32, where split along its rows (FSDPv2 splits
    its largest dimension: rows >= width). Frozen (LoRA) ones reduce nothing; where every gradient is reduced
    whole (`whole`) they are counted there. `grads`: the devices gradients are split over (G), the group the
    slice would reduce-scatter over."""
    rules = work.reductions
    if rules is None or whole or work.trained_params is not None:
        return 0, 0
    experts = rules.reaches(rules.experts, grads)
    summed = work.grouped_expert_params if experts else 0
    for params, width, grouped in work.last_dim_splits:
        if grouped and not experts and rules.reaches(rules.experts_last_dim, grads):
            summed += params
        elif not grouped and width / grads < _LANES and rules.reaches(rules.narrow_last_dim, grads):
            summed += params
    by_rows = work.embedding_params >= work.hidden ** 2 and not split_by_width
    embedding = work.embedding_params if by_rows and rules.reaches(rules.embedding, grads) else 0
    return summed, embedding


def result_bytes(found: list[Collective]) -> dict[str, float]:
    """Bytes of the collectives' results by op, as a compiled program's are counted (`hlo.collective_totals`):
    a reduce-scatter's result is one shard of the tensor it reduces."""
    by_op: dict[str, float] = {}
    for x in found:
        by_op[x.op] = by_op.get(x.op, 0.0) + (x.tensor_bytes / x.size if x.op == "reduce-scatter" else x.tensor_bytes)
    return by_op


@dataclass
class Estimate:
    triple: Triple
    memory: dict[str, float]  # bytes per device, by `memory`'s keys
    traffic: dict[str, float]  # bytes per device per step, by link class
    compute_s: float
    comm_s: float
    step_s: float
    mfu: float
    fits: bool
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {**asdict(self), "triple": str(self.triple)}


# Step times closer than this (relative) are the same to the cost model: its compute term rests on an assumed
# efficiency and its links on nominal bandwidths, so finer differences say nothing. Such rows are ranked by
# memory per device instead.
STEP_RESOLUTION = 0.01


def tie_groups(estimates: list[Estimate], part: Callable[[Estimate], tuple] = lambda e: (not e.fits,)
               ) -> dict[int, tuple]:
    """id(estimate) -> (its part, its group): within each part (those that fit, those that do not, ...), sorted
    by step time, a group starts wherever a step is more than STEP_RESOLUTION slower than the group's fastest.
    Sorting by it, then by memory, ranks the fastest first to the cost model's resolution."""
    groups: dict[int, tuple] = {}
    leads: dict[tuple, tuple[float, int]] = {}
    for e in sorted(estimates, key=lambda e: (part(e), e.step_s)):
        key = part(e)
        lead, group = leads.get(key, (None, -1))
        if lead is None or e.step_s > lead * (1 + STEP_RESOLUTION):
            lead, group = e.step_s, group + 1
            leads[key] = (lead, group)
        groups[id(e)] = (key, group)
    return groups


def compute_bound(estimates: list[Estimate]) -> bool:
    """Whether every estimate's step is set by its compute (its collectives hide behind it)."""
    return bool(estimates) and all(e.comm_s <= e.compute_s for e in estimates)


def estimate(work: Workload, triple: Triple, devices: int, acc: Accelerator, domain: int,
             efficiency: float = 0.7) -> Estimate:
    held = memory(work, triple, devices)
    traffic = {acc.fast_name: 0.0, acc.slow_name: 0.0}
    seconds = 0.0
    for x in collectives(work, triple, devices):
        # A group spanning several fast domains runs hierarchically (NCCL's multi-ring, XLA's DCN collectives):
        # inside each domain first, then only 1/d of the bytes per device across domains, d being the group's
        # devices per domain.
        local = max(1, min(x.size, domain // x.stride)) if x.stride < domain else 1
        across = x.size // local
        whole = x.ring_bytes * x.size / (x.size - 1)  # the bytes a device's share of the collective covers
        fast_bytes = whole * (local - 1) / local
        slow_bytes = whole * (across - 1) / across / local
        traffic[acc.fast_name] += fast_bytes
        traffic[acc.slow_name] += slow_bytes
        hops = (local - 1) * acc.fast_latency_s + (across - 1) * acc.slow_latency_s
        seconds += fast_bytes / acc.fast_bw + slow_bytes / acc.slow_bw
        seconds += x.calls * (2 if x.op == "all-reduce" else 1) * hops
    compute = work.flops_per_token * work.tokens_per_device / (acc.peak_flops * efficiency)
    exposed = seconds / max(1, work.units)  # the first gather and the last reduction of a step
    step = max(compute, seconds) + exposed
    mfu = work.flops_per_token * work.tokens_per_device / (step * acc.peak_flops)
    return Estimate(triple, held, traffic, compute, seconds, step, mfu, held["total"] <= acc.hbm_bytes)
