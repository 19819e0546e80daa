"""GRPO's reward functions: the user's own Python, named by import path and called as TRL's GRPOTrainer calls
them.

A function is `module:function` (importable from the working directory or the Python path) or
`path/to/file.py:function`. It is called with keyword arguments: `prompts`, `completions` and `completion_ids`
(one entry per completion, a prompt repeated for each of its completions), every other column of the prompts'
rows under its own name, `trainer_state` (its `global_step` and `max_steps`) and `log_metric(name, value)`; it
returns one float per completion, or None where it does not score one (TRL's convention: that completion then
takes its other functions' rewards only). A function that raises, returns another count, or a NaN or an
infinity (in float32, as rewards are held) is one line naming it and the data row of the completion it failed
on.

The user's code runs inside the run but does not steer it: what it logs is recorded under `log_metric/NAME`,
apart from the run's own metrics (it cannot write the step or the loss); a call of `sys.exit` is a failure of
the function, not the end of the run; a message is cut to a line of bounded length. Two functions of one name
are told apart by their place (`NAME`, `NAME_2`).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import math
import numbers
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch

from xla_shard.errors import ConfigError, UserError, one_line

KEY = "grpo.reward_funcs"
LOGGED = "log_metric/"  # what reward functions log, in the records: apart from the run's own metrics
# The keywords a reward function is called with besides the data's columns: a column of one of these names would
# be shadowed (or clash), so it is refused by name.
CALL_KEYWORDS = ("prompts", "completions", "completion_ids", "trainer_state", "log_metric")
_SAID = 300  # characters of a reward function's message kept in the line that names it
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


class RewardError(UserError):
    """A reward function of the user's that failed on the completions it was handed."""


def load(spec: str, key: str = KEY) -> Callable:
    """The function `spec` names (`module:function` or `file.py:function`), or one line naming what is missing."""
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise ConfigError(key, f"{spec!r} is not MODULE:FUNCTION (or path/to/file.py:FUNCTION)")
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise ConfigError(key, f"{spec!r}: no file {path}")
        loader = importlib.util.spec_from_file_location(f"xla_shard_rewards_{path.stem}", path)
        module = importlib.util.module_from_spec(loader)
        _run(loader.loader.exec_module, module, spec, key)
    else:
        if "" not in sys.path and str(Path.cwd()) not in sys.path:
            sys.path.insert(0, str(Path.cwd()))  # the user's own module, beside the config they run
        module = _run(importlib.import_module, where, spec, key)
    found = getattr(module, name, None)
    if found is None:
        raise ConfigError(key, f"{spec!r}: {where} has no {name}")
    if not callable(found):
        raise ConfigError(key, f"{spec!r}: {name} is a {type(found).__name__}, not a function")
    return found


def _run(call, argument, spec: str, key: str):
    try:
        return call(argument)
    except ModuleNotFoundError as e:
        raise ConfigError(key, f"{spec!r}: no module named {e.name!r} (run from the directory that holds it, or "
                               "name its file: path/to/file.py:FUNCTION)") from None
    except Exception as e:  # the user's module failed while importing
        raise ConfigError(key, f"{spec!r}: importing it raised {type(e).__name__}: {_said(e)}") from None


