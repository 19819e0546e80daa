"""The one config schema every backend reads.

Validation here is structural (types, names, ranges). Whether a backend can honour a valid value is the
backend's call (`Backend.check`), so the same file runs everywhere or fails with a message naming the key
and the backend.
"""

from __future__ import annotations

import enum
import re
from typing import Annotated, Any, ClassVar, Literal

from pydantic import ConfigDict, Field, create_model, field_validator, model_validator

from xla_shard.config.data_kinds import KINDS
from xla_shard.config.section import Section
from xla_shard.methods.registry import METHODS


class ShardingStrategy(str, enum.Enum):
    """The five strategies of the FSDP guide; 1-5 are accelerate's numeric spellings."""

    FULL_SHARD = "FULL_SHARD"
    SHARD_GRAD_OP = "SHARD_GRAD_OP"
    NO_SHARD = "NO_SHARD"
    HYBRID_SHARD = "HYBRID_SHARD"
    HYBRID_SHARD_ZERO2 = "HYBRID_SHARD_ZERO2"

    @classmethod
    def parse(cls, value: Any) -> ShardingStrategy:
        if isinstance(value, cls):
            return value
        members = list(cls)
        if isinstance(value, int) and not isinstance(value, bool) or (isinstance(value, str) and value.isdigit()):
            index = int(value)
            if 1 <= index <= len(members):
                return members[index - 1]
            raise ValueError(f"numeric strategy must be 1-{len(members)}, got {value}")
        if isinstance(value, str):
            name = value.strip().upper().replace(" ", "_").replace("-", "_")
            if name in cls.__members__:
                return cls[name]
        raise ValueError(f"unknown strategy {value!r}; expected one of {', '.join(cls.__members__)} or 1-5")

    @property
    def is_hybrid(self) -> bool:
        return self in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy.HYBRID_SHARD_ZERO2)

    @property
    def reshards_after_forward(self) -> bool:
        return self in (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD)


class WrapPolicy(str, enum.Enum):
    TRANSFORMER_BASED_WRAP = "TRANSFORMER_BASED_WRAP"
    SIZE_BASED_WRAP = "SIZE_BASED_WRAP"
    NO_WRAP = "NO_WRAP"


class Backend(str, enum.Enum):
    AUTO = "auto"
    XLA_SPMD = "xla_spmd"
    XLA_FSDP = "xla_fsdp"
    TORCH_FSDP = "torch_fsdp"
    TORCH_TPU = "torch_tpu"


class ShardingTriple(Section):
    """How many devices each of parameters, gradients and optimizer state is split over (AMSP's P, G, OS):
    a device count dividing the devices, `all`, or `none` (replicated); nested, P <= G <= OS.

    `params_after_forward`: what a parameter stays split over between its forward and its backward (default:
    params, gathered again over all P in backward; `none`: kept whole, ZeRO-2 style; a divisor k of params:
    FSDP2's `reshard_after_forward=k`, so backward gathers over k close devices, for P/k times the memory)."""

    params: int | Literal["all", "none"] = "all"
    grads: int | Literal["all", "none"] = "all"
    optimizer: int | Literal["all", "none"] = "all"
    params_after_forward: int | Literal["none"] | None = None

    @field_validator("params", "grads", "optimizer", "params_after_forward")
    @classmethod
    def _positive(cls, value: Any) -> Any:
        if isinstance(value, int) and value < 1:
            raise ValueError("must be a positive device count, all or none")
        return value

    def resolve(self, devices: int) -> tuple[int, int, int, int]:
        """(params, grads, optimizer, params_after_forward) as device counts."""
        params, grads, optimizer = (devices if v == "all" else 1 if v == "none" else v
                                    for v in (self.params, self.grads, self.optimizer))
        after = self.params_after_forward
        return params, grads, optimizer, (params if after is None else 1 if after == "none" else after)


class FsdpSection(Section):
    sharding_strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD
    # Instead of a strategy: the sharding degrees of {params, grads, optimizer} (see ShardingTriple), or auto:
    # the cost model's fastest choice for the devices and model (`xla-shard plan` shows the ranking).
    sharding: Literal["auto"] | ShardingTriple | None = None
    auto_wrap_policy: WrapPolicy = WrapPolicy.TRANSFORMER_BASED_WRAP
    # Class names resolved against the model's own modules; empty means the model's `_no_split_modules`.
    transformer_layer_cls_to_wrap: list[str] = Field(default_factory=list)
    min_num_params: int = Field(default=100_000_000, ge=1)
    activation_checkpointing: bool = False
    # Run the repeated decoder layers as one XLA loop (torch_xla's scan): compile time flat in depth (xla_spmd).
    scan_layers: bool = False
    offload_params: bool = False
    mixed_precision: Literal["no", "bf16", "fp16"] = "no"
    # Under bf16 mixed precision, the dtype of what flows between the layers: the embedding's output and each
    # decoder layer's output (the residual stream, which activation checkpointing keeps). bfloat16 (null's
    # choice): as FSDP2's MixedPrecisionPolicy(param_dtype=bf16) and MaxText compute, half the memory. float32:
    # torch autocast's own rule (matmuls in bf16, the stream in fp32), twice the memory (docs/backends.md).
    activation_dtype: Literal["bfloat16", "float32"] | None = None
    state_dict_type: Literal["SHARDED_STATE_DICT", "FULL_STATE_DICT"] = "SHARDED_STATE_DICT"
    # NO_SHARD on torch_fsdp runs DDP; this is its gradient bucket.
    bucket_cap_mb: float = Field(default=25.0, gt=0)
    # Passed unchanged to XlaFullyShardedDataParallel (xla_fsdp only), as transformers' `xla_fsdp_settings`.
    xla_settings: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _activations_need_mixed_precision(self) -> FsdpSection:
        if self.activation_dtype == "bfloat16" and self.mixed_precision != "bf16":
            raise ValueError(f"fsdp.activation_dtype bfloat16 needs fsdp.mixed_precision: bf16 (it is "
                             f"{self.mixed_precision}: everything computes in fp32)")
        return self

    @property
    def bf16_activations(self) -> bool:
        """Whether the residual stream between layers is bf16 (see `activation_dtype`)."""
        return self.mixed_precision == "bf16" and self.activation_dtype != "float32"

    @field_validator("sharding_strategy", mode="before")
    @classmethod
    def _strategy(cls, value: Any) -> ShardingStrategy:
        return ShardingStrategy.parse(value)

    @field_validator("auto_wrap_policy", mode="before")
    @classmethod
    def _wrap_policy(cls, value: Any) -> Any:
        return value.strip().upper() if isinstance(value, str) else value

    @field_validator("transformer_layer_cls_to_wrap", mode="before")
    @classmethod
    def _layer_names(cls, value: Any) -> Any:
        if value is None:
            return []
        if isinstance(value, str):  # accelerate writes "LlamaDecoderLayer,MLP"
            return [name.strip() for name in value.split(",") if name.strip()]
        return value

    @field_validator("mixed_precision", mode="before")
    @classmethod
    def _precision(cls, value: Any) -> Any:
        if value is None or value is False:
            return "no"
        aliases = {"bfloat16": "bf16", "float16": "fp16", "fp32": "no", "float32": "no", "none": "no"}
        return aliases.get(str(value).lower(), str(value).lower()) if isinstance(value, str) else value


