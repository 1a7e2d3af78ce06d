"""GRPO's reward functions: the user's code that reward_funcs names (or a built-in), loaded and checked before
launch and again in each worker, and called as TRL 1.16's GRPOTrainer._calculate_rewards calls it.

A reward function is called with keywords only: `prompts`, `completions` (strings for text prompts; for
conversational prompts, `[{"role": "assistant", "content": text}]` per completion), `completion_ids` (token id
lists), `trainer_state` (when the caller has one) and every other column of the dataset, as lists aligned with the
completions (a prompt's row repeated num_generations times), and with environment_factory `environments` (each
rollout's environment). With tools, a conversational completion is the whole trajectory: the assistant turns (with
their tool_calls) and the tool messages. It returns one float, or None ("not applicable"), per completion.
Differences from TRL, on purpose: a function without **kwargs gets only the keywords it names (TRL would pass it
every column and fail); TRL's `log_extra` and `log_metric` are not passed, so a function that requires them is
refused at load. docs/reward_functions.md is the user's page.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from ..data import DataError
from ..errors import ConfigError, first_line
from ..logs import FILE_ONLY
from .method_keys import REWARD_MODEL_PREFIX, parse_reward_entry
from .user_code import import_user_module

log = logging.getLogger("praisonai_accel")

PASSED = ("prompts", "completions", "completion_ids", "trainer_state")  # what `score` passes beside the columns
NOT_PASSED = ("log_extra", "log_metric", "environments")  # TRL passes these; praisonai-accel does not (environments:
# only with environment_factory)
NOT_COLUMNS = ("prompt", "completion", "completion_ids")  # dataset keys TRL leaves out of the keywords
SIGNATURE = "def reward(prompts, completions, **kwargs) -> list[float | None]"


@dataclass(frozen=True)
class TrainerState:
    """What `score` passes as trainer_state: the attributes of TRL's TrainerState that rewards shaped by training
    progress read."""

    global_step: int
    max_steps: int
    epoch: float = 0.0


class RewardError(Exception):
    """A reward function failed while training: one line naming the function and the dataset row."""


@dataclass(frozen=True)
class RewardFunction:
    name: str  # as reward_funcs lists it
    func: Callable
    weight: float
    takes_all: bool  # it has **kwargs: it gets every keyword, as TRL passes them
    keywords: frozenset[str]  # the keywords it names: without **kwargs, all it gets
    columns: tuple[str, ...]  # dataset columns it needs (parameters without a default that are not PASSED)

    @property
    def short_name(self) -> str:
        """The function's name, as TRL names its metrics (rewards/<name>/mean)."""
        return reward_name(self.name)


def reward_name(entry: str) -> str:
    """The name a reward_funcs entry is logged under (rewards/<name>/mean): the function's own name, as TRL."""
    entry = entry.strip()
    if entry.startswith(REWARD_MODEL_PREFIX):  # a reward model: its directory's name, as TRL names it
        return Path(entry[len(REWARD_MODEL_PREFIX):].strip().rstrip("/")).name
    return entry.replace(":", ".").rsplit(".", 1)[-1]


# ---------------------------------------------------------------- built-ins

def completion_text(completion: Any) -> str:
    """The text of a completion: itself, or the contents of its messages (conversational prompts)."""
    if isinstance(completion, str):
        return completion
    parts = []
    for message in completion or ():
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):  # content parts: [{"type": "text", "text": ...}]
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
        parts.append(content or "")
    return "".join(parts)


_ANSWER_BLOCK = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def exact_match(completions, answer, **kwargs) -> list[float | None]:
    """1.0 where the completion (stripped; the content of its last <answer>...</answer> block when it has one)
    equals the row's `answer` (stripped), else 0.0; None for a row whose answer is empty (null)."""
    rewards: list[float | None] = []
    for completion, expected in zip(completions, answer, strict=True):
        if expected is None:
            rewards.append(None)
            continue
        text = completion_text(completion).strip()
        blocks = _ANSWER_BLOCK.findall(text)
        if blocks:
            text = blocks[-1].strip()
        rewards.append(1.0 if text == str(expected).strip() else 0.0)
    return rewards


def format_reward(pattern: str) -> Callable:
    """The built-in `format`: 1.0 where re.match(pattern, completion, re.DOTALL), else 0.0 (TRL's examples'
    format reward; DOTALL so that .*? spans the lines of a reasoning block)."""
    compiled = re.compile(pattern, re.DOTALL)

    def format(completions, **kwargs) -> list[float]:  # noqa: A001  (its name is the config's)
        return [1.0 if compiled.match(completion_text(c)) else 0.0 for c in completions]

    return format


# ---------------------------------------------------------------- loading

def config_dir(config) -> Path | None:
    """The directory of the config file the config was read from (None for a config built in code)."""
    where = getattr(config, "_config_dir", None)
    return Path(where) if where else None


