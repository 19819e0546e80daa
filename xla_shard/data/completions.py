"""Supervised fine-tuning rows: chat conversations or prompt/completion pairs -> token ids and labels.

Tokenized as TRL's `SFTTrainer` tokenizes them (the reference users know, and what tests compare against):
- chat: the `messages` list rendered by the tokenizer's chat template; with `completion_only_loss` only the
  assistant turns are labelled. A template with `{% generation %}` markers says which tokens those are (TRL's
  `assistant_only_loss`); any other template is rendered turn by turn, each assistant turn being the tokens
  its rendering adds after the prompt that asks for it, and a template that renders a conversation's start
  differently once more turns follow is refused (it has no well-defined answer tokens).
- prompt_completion: the tokens of prompt + completion (+ EOS for text), labelled from where the tokenized
  prompt stops being a prefix of them; prompts and completions may also be lists of messages.

Each example is cut at `seq_len` (its start kept); one left with no labelled token is dropped and counted.
Rows then get one length, so XLA compiles one step: packing (`data.packing`) puts whole examples into `seq_len`
rows best-fit decreasing, as TRL does, with `position_ids` restarting at 0 per example, which transformers turns
into a block-diagonal causal mask (eager, SDPA) or variable-length attention (flash attention 2), and the Pallas
flash kernel into segment ids, so an example never attends to another (transformers looks for packed examples
only when no KV cache is in use, and training runs without one: `train_without_cache`); without packing each
example is padded.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from xla_shard.data import chat_template
from xla_shard.data.kind import RowKind
from xla_shard.data.tokenize import IGNORE, require_columns
from xla_shard.errors import ConfigError, one_line

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_CHARS_PER_TOKEN = 256  # a rendering's bound, per token of seq_len (see Renderer)


@dataclass(frozen=True)
class CompletionFields:
    """Which columns hold what, and whether the prompt tokens are left out of the loss."""

    kind: str  # chat | prompt_completion
    messages: str
    prompt: str
    completion: str
    completion_only: bool


def fields_of(data) -> CompletionFields:
    only = data.completion_only_loss is not False  # null: true for chat and prompt_completion
    return CompletionFields(data.kind, data.messages_field, data.prompt_field, data.completion_field, only)


def examples(rows, tokenizer, fields: CompletionFields, seq_len: int, num_proc: int | None, path: str):
    """(`datasets.Dataset` of input_ids and labels, one example per row and of any length up to `seq_len`,
    how many rows were dropped because truncation left them no labelled token)."""
    if fields.kind == "chat":
        require_columns(rows, [fields.messages], "data.messages_field", path)
        encode = _ChatEncoder(tokenizer, fields, path, seq_len)
    else:
        require_columns(rows, [fields.prompt, fields.completion], "data.prompt_field", path)
        encode = _PromptCompletionEncoder(tokenizer, fields, path, seq_len)

    def tokenize(row, index):
        ids, labels = encode(row, index)
        return {"input_ids": ids[:seq_len], "labels": labels[:seq_len]}

    tokenized = rows.map(tokenize, with_indices=True, remove_columns=rows.column_names, num_proc=num_proc)
    kept = tokenized.filter(lambda row: any(label != IGNORE for label in row["labels"]), num_proc=num_proc)
    if len(kept) == 0:
        raise ConfigError("train.seq_len", f"{path}: no row keeps a token to learn from within {seq_len} tokens "
                                           "(every answer starts past it)")
    return kept, len(tokenized) - len(kept)


def padded(rows, seq_len: int, pad_id: int, num_proc: int | None):
    """One example per row, padded to `seq_len`; the padding is masked and unlabelled."""
    return rows.map(lambda row: padded_example(row["input_ids"], row["labels"], seq_len, pad_id), num_proc=num_proc)


def padded_example(ids: list[int], labels: list[int], seq_len: int, pad_id: int) -> dict[str, list[int]]:
    """One example's ids, labels and attention mask padded to `seq_len`; the padding masked and unlabelled."""
    fill = seq_len - len(ids)
    return {"input_ids": ids + [pad_id] * fill, "labels": labels + [IGNORE] * fill,
            "attention_mask": [1] * len(ids) + [0] * fill}


def pad_id(tokenizer) -> int:
    """The id padding positions hold: masked and unlabelled, so any id serves; the tokenizer's own if it has one."""
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if candidate is not None:
            return candidate
    return 0


def require_position_ids(model_config) -> None:
    """Packed examples are kept apart through `position_ids`; a model whose forward takes none cannot be told
    where one ends."""
    from transformers import AutoModelForCausalLM

    try:
        model_class = AutoModelForCausalLM._model_mapping[type(model_config)]
    except KeyError:
        return  # no causal LM for this config: building the model says so, naming model.task
    if "position_ids" not in inspect.signature(model_class.forward).parameters:
        raise ConfigError("data.packing", f"{model_class.__name__} takes no position_ids, so packed examples would "
                                          "attend to each other: set data.packing: false (one padded example per "
                                          "row)")