@dataclass
class Rewards:
    """The run's reward functions and their weights (1 each unless given)."""

    functions: list[Callable]
    weights: list[float]
    names: list[str] = field(init=False)
    logged: dict[str, list[float]] = field(default_factory=dict)

    def __post_init__(self):
        if len(self.weights) != len(self.functions):
            raise ConfigError("grpo.reward_weights", f"{len(self.weights)} weight(s) for {len(self.functions)} "
                                                     f"reward function(s): give one each, or none")
        names = [getattr(f, "__name__", type(f).__name__) for f in self.functions]
        self.names = [name if names[:i].count(name) == 0 else f"{name}_{names[:i].count(name) + 1}"
                      for i, name in enumerate(names)]

    @classmethod
    def from_specs(cls, specs: Sequence[str], weights: Sequence[float] | None = None) -> Rewards:
        if not specs:
            raise ConfigError(KEY, "GRPO needs at least one reward function (MODULE:FUNCTION)")
        return cls([load(spec) for spec in specs], list(weights) if weights is not None else [1.0] * len(specs))

    def score(self, prompts: list, completions: list, completion_ids: list[list[int]], columns: dict[str, list],
              rows: list[int], step: int = 0, max_steps: int = 0) -> torch.Tensor:
        """[completions, functions] of float32 scores, NaN where a function returned None. `rows`: the data row
        each completion's prompt came from, for the error that names it."""
        clash = sorted(set(columns) & set(CALL_KEYWORDS))
        if clash:
            raise RewardError(f"the data's column {clash[0]!r} has the name of an argument reward functions are "
                              f"called with ({', '.join(CALL_KEYWORDS)}): rename the column")
        state = SimpleNamespace(global_step=step, max_steps=max_steps)
        scores = torch.full((len(completions), len(self.functions)), float("nan"))
        for index, (function, name) in enumerate(zip(self.functions, self.names)):
            def call(keep: Sequence[int], function=function, name=name):
                return function(prompts=[prompts[i] for i in keep], completions=[completions[i] for i in keep],
                                completion_ids=[completion_ids[i] for i in keep],
                                **{key: [values[i] for i in keep] for key, values in columns.items()},
                                trainer_state=state, log_metric=functools.partial(self._log, name))

            everything = range(len(completions))
            try:
                got = list(call(everything))
            except RewardError:  # its log_metric refused what it logged: said already
                raise
            except (Exception, SystemExit) as e:
                raise RewardError(self._failed(name, call, everything, rows, e)) from None
            if len(got) != len(completions):
                raise RewardError(f"reward function {name} returned {len(got)} rewards for {len(completions)} "
                                  "completions: return one per completion (None where it does not score one)")
            for i, value in enumerate(got):
                if value is None:
                    continue
                reward = _finite(value)
                if reward is None:
                    raise RewardError(f"reward function {name} returned {_said(repr(value))} for the completion of "
                                      f"data row {rows[i]}: return a finite number within float32's range (or "
                                      "None where it does not score one)")
                scores[i, index] = reward
        if len(completions) and scores.isnan().all():
            _warn(f"step {step}: every reward function returned None for all {len(completions)} completions scored "
                  "here: their advantages are 0, and they teach the step nothing")
        return scores

    @staticmethod
    def _failed(name: str, call, everything, rows: list[int], error: BaseException) -> str:
        """The line for a function that raised (or called sys.exit): the first completion it fails on alone
        names the row."""
        for i in everything:
            try:
                call([i])
            except (Exception, SystemExit) as alone:
                return f"reward function {name} {_raised(alone)} on the completion of data row {rows[i]}"
        return f"reward function {name} {_raised(error)} (on the completions together)"

    def _log(self, function: str, name, value) -> None:
        """`log_metric` as the function `function` is handed it: a name and a finite number, recorded apart."""
        number = _finite(value) if isinstance(name, str) and name else None
        if number is None:
            raise RewardError(f"reward function {function} logged {_said(repr(name))} = {_said(repr(value))} with "
                              "log_metric: give it a name and a finite number")
        self.logged.setdefault(LOGGED + name, []).append(number)


def _warn(message: str) -> None:
    print(f"WARNING: {message}", file=sys.stderr, flush=True)


def _finite(value) -> float | None:
    """`value` as a float a float32 holds finitely, or None (a non-number, NaN, an infinity, past float32)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if not isinstance(value, numbers.Real):  # a bool is one (True scores 1.0, as in TRL)
        return None
    try:
        number = float(value)
    except (OverflowError, ValueError):  # an int past a double's range
        return None
    return number if math.isfinite(number) and abs(number) <= _FLOAT32_MAX else None


def _raised(error: BaseException) -> str:
    if isinstance(error, SystemExit):
        return (f"called sys.exit({_said(repr(error.code))}): a reward function returns rewards, it does not end "
                "the run")
    return f"raised {type(error).__name__}: {_said(error)}"


def _said(text) -> str:
    """A user's message on one line, cut to a bounded length (a megabyte of it is not a message)."""
    line = one_line(text)
    return line if len(line) <= _SAID else f"{line[:_SAID]}... ({len(line)} characters)"
