"""The training methods by name. `method:` in config.yaml names one of:

- a built-in (BUILTINS: sft, dpo, orpo, kto, grpo, reward);
- a class registered from Python: `register_method("mine", MyMethod)`;
- a class a package declares under the entry point group `praisonai_accel.methods` (`mine = "mypkg.methods:MyMethod"`
  in its pyproject's `[project.entry-points."praisonai_accel.methods"]`), found when the name is first asked for;
- a class by its import path, "package.module:Class" (looked for next to the config file first, as reward_funcs are).

A method class (methods/base.TrainingMethod) declares everything about itself; this module only finds it. Importing a
built-in's class imports no torch: the config asks for its keys before anything is launched.
"""

from __future__ import annotations

import importlib
import re
from importlib.metadata import entry_points
from pathlib import Path

from ..config import TrainConfig
from .base import TrainingMethod
from .user_code import import_user_module

ENTRY_POINT_GROUP = "praisonai_accel.methods"
# module (in this package) and class of each built-in, in the order error lines list them
BUILTINS = ("sft:SFT", "preference:DPO", "preference:ORPO", "preference:KTO", "grpo:GRPO", "reward:RewardMethod")
_NAME = re.compile(r"[A-Za-z_][\w.\-]*(:[A-Za-z_]\w*)?$")
_registered: dict[str, type] = {}
_builtins_loaded = False


def register_method(name: str, cls: type) -> type:
    """Make `method: <name>` train with `cls`, a subclass of methods.base.TrainingMethod whose `keys` is a pydantic
    model of its own config keys. Returns `cls`. ValueError (one line) for a class that cannot be one, a name taken
    by another class, or keys that would replace one of TrainConfig's own."""
    _load_builtins()
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"method: {name!r} is not a method name (letters, digits, _ . -, or \"package.module:Class\")")
    if not (isinstance(cls, type) and issubclass(cls, TrainingMethod)):
        raise ValueError(f"method: {name}: {cls!r} is not a subclass of praisonai_accel.methods.base.TrainingMethod")
    if _registered.get(name, cls) is not cls:
        raise ValueError(f"method: {name} is already registered to {_qualified(_registered[name])}")
    from pydantic import BaseModel

    if not (isinstance(cls.keys, type) and issubclass(cls.keys, BaseModel)):
        raise ValueError(f"method: {name}: {_qualified(cls)}.keys is not a pydantic model of its config keys")
    taken = sorted(set(cls.keys.model_fields) & set(TrainConfig.model_fields))
    if taken:
        raise ValueError(f"method: {name}: {_qualified(cls)}.keys declares {', '.join(taken)}, which TrainConfig "
                         "already has; give the method's keys names of their own")
    _registered[name] = cls
    return cls


def method_class(name: str, config_dir: str | Path | None = None) -> type:
    """The class `method: <name>` trains with; ValueError (one line) for a name that names none."""
    _load_builtins()
    if name in _registered:
        return _registered[name]
    found = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == name]
    if found:
        return register_method(name, _load(found[0].value, f"method: {name} (entry point {found[0].value})"))
    if isinstance(name, str) and ":" in name and _NAME.match(name):
        return register_method(name, _load(name, f"method: {name}", config_dir))
    known = ", ".join(repr(n) for n in known_methods())
    raise ValueError(f"method: expected one of {known}, or \"package.module:Class\", got {name!r}")


def known_methods() -> dict[str, type]:
    """Every method by name: built-ins, those registered, and those packages declare as entry points (imported)."""
    _load_builtins()
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name not in _registered:
            try:
                register_method(ep.name, _load(ep.value, f"method: {ep.name} (entry point {ep.value})"))
            except ValueError:
                continue  # asked for by name, it says why; here it only cannot own a key
    return dict(_registered)


def builtin_methods() -> list[type]:
    """The built-in methods' classes, in BUILTINS' order (what `config schema` documents)."""
    _load_builtins()
    return [getattr(importlib.import_module(f"{__package__}.{module}"), cls)
            for module, cls in (entry.split(":") for entry in BUILTINS)]


def owners_of(key: str) -> list[tuple[str, object]]:
    """(method name, its default) for each method whose keys declare `key`, built-ins first."""
    return [(name, cls.keys.model_fields[key].default) for name, cls in known_methods().items()
            if key in cls.keys.model_fields]


def _load_builtins() -> None:
    global _builtins_loaded
    if _builtins_loaded:
        return
    _builtins_loaded = True
    for entry in BUILTINS:
        module, _, attribute = entry.partition(":")
        cls = getattr(importlib.import_module(f"{__package__}.{module}"), attribute)
        _registered[cls.name] = cls


def _load(path: str, where: str, config_dir: str | Path | None = None) -> type:
    module_name, _, attribute = path.partition(":")
    module = import_user_module(module_name, where, config_dir, ValueError)
    cls = getattr(module, attribute, None) if attribute else None
    if cls is None:
        raise ValueError(f"{where}: module '{module_name}' has no class '{attribute}'")
    return cls


def _qualified(cls) -> str:
    return f"{getattr(cls, '__module__', '?')}:{getattr(cls, '__qualname__', cls)}"