class Renderer:
    """Renders rows with the tokenizer's chat template, each rendering bounded (`chat_template.budget`) to
    MAX_CHARS_PER_TOKEN characters per token of `seq_len`: far more than a row can keep. Past that, a rendering
    whose labels are every token is cut there (tokens past `seq_len` are dropped anyway); any other is refused,
    since its labels depend on where each turn ends."""

    def __init__(self, tokenizer, fields: CompletionFields, path: str, seq_len: int):
        self.tokenizer, self.fields, self.path, self.seq_len = tokenizer, fields, path, seq_len
        self.template = chat_template.template_of(tokenizer)
        self.max_chars = MAX_CHARS_PER_TOKEN * seq_len + 65536

    def render(self, messages: list[dict], index: int, **options) -> dict:
        cut = not self.fields.completion_only
        try:
            with chat_template.budget(self.template, self.max_chars, cut):
                return self.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **options)
        except chat_template.OverBudget as exc:
            raise ConfigError("data.tokenizer", f"{self.path}: row {index}: the chat template {exc} (at most "
                                                f"{self.max_chars} characters, {chat_template.RENDER_SECONDS:g} s a "
                                                "row); it is not rendered: fix the template or the row") from None
        except Exception as exc:  # noqa: BLE001 - a template's raise_exception, or a jinja error: the user's to fix
            raise ConfigError("data.kind", f"{self.path}: row {index}: the chat template cannot render it: "
                                           f"{type(exc).__name__}: {one_line(exc)[:300]}") from None

    def prompted(self, prompt, completions: list[tuple], index: int, kind: str,
                 assistant_first: bool = False) -> tuple[list[int], list[list[int]]]:
        """(the prompt's ids, the ids of prompt + each completion) as TRL tokenizes them: text with EOS added to
        each completion that lacks it, or messages through the chat template (the prompt with its generation
        prompt). `completions`: (value, config key, column) each; `assistant_first` refuses a completion whose
        first message is not the assistant's. Text mixed with messages is one line naming the columns."""
        fields = [self.fields.prompt, *(field for _, _, field in completions)]
        values = [prompt, *(value for value, _, _ in completions)]
        if all(isinstance(v, str) for v in values):
            eos = self.tokenizer.eos_token
            if eos is None:
                raise ConfigError("data.kind", f"{kind} ends each completion with EOS, and the tokenizer "
                                               f"({self.tokenizer.name_or_path}) has no EOS token")
            # Text past `max_chars` lies past seq_len's tokens (dropped anyway): it is not tokenized (an 8 MB field
            # would take GiBs and minutes). The EOS of a cut completion is past seq_len too.
            prompt = prompt[:self.max_chars]
            ends = [v[:self.max_chars] if len(v) > self.max_chars else v if v.endswith(eos) else v + eos
                    for v in values[1:]]
            return (self.tokenizer(text=prompt)["input_ids"],
                    [self.tokenizer(text=prompt + end)["input_ids"] for end in ends])
        if all(isinstance(v, list) for v in values):
            if not self.tokenizer.chat_template:
                raise ConfigError("data.kind", f"row {index} of {self.path} holds messages, which are rendered with "
                                               "the tokenizer's chat template, and the tokenizer has none")
            prompt = check_messages(prompt, "data.prompt_field", self.fields.prompt, self.path, index)
            answers = [check_messages(value, key, field, self.path, index) for value, key, field in completions]
            for answer, (_, key, _) in zip(answers, completions):
                if assistant_first and answer[0]["role"] != "assistant":  # labels would start inside its header
                    raise ConfigError(key, f"{self.path}: row {index}: the completion starts with a "
                                           f"{answer[0]['role']!r} turn; a completion is the assistant's answer to "
                                           "the prompt")
            return (self.render(prompt, index, add_generation_prompt=True)["input_ids"],
                    [self.render(prompt + answer, index)["input_ids"] for answer in answers])
        each = "both" if len(values) == 2 else "all"
        names = ", ".join(repr(f) for f in fields[:-1]) + f" and {fields[-1]!r}"
        kinds = ", ".join(kind_of(v) for v in values[:-1]) + f" and {kind_of(values[-1])}"
        raise ConfigError("data.prompt_field", f"{self.path}: row {index}: {names} must {each} be text or {each} be "
                                               f"lists of messages, not {kinds}")


