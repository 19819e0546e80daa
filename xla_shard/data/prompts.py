"""Prompt rows (`data.kind: prompt`): a prompt alone, for a method that generates its completions (GRPO).

Tokenized as TRL's `GRPOTrainer` tokenizes them: text as the tokenizer encodes it (special tokens included),
messages through the chat template with its generation prompt. Each prompt is left-padded to `prompt_len`
(train.seq_len less the completion's tokens), so every row has one shape and the completion follows it in one
buffer; a longer prompt would be cut where its question is, so it is dropped and counted. The row keeps `row`,
its index in the file, through which the trainer finds the row's text and other columns for the rewards.
"""

from __future__ import annotations

from dataclasses import dataclass

from xla_shard.data.completions import Renderer, check_messages, kind_of, pad_id
from xla_shard.data.kind import RowKind
from xla_shard.data.tokenize import require_columns
from xla_shard.errors import ConfigError


@dataclass(frozen=True)
class Generations:
    """What a generating method asks of its prompt rows: completions a prompt, optimizer steps a generation
    trains, and the tokens a completion may take of seq_len (`length_key`: the config key that sets them)."""

    per_prompt: int
    steps_each: int
    completion_tokens: int
    length_key: str

    def prompt_tokens(self, seq_len: int) -> int:
        """The positions a prompt is left-padded to: what the completion leaves of `seq_len`."""
        return seq_len - self.completion_tokens


@dataclass(frozen=True)
class PromptFields:
    prompt: str
    completion_only: bool = True  # what `Renderer` asks: a prompt's end matters


def fields_of(data) -> PromptFields:
    return PromptFields(data.prompt_field)


def examples(rows, tokenizer, fields: PromptFields, prompt_len: int, pad: int, num_proc: int | None, path: str,
             length_key: str):
    """(`datasets.Dataset` of left-padded `input_ids` and `attention_mask` [prompt_len] and `row`, how many
    rows were dropped: their prompt is longer than `prompt_len`)."""
    require_columns(rows, [fields.prompt], "data.prompt_field", path)
    encode = _PromptEncoder(tokenizer, fields, path, prompt_len)

    def tokenize(row, index):
        ids = encode(row, index)
        if len(ids) > prompt_len:
            return {"input_ids": [], "attention_mask": [], "row": index}
        fill = prompt_len - len(ids)
        return {"input_ids": [pad] * fill + ids, "attention_mask": [0] * fill + [1] * len(ids), "row": index}

    tokenized = rows.map(tokenize, with_indices=True, remove_columns=rows.column_names, num_proc=num_proc)
    kept = tokenized.filter(lambda row: len(row["input_ids"]) > 0, num_proc=num_proc)
    if len(kept) == 0:
        raise ConfigError(length_key, f"{path}: every prompt is longer than the {prompt_len} tokens train.seq_len "
                                      f"leaves beside {length_key}")
    return kept, len(tokenized) - len(kept)


class _PromptEncoder(Renderer):
    def __call__(self, row, index: int) -> list[int]:
        prompt = row[self.fields.prompt]
        if isinstance(prompt, str):
            if not prompt:
                raise ConfigError("data.prompt_field", f"{self.path}: row {index}: {self.fields.prompt!r} is empty")
            return self.tokenizer(text=prompt[:self.max_chars])["input_ids"]
        if not isinstance(prompt, list):
            raise ConfigError("data.prompt_field", f"{self.path}: row {index}: {self.fields.prompt!r} must be text or "
                                                   f"a list of messages, not {kind_of(prompt)}")
        if not self.tokenizer.chat_template:
            raise ConfigError("data.kind", f"row {index} of {self.path} holds messages, which are rendered with the "
                                           "tokenizer's chat template, and the tokenizer has none")
        messages = check_messages(prompt, "data.prompt_field", self.fields.prompt, self.path, index)
        return self.render(messages, index, add_generation_prompt=True)["input_ids"]


