"""config.yaml: the training method's keys. `method:` names a class of methods/registry.py; that class's `keys` (a
pydantic model of its own, TRL's names and defaults) are composed with TrainConfig's into the model the file is
validated against, so `config.beta` reads the chosen method's beta. A key that another method declares is refused
in one line naming its methods."""

from __future__ import annotations

import functools
from typing import ClassVar

from pydantic import BaseModel, Field, PrivateAttr, model_validator


class MethodChoice(BaseModel):
    """Method: the training method; its own keys are listed under "Keys of each method".

    Also what TrainConfig asks of the chosen method's class."""

    # The training method (methods/registry.py): a built-in (sft, dpo, orpo, kto, grpo, reward), a registered or
    # entry-point name, or "package.module:Class". parse_config validates against TrainConfig composed with its keys.
    method: str = Field(default="sft", description=(
        "The training method: sft, dpo, orpo, kto, grpo, reward, a method a package registers, or "
        "\"package.module:Class\" "
        "(looked for next to the config file first). Its own keys are written beside the others."))
    training_method: ClassVar[type | None] = None  # the method's class, set on the composed model
    # The directory of the config file (load_config sets it): reward_funcs' and method's modules are looked for there
    _config_dir: str | None = PrivateAttr(default=None)
    # The config file itself (load_config sets it): progress.json names it, so `export gguf` of a run reads its rows
    _config_file: str | None = PrivateAttr(default=None)

    def __reduce__(self):
        # The composed class is made at run time (composed()), so pickle (datasets' map fingerprints and its worker
        # processes, dill) cannot find it by name: a config pickles as how to compose its class again, and its state.
        return _unpickle, (self.method, self._config_dir, self.__getstate__())

    @model_validator(mode="after")
    def _check_best_model_metric(self) -> "MethodChoice":
        self.best_model_metric()
        return self

    @property
    def model_head(self) -> str:
        """What models/loading.py loads for the chosen method: its class's `model_head` ("causal-lm", or
        "sequence-classification" for a reward model)."""
        return getattr(self.training_method, "model_head", "causal-lm")

    def best_model_metric(self) -> str:
        """metric_for_best_model as evaluation logs it ("loss" and names without eval_ mean their eval_ form, as in
        transformers); ValueError (one line) for a metric the method never logs."""
        name = self.metric_for_best_model
        name = name if name.startswith("eval_") else f"eval_{name}"
        metrics = self.training_method.metrics if self.training_method else ()
        known = ("eval_loss",) + tuple(f"eval_{m}" for m in metrics)
        # an eval_tasks score, eval_<task>/<metric>: its metric is checked before launch, once the task is built
        tasks = tuple(f"eval_{task}/" for task in getattr(self, "eval_tasks", None) or ())
        if name not in known and not (tasks and name.startswith(tasks)):
            raise ValueError(f"metric_for_best_model: {self.metric_for_best_model!r} is not a metric method: "
                             f"{self.method} logs; use one of {', '.join(known + tuple(t + '<metric>' for t in tasks))}")
        return name


def config_model(base: type, data: dict, config_dir: str | None) -> tuple[type, dict]:
    """(TrainConfig composed with the keys of data["method"]'s class, data without keys another method declares at
    their default: a config dumped by another version or method reads back). ValueError (one line) for a method
    that names no class, or a key written for another method."""
    from ..methods.registry import method_class, owners_of

    name = data.get("method", base.model_fields["method"].default)
    if not isinstance(name, str):
        raise ValueError(f"method: expected a method name such as sft, got {name!r}")
    model = composed(base, method_class(name, config_dir))
    kept = {}
    for key, value in data.items():
        owners = [] if key in model.model_fields else owners_of(key)
        if not owners:
            kept[key] = value  # ours, or unknown: validation names it
        elif all(value != default for _, default in owners):
            users = [owner for owner, _ in owners]
            raise ValueError(f"{key}: belongs to method {' / '.join(users)}, not to method: {name}; remove it or set "
                             f"method: {users[0]}")
    return model, kept


@functools.cache
def composed(base: type, method: type) -> type:
    """The config model of a run of `method`: base's keys and the method's own (its validators too)."""
    # the method's keys after the base's when dumped (fields are collected from the last base first)
    return type(base.__name__, (method.keys, base), {"__module__": base.__module__, "training_method": method})



def _unpickle(method: str, config_dir: str | None, state: dict):
    from . import TrainConfig
    from ..methods.registry import method_class

    model = composed(TrainConfig, method_class(method, config_dir))
    config = model.__new__(model)
    config.__setstate__(state)
    return config