def load_reward_functions(config, base_dir: Path | None = None) -> list[RewardFunction]:
    """The reward functions config.reward_funcs names, imported and their signatures checked; ConfigError (one line)
    for an entry that cannot be one. Modules are looked for in base_dir first (default: the config file's
    directory, where users keep rewards.py), then on sys.path."""
    base_dir = config_dir(config) if base_dir is None else Path(base_dir)
    weights = config.reward_weights or [1.0] * len(config.reward_funcs)
    functions = []
    for index, (entry, weight) in enumerate(zip(config.reward_funcs, weights, strict=True)):
        try:
            module, attribute = parse_reward_entry(entry, index)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if module == REWARD_MODEL_PREFIX:  # a trained reward model (methods/reward.py), loaded at its first call
            from .reward_scoring import ModelReward

            func = ModelReward.checked(attribute, base_dir, f"reward_funcs[{index}]")
        elif module is None:
            func = exact_match if attribute == "exact_match" else format_reward(config.reward_format_pattern)
        else:
            func = import_callable(module, attribute, f"reward_funcs[{index}]", base_dir)
        extra = ("environments",) if getattr(config, "environment_factory", None) else ()
        functions.append(_checked(entry.strip(), func, float(weight), f"reward_funcs[{index}]: {entry.strip()}",
                                  extra))
    return functions


def import_callable(module_name: str, attribute: str, where: str, base_dir: Path | None) -> Callable:
    """module_name.attribute, imported as the config names it (reward functions, tools, environments);
    ConfigError (one line) when it is missing or not callable."""
    module = import_user_module(module_name, where, base_dir, ConfigError,
                                "; put {top}.py next to the config file or install it")
    if not hasattr(module, attribute):
        raise ConfigError(f"{where}: module '{module_name}' ({getattr(module, '__file__', None) or 'built in'}) has "
                          f"no attribute '{attribute}'")
    func = getattr(module, attribute)
    if not callable(func):
        raise ConfigError(f"{where}: '{module_name}:{attribute}' is a {type(func).__name__}, not a function")
    return func