class MeshSection(Section):
    """SPMD device mesh: `fsdp` devices shard parameters, `replica` groups hold copies (HYBRID_SHARD).

    `fsdp: -1` means "all devices left after the replica axis". torch_fsdp uses the same two numbers for
    its 2-D DeviceMesh under HYBRID_SHARD.

    `context`: the sequence axis (xla_spmd, torch_fsdp). Each sequence is split over that many devices (a
    divisor of the devices parameters are split over, which still span them: the axis adds no state per device);
    attention gathers keys and values along it, and each device holds an early and a late chunk of every
    sequence, so the causal work is balanced.

    `generation`: the devices an online method's generation (GRPO's sampling) splits the weights over, as tensor
    parallelism splits them (xla_spmd); the weights take that layout once a generation, not once a token. 1: whole
    on every device; auto: 1 where they fit beside the KV cache, else the fewest devices that fit.
    """

    fsdp: int = -1
    replica: int = Field(default=1, ge=1)
    context: int = Field(default=1, ge=1)
    generation: Literal["auto"] | Annotated[int, Field(ge=1)] = "auto"

    @field_validator("fsdp")
    @classmethod
    def _fsdp(cls, value: int) -> int:
        if value == 0 or value < -1:
            raise ValueError("must be a positive device count or -1 (all devices)")
        return value

    def resolve(self, num_devices: int) -> tuple[int, int]:
        """(replica, fsdp) for `num_devices`, or ValueError naming what does not divide."""
        if num_devices % self.replica:
            raise ValueError(f"mesh.replica={self.replica} does not divide the {num_devices} devices")
        fsdp = num_devices // self.replica if self.fsdp == -1 else self.fsdp
        if self.replica * fsdp != num_devices:
            inside = ""
            if self.context > 1:  # MaxText's ici_fsdp x ici_context = devices is not this schema's form
                inside = (f" (mesh.context's {self.context} devices lie inside mesh.fsdp's, which counts them: "
                          f"fsdp {num_devices // self.replica} with context {self.context} splits each sequence "
                          f"over {self.context} of them)")
            raise ValueError(f"mesh replica x fsdp = {self.replica} x {fsdp} = {self.replica * fsdp} "
                             f"does not match the {num_devices} devices{inside}")
        return self.replica, fsdp


class LoraSection(Section):
    """LoRA adapters (peft's): the model's weights stay frozen, small low-rank matrices beside the chosen layers
    are trained, and checkpoints hold only what is trained."""

    r: int = Field(default=8, ge=1)
    alpha: float = Field(default=16.0, gt=0)
    dropout: float = Field(default=0.0, ge=0, lt=1)
    # Module names (the last part, as peft matches them: [q_proj, v_proj]) or "all-linear": every linear layer
    # but the output head.
    target_modules: list[str] | Literal["all-linear"] = "all-linear"
    # Modules trained whole beside the adapters (a new classifier head is added by itself).
    modules_to_save: list[str] = Field(default_factory=list)
    # The frozen weights' dtype: bfloat16 halves their memory and runs the base in bf16, while the adapters
    # (and modules_to_save) stay float32, computed in float32 (peft casts their input).
    base_dtype: Literal["float32", "bfloat16"] = "float32"
    # DoRA (peft's use_dora): each adapted layer also trains one magnitude per output row, which starts as that
    # row's norm in the base weight; the adapters then set each row's direction.
    use_dora: bool = False

    @field_validator("target_modules")
    @classmethod
    def _some_targets(cls, value: Any) -> Any:
        if isinstance(value, list) and not value:
            raise ValueError("model.lora.target_modules is empty: name the layers to adapt, or all-linear")
        return value


