"""A tokenizer's chat template is code that came with a model directory (or `data.tokenizer`): untrusted.

transformers renders it in Jinja's sandbox, which stops it from reaching outside, but not from working for
ever (two nested `range(100000)` loops) or writing without end (40 MB a row, which tokenizing then turns into
gigabytes). Every rendering here runs under a budget: `RENDER_SECONDS` of time and a number of characters.
transformers compiles each template once and keeps it (`_compile_jinja_template`); the budget sits on that
compiled template, so `apply_chat_template` itself renders under it:
- its output is counted as Jinja produces it (the template's root render function is wrapped), so an
  oversized rendering stops before anything is tokenized: refused, or cut where the caller can use a cut;
- its time is checked at every output and every call the template makes (the sandbox's `call`), and in the
  main thread also by a timer signal, which stops even a loop that neither writes nor calls.
"""

from __future__ import annotations

import contextlib
import re
import signal
import threading
import time
from contextvars import ContextVar
from dataclasses import dataclass

from xla_shard.errors import ConfigError

RENDER_SECONDS = 10.0  # one rendering of one row; real templates take milliseconds
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")  # transformers' own test for assistant-mask support
_COMMENT = re.compile(r"\{#.*?#\}", re.S)


class OverBudget(Exception):
    """A rendering ran past its time or its characters."""


@dataclass
class _Budget:
    deadline: float
    chars_left: int
    cut: bool  # stop the output at the limit (True) or refuse it (False)

    def check_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise OverBudget(f"ran past {RENDER_SECONDS:g} s")


_BUDGET: ContextVar[_Budget | None] = ContextVar("xla_shard_template_budget", default=None)


def template_of(tokenizer) -> str | None:
    """The template `apply_chat_template` uses: the tokenizer's own, or of several named ones (a dict, or the
    list of {name, template} that tokenizer_config.json may store) the one named `default`, as transformers
    picks it."""
    template = tokenizer.chat_template
    if isinstance(template, list):
        if not all(isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)
                   for t in template):
            raise ConfigError("data.tokenizer", f"the chat template of {tokenizer.name_or_path} is a list, but not "
                                                "of {name, template} entries")
        template = {t["name"]: t["template"] for t in template}
        tokenizer.chat_template = template
    if isinstance(template, dict):
        if not isinstance(template.get("default"), str):
            raise ConfigError("data.tokenizer", f"{tokenizer.name_or_path} has several chat templates "
                                                f"({', '.join(sorted(map(str, template)))}) and none named 'default', "
                                                "which is the one used")
        return template["default"]
    if template is not None and not isinstance(template, str):
        raise ConfigError("data.tokenizer", f"the chat template of {tokenizer.name_or_path} is a "
                                            f"{type(template).__name__}, not text")
    return template or None


def marks_generation(template: str) -> bool:
    """Whether the template has `{% generation %}` blocks (in its code, not in a comment)."""
    return bool(_GENERATION.search(_COMMENT.sub("", template)))


@contextlib.contextmanager
def budget(template: str, max_chars: int, cut: bool):
    """Render `template` (through transformers) within RENDER_SECONDS and `max_chars` characters: past the
    limit the output stops there (`cut`) or `OverBudget` is raised."""
    _guard(template)
    state = _Budget(time.monotonic() + RENDER_SECONDS, max_chars, cut)
    token = _BUDGET.set(state)
    timer = threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer")
    if timer:
        def expire(signum, frame):
            raise OverBudget(f"ran past {RENDER_SECONDS:g} s")

        previous = signal.signal(signal.SIGALRM, expire)
        signal.setitimer(signal.ITIMER_REAL, RENDER_SECONDS)
    try:
        yield
    finally:
        if timer:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        _BUDGET.reset(token)


def _guard(template: str) -> None:
    """Put the budget checks on transformers' compiled copy of `template` (once; they do nothing outside
    `budget`)."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    compiled = _compile_jinja_template(template)
    if getattr(compiled, "_xla_shard_budget", False):
        return
    render, environment = compiled.root_render_func, compiled.environment
    sandbox_call = environment.call

    def bounded_render(context):
        for part in render(context):
            state = _BUDGET.get()
            if state is not None:
                state.check_time()
                if len(part) > state.chars_left:
                    if not state.cut:
                        raise OverBudget("writes more than its limit of characters")
                    yield part[:state.chars_left]
                    return
                state.chars_left -= len(part)
            yield part

    def bounded_call(context, obj, /, *args, **kwargs):  # positional: a template may pass obj= itself
        state = _BUDGET.get()
        if state is not None:
            state.check_time()
        return sandbox_call(context, obj, *args, **kwargs)

    compiled.root_render_func = bounded_render
    environment.call = bounded_call
    compiled._xla_shard_budget = True
