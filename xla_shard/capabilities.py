"""What a backend can run, declared once as data: read by the config check, the plan (`planner.settle`), the
planner's cost model, the launcher choice and the README's strategy table test alike, so no code outside a
backend ever compares a backend's name.

One convention: a `str | None` field is the reason the backend *cannot* do something (None: it can); a `bool`
field is a fact about how it runs that the cost model prices.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

from xla_shard.config.schema import ShardConfig, ShardingStrategy
from xla_shard.errors import ConfigError
from xla_shard.plan import ShardingPlan, Triple, from_planner

LauncherKind = Literal["in_process", "torchrun", "xmp_spawn"]


@dataclass(frozen=True)
class Capabilities:
    name: str
    # How its processes start: this process drives every local device (SPMD), torchrun starts one per
    # device, or torch_xla's xmp.spawn does.
    launcher: LauncherKind
    # Where it runs: "tpu", "cuda", "cpu" (the CPU path is how CI tests it).
    platforms: tuple[str, ...] = ("cpu",)
    # Whether it runs on torch_xla (the others tell transformers not to import it: `device.declare_runtime`).
    torch_xla: bool = False
    # What a run's device count counts, in messages ("devices", "torchrun processes", "replicas").
    unit: str = "devices"
    # Named strategies it cannot run, each with the reason and what to use instead.
    strategies: Mapping[ShardingStrategy, str] = field(default_factory=dict)
    offload_params: str | None = "this backend has no CPU offload"
    xla_settings: str | None = "these are XlaFullyShardedDataParallel arguments; use backend xla_fsdp"
    # A (P, G, OS) triple that is not k/k/k: parameters, gradients and optimizer state sharded apart.
    nonuniform_triple: str | None = "it keeps gradients and optimizer state in the parameters' layout"
    # Parameters kept split over a smaller group between forward and backward (FSDP2's int reshard).
    group_after_forward: str | None = "its reshard_after_forward is a bool"
    scan_layers: str | None = "it runs no compiled loop over layers (torch_xla's scan runs under SPMD)"
    compile: str | None = ("torch_xla traces each step and compiles it into one XLA graph already; torch.compile's "
                           "openxla backend does not run its FSDP wrappers")
    # LoRA adapters beside frozen weights (model.lora).
    lora: str | None = None
    # A 4-bit frozen base under the adapters (model.quantization).
    quantization: str | None = "its 4-bit base is not verified yet; use backend xla_spmd or torch_fsdp"
    # How MoE experts run (transformers' experts_implementation); None: transformers' choice (grouped_mm).
    experts: str | None = None
    # MoE router load-balancing loss (config output_router_logits), which transformers adds to the loss.
    router_aux_loss: str | None = None
    # What `scripts/setup_worker.sh KIND` installs on a TPU VM for it: torch_xla[tpu] ("tpu") or TorchTPU.
    tpu_setup: str = "tpu"
    # Cost-model facts: per-tensor gathers (backward skips an embedding table, which needs only the ids) and a
    # gradient reduction per micro-batch (GSPMD cannot keep partial sums: see the README).
    gathers_per_tensor: bool = False
    reduces_every_micro_batch: bool = False
    # Generation (`Backend.generation_context`) holds the whole model gathered, not a unit at a time each token.
    gathers_model_to_generate: bool = False
    # Generation's weights split over several devices as tensor parallelism splits them (mesh.generation > 1).
    generation_split: str | None = "it generates with the weights whole on each device"
    # A sequence axis (mesh.context > 1): each sequence split over several devices.
    context: str | None = ("it has no sequence axis (each device holds whole sequences); use backend xla_spmd or "
                           "torch_fsdp, or set it to 1")
    # Under the sequence axis: how it attends across the split sequence, and the model.attn_implementation values
    # that leave it to do so (any other would attend within each device's piece alone).
    context_attention: str = ""
    context_attention_keeps: tuple[str, ...] = ("auto",)
    # An inference engine (vLLM) colocated with its processes, the policy's weights pushed to it (a method's
    # INFERENCE_ENGINE need).
    inference_engine: str | None = ("no inference engine is wired to it yet (its generation is the policy's own "
                                    "sampler): use backend torch_fsdp")
    # Whether a step may take rows of another length than the last (eager execution: padded rows are cut to
    # their micro-batch's longest); a compiler that traces one program per shape takes seq_len always.
    varying_shapes: bool = False

    def __post_init__(self):
        object.__setattr__(self, "strategies", MappingProxyType(dict(self.strategies)))

    def refuse(self, key: str, message: str) -> None:
        raise ConfigError(key, message, backend=self.name)

    def check(self, cfg: ShardConfig) -> None:
        """Reject, naming key and backend, every option of `cfg` this backend cannot honour."""
        fsdp = cfg.fsdp
        reason = self.strategies.get(fsdp.sharding_strategy)
        if reason:
            self.refuse("fsdp.sharding_strategy", f"{fsdp.sharding_strategy.value} {reason}")
        if fsdp.offload_params and self.offload_params:
            self.refuse("fsdp.offload_params", f"{self.offload_params}; set it to false")
        if fsdp.mixed_precision == "fp16":
            self.refuse("fsdp.mixed_precision", "fp16 needs loss scaling, which xla_shard does not do; use bf16")
        if fsdp.scan_layers and self.scan_layers:
            self.refuse("fsdp.scan_layers", f"{self.scan_layers}; use backend xla_spmd or set it to false")
        if cfg.model.lora is not None and self.lora:
            self.refuse("model.lora", f"{self.lora}; use backend xla_spmd or torch_fsdp")
        if cfg.model.quantization is not None and self.quantization:
            self.refuse("model.quantization", self.quantization)
        if cfg.train.compile and self.compile:
            self.refuse("train.compile", f"{self.compile}; set it to false")
        if cfg.mesh.context > 1 and self.context:
            self.refuse("mesh.context", f"{cfg.mesh.context}: {self.context}")
        if cfg.mesh.context > 1 and cfg.model.attn_implementation not in self.context_attention_keeps:
            self.refuse("model.attn_implementation",
                        f"{cfg.model.attn_implementation}: mesh.context={cfg.mesh.context} attends across the "
                        f"sequence's shards itself ({self.context_attention}); set auto")
        if cfg.mesh.generation not in ("auto", 1) and self.generation_split:
            self.refuse("mesh.generation", f"{cfg.mesh.generation}: {self.generation_split}; use backend xla_spmd, or "
                                           "set it to auto")
        if fsdp.xla_settings and self.xla_settings:
            self.refuse("fsdp.xla_settings", self.xla_settings)
        if self.launcher != "torchrun" and (cfg.launch.nproc_per_node is not None or cfg.launch.nnodes != 1
                                             or cfg.launch.node_rank is not None or cfg.launch.rdzv_endpoint):
            self.refuse("launch", "sets torchrun's process counts (backend torch_fsdp); this backend drives every "
                                  "local device from one process per host: remove it")

    def trains(self, cfg: ShardConfig) -> bool:
        """Whether this backend trains the config's model as configured, whatever the sharding: its LoRA
        adapters, its scanned layers, its compiled blocks, its sequence axis."""
        return not ((cfg.model.lora is not None and self.lora) or (cfg.fsdp.scan_layers and self.scan_layers)
                    or (cfg.model.quantization is not None and self.quantization)
                    or (cfg.train.compile and self.compile) or (cfg.mesh.context > 1 and self.context))

    def runs(self, triple: Triple, devices: int) -> bool:
        """Whether this backend runs a planner `Triple` on `devices`."""
        return self.triple_refusal(from_planner(triple, devices)) is None

    def triple_refusal(self, plan: ShardingPlan) -> str | None:
        """Why this backend cannot run the plan's (P, G, OS) triple, in one line naming it; None if it can."""
        if not plan.uniform and self.nonuniform_triple:
            return (f"{plan.triple}: {self.name} shards parameters, gradients and optimizer state alike "
                    f"({self.nonuniform_triple}); use a uniform triple k/k/k, or backend xla_spmd")
        reason = self.strategies.get(plan.strategy)
        if reason:
            return f"{plan.triple} is {plan.strategy.value}, which {reason}"
        if 1 < plan.after_forward < plan.params and self.group_after_forward:
            return (f"{plan.triple}: params_after_forward {plan.after_forward} is FSDP2's int "
                    f"reshard_after_forward (backend torch_fsdp); {self.name}: {self.group_after_forward}")
        return None