class QuantizationSection(Section):
    """QLoRA: the frozen base's linear layers held in 4 bits, in bitsandbytes' format and arithmetic, under the
    names of transformers' BitsAndBytesConfig (its 4-bit keys). Which layers stay whole is transformers' choice
    (the output head, tied weights), or llm_int8_skip_modules."""

    quant_method: Literal["bitsandbytes"] = "bitsandbytes"
    load_in_4bit: bool = True
    bnb_4bit_quant_type: Literal["nf4", "fp4"] = "fp4"  # BitsAndBytesConfig's default; QLoRA's is nf4
    # The blocks' scales quantized again, in 8 bits (their values as bitsandbytes gives them back; held here as
    # fp32, half a bit a weight more than bitsandbytes stores).
    bnb_4bit_use_double_quant: bool = False
    # What the 4-bit layers' matmuls run in (their inputs cast to it, their outputs back), as transformers has
    # bitsandbytes run them.
    bnb_4bit_compute_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    bnb_4bit_quant_storage: Literal["uint8"] = "uint8"
    llm_int8_skip_modules: list[str] | None = None

    @field_validator("load_in_4bit")
    @classmethod
    def _four_bits(cls, value: bool) -> bool:
        if not value:
            raise ValueError("model.quantization.load_in_4bit is false: xla_shard quantizes to 4 bits only (8-bit "
                             "bitsandbytes is not supported); set it to true, or remove model.quantization")
        return value


class ModelSection(Section):
    # A preset name (see `xla_shard.config.presets`), a transformers config.json, or a model directory
    # (`save_pretrained` output: config.json + safetensors) on a local disk or any fsspec URL (gs://, hf://).
    name: str = "tiny-llama"
    # auto: the directory's weights if it has any, else random; pretrained: its weights or an error; random.
    init: Literal["auto", "pretrained", "random"] = "auto"
    # What the model is trained for: next-token prediction, or one label per sequence (a classifier head).
    task: Literal["causal_lm", "sequence_classification"] = "causal_lm"
    # sequence_classification: how many labels (null: the config's id2label / num_labels).
    num_labels: int | None = Field(default=None, ge=1)
    # Applied on top of the transformers config, e.g. {num_hidden_layers: 4}.
    overrides: dict[str, Any] = Field(default_factory=dict)
    # The attention kernel. auto: the fastest that computes the same thing on the device (TPU: xla_pallas,
    # torch_xla's Pallas flash attention; CUDA and TorchTPU: sdpa; torch's CPU: sdpa_packed; XLA's CPU: eager).
    # eager; sdpa (torch's scaled_dot_product_attention); sdpa_packed (SDPA with packed rows' documents attended
    # apart, no mask); flash_attention_2 (CUDA, the flash-attn package); xla_pallas (TPU).
    attn_implementation: Literal["auto", "eager", "sdpa", "sdpa_packed", "flash_attention_2", "xla_pallas"] = "auto"
    # Train LoRA adapters (peft) instead of every weight; null: full fine-tuning.
    lora: LoraSection | None = None
    # The frozen base in 4 bits under the adapters (QLoRA); null: the base in model.lora.base_dtype.
    quantization: QuantizationSection | None = None

    @model_validator(mode="after")
    def _quantized_base_needs_adapters(self) -> ModelSection:
        if self.quantization is None:
            return self
        if self.lora is None:
            raise ValueError("model.quantization holds the base in 4 bits, which does not train: set model.lora "
                             "(QLoRA), or remove model.quantization")
        if self.lora.use_dora:
            raise ValueError("model.lora.use_dora with model.quantization: DoRA over a 4-bit base is not supported "
                             "yet; drop one of them")
        return self

    @model_validator(mode="after")
    def _labels_need_a_classifier(self) -> ModelSection:
        if self.num_labels is not None and self.task != "sequence_classification":
            raise ValueError("model.num_labels sizes a classifier head: set model.task: sequence_classification")
        return self

    @field_validator("overrides")
    @classmethod
    def _no_attention_override(cls, value: dict[str, Any]) -> dict[str, Any]:
        for key in ("attn_implementation", "_attn_implementation"):
            if key in value:
                raise ValueError(f"{key} is chosen by model.attn_implementation, not an override")
        return value


class TrainSection(Section):
    # Optimizer steps; or `epochs` (passes over the training rows, fractions allowed), not both.
    steps: int = Field(default=8, ge=1)
    epochs: float | None = Field(default=None, gt=0)
    # Rows per optimizer step, all processes together (split into grad_accum_steps micro-batches).
    global_batch_size: int = Field(default=8, ge=1)
    seq_len: int = Field(default=64, ge=2)
    optimizer: Literal["sgd", "adamw"] = "adamw"
    lr: float = Field(default=1e-3, gt=0)
    # constant, or linear / cosine decay to lr * lr_min_ratio at the last step; after lr_warmup_steps of linear warm-up.
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    lr_warmup_steps: int = Field(default=0, ge=0)
    lr_min_ratio: float = Field(default=0.0, ge=0, le=1)
    weight_decay: float = Field(default=0.0, ge=0)
    # Clip the global gradient norm (over every shard) to this; null: no clipping. The norm is logged either way.
    max_grad_norm: float | None = Field(default=None, gt=0)
    # Micro-batches per optimizer step: the same update as one batch of global_batch_size rows, in less memory.
    grad_accum_steps: int = Field(default=1, ge=1)
    # A causal LM's loss (and DPO's log-probabilities, evaluation's loss and accuracy) computed over this many
    # chunks of the positions, the output head inside each, so its logits are never whole. auto: as many chunks
    # as the vocabulary is wider than the hidden states (a chunk's logits take about what the hidden states do);
    # 0: the model's own loss over its whole logits.
    loss_chunks: Literal["auto"] | int = "auto"
    # torch.compile each wrapped block (the units fsdp.auto_wrap_policy picks; the whole model if none), as
    # torchtitan does: one graph per layer, reused by every layer. FSDP2 backends only (torch_fsdp, torch_tpu):
    # torch_xla compiles each step into one XLA graph already.
    compile: bool = False
    seed: int = 0
    log_every: int = Field(default=1, ge=1)
    # Evaluate every N steps (and after the last) on data.eval_path / data.eval_fraction; null: only at the end.
    eval_every: int | None = Field(default=None, ge=1)
    # Batches per evaluation (null: the whole evaluation set, in full batches).
    eval_steps: int | None = Field(default=None, ge=1)
    # Also write TensorBoard event files to output_dir (needs the `tensorboard` package:
    # pip install xla_shard[tensorboard]).
    tensorboard: bool = False
    # Denominator of MFU in FLOP/s per device; null uses the device table (`xla_shard.planner.hardware`).
    peak_flops_per_device: float | None = Field(default=None, gt=0)
    # Steps after which a new XLA graph compilation is reported as a recompile (not learning-rate warm-up).
    recompile_warmup_steps: int = Field(default=2, ge=1)

    # Keys that moved, with where they went: a user who sets one learns where, instead of a did-you-mean.
    _MOVED: ClassVar[dict[str, str]] = {
        "data": "data.path (the data section: path, tokenizer, text_field, ...)",
        "warmup_steps": "train.recompile_warmup_steps (it never warmed up the learning rate; that is "
                        "train.lr_warmup_steps)",
        "warmup_ratio": "train.lr_warmup_steps (a number of steps)",
    }

    @field_validator("loss_chunks")
    @classmethod
    def _chunks(cls, value: Any) -> Any:
        if isinstance(value, int) and value < 0:
            raise ValueError("must be auto, 0 (the logits whole) or a count of chunks")
        return value

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, value: Any) -> Any:
        if isinstance(value, dict):
            for key, now in cls._MOVED.items():
                if key in value:
                    raise ValueError(f"train.{key} is now {now}")
        return value

    @model_validator(mode="after")
    def _steps_or_epochs(self) -> TrainSection:
        if self.epochs is not None and "steps" in self.model_fields_set:
            raise ValueError("set train.steps or train.epochs, not both")
        if self.global_batch_size % self.grad_accum_steps:
            raise ValueError(f"train.global_batch_size={self.global_batch_size} does not split into "
                             f"train.grad_accum_steps={self.grad_accum_steps} equal micro-batches")
        return self