def _checked(name: str, func: Callable, weight: float, where: str, extra: tuple[str, ...] = ()) -> RewardFunction:
    """A RewardFunction for `func` if TRL's call can reach it: prompts= and completions= by keyword, every other
    parameter without a default a keyword that is passed (a column, completion_ids, trainer_state)."""
    try:
        signature = inspect.signature(func)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: its signature cannot be read; define it as {SIGNATURE}") from None
    params = signature.parameters.values()
    takes_all = any(p.kind is p.VAR_KEYWORD for p in params)
    named = {p.name: p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    for p in params:
        if p.kind is p.POSITIONAL_ONLY and p.default is p.empty:
            raise ConfigError(f"{where}: parameter '{p.name}' is positional-only, but reward functions are called "
                              f"with keywords; define it as {SIGNATURE}")
    missing = [k for k in ("prompts", "completions") if k not in named and not takes_all]
    if missing:
        raise ConfigError(f"{where}: it does not take {' or '.join(f'{k}=' for k in missing)}; reward functions "
                          f"are called as TRL calls them: {SIGNATURE}")
    required = [n for n, p in named.items() if p.default is p.empty and n not in PASSED and n not in extra]
    singular = [n for n in required if n in NOT_COLUMNS and n not in PASSED]
    if singular:
        raise ConfigError(f"{where}: it requires '{singular[0]}', which is never passed (the batch comes as "
                          f"{singular[0]}s=); define it as {SIGNATURE}")
    unsupported = [n for n in required if n in NOT_PASSED]
    if unsupported:
        if unsupported[0] == "environments":
            raise ConfigError(f"{where}: it requires 'environments', which is passed only with environment_factory; "
                              "set environment_factory or give the parameter a default (None)")
        raise ConfigError(f"{where}: it requires '{unsupported[0]}', which TRL passes but praisonai-accel does not; "
                          f"give it a default (None)")
    return RewardFunction(name, func, weight, takes_all, frozenset(named), tuple(required))


def check_columns(functions: Sequence[RewardFunction], column_names, dataset: str = "dataset") -> None:
    """DataError (one line) for a reward function that reads a column the dataset does not have (exact_match:
    `answer`); callable before launch from the dataset's column names."""
    have = set(column_names)
    for function in functions:
        for column in function.columns:
            if column not in have:
                raise DataError(f"{dataset}: reward function {function.name} reads column '{column}', which the "
                                f"dataset does not have (its columns: {', '.join(sorted(map(str, have)))}); add it "
                                f"or give the parameter a default")


# ---------------------------------------------------------------- calling

def where(row) -> str:
    """A completion's dataset row as the user finds it: `row 7` for an index, or the text given (`line 7`)."""
    return f"row {row}" if isinstance(row, int) else str(row)


def score(functions: Sequence[RewardFunction], prompts: list, completions: list, completion_ids: list,
          columns: dict[str, list], rows: Sequence, trainer_state: TrainerState | None = None,
          extra: dict | None = None):
    """[N, F] float32 rewards of N completions by F functions, NaN where a function returned None (TRL: not
    applicable; the weighted total skips it, grpo_loss.weighted_rewards). `columns`: the dataset's other columns,
    each a list aligned with the completions; `rows`: each completion's dataset row (an index, or a place such as
    "line 7"), named by RewardError (raised when a function raises, returns the wrong number of rewards, or
    something that is not a number). A completion no function scored is warned about, as TRL does."""
    import torch

    n = len(completions)
    columns = {k: v for k, v in columns.items() if k not in NOT_COLUMNS}
    keywords = {"prompts": prompts, "completions": completions, "completion_ids": completion_ids, **columns}
    if trainer_state is not None:
        keywords["trainer_state"] = trainer_state
    keywords.update(extra or {})  # environments
    rewards = torch.full((n, len(functions)), float("nan"), dtype=torch.float32)
    for j, function in enumerate(functions):
        given = keywords if function.takes_all else {k: v for k, v in keywords.items() if k in function.keywords}
        rewards[:, j] = torch.tensor(_call(function, given, rows, n), dtype=torch.float32)
    unscored = torch.isnan(rewards).all(dim=1)
    if unscored.any():
        first = int(unscored.nonzero()[0])
        log.warning("every reward function returned None for %d completion(s) (the first of %s); they add nothing "
                    "to the loss", int(unscored.sum()), where(rows[first]))
    return rewards


def _invoke(function: RewardFunction, keywords: dict):
    result = function.func(**keywords)
    return asyncio.run(result) if inspect.iscoroutine(result) else result


def _call(function: RewardFunction, keywords: dict, rows: Sequence, n: int) -> list[float]:
    try:
        result = _invoke(function, keywords)
    except Exception as exc:
        FILE_ONLY.error("reward function %s raised:", function.name, exc_info=True)
        raise RewardError(f"reward function {function.name} failed on {_failing_row(function, keywords, rows, n)}: "
                          f"{type(exc).__name__}: {first_line(exc)}") from None
    if result is None or isinstance(result, (str, bytes, dict)) or not hasattr(result, "__iter__"):
        raise RewardError(f"reward function {function.name} returned {_shown(result)} for {where(rows[0])} and "
                          f"the rest of its batch; return a list with one float (or None) per completion")
    values = list(result)
    if len(values) != n:
        raise RewardError(f"reward function {function.name} returned {len(values)} reward(s) for {n} completions "
                          f"({where(rows[0])} and the rest of its batch); return one per completion")
    return [_number(function, value, rows[i]) for i, value in enumerate(values)]


def _number(function: RewardFunction, value, row) -> float:
    if value is None:
        return math.nan
    if not isinstance(value, (str, bytes)):
        try:
            number = float(value)  # int, float, bool, numpy and one-element torch numbers
        except (TypeError, ValueError):
            pass
        else:
            if math.isfinite(number):
                return number
            # inf would make its group's mean inf and every advantage NaN; NaN would read as "not applicable"
            raise RewardError(f"reward function {function.name} returned {number} for {where(row)}; return a finite "
                              "float, or None where the function does not apply")
    raise RewardError(f"reward function {function.name} returned {_shown(value)} for {where(row)}; return a float "
                      "or None per completion")


def _shown(value) -> str:
    text = repr(value)
    return f"{text if len(text) <= 40 else text[:37] + '...'} ({type(value).__name__})"


FAILING_ROW_TRIES = 16


def _failing_row(function: RewardFunction, keywords: dict, rows: Sequence, n: int) -> str:
    """The first row whose completion alone makes the function raise (it is called again, one completion at a
    time, only after it failed on the batch, and for at most FAILING_ROW_TRIES of them: a reward that calls a judge
    model is not run once more per completion); the batch when none does alone, or when the function is a
    collective (a reward model sharded across the ranks: called on this rank alone, it would wait for the others)."""
    if getattr(function.func, "collective", False):
        return f"the batch of {where(rows[0])} and {n - 1} other completion(s)"
    for i in range(min(n, FAILING_ROW_TRIES)):
        alone = {k: v[i:i + 1] if isinstance(v, list) and len(v) == n else v for k, v in keywords.items()}
        try:
            _invoke(function, alone)
        except Exception:
            return where(rows[i])
    tried = "no completion alone fails" if n <= FAILING_ROW_TRIES else f"none of its first {FAILING_ROW_TRIES} alone fails"
    return f"the batch of {where(rows[0])} and {n - 1} other completion(s) ({tried})"