class _ChatEncoder(Renderer):
    def __init__(self, tokenizer, fields: CompletionFields, path: str, seq_len: int):
        if not tokenizer.chat_template:
            raise ConfigError("data.kind", f"chat renders {fields.messages!r} with the tokenizer's chat template, and "
                                           f"the tokenizer ({tokenizer.name_or_path}) has none: name a tokenizer "
                                           "with one (data.tokenizer)")
        super().__init__(tokenizer, fields, path, seq_len)
        self.marked = chat_template.marks_generation(self.template)

    def __call__(self, row, index: int) -> tuple[list[int], list[int]]:
        messages = check_messages(row[self.fields.messages], "data.messages_field", self.fields.messages,
                                  self.path, index)
        if not self.fields.completion_only:
            ids = self.render(messages, index)["input_ids"]
            return ids, list(ids)
        if not any(m["role"] == "assistant" for m in messages):
            raise ConfigError("data.messages_field", f"{self.path}: row {index} has no assistant turn, so nothing to "
                                                     "learn (completion_only_loss)")
        if self.marked:
            rendered = self.render(messages, index, return_assistant_tokens_mask=True)
            ids, mask = rendered["input_ids"], rendered["assistant_masks"]
            if not any(mask) and any(m["role"] == "assistant" and m["content"] for m in messages):
                raise ConfigError("data.tokenizer", f"{self.path}: row {index}: the chat template's "
                                                    "{% generation %} blocks mark none of the assistant turns' "
                                                    "tokens, so there is nothing to learn (are they around the "
                                                    "answers?); fix the template, or set "
                                                    "data.completion_only_loss: false")
        else:
            ids = self.render(messages, index)["input_ids"]
            mask = self._turn_mask(messages, ids, index)
        return ids, [t if m else IGNORE for t, m in zip(ids, mask)]

    def _turn_mask(self, messages: list[dict], ids: list[int], index: int) -> list[int]:
        mask = [0] * len(ids)
        for turn, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            asked = self.render(messages[:turn], index, add_generation_prompt=True)["input_ids"]
            answered = self.render(messages[:turn + 1], index)["input_ids"]
            if answered[:len(asked)] != asked or ids[:len(answered)] != answered:
                raise ConfigError("data.kind", f"{self.path}: row {index}: the chat template renders the conversation "
                                               f"before assistant turn {turn} differently once the turn follows, so "
                                               "its answer tokens are not defined; give the template {% generation %} "
                                               "markers, or set data.completion_only_loss: false")
            if len(answered) == len(asked) and message["content"]:
                raise ConfigError("data.tokenizer", f"{self.path}: row {index}: the chat template renders assistant "
                                                    f"turn {turn} as nothing (does it leave assistant messages "
                                                    "out?), so there is no answer to learn; fix the template")
            mask[len(asked):len(answered)] = [1] * (len(answered) - len(asked))
        return mask


class _PromptCompletionEncoder(Renderer):
    def __call__(self, row, index: int) -> tuple[list[int], list[int]]:
        fields = self.fields
        prompt_ids, (ids,) = self.prompted(row[fields.prompt], [(row[fields.completion], "data.completion_field",
                                                                  fields.completion)], index, "prompt_completion",
                                           assistant_first=True)
        start = common_prefix(prompt_ids, ids)  # where the completion's tokens start (TRL's rule)
        if not self.fields.completion_only:
            return ids, list(ids)
        return ids, [IGNORE] * start + ids[start:]


def check_messages(messages, key: str, field: str, path: str, index: int) -> list[dict]:
    """The row's messages as {role, content} dicts, or one line naming the key, the row and what is wrong."""
    where = f"{path}: row {index}"
    if not isinstance(messages, list) or not messages:
        raise ConfigError(key, f"{where}: {field!r} is {kind_of(messages)}, not a list of messages")
    for turn, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ConfigError(key, f"{where}: message {turn} of {field!r} has no role")
        if message["role"] not in ROLES:
            raise ConfigError(key, f"{where}: message {turn} has the unknown role {message['role']!r} "
                                   f"(roles: {', '.join(ROLES)})")
        if not isinstance(message.get("content"), str):
            raise ConfigError(key, f"{where}: message {turn} ({message['role']}) has no text content")
    # Arrow gives every message of a column the union of their keys (None where absent): drop those again.
    return [{k: v for k, v in message.items() if v is not None} for message in messages]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def kind_of(value) -> str:
    return "missing" if value is None else type(value).__name__


class CompletionRows(RowKind):
    """data.kind chat and prompt_completion: examples tokenized as TRL does, packed or padded to seq_len."""

    @property
    def loss_scope(self) -> str:
        return "; loss on the assistant turns" if self.name == "chat" else "; loss on the completions"

    def encode(self, cfg, tokenizer, model_config, rows, path, generations):
        from xla_shard.data import packing, tokenize

        data, seq_len = cfg.data, cfg.train.seq_len
        workers = tokenize.worker_count(len(rows), data.num_proc)
        found, dropped = examples(rows, tokenizer, fields_of(data), seq_len, workers, path)
        pad = pad_id(tokenizer)
        if data.packs:
            require_position_ids(model_config)
            return packing.pack(found, seq_len, pad, workers, split=data.packs == "bfd_split"), dropped
        return padded(found, seq_len, pad, workers), dropped