class PromptSource:
    """A step's completions' rows: each of its prompts `num_generations` times in a row (a group's completions
    are consecutive, as TRL's sampler repeats them), the same prompts for `num_iterations` steps (one generation
    trains that many), in the shuffled order a `DatasetSource` of the prompts gives. Row r of a step is a
    completion of that step's prompt r // num_generations. `rows_per_epoch` counts completion rows: an epoch
    is every prompt's group, each trained `num_iterations` times."""

    def __init__(self, rows, raw, tokenizer, generations: Generations, global_batch_size: int, seed: int):
        from xla_shard.data.source import DatasetSource

        self.num_generations, self.num_iterations = generations.per_prompt, generations.steps_each
        self.prompts = DatasetSource(rows, global_batch_size // self.num_generations, seed)
        self.raw, self.tokenizer = raw, tokenizer
        self.rows_per_epoch = len(rows) * self.num_generations * self.num_iterations

    def generation(self, step: int) -> int:
        """Which generation trains `step`: steps g * num_iterations ... share generation g's completions."""
        return step // self.num_iterations

    def rows(self, step: int, rows: range):
        from xla_shard.data.source import _as_batch

        picked = self.prompts.indices(self.generation(step), [r // self.num_generations for r in rows])
        batch = _as_batch(self.prompts.table[picked])
        batch.pop("labels")  # (a generating method's labels are its completions)
        return batch

    def real_tokens(self, step: int) -> int:
        return int(self.rows(step, range(self.prompts.batch * self.num_generations))["attention_mask"].sum())

    def columns(self, rows: list[int], prompt_field: str) -> tuple[list, dict[str, list]]:
        """The prompts of data rows `rows` as written (text, or messages) and the rows' other columns."""
        return _columns(self.raw, rows, prompt_field)


class PromptEvalSource:
    """Evaluation prompts in file order, each `num_generations` times in a row, as batches of global_batch_size
    completion rows (as `PromptSource` lays out a step). The last batch is filled up with copies of the first
    prompt whose `row` is -1: generated with the rest (one shape: XLA compiles nothing new), never scored or
    counted. `rows_covered` counts prompts."""

    labelled = False  # its completions are generated: no labels to check

    def __init__(self, rows, raw, tokenizer, generations: Generations, global_batch_size: int):
        self.table = rows.with_format("numpy")
        self.raw, self.tokenizer = raw, tokenizer
        self.num_generations = generations.per_prompt
        self.prompts_per_batch = global_batch_size // self.num_generations
        self.rows_total = len(rows)
        self.batches = -(-len(rows) // self.prompts_per_batch)

    def rows_covered(self, batches: int) -> int:
        return min(batches * self.prompts_per_batch, self.rows_total)

    def rows(self, index: int, rows: range):
        from xla_shard.data.source import _as_batch

        picked = [index * self.prompts_per_batch + r // self.num_generations for r in rows]
        batch = _as_batch(self.table[[p if p < self.rows_total else 0 for p in picked]])
        batch.pop("labels")
        batch["row"][[i for i, p in enumerate(picked) if p >= self.rows_total]] = -1
        return batch

    def columns(self, rows: list[int], prompt_field: str) -> tuple[list, dict[str, list]]:
        return _columns(self.raw, rows, prompt_field)


def _columns(raw, rows: list[int], prompt_field: str) -> tuple[list, dict[str, list]]:
    picked = raw[rows]
    return picked[prompt_field], {key: values for key, values in picked.items() if key != prompt_field}


class PromptRows(RowKind):
    """data.kind prompt: prompts alone, tokenized as TRL's GRPOTrainer does, left-padded to what the completion
    leaves of seq_len; each stands for its group of generated completions."""

    def encode(self, cfg, tokenizer, model_config, rows, path, generations):
        from xla_shard.data.tokenize import worker_count

        return examples(rows, tokenizer, fields_of(cfg.data), generations.prompt_tokens(cfg.train.seq_len),
                        pad_id(tokenizer), worker_count(len(rows), cfg.data.num_proc), path, generations.length_key)

    def training_rows(self, encoded: int, generations) -> int:
        return encoded * generations.per_prompt

    def train_source(self, cfg, rows, raw, tokenizer, generations):
        return PromptSource(rows, raw, tokenizer, generations, cfg.train.global_batch_size, cfg.train.seed)

    def eval_source(self, cfg, rows, raw, tokenizer, generations):
        return PromptEvalSource(rows, raw, tokenizer, generations, cfg.train.global_batch_size)

    def describe(self, cfg, rows, count, evaluated, dropped, generations):
        return (f"{cfg.data.path}: {len(rows)} prompts, left-padded to "
                f"{generations.prompt_tokens(cfg.train.seq_len)} tokens, {generations.per_prompt} completions each"
                + (f"; {dropped} prompt(s) longer dropped" if dropped else "")
                + (f", {evaluated} for evaluation" if evaluated is not None else ""))
