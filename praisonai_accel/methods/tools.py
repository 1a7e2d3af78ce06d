"""GRPO's tools (TRL's contract): the functions `tools` names and the public methods of the environments
`environment_factory` makes, their JSON schemas (transformers' get_json_schema: type hints and a Google-style
docstring), and a call that cannot hang the run or write on its console.

A tool runs in a thread of the worker's process: past `tool_timeout` seconds it is abandoned (the thread is left to
finish on its own) and the model reads an error as its result, as it does for an exception (TRL's `{"error": ...}`);
both are counted as failures. What a tool prints goes to the rank's log file, never to the console.
"""

from __future__ import annotations

import inspect
import json
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..errors import ConfigError, first_line
from ..logs import FILE_ONLY
from .method_keys import split_entry
from .rewards import config_dir, import_callable

NOT_TOOLS = ("reset", "get_reward")  # an environment's methods that are not tools (TRL's)
THREAD_PREFIX = "praisonai-tool"


def _import(entry: str, where: str, base_dir: Path | None):
    return import_callable(*split_entry(entry, where), where, base_dir)


def schema_of(func: Callable, where: str) -> dict:
    """The tool's JSON schema as chat templates take it, or ConfigError naming what is missing."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(func)
    except Exception as exc:  # DocstringParsingException, TypeHintParsingException: their text says what is missing
        raise ConfigError(f"{where}: {getattr(func, '__name__', func)} cannot be a tool: {first_line(exc)} (a tool "
                          "needs type hints on every parameter and a Google-style docstring with an Args: section)"
                          ) from None


def environment_methods(cls: type) -> list[str]:
    """The names of an environment's tools: its public functions other than reset and get_reward (TRL's rule)."""
    return [name for name, _ in inspect.getmembers(cls, predicate=inspect.isfunction)
            if name not in NOT_TOOLS and not name.startswith("_")]


@dataclass
class ToolSet:
    """The standalone tools and the environment classes (by the name rows select them with; None for one)."""

    functions: dict[str, Callable]
    factories: dict[str | None, Callable]
    schemas: dict[str | None, list[dict]]  # the tools offered with each environment (None: without one)
    timeout: float
    max_result_length: int
    env_classes: dict[str | None, type] = field(default_factory=dict)

    @property
    def multi_environment(self) -> bool:
        return bool(self.factories) and None not in self.factories


def load_tools(config, base_dir: Path | None = None) -> ToolSet | None:
    """The tools and environments the config names, imported and their schemas built; ConfigError (one line) for a
    function without type hints or docstring, a name clash, or an environment without reset(). None without tools."""
    if not config.tools and not config.environment_factory:
        return None
    base_dir = config_dir(config) if base_dir is None else Path(base_dir)
    functions, schemas = {}, []
    for index, entry in enumerate(config.tools or []):
        where = f"tools[{index}]: {entry}"
        func = _import(entry, where, base_dir)
        schema = schema_of(func, where)
        name = schema["function"]["name"]
        if name in functions:
            raise ConfigError(f"{where}: a tool named {name!r} is listed already; tools need distinct names")
        functions[name] = func
        schemas.append(schema)
    factories, offered, classes = {}, {None: schemas} if not isinstance(config.environment_factory, dict) else {}, {}
    entries = config.environment_factory if isinstance(config.environment_factory, dict) else (
        {None: config.environment_factory} if config.environment_factory else {})
    for env_name, entry in entries.items():
        where = "environment_factory" + (f".{env_name}" if env_name is not None else "") + f": {entry}"
        factory = _import(entry, where, base_dir)
        cls = factory if isinstance(factory, type) else None
        if cls is None:  # a function making one: the class is known once it has made one (here, before launch)
            cls = type(factory())
        if not callable(getattr(cls, "reset", None)):
            raise ConfigError(f"{where}: {cls.__name__} has no reset() method; an environment needs one (it may "
                              "return the first observation, appended to the prompt)")
        env_schemas = list(schemas)
        for method in environment_methods(cls):
            schema = schema_of(getattr(cls, method), f"{where}: method {method}")
            if schema["function"]["name"] in functions:
                raise ConfigError(f"{where}: method {method} has the name of a tool in tools; rename one of them")
            env_schemas.append(schema)
        factories[env_name], offered[env_name], classes[env_name] = factory, env_schemas, cls
    return ToolSet(functions, factories, offered, float(config.tool_timeout), int(config.max_tool_result_length),
                   classes)


# ---------------------------------------------------------------- calls

class _ToolOutput:
    """sys.stdout / sys.stderr while tools may run: writes from a tool's thread go to the rank's log file."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> int:
        if threading.current_thread().name.startswith(THREAD_PREFIX):
            if text.strip():
                FILE_ONLY.info("tool output: %s", text.rstrip())
            return len(text)
        return self.stream.write(text)

    def __getattr__(self, name):
        return getattr(self.stream, name)


def route_tool_output() -> None:
    """Once per process: what a tool prints, now or after it was abandoned, goes to the log file."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if not isinstance(stream, _ToolOutput):
            setattr(sys, name, _ToolOutput(stream))


def tool_functions(tools: ToolSet, environment) -> dict[str, Callable]:
    """The tools a rollout may call: the standalone ones and its environment's methods (bound to it)."""
    out = dict(tools.functions)
    if environment is not None:
        out.update({name: getattr(environment, name) for name in environment_methods(type(environment))})
    return out


def call_tool(functions: dict[str, Callable], call: dict, timeout: float, max_length: int) -> tuple[str, str, bool]:
    """(the tool's name, its result as the text the model reads, whether it failed). A failure (unknown tool, bad
    arguments, an exception, no answer within `timeout`, a result that is not JSON) reads as TRL's {"error": ...}."""
    function = call.get("function") if isinstance(call, dict) else None
    name = str((function or {}).get("name", "unknown"))
    if call.get("type", "function") != "function" or function is None:
        return name, _error(f"unsupported tool call type: {call.get('type')}"), True
    if name not in functions:
        return name, _error(f"Tool {name} not found."), True
    arguments = function.get("arguments") or {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return name, _error(f"the arguments of {name} are not JSON: {arguments[:200]}"), True
    if not isinstance(arguments, dict):
        return name, _error(f"the arguments of {name} are not an object"), True
    outcome: dict[str, Any] = {}

    def run():
        try:
            result = functions[name](**arguments)
            if inspect.iscoroutine(result):
                import asyncio

                result = asyncio.run(result)
            outcome["result"] = result
        except BaseException as exc:  # noqa: BLE001 - the model reads it, as TRL's loop does
            outcome["error"] = str(exc) or type(exc).__name__

    thread = threading.Thread(target=run, name=f"{THREAD_PREFIX}-{name}", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        FILE_ONLY.warning("tool %s did not answer within tool_timeout: %gs; abandoned", name, timeout)
        return name, _error(f"{name} did not answer within {timeout:g} seconds"), True
    if "error" in outcome:
        FILE_ONLY.info("tool %s raised: %s", name, outcome["error"])
        return name, _error(outcome["error"]), True
    result = outcome.get("result")
    if isinstance(result, str):
        text = result
    else:
        try:
            text = json.dumps(result, ensure_ascii=False)
        except (TypeError, ValueError):
            return name, _error(f"{name} returned a {type(result).__name__}, which is not JSON"), True
    if len(text) > max_length:
        text = text[:max_length] + f"... [cut at max_tool_result_length: {max_length} characters]"
    return name, text, False


def _error(text: str) -> str:
    return str({"error": text})  # as TRL's loop renders it: str() of the dict
