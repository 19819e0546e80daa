"""Every data.kind, a line each: what its rows are (the facts the config's checks read) and the `RowKind` that
turns them into token rows and sources (`xla_shard.data.build` looks it up, importing it when a run reads its
rows). Imports no torch: the config's schema composes `data.kind` and its checks from this table."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Kind:
    rows: str  # MODULE:CLASS, the data.kind.RowKind of these rows
    # Plain text in one column: synthetic tokens may stand in for it, and it streams, reads .txt files and packs
    # by wrapping (documents joined and cut into rows); every other kind reads named columns from a file.
    plain_text: bool = False
    padded: bool = False  # never packed: a row's sequences stand side by side, or are generated
    columns: tuple[str, ...] = ()  # the data.* keys naming a row's parts, each a column of its own
    # data.completion_only_loss: it applies ("optional"), a row has no prompt to leave out ("no_prompt": true is
    # refused), or the loss is always the completions' ("always": any value is refused).
    completion_loss: Literal["optional", "no_prompt", "always"] = "optional"


KINDS: dict[str, Kind] = {
    "text": Kind("xla_shard.data.tokenize:TextRows", plain_text=True, completion_loss="no_prompt"),
    "chat": Kind("xla_shard.data.completions:CompletionRows"),
    "prompt_completion": Kind("xla_shard.data.completions:CompletionRows",
                              columns=("prompt_field", "completion_field")),
    "preference": Kind("xla_shard.data.preference:PreferenceRows", padded=True,
                       columns=("prompt_field", "chosen_field", "rejected_field"), completion_loss="always"),
    "prompt": Kind("xla_shard.data.prompts:PromptRows", padded=True, completion_loss="always"),
}
