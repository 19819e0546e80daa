"""GRPO's rollout (`method: grpo`): the examples a step trains on, made as TRL's `GRPOTrainer._generate_and_score`
makes them.

The policy being trained (sharded, on the run's devices) samples a completion for each row (a group of
`num_generations` rows per prompt, `xla_shard.sampling`) inside the backend's generation context (the weights in
the layout it generates in: gathered once a generation, not once a token), the user's reward functions score
them on the host (`rewards`), the scores of the whole global batch are summed over the processes so every process
computes every group's advantage (`grpo.advantages`), and each row becomes its prompt + completion with its
completion mask and advantage; with `num_iterations` > 1 the tokens' log-probabilities under the generating
policy, with `beta` > 0 the reference's, both computed there without gradients. A generation trains
`num_iterations` steps, as TRL's buffer does.

A row's draws are keyed by (train.seed, the generation, the row's place in the global batch): the same
completions on any backend and any number of processes, and a resumed run draws what the uninterrupted one drew at
the same step. A checkpoint taken inside a generation's `num_iterations` steps holds each process's examples of
that generation (`state`), so a resume there trains on them as the uninterrupted run did; where it cannot (another
number of processes) that generation is drawn again from the resumed policy, and the run's log says so.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from xla_shard.data import Batch
from xla_shard.data.prompts import Generations
from xla_shard.errors import ConfigError
from xla_shard.methods import grpo
from xla_shard.methods.adapter import Adapter
from xla_shard.methods.rewards import Rewards
from xla_shard.methods.rollout import Rollout
from xla_shard.sampling import Generation, Sampling, row_keys, sample, shared_prompts


class GrpoRollout(Rollout):
    trims_padding = False  # a row is its left-padded prompt, then its completion

    def __init__(self, cfg, adapter: Adapter):
        section = cfg.grpo
        self.section, self.adapter, self.seed, self.cfg = section, adapter, cfg.train.seed, cfg
        self.engine = None  # the colocated vLLM engine (grpo.use_vllm), built at the first generation
        self.prompt_field = cfg.data.prompt_field
        self.rewards = Rewards.from_specs(section.reward_funcs, section.reward_weights)
        self.steps_per_round = section.num_iterations
        self.generations = Generations(section.num_generations, section.num_iterations,
                                       section.max_completion_length, "grpo.max_completion_length")
        self.batch_size, self.seq_len = cfg.train.global_batch_size, cfg.train.seq_len  # completions a step
        self.reference: nn.Module | None = None  # a model of its own (grpo.reference), once the trainer built it
        self._generated: tuple[int, list[Batch]] | None = None  # (generation, its micro-batches)
        self._host: dict[str, list[float]] = {}  # the rollouts' metrics since the last record

    def describe(self) -> str:
        s = self.section
        return (f"grpo ({s.loss_type}, {s.num_generations} completions a prompt of up to {s.max_completion_length} "
                f"tokens, temperature {s.temperature:g}, beta {s.beta:g}; rewards: {', '.join(self.rewards.names)})")

    def make(self, model, backend, source, step, micro_batches, rows):
        if backend.placeholders:  # a traced step (`xla-shard compile`): the training step's shapes, nothing drawn
            return [self._shaped_like(batch) for batch in micro_batches]
        generation = source.generation(step)
        if self._generated is not None and self._generated[0] == generation:
            return self._generated[1]
        made = self.generate(model, backend, source, micro_batches, rows, (self.seed, generation), step)
        self._generated = (generation, made)
        return made

    def state(self, next_step: int) -> dict[str, torch.Tensor]:
        if self._generated is None or next_step // self.steps_per_round != self._generated[0]:
            return {}  # the next step starts a generation of its own
        generation, made = self._generated
        kept = {"generation": torch.tensor(generation)}
        for index, batch in enumerate(made):
            kept.update({f"{index}/{key}": value for key, value in batch.items()})
        return kept

    def resume(self, step: int, state: dict[str, torch.Tensor]) -> str:
        generation = step // self.steps_per_round
        if step % self.steps_per_round == 0:
            return ""
        if "generation" not in state or int(state["generation"]) != generation:
            return (f"grpo: resumed at step {step}, inside generation {generation}, whose examples the checkpoint "
                    "does not hold for this process (written by another number of processes): drawn again from the "
                    "resumed weights, so steps up to the next generation differ from the uninterrupted run")
        made: dict[int, Batch] = {}
        for key, value in state.items():
            if key != "generation":
                index, name = key.split("/", 1)
                made.setdefault(int(index), {})[name] = value
        self._generated = (generation, [made[index] for index in sorted(made)])
        return (f"grpo: resumed at step {step} inside generation {generation}: its examples as the checkpoint holds "
                f"them, not drawn again")

    def generate(self, model, backend, source, micro_batches, rows, stream: tuple[int, ...],
                 step: int) -> list[Batch]:
        """The micro-batches `loss` takes, made from prompt rows: sampled (row r's draws keyed by `stream` and r's
        place in the global batch), scored, their advantages over the whole batch. A row whose `row` is -1 (an
        evaluation batch's filler) is sampled with the rest but neither scored nor counted."""
        s, tokenizer = self.section, source.tokenizer
        prompts = {key: torch.cat([batch[key] for batch in micro_batches]) for key in ("input_ids", "attention_mask")}
        data_rows = torch.cat([batch["row"] for batch in micro_batches]).tolist()
        places = [r for part in rows for r in part]  # this process's rows of the global batch
        sampling = self._sampling(tokenizer, model)
        keys = row_keys(stream, places)
        engine_logps = None
        if self.section.use_vllm:
            ids, mask, engine_logps = self._engine_draws(model, backend, prompts, sampling, keys, len(places))
        else:
            group = shared_prompts(prompts["input_ids"], prompts["attention_mask"])
            with backend.generation_context(model) as place:
                placed = place(prompts)
                ids, mask = sample(model, placed["input_ids"], placed["attention_mask"], sampling, keys,
                                   after_token=backend.after_step, group=group,
                                   agreed=lambda ended: not backend.processes.any_rank(not ended))
                ids, mask = backend.to_host(ids, mask)
        real = torch.tensor([row >= 0 for row in data_rows])
        mask = mask * real[:, None]  # a filler row's completion counts for nothing
        lengths = mask.sum(-1)
        completion_ids = [row[:n].tolist() for row, n in zip(ids, lengths)]
        scored = [i for i, row in enumerate(data_rows) if row >= 0]
        texts, columns = source.columns([data_rows[i] for i in scored], self.prompt_field)
        completions = tokenizer.batch_decode([completion_ids[i] for i in scored], skip_special_tokens=True)
        if texts and not isinstance(texts[0], str):  # conversational prompts get messages back, as in TRL
            completions = [[{"role": "assistant", "content": text}] for text in completions]
        scores = torch.full((len(data_rows), len(self.rewards.names)), float("nan"))
        if scored:
            scores[scored] = self.rewards.score(texts, completions, [completion_ids[i] for i in scored], columns,
                                                [data_rows[i] for i in scored], step)
        truncated = torch.tensor([not ids_ or ids_[-1] not in sampling.eos_token_ids for ids_ in completion_ids])
        everything = self._whole_batch(backend, places, scores, lengths.float(), truncated.float(), real.float())
        full_scores, full_lengths, full_truncated, full_real = everything
        advantages, rewards, zero_std = grpo.advantages(full_scores, torch.tensor(self.rewards.weights),
                                                        s.num_generations, s.scale_rewards)
        counted = full_real.bool()
        self._log(full_scores[counted], rewards[counted], zero_std[counted], full_lengths[counted],
                  full_truncated.bool()[counted])
        # TRL's num_items_in_batch over its processes: the generation's completion tokens per gradient-averaged part
        step_tokens = float(full_lengths.sum()) / backend.world
        made, start = [], 0
        for batch in micro_batches:
            n = batch["input_ids"].shape[0]
            part = slice(start, start + n)
            made.append({"input_ids": torch.cat([batch["input_ids"], ids[part]], 1),
                         "attention_mask": torch.cat([batch["attention_mask"], mask[part]], 1),
                         "completion_mask": mask[part],
                         "advantages": advantages[[places[i] for i in range(start, start + n)]],
                         "step_tokens": torch.full((n,), step_tokens)})
            if engine_logps is not None:
                made[-1]["engine_logps"] = engine_logps[part]
            start += n
        self._score_without_grad(model, backend, made)
        if engine_logps is not None:
            self._check_engine(backend, made)
        return made

    def prepare(self, model, backend) -> str:
        if not self.section.use_vllm or backend.placeholders:
            return ""
        from xla_shard.methods.vllm_engine import VllmEngine

        self.engine = VllmEngine(self.cfg, model, backend, max(self.batch_size // backend.world, 1))
        return f"grpo: completions drawn by {self.engine.describe()}"

    def _engine_draws(self, model, backend, prompts, sampling, keys, rows):
        """The engine's completions of this process's rows, with its log-probabilities of them; the policy's
        weights are pushed to it before each generation."""
        from xla_shard.methods.vllm_engine import VllmEngine, seeds

        if self.engine is None:  # a rollout used without the trainer's set-up (a user's own loop)
            self.engine = VllmEngine(self.cfg, model, backend, rows)
        self.engine.push(model)
        return self.engine.draw(prompts["input_ids"], prompts["attention_mask"], sampling, seeds(keys))

    def _check_engine(self, backend, made: list[Batch]) -> None:
        """TRL's metrics of how far the engine's log-probabilities are from the trainer's, its importance ratio
        put into each micro-batch, and the run stopped where they are too far apart to be the same weights."""
        from xla_shard.methods.vllm_engine import importance_sampling

        differences, largest, count = 0.0, 0.0, 0.0
        for batch in made:
            ratio, metrics = importance_sampling(batch["old_logps"], batch.pop("engine_logps"),
                                                 batch["completion_mask"], self.section)
            if ratio is not None:
                batch["importance_ratio"] = ratio
            tokens = float(batch["completion_mask"].sum())
            differences += float(metrics["sampling/sampling_logp_difference/mean"]) * tokens
            largest = max(largest, float(metrics["sampling/sampling_logp_difference/max"]))
            count += tokens
            for key, value in metrics.items():
                if "importance_sampling_ratio" in key:
                    self._host.setdefault(key, []).append(float(value))
        differences, count = backend.processes.total([differences, count])  # the largest stays this process's
        mean = differences / count if count else 0.0
        self._host.setdefault("sampling/sampling_logp_difference/mean", []).append(mean)
        self._host.setdefault("sampling/sampling_logp_difference/max", []).append(largest)
        limit = self.engine.default_limit()
        if mean > limit:
            raise ConfigError("grpo.vllm_logp_difference_limit",
                              f"the engine's log-probabilities of its own tokens are {mean:.3g} from the "
                              f"trainer's on average, over the limit {limit:g}: the engine is not sampling "
                              "from the weights being trained (a weight sync that did not happen, or pushed other "
                              "weights). Stopping rather than training on them")

    def _sampling(self, tokenizer, model) -> Sampling:
        s = self.section
        return Sampling(s.max_completion_length, _eos_ids(tokenizer, model), _pad_id(tokenizer), s.temperature,
                        s.top_k, s.top_p)

    def generation(self, model, source) -> Generation:
        """A step's generation: every row of the global batch, its prompt padded to what the completion leaves of
        train.seq_len, a group of num_generations rows a prompt."""
        sampling = self._sampling(source.tokenizer, model)
        return Generation(sampling, self.batch_size, self.generations.prompt_tokens(self.seq_len),
                          self.section.num_generations)

    def _shaped_like(self, batch: Batch) -> Batch:
        """A micro-batch as the training step takes it, every completion full length: for tracing the step."""
        rows, length = batch["input_ids"].shape[0], self.section.max_completion_length
        made = {"input_ids": torch.cat([batch["input_ids"], torch.zeros(rows, length, dtype=torch.long)], 1),
                "attention_mask": torch.cat([batch["attention_mask"], torch.ones(rows, length, dtype=torch.long)], 1),
                "completion_mask": torch.ones(rows, length, dtype=torch.long), "advantages": torch.zeros(rows),
                "step_tokens": torch.full((rows,), float(self.batch_size * length))}
        if self.section.num_iterations > 1:
            made["old_logps"] = torch.zeros(rows, length)
        if self.section.beta > 0:
            made["ref_logps"] = torch.zeros(rows, length)
        return made

    def _whole_batch(self, backend, places: list[int], *columns: torch.Tensor) -> list[torch.Tensor]:
        """Each of this process's per-row `columns` as the whole global batch's, every process's rows in their
        places (one sum over the processes: the others' places hold 0 here)."""
        size = self.batch_size
        laid = []
        for column in columns:
            whole = torch.zeros((size, *column.shape[1:]), dtype=torch.float32)
            whole[places] = column.float()
            laid.append(whole)
        flat = torch.cat([t.reshape(-1) for t in laid]).tolist()
        summed = torch.tensor(backend.processes.total(flat), dtype=torch.float32)
        out, at = [], 0
        for whole in laid:
            out.append(summed[at:at + whole.numel()].view_as(whole))
            at += whole.numel()
        return out

    @torch.no_grad()
    def _score_without_grad(self, model, backend, made: list[Batch]) -> None:
        """The generating policy's log-probabilities (num_iterations > 1) and the reference's (beta > 0) of each
        micro-batch's completions, as TRL computes them when it generates."""
        s = self.section
        old = s.num_iterations > 1 or s.use_vllm  # TRL scores the engine's tokens with the trainer, always
        if not old and s.beta == 0:
            return
        for batch in made:
            placed = backend.place({key: batch[key] for key in ("input_ids", "attention_mask", "completion_mask")})
            with backend.forward_context():
                if old:
                    batch["old_logps"] = grpo.completion_log_probs(model, placed, s.temperature)[0].float()
                if s.beta > 0:
                    if self.reference is not None:
                        reference = grpo.completion_log_probs(self.reference, placed, s.temperature)[0]
                    else:
                        with self.adapter.switched_off(model):
                            reference = grpo.completion_log_probs(model, placed, s.temperature)[0]
                    batch["ref_logps"] = reference.float()
            kept = [key for key in ("old_logps", "ref_logps") if key in batch]
            batch.update(zip(kept, backend.to_host(*(batch[key] for key in kept))))

    def _log(self, scores, rewards, zero_std, lengths, truncated) -> None:
        got = {"reward": torch.nanmean(rewards), "reward_std": grpo.nanstd(rewards),
               "frac_reward_zero_std": zero_std.float().mean()}
        for index, name in enumerate(self.rewards.names):
            got[f"rewards/{name}/mean"] = torch.nanmean(scores[:, index])
            got[f"rewards/{name}/std"] = grpo.nanstd(scores[:, index])
        ended = lengths[~truncated] if (~truncated).any() else torch.zeros(1)
        got.update({"completions/mean_length": lengths.mean(), "completions/min_length": lengths.min(),
                    "completions/max_length": lengths.max(), "completions/clipped_ratio": truncated.float().mean(),
                    "completions/mean_terminated_length": ended.mean(),
                    "completions/min_terminated_length": ended.min(),
                    "completions/max_terminated_length": ended.max()})
        for key, value in got.items():
            self._host.setdefault(key, []).append(float(value))

    def step_metrics(self) -> dict[str, float]:
        """TRL's rollout metrics since the last record (rewards, completion lengths), and what the reward functions
        logged through log_metric, as TRL logs it."""
        got = {key: sum(values) / len(values) for key, values in (*self._host.items(), *self.rewards.logged.items())}
        self._host = {}
        self.rewards.logged.clear()
        return got

    @contextlib.contextmanager
    def apart(self):
        """Metrics of the rollouts made inside (an evaluation's) kept apart from training's."""
        training = self._host, self.rewards.logged
        self._host, self.rewards.logged = {}, {}
        try:
            yield
        finally:
            self._host, self.rewards.logged = training


def _eos_ids(tokenizer, model: nn.Module) -> tuple[int, ...]:
    """The tokens that end a completion, as TRL takes them: the tokenizer's EOS, then every one the model's
    generation config declares (an end-of-turn token)."""
    if tokenizer.eos_token_id is None:
        raise ConfigError("data.tokenizer", f"GRPO ends a completion at EOS, and the tokenizer "
                                            f"({tokenizer.name_or_path}) has no EOS token")
    declared = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    declared = [] if declared is None else [declared] if isinstance(declared, int) else list(declared)
    return tuple(dict.fromkeys([tokenizer.eos_token_id, *declared]))


def _pad_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