def _completion_kinds() -> list[str]:
    return [name for name, kind in KINDS.items() if kind.completion_loss == "optional"]


class DataSection(Section):
    """What the model trains on. Files are read with Hugging Face `datasets` (memory-mapped Arrow, tokenized
    once and cached), so a corpus larger than host memory works."""

    # synthetic (generated tokens, for benchmarks), or a file, directory or glob, local or any fsspec URL (gs://)
    path: str = "synthetic"
    # json | jsonl | csv | parquet | txt; null: from the files' extension (.gz .bz2 .xz .zst compressed too)
    format: Literal["json", "jsonl", "csv", "parquet", "txt"] | None = None
    # A tokenizer directory (local or URL); null: the model directory's own.
    tokenizer: str | None = None
    # causal_lm: what a row is. text: plain text in `text_field`; chat: a list of {role, content} messages in
    # `messages_field`, rendered with the tokenizer's chat template; prompt_completion: a prompt and its answer in
    # `prompt_field` and `completion_field` (strings, or lists of messages); preference: a prompt and two answers
    # to it, `chosen_field` preferred over `rejected_field` (strings, or lists of messages), trained with DPO (the
    # `dpo` section); prompt: a prompt alone in `prompt_field` (a string or a list of messages), its row's other
    # columns handed to the reward functions, trained with GRPO (the `grpo` section).
    kind: Literal[tuple(KINDS)] = "text"  # config/data_kinds.py
    # causal_lm: the column holding the text (txt files: each line is a row of `text`).
    text_field: str = "text"
    messages_field: str = "messages"
    prompt_field: str = "prompt"
    completion_field: str = "completion"
    chosen_field: str = "chosen"
    rejected_field: str = "rejected"
    # chat and prompt_completion: the loss covers the assistant turns / the completion only (null: true for them).
    completion_only_loss: bool | None = None
    # sequence_classification: one text column, or a pair such as [premise, hypothesis]; and the label column
    # (integers, or strings mapped through the model config's label2id).
    text_fields: list[str] = Field(default_factory=lambda: ["text"], min_length=1, max_length=2)
    label_field: str = "label"
    # causal_lm: several examples to a row of seq_len tokens (true), or one example per row, padded (false).
    # Preference rows are always padded: the chosen and rejected sequences of a row stand side by side.
    packing: bool = True
    # How: bfd (best-fit decreasing, as TRL's pack_dataset: examples kept apart, each truncated at seq_len),
    # bfd_split (the same, long examples cut into pieces first: no token lost), or wrapped (documents joined with
    # EOS and cut into seq_len blocks, attending across documents: text only). null: bfd for chat and
    # prompt_completion, wrapped for text.
    packing_strategy: Literal["bfd", "bfd_split", "wrapped"] | None = None
    # Evaluation rows: another file (same format rules), or a seeded fraction held out of the training rows.
    eval_path: str | None = None
    eval_fraction: float = Field(default=0.0, ge=0, lt=1)
    # Processes that tokenize (null: one per CPU core, up to 8, for corpora over 10,000 rows).
    num_proc: int | None = Field(default=None, ge=1)
    # causal_lm: tokenize while reading (nothing prepared up front), shuffling within a buffer of this many rows.
    streaming: bool = False
    shuffle_buffer: int = Field(default=10_000, ge=1)

    @property
    def packs(self) -> str | None:
        """The packing strategy rows are packed with, None where they are not."""
        if not self.packing or KINDS[self.kind].padded:
            return None
        return self.packing_strategy or ("wrapped" if KINDS[self.kind].plain_text else "bfd")

    @model_validator(mode="after")
    def _one_eval_source(self) -> DataSection:
        if self.eval_path and self.eval_fraction:
            raise ValueError("set data.eval_path or data.eval_fraction, not both")
        if self.path == "synthetic" and (self.eval_path or self.eval_fraction):
            raise ValueError("data.path is synthetic: there is nothing to evaluate on (set data.path to a file)")
        kind = KINDS[self.kind]
        if not kind.plain_text and self.path == "synthetic":
            raise ValueError(f"data.kind {self.kind} reads rows from a file: set data.path")
        if kind.completion_loss == "no_prompt" and self.completion_only_loss:
            raise ValueError(f"data.completion_only_loss applies to data.kind {' and '.join(_completion_kinds())}; a "
                             f"{self.kind} row has no prompt to leave out of the loss")
        if self.packing_strategy is not None and (not self.packing or kind.padded):
            raise ValueError(f"data.packing_strategy {self.packing_strategy} packs rows, but "
                             + ("data.packing is false" if not self.packing else
                                f"{self.kind} rows are always padded"))
        if self.packing_strategy == "wrapped" and not kind.plain_text:
            raise ValueError(f"data.packing_strategy wrapped cuts rows across examples; data.kind {self.kind} keeps "
                             "each example whole: use bfd or bfd_split")
        if not kind.plain_text and self.streaming:
            raise ValueError(f"data.streaming reads plain text only; data.kind {self.kind} rows are prepared up front "
                             "(set data.streaming: false)")
        if not kind.plain_text and self.format == "txt":
            raise ValueError(f"data.format txt holds one line of text per row; data.kind {self.kind} needs named "
                             "columns (jsonl, json, parquet or csv)")
        named = [(key, getattr(self, key)) for key in kind.columns]
        for index, (key, column) in enumerate(named):
            same = next((other for other, theirs in named[:index] if theirs == column), None)
            if same:
                raise ValueError(f"data.{same} and data.{key} both name the column {column!r}: a data.kind "
                                 f"{self.kind} row's parts are columns of their own")
        if kind.completion_loss == "always" and self.completion_only_loss is not None:
            raise ValueError(f"data.completion_only_loss applies to {' and '.join(_completion_kinds())}; a "
                             f"{self.kind} row's log-probabilities are always the completions' (drop the key)")
        if self.streaming and self.packing and self.packs != "wrapped":
            raise ValueError(f"data.streaming packs documents as it reads them (wrapped); data.packing_strategy "
                             f"{self.packing_strategy} packs a thousand at a time from prepared rows: drop one")
        if self.streaming and self.eval_fraction:
            raise ValueError("data.streaming reads the rows once, in order: hold evaluation rows out in a file "
                             "(data.eval_path), not data.eval_fraction")
        return self


