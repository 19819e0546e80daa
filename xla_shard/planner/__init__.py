"""AMSP-style planning: which (parameters, gradients, optimizer state) sharding degrees a run should use.

`candidates` enumerates every nested triple for the device count, `estimate` (cost.py) predicts each one's
memory, traffic per link class and step time, and `plan` ranks those that fit, fastest first. Which triples a
backend runs is the backend's to say (`Capabilities.triple_refusal`): xla_spmd any, the FSDP wrappers k/k/k.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from xla_shard.capabilities import Capabilities
from xla_shard.planner.cost import (Collective, Estimate, Triple, Workload, collectives, estimate, memory, tie_groups,
                                    update_degree)
from xla_shard.planner.hardware import ACCELERATORS, Accelerator, accelerator, for_device_kind
from xla_shard.quant import model as quant

__all__ = ["ACCELERATORS", "Accelerator", "Collective", "Estimate", "Plan", "Triple", "Workload", "accelerator",
           "candidates", "collectives", "embedding_params", "estimate", "for_device_kind", "memory", "plan",
           "update_degree", "workload"]


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(devices: int, domain: int | None = None) -> list[Triple]:
    """Every (P, G, OS) with P | G | OS | devices; each sharded P also kept whole after forward (ZeRO-2) and,
    given the fast `domain`, split over it (backward gathers on the fast links: FSDP2's int reshard)."""
    found = []
    for triple in (Triple(p, g, o) for o in divisors(devices) for g in divisors(o) for p in divisors(g)):
        found.append(triple)
        p = triple.params
        for kept in dict.fromkeys(k for k in (1, min(p, domain or p)) if k < p and p % k == 0):
            found.append(Triple(p, triple.grads, triple.optimizer, kept))
    return found


@dataclass
class Plan:
    devices: int
    domain: int
    accelerator: Accelerator
    ranked: list[Estimate]  # fitting ones first, fastest first (to STEP_RESOLUTION), then least memory
    baseline: Estimate  # FULL_SHARD (ZeRO-3)
    work: Workload  # the step they were ranked for

    @property
    def best(self) -> Estimate | None:
        return next((e for e in self.ranked if e.fits), None)

    def best_where(self, runs: Callable[[Triple], bool]) -> Estimate | None:
        """The fastest fitting triple that `runs` (a backend's test) accepts; among equally fast, the smallest."""
        return next((e for e in self.ranked if e.fits and runs(e.triple)), None)


def plan(work: Workload, devices: int, acc: Accelerator, hosts: int | None = None, slices: int = 1,
         hbm_bytes: float | None = None, efficiency: float = 0.7) -> Plan:
    """Rank every triple for `devices` of `acc`. The fast domain is a GPU node (devices / hosts, at most the
    accelerator's node size; hosts default to full nodes) or a TPU slice (devices / slices)."""
    if acc.domain_max is None:
        domain = devices // slices
    else:
        domain = min(acc.domain_max, devices // hosts if hosts else devices)
    if hbm_bytes:
        acc = Accelerator(**{**acc.__dict__, "hbm_bytes": hbm_bytes})
    estimates = [estimate(work, t, devices, acc, domain, efficiency=efficiency) for t in candidates(devices, domain)
                 if t.params % work.context == 0]  # the sequence axis lies inside a parameter's devices
    groups = tie_groups(estimates)
    ranked = sorted(estimates, key=lambda e: (groups[id(e)], e.memory["total"]))
    baseline = next(e for e in estimates if e.triple == Triple(devices, devices, devices))
    return Plan(devices, domain, acc, ranked, baseline, work)


def embedding_params(model) -> int:
    """Parameters of embedding tables that nothing else uses (an untied input embedding, BERT's position
    embeddings): their gradients need only the token ids, so backward does not gather them again."""
    return sum(w.numel() for w in _lookup_tables(model))


def _lookup_tables(model) -> list:
    from torch import nn

    elsewhere = {id(p) for m in model.modules() if not isinstance(m, nn.Embedding) for p in m.parameters(recurse=False)}
    return [m.weight for m in model.modules() if isinstance(m, nn.Embedding) and id(m.weight) not in elsewhere]


def _gathered_last(model, targets: list) -> tuple[int, int]:
    """(the root's parameters, the last unit's), lookup tables left out: what forward gathers last. `targets`
    lists children before parents, so its last is a top-level unit, the last to run."""
    tables = {id(w) for w in _lookup_tables(model)}
    elsewhere = tables | {id(p) for unit in targets for p in unit.parameters()}
    root = sum(p.numel() for p in model.parameters() if id(p) not in elsewhere)
    last = sum(p.numel() for p in targets[-1].parameters() if id(p) not in tables) if targets else 0
    return root, last


def _reference_params(cfg, objective, policy_params: int) -> int:
    """The parameters of the objective's reference model held beside the policy (built on the meta device), 0
    when it holds none (the policy with its adapters switched off)."""
    import torch

    from xla_shard.models import build_model

    directory = objective.reference_directory
    if directory is None:
        return 0
    if directory == cfg.model.name:  # the policy's starting weights: a second copy of the same model
        return policy_params
    with torch.device("meta"):
        model = build_model(cfg.model.model_copy(update={"name": directory, "lora": None}), cfg.train.seed)
    return sum(p.numel() for p in model.parameters())


def _split_weights(model, grouped) -> dict:
    """What the TPU compiler's reductions depend on (`WholeReductions`): the grouped experts' parameters, and the
    weights FSDPv2 splits along their last dimension (its largest, the first of equals), as (parameters, that
    dimension's size, whether a grouped expert's)."""
    experts = {id(p): p.numel() for module in grouped for p in module.parameters(recurse=False)}
    last = tuple((p.numel(), p.shape[-1], id(p) in experts) for p in model.parameters()
                 if p.dim() >= 2 and list(p.shape).index(max(p.shape)) == p.dim() - 1)
    return {"grouped_expert_params": sum(experts.values()), "last_dim_splits": last}


def _chunked_head(cfg, model) -> tuple[int, int]:
    """(the chunks a causal LM's loss is computed in, 0 for its logits whole; its output head's parameters)."""
    from xla_shard import lm_head

    if cfg.model.task != "causal_lm" or cfg.train.loss_chunks == 0 or lm_head.unscorable(model):
        return 0, 0
    head = model.get_output_embeddings()
    return lm_head.chunks_for(cfg.train.loss_chunks, model.config, cfg.train.seq_len), head.weight.numel()


def workload(cfg, devices: int, capabilities: Capabilities, hardware: Accelerator | None = None,
             method=None) -> Workload:
    """The step of a config, from its model built on the meta device (no memory, nothing downloaded), as the
    backend with `capabilities` runs it on `hardware` (per-tensor gathers skip the embedding in backward and
    reduce gradients at every micro-batch, and on a TPU are XLA's TPU compiler's; FSDP wrappers gather whole
    units and reduce once)."""
    import torch

    from xla_shard import experts, tensor_parallel
    from xla_shard.methods import GENERATION, method_for
    from xla_shard.metrics import train_flops_per_token
    from xla_shard.models import build_model
    from xla_shard.wrap import wrap_targets

    with torch.device("meta"):
        model = build_model(cfg.model, cfg.train.seed)
    config = model.config
    method = method or method_for(cfg)  # the run's, handed by its backend; else the config's
    objective = method.objective
    tokens = objective.tokens_per_step(cfg.train) // devices
    params = sum(p.numel() for p in model.parameters())
    targets = wrap_targets(model, cfg.fsdp)
    units = len(targets) + 1
    root, last = _gathered_last(model, targets)
    flops = train_flops_per_token(model, cfg.train.seq_len)
    embedding = embedding_params(model) if capabilities.gathers_per_tensor else 0
    adapter = method.adapter
    trained, frozen_bytes = adapter.trained_parameters(model, cfg.model.task), adapter.frozen_bytes
    if trained is not None:  # counted on the meta device: nothing allocated
        flops -= 2 * max(0, params - trained)  # backward computes no weight gradient for the frozen base
        if cfg.model.quantization is not None and params > trained:  # QLoRA: its 4-bit layers, the rest as they are
            four_bit = quant.quantized_params(model, cfg.model.quantization, adapter.stored_name)
            frozen_bytes = (four_bit * quant.BYTES_PER_WEIGHT + (params - trained - four_bit) * frozen_bytes) / (
                params - trained)
    flops = objective.step_flops_per_token(flops)  # as the trainer counts them for MFU
    tpu_compiler = capabilities.gathers_per_tensor and hardware is not None and hardware.tpu
    grouped = tpu_compiler and experts.choose(capabilities.experts, "tpu") == experts.XLA_GMM
    chunks, head = _chunked_head(cfg, model)
    return Workload(params=params, units=units, trained_params=trained, frozen_bytes=frozen_bytes,
                    embedding_by_width=bool(embedding), loss_chunks=chunks, head_params=head if embedding else 0,
                    tpu_compiler=tpu_compiler,
                    reductions=hardware.reductions if tpu_compiler else None,
                    **_split_weights(model, experts.grouped_modules(model) if grouped else []),
                    root_params=root, last_unit_params=last, scanned=cfg.fsdp.scan_layers,
                    reference_params=_reference_params(cfg, objective, params),
                    reference_forwards=objective.forwards_without_grad,
                    embedding_params=embedding,
                    grad_reductions=cfg.train.grad_accum_steps if capabilities.reduces_every_micro_batch else 1,
                    flops_per_token=flops, tokens_per_device=max(1, tokens),
                    layers=getattr(config, "num_hidden_layers", 1), hidden=getattr(config, "hidden_size", 1),
                    intermediate=getattr(config, "intermediate_size", 0) or 0,
                    seq_len=cfg.train.seq_len, compute_bytes=2 if cfg.fsdp.mixed_precision == "bf16" else 4,
                    optimizer=cfg.train.optimizer, activation_checkpointing=cfg.fsdp.activation_checkpointing,
                    micro_batches=cfg.train.grad_accum_steps, context=cfg.mesh.context,
                    kv_width=attention_widths(config)[1],
                    generated_rows=cfg.train.global_batch_size / devices if GENERATION in method.needs else 0.0,
                    generation_gathers_model=capabilities.gathers_model_to_generate,
                    mlp_params=tensor_parallel.mlp_params(model),
                    vocab=getattr(config, "vocab_size", 0) if cfg.model.task == "causal_lm" else 0)


def attention_widths(config) -> tuple[int, int]:
    """(a head's width, the keys' width per token: KV heads x head_dim) of a transformers config."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", 1) or 1
    head_dim = getattr(text, "head_dim", None) or getattr(text, "hidden_size", heads) // heads
    return head_dim, (getattr(text, "num_key_value_heads", None) or heads) * head_dim
