"""Preference rows (`data.kind: preference`): a prompt, a chosen and a rejected completion -> one training row
holding both sequences.

Tokenized as TRL's `DPOTrainer` tokenizes them: plain text rows as prompt and prompt + completion (EOS added to
each completion that lacks it), conversations through the tokenizer's chat template (the prompt with the
generation prompt); the completion starts where the tokenized prompt stops being a prefix of both tokenized
sequences. Each sequence is cut at `seq_len` (its start kept) and padded to it; a row whose prompt alone fills
`seq_len` keeps no completion token and is dropped and counted, as TRL drops it.

A row is `input_ids`, `labels` and `attention_mask` of shape [2, seq_len]: chosen, then rejected. The labels are
the completion tokens (IGNORE on the prompt and padding): the objective sums their log-probabilities.
"""

from __future__ import annotations

from dataclasses import dataclass

from xla_shard.data.completions import Renderer, common_prefix, pad_id, padded_example
from xla_shard.data.kind import RowKind
from xla_shard.data.tokenize import IGNORE, require_columns
from xla_shard.errors import ConfigError


@dataclass(frozen=True)
class PreferenceFields:
    prompt: str
    chosen: str
    rejected: str
    completion_only: bool = True  # what `Renderer` asks: every rendering has answers whose ends matter


def fields_of(data) -> PreferenceFields:
    return PreferenceFields(data.prompt_field, data.chosen_field, data.rejected_field)


def examples(rows, tokenizer, fields: PreferenceFields, seq_len: int, pad: int, num_proc: int | None, path: str):
    """(`datasets.Dataset` of [2, seq_len] rows, how many rows were dropped: their prompt fills seq_len)."""
    require_columns(rows, [fields.prompt, fields.chosen, fields.rejected], "data.prompt_field", path)
    encode = _PairEncoder(tokenizer, fields, path, seq_len)

    def tokenize(row, index):
        prompt, chosen, rejected = encode(row, index)
        if len(prompt) >= seq_len:  # no completion token left: an empty row, dropped below
            return {"input_ids": [], "labels": [], "attention_mask": []}
        pair = [padded_example((prompt + completion)[:seq_len], ([IGNORE] * len(prompt) + completion)[:seq_len],
                               seq_len, pad) for completion in (chosen, rejected)]
        return {key: [sequence[key] for sequence in pair] for key in pair[0]}

    tokenized = rows.map(tokenize, with_indices=True, remove_columns=rows.column_names, num_proc=num_proc)
    kept = tokenized.filter(lambda row: len(row["input_ids"]) == 2, num_proc=num_proc)
    if len(kept) == 0:
        raise ConfigError("train.seq_len", f"{path}: every prompt fills train.seq_len={seq_len} tokens, so no "
                                           "completion token is left to compare")
    return kept, len(tokenized) - len(kept)


class _PairEncoder(Renderer):
    def __call__(self, row, index: int) -> tuple[list[int], list[int], list[int]]:
        """(prompt ids, chosen ids, rejected ids) as TRL splits them."""
        fields, where = self.fields, f"{self.path}: row {index}"
        prompt, chosen, rejected = row[fields.prompt], row[fields.chosen], row[fields.rejected]
        for key, field, value in (("data.chosen_field", fields.chosen, chosen),
                                  ("data.rejected_field", fields.rejected, rejected)):
            if value is None or (isinstance(value, (str, list)) and not value):
                raise ConfigError(key, f"{where}: {field!r} is {'missing' if value is None else 'empty'}: a "
                                       "preference row needs two completions to compare")
        prompt_ids, pairs = self.prompted(prompt, [(chosen, "data.chosen_field", fields.chosen),
                                                   (rejected, "data.rejected_field", fields.rejected)],
                                          index, "data.kind preference", assistant_first=True)
        cut = isinstance(chosen, str) and max(len(chosen), len(rejected)) > self.max_chars  # (unread past that)
        if pairs[0] == pairs[1] and not cut:  # (text differing only by the EOS each is given)
            raise ConfigError("data.rejected_field", f"{where}: {fields.chosen!r} and {fields.rejected!r} are the "
                                                     "same completion once tokenized, so there is no preference to "
                                                     "learn")
        start = min(common_prefix(prompt_ids, ids) for ids in pairs)  # TRL's rule
        return prompt_ids[:start], pairs[0][start:], pairs[1][start:]


class PreferenceRows(RowKind):
    """data.kind preference: prompt / chosen / rejected rows, tokenized as TRL's DPOTrainer does, both sequences
    of a row padded."""

    loss_scope = "; the loss on the completions' log-probabilities"

    def encode(self, cfg, tokenizer, model_config, rows, path, generations):
        from xla_shard.data.tokenize import worker_count

        return examples(rows, tokenizer, fields_of(cfg.data), cfg.train.seq_len, pad_id(tokenizer),
                        worker_count(len(rows), cfg.data.num_proc), path)

    def layout(self, cfg) -> str:
        return "prompt + chosen and prompt + rejected, padded"