# The longest wait or grace any duration key takes: a week. Beyond it a value is a mistake, and what it feeds
# (timedelta, Kubernetes' terminationGracePeriodSeconds, xpk's flags) overflows or refuses it.
MAX_SECONDS = 7 * 24 * 3600


class LaunchSection(Section):
    """How many processes torch_fsdp starts (through torchrun), on how many nodes. The XLA backends drive
    every local device from one process per host and take none of these keys. `--nproc-per-node` on the
    command line wins."""

    # null: one per GPU, or cpu_devices gloo processes on a CPU
    nproc_per_node: int | None = Field(default=None, ge=1, le=1024)
    # > 1: run `xla-shard train CONFIG --set launch.node_rank=R` on every node, all naming one rdzv_endpoint
    # (torchrun's static rendezvous, its store served by node 0: node r holds ranks r*nproc_per_node..).
    nnodes: int = Field(default=1, ge=1)
    node_rank: int | None = Field(default=None, ge=0)
    rdzv_endpoint: str | None = Field(default=None, pattern=r"^[A-Za-z0-9.\-]+:\d{1,5}$")
    rdzv_id: str = Field(default="xla_shard", pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    # Seconds the nodes wait for each other: at the rendezvous, and in any collective once running (a node that
    # died makes the others stop after at most this long).
    timeout_s: float = Field(default=600.0, gt=0, le=MAX_SECONDS)

    @field_validator("rdzv_endpoint")
    @classmethod
    def _port(cls, value: str | None) -> str | None:
        if value is not None and not 1 <= int(value.rsplit(":", 1)[1]) <= 65535:
            raise ValueError(f"{value}: the port must be 1-65535")
        return value

    @model_validator(mode="after")
    def _nodes(self) -> LaunchSection:
        # node_rank and rdzv_endpoint may come per node (--set) onto a shared file: `xla-shard train` asks for
        # them when it starts several nodes, not here.
        if self.node_rank is not None and self.node_rank >= self.nnodes:
            raise ValueError(f"launch.node_rank={self.node_rank} is not below launch.nnodes={self.nnodes}")
        return self


_BUCKET_SCHEMES = ("gs", "gcs", "s3", "az", "abfs")  # object stores: the first segment after :// is the bucket


def _place(value: str) -> str:
    """A directory or a URL that names a place: `gs://` alone (or `gs:///x`) names no bucket, and would otherwise
    become a local folder called `gs:`."""
    if not value.strip():
        raise ValueError("is empty: give a directory or a URL")
    scheme, sep, rest = value.partition("://")
    if sep and (not rest.strip("/") or (scheme in _BUCKET_SCHEMES and rest.startswith("/"))):
        raise ValueError(f"{value!r} names no {'bucket' if scheme in _BUCKET_SCHEMES else 'path'} after {scheme}://")
    scheme, colon, rest = value.partition(":")
    if not sep and colon and scheme.lower() in _BUCKET_SCHEMES:  # gs:/bucket, gs:bucket: a local folder "gs:"
        raise ValueError(f"{value!r} is not a URL ({scheme}:// takes two slashes: {scheme}://{rest.lstrip('/')})")
    return value


class CheckpointSection(Section):
    # Any fsspec URL: a local path, gs://bucket/prefix (gcsfs, the VM's credentials), memory://... ;
    # null turns checkpointing off.
    dir: str | None = None
    every_steps: int = Field(default=100, ge=1)
    # Committed checkpoints kept (newest first); older ones are deleted after each commit.
    keep_last: int = Field(default=3, ge=1)
    # Also keep every checkpoint whose step is a multiple of this, for good (null: none).
    keep_every: int | None = Field(default=None, ge=1)
    # Upload in a background thread; the step waits only for the device-to-host copy.
    async_save: bool = Field(default=True, alias="async")
    # auto: the newest committed checkpoint under `dir`, if any; never; or the URL of one checkpoint.
    resume: str = "auto"
    # Seconds a SIGTERM (spot preemption) or a first Ctrl-C allows to finish or take the final save before exiting.
    preemption_grace_s: float = Field(default=120.0, gt=0, le=MAX_SECONDS)
    # Transient storage errors (HTTP 429/5xx, timeouts, refused connections) are retried for this long.
    retry_deadline_s: float = Field(default=120.0, gt=0, le=MAX_SECONDS)
    # How long the main process waits for every rank's shard before it declares the save failed.
    commit_timeout_s: float = Field(default=600.0, gt=0, le=MAX_SECONDS)

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False, populate_by_name=True)

    @field_validator("dir")
    @classmethod
    def _dir_place(cls, value: str | None) -> str | None:
        return None if value is None else _place(value)

    @field_validator("resume")
    @classmethod
    def _keyword_case(cls, value: str) -> str:
        """`Auto` would be read as a checkpoint directory of that name, and fail far from this key."""
        if value.lower() in ("auto", "never") and value not in ("auto", "never"):
            raise ValueError(f"{value!r}: the keywords are auto and never, in lower case (for a checkpoint "
                             f"directory named {value}, write ./{value})")
        return value


# What GCP accepts for each deploy value. Every value ends up in shell scripts (some run as root at boot) and
# in commands run remotely over ssh, so anything outside these is refused here, before it is rendered.
_RESOURCE = r"[a-z](?:[-a-z0-9]{0,61}[a-z0-9])?"  # RFC 1035: TPU nodes, instances, images, networks
_SUBDOMAIN = r"[a-z0-9](?:[-a-z0-9]*[a-z0-9])?(?:\.[a-z0-9](?:[-a-z0-9]*[a-z0-9])?)*"
# Longest values (characters) of the deploy keys; any other key's: 253 (a DNS name's, an email's 254)
_MAX_LENGTH = {"queue": 63, "priority_class": 63, "service_account": 254}
DEPLOY_PATTERNS = {
    "project": (r"(?:[a-z0-9][-a-z0-9.]*[a-z0-9]:)?[a-z][-a-z0-9]{4,28}[a-z0-9]",
                "a Google Cloud project id: 6-30 lowercase letters, digits or hyphens, starting with a letter"),
    "zone": (r"[a-z]+-[a-z]+[0-9]+-[a-z]", "a zone such as us-central2-b"),
    "name": (_RESOURCE, "a GCP resource name: lowercase letters, digits and hyphens, starting with a letter, "
                        "at most 63 characters"),
    "accelerator_type": (r"[a-z0-9]+-[0-9]+", "a TPU type such as v4-8 or v5litepod-16"),
    "network": (r"[a-zA-Z0-9][-a-zA-Z0-9_./:]*", "a network name or resource path"),
    "subnetwork": (r"[a-zA-Z0-9][-a-zA-Z0-9_./:]*", "a subnetwork name or resource path"),
    "service_account": (r"[a-z0-9][-a-z0-9._]*@[a-z0-9][-a-z0-9.]*[a-z0-9]", "a service account email"),
    "gpu_machine_type": (r"[a-z0-9]+(?:-[a-z0-9]+)*", "a Compute Engine machine type such as a3-highgpu-8g"),
    "gpu_image_family": (_RESOURCE, "an image family name"),
    "gpu_image_project": (r"[a-z][-a-z0-9]{4,61}[a-z0-9]", "an image project id"),
    "remote_user": (r"[a-z_][a-z0-9_-]{0,31}", "a Linux user name: lowercase letters, digits, _ or -"),
    "remote_dir": (r"[A-Za-z0-9_][-A-Za-z0-9_.]*(?:/[A-Za-z0-9_][-A-Za-z0-9_.]*)*",
                   "a path relative to the remote home: letters, digits, '.', '_', '-' and '/'"),
    "cluster": (r"[a-z](?:[-a-z0-9]{0,38}[a-z0-9])?", "a GKE cluster name: lowercase letters, digits and hyphens, "
                                                      "starting with a letter, at most 40 characters"),
    "image": (r"[a-z0-9]+(?:[._-][a-z0-9]+)*(?::[0-9]{1,5})?(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*"
              r"(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(?:@sha256:[a-f0-9]{64})?",
              "a container image reference such as us-docker.pkg.dev/my-project/train/xla-shard:1.0"),
    "namespace": (r"[a-z0-9](?:[-a-z0-9]{0,61}[a-z0-9])?", "a Kubernetes namespace: lowercase letters, digits "
                                                          "and hyphens, at most 63 characters"),
    "region": (r"[a-z]+-[a-z]+[0-9]+", "a region such as us-east5"),
    # Kubernetes object names (DNS subdomains: dot-separated parts, each starting and ending with a letter or
    # digit) that are label values too (at most 63 characters: `_MAX_LENGTH`)
    "queue": (_SUBDOMAIN, "a Kueue LocalQueue name: lowercase letters, digits, '-' and '.', each '.'-separated part "
                          "starting and ending with a letter or digit, at most 63 characters"),
    "priority_class": (_SUBDOMAIN, "a Kueue WorkloadPriorityClass name: lowercase letters, digits, '-' and '.', each "
                                   "'.'-separated part starting and ending with a letter or digit, at most 63 "
                                   "characters"),
    "cpu": (r"[0-9]+(?:\.[0-9]+)?m?", "a Kubernetes CPU quantity such as 8, 7.5 or 500m"),
    "memory": (r"[0-9]+(?:\.[0-9]+)?(?:[KMGTPE]i|[kMGTPE])?", "a Kubernetes memory quantity such as 64Gi or 200G"),
}


class DeploySection(Section):
    """Where `xla-shard gcp render` puts the job. Only the deploy commands read this section."""

    project: str | None = None
    zone: str = "us-central2-b"
    name: str = "xla-shard"
    # TPU: v4-8, v5litepod-8, v5p-8, v6e-8, ... (see xla_shard.deploy.tpu.GENERATIONS)
    accelerator_type: str = "v4-8"
    # on-demand | spot | preemptible | reserved
    provisioning: Literal["on-demand", "spot", "preemptible", "reserved"] = "spot"
    network: str | None = None
    subnetwork: str | None = None
    # Runs the VM with the cloud-platform scope, so gcsfs reaches gs:// checkpoints with its credentials.
    service_account: str | None = None
    # Queued resources: how long the request may wait for capacity, e.g. 6h, 2d (gcloud duration).
    valid_until: str = "6h"
    # Allow a zone that xla_shard's table does not list for this TPU generation (the table may be stale).
    allow_unlisted_zone: bool = False
    # GPU fallback: machine type (GPUs come with a2/a3/g2 types) and node count for torchrun.
    gpu_machine_type: str = "a3-highgpu-8g"
    gpu_nodes: int = Field(default=1, ge=1)
    gpu_image_family: str = "common-cu128-ubuntu-2204-nvidia-570"
    gpu_image_project: str = "deeplearning-platform-release"
    # The account the commands ssh in as, and where the code is unpacked in its home on every machine.
    remote_user: str = "xlashard"
    remote_dir: str = "xla_shard"
    # GKE (--target gke, and the xpk command beside it): the cluster, and an image holding xla_shard with its
    # runtime (pip install 'xla_shard[tpu]' for TPU slices, xla_shard on CUDA torch for GPU node pools).
    cluster: str | None = None
    image: str | None = None
    namespace: str = "default"
    # TPU slices of accelerator_type joined over DCN (one replicated job each); GPU node pools use gpu_nodes.
    num_slices: int = Field(default=1, ge=1, le=64)
    # Times the JobSet recreates every pod after one failed (preemption, a lost node) before it gives up.
    max_restarts: int = Field(default=5, ge=0, le=1000)
    # A regional cluster's region: its credentials are fetched there; deploy.zone, inside it, still names where
    # the node pools with the accelerators are.
    region: str | None = None
    # A shared cluster's admission: the Kueue LocalQueue the JobSet is submitted to, and its
    # WorkloadPriorityClass (the kueue.x-k8s.io/queue-name and priority-class labels).
    queue: str | None = None
    priority_class: str | None = None
    # CPU and memory each pod requests beside its accelerators (clusters with quotas require requests).
    cpu: str | None = None
    memory: str | None = None

    @field_validator("cpu", "memory", mode="before")
    @classmethod
    def _quantity(cls, value: Any) -> Any:
        """A bare number (cpu: 8) is a quantity as Kubernetes writes it."""
        return str(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value

    @field_validator(*DEPLOY_PATTERNS, mode="after")
    @classmethod
    def _shell_safe(cls, value: str | None, info) -> str | None:
        pattern, what = DEPLOY_PATTERNS[info.field_name]
        longest = _MAX_LENGTH.get(info.field_name, 253)
        if value is not None and len(value) > longest:
            raise ValueError(f"is {len(value)} characters long; {what} is at most {longest}")
        if value is not None and not re.fullmatch(pattern, value):
            raise ValueError(f"{value!r} is not {what}")
        if info.field_name == "remote_dir" and ".." in value.split("/"):
            raise ValueError(f"{value!r} must stay inside the remote home (no '..')")
        return value

    @model_validator(mode="after")
    def _node_names_fit(self) -> DeploySection:
        if self.gpu_nodes > 1 and len(f"{self.name}-{self.gpu_nodes - 1}") > 63:
            raise ValueError(f"deploy.name {self.name!r} is too long for {self.gpu_nodes} GPU nodes "
                             f"('{self.name}-{self.gpu_nodes - 1}' exceeds GCP's 63 characters)")
        return self


# The fine-tuning methods, a config key each (`xla_shard.methods.registry`: their rows and sections).
Method = Literal[tuple(METHODS)]


class _ShardConfig(Section):
    """Every key but the methods' own sections, which `ShardConfig` adds from the methods' registry."""

    backend: Backend = Backend.AUTO
    # The fine-tuning method (`xla_shard.methods.registry`): its keys are the section of its name.
    method: Method = "sft"
    # Devices to use on CPU: XLA virtual devices (xla_spmd) or gloo processes (torch_fsdp, via torchrun).
    cpu_devices: int = Field(default=4, ge=1, le=64)
    model: ModelSection = Field(default_factory=ModelSection)
    fsdp: FsdpSection = Field(default_factory=FsdpSection)
    mesh: MeshSection = Field(default_factory=MeshSection)
    train: TrainSection = Field(default_factory=TrainSection)
    data: DataSection = Field(default_factory=DataSection)
    launch: LaunchSection = Field(default_factory=LaunchSection)
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    deploy: DeploySection = Field(default_factory=DeploySection)
    output_dir: str = "runs/default"

    # Keys that must agree for a resumed run to continue the same model, optimizer state and data stream.
    RESUME_KEYS: ClassVar[tuple[str, ...]] = ("model.name", "model.overrides", "model.task", "model.lora",
                                              "model.quantization", "train.optimizer", "train.seed",
                                              "train.global_batch_size", "train.seq_len", "data.path", "data.kind",
                                              "data.tokenizer", "data.packing", "data.eval_fraction")

    # Of those, the keys that may name a local file or directory: the same place named by a relative path, an
    # absolute one or through a link is the same run.
    PLACE_KEYS: ClassVar[tuple[str, ...]] = ("model.name", "data.path", "data.tokenizer")

    # Keys whose being set, not only their value, a validator reads where another key is given (not null)
    # (`TrainSection._steps_or_epochs`, `_consistent`): a dumped config writes them there only where they were
    # set, so that it validates again as it did (`config.load.dump`).
    SET_ONLY_BESIDE: ClassVar[dict[str, str]] = {"train.steps": "train.epochs",
                                                 "fsdp.sharding_strategy": "fsdp.sharding",
                                                 "mesh.replica": "fsdp.sharding"}

    def run_identity(self) -> dict[str, Any]:
        """{dotted key: value} of RESUME_KEYS, as written into and compared against checkpoint manifests."""
        dumped = self.model_dump(mode="json", by_alias=True)
        return {key: dumped[key.split(".")[0]][key.split(".")[1]] for key in self.RESUME_KEYS}

    @field_validator("output_dir")
    @classmethod
    def _output_place(cls, value: str) -> str:
        return _place(value)

    @field_validator("data", mode="before")
    @classmethod
    def _data_shorthand(cls, value: Any) -> Any:
        return {"path": value} if isinstance(value, str) else value

    @model_validator(mode="after")
    def _eval_needs_data(self) -> _ShardConfig:
        if self.data.path == "synthetic" and self.train.eval_every is not None:
            raise ValueError("train.eval_every is set but data.path is synthetic: nothing to evaluate on")
        for method, entry in METHODS.items():
            changed = entry.section and getattr(self, method).changed()
            if self.method != method and changed:
                raise ValueError(f"{method}.{changed[0]} applies to method {method}; method is {self.method}")
        if self.model.lora is not None and self.model.lora.use_dora and self.fsdp.scan_layers:
            raise ValueError("model.lora.use_dora with fsdp.scan_layers: DoRA's magnitudes start from each "
                             "layer's weights, which a scanned model holds stacked; drop one of them")
        if not KINDS[self.data.kind].plain_text and self.model.task != "causal_lm":
            raise ValueError(f"data.kind {self.data.kind} trains a causal LM on answers; model.task is "
                             f"{self.model.task} (its rows are data.text_fields and data.label_field)")
        return self

    @model_validator(mode="after")
    def _method_trains_its_rows(self) -> _ShardConfig:
        kinds = METHODS[self.method].rows
        if self.data.kind not in kinds:
            trains = next(method for method, entry in METHODS.items() if self.data.kind in entry.rows)
            raise ValueError(f"data.kind {self.data.kind} rows train method {trains}, and method is {self.method} "
                             f"(it trains on data.kind {' or '.join(kinds)}): set method: {trains}")
        section = METHODS[self.method].section
        if section is not None:
            getattr(self, self.method).check_run(self)
        return self

    @model_validator(mode="after")
    def _sequence_axis(self) -> _ShardConfig:
        context = self.mesh.context
        if context == 1:
            return self
        if self.model.task != "causal_lm":
            raise ValueError(f"mesh.context={context} splits a causal LM's sequences; model.task is {self.model.task}")
        if self.train.seq_len % (2 * context):
            raise ValueError(f"mesh.context={context}: train.seq_len {self.train.seq_len} must split into "
                             f"{2 * context} equal chunks (each device holds an early and a late one)")
        if self.train.loss_chunks == 0:
            raise ValueError(f"mesh.context={context} scores the loss per piece of the split sequence: "
                             "train.loss_chunks 0 (the model's own loss, over whole logits) cannot; set auto")
        return self

    @field_validator("model", mode="before")
    @classmethod
    def _model_shorthand(cls, value: Any) -> Any:
        return {"name": value} if isinstance(value, str) else value

    @field_validator("backend", mode="before")
    @classmethod
    def _backend(cls, value: Any) -> Any:
        return value.strip().lower() if isinstance(value, str) else value

    @model_validator(mode="after")
    def _consistent(self) -> _ShardConfig:
        fsdp = self.fsdp
        if fsdp.auto_wrap_policy is not WrapPolicy.TRANSFORMER_BASED_WRAP and fsdp.transformer_layer_cls_to_wrap:
            raise ValueError(
                "fsdp.transformer_layer_cls_to_wrap is set but fsdp.auto_wrap_policy is "
                f"{fsdp.auto_wrap_policy.value}; use TRANSFORMER_BASED_WRAP or drop the class list"
            )
        if fsdp.sharding is not None and ("sharding_strategy" in fsdp.model_fields_set or
                                          "replica" in self.mesh.model_fields_set):
            raise ValueError("fsdp.sharding sets the sharding (and the mesh) itself: drop fsdp.sharding_strategy "
                             "and mesh.replica, or fsdp.sharding")
        if not fsdp.sharding_strategy.is_hybrid and self.mesh.replica != 1:
            raise ValueError(
                f"mesh.replica={self.mesh.replica} needs fsdp.sharding_strategy HYBRID_SHARD or "
                f"HYBRID_SHARD_ZERO2, not {fsdp.sharding_strategy.value}"
            )
        return self


# The config: its keys, and each method's section under the method's name.
ShardConfig = create_model("ShardConfig", __base__=_ShardConfig, __module__=__name__,
                           **{name: (entry.section, Field(default_factory=entry.section))
                              for name, entry in METHODS.items() if entry.section is not None})
