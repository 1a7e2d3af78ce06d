"""Test-only fault injection; never part of the package. Python imports this at start-up when tests/faults is on
PYTHONPATH (conftest.crash_env), in the launcher and in every worker.

PRAISONAI_ACCEL_TEST_CRASH_IN_SAVE=N        rank 0 dies in the save of step N after the weights, optimizer and
                                            scheduler are written, before the checkpoint is marked complete
PRAISONAI_ACCEL_TEST_CRASH_IN_SAVE=N:state  rank 0 dies as accelerator.save_state starts, before anything is written
PRAISONAI_ACCEL_TEST_PREPROCESS=sleep:S     tokenizing takes S seconds longer, on rank 0 (or in the launcher)
PRAISONAI_ACCEL_TEST_PREPROCESS=fail        tokenizing raises, on rank 0 (or in the launcher)
PRAISONAI_ACCEL_TEST_HANG=R:N               rank R sleeps for an hour inside the forward of step N
PRAISONAI_ACCEL_TEST_SLOW_MICRO_BATCH=S     every micro-batch forward takes S seconds longer, on every rank
PRAISONAI_ACCEL_TEST_PREFLIGHT=late:R:S     rank R reaches the preflight all-reduce S seconds late
PRAISONAI_ACCEL_TEST_PREFLIGHT=version:R:P=V  rank R reports version V of package P
PRAISONAI_ACCEL_TEST_MONITOR_INTERVAL=S     torchrun's agent looks at its workers every S seconds (0.1 by default), so ranks that
                                            fail within S of each other are noticed together, ordered by rank
PRAISONAI_ACCEL_TEST_LAUNCHER_IMPORTS=FILE  the `praisonai-accel` process writes, as it exits, whether it imported
                                            transformers
PRAISONAI_ACCEL_TEST_LLAMA_CPP_CRASH=OP     the llama.cpp child (publish/gguf_engine.serve) dies of a segmentation
                                            fault as it starts OP (tokenize, quantize, generate)
PRAISONAI_ACCEL_TEST_HIDE_MODULE=NAME       importing NAME (and its submodules) fails, as if it were not installed
"""

import importlib.abc
import os
import sys
from pathlib import Path

_SPEC = os.environ.get("PRAISONAI_ACCEL_TEST_CRASH_IN_SAVE", "")
_PREPROCESS = os.environ.get("PRAISONAI_ACCEL_TEST_PREPROCESS", "")
_HANG = os.environ.get("PRAISONAI_ACCEL_TEST_HANG", "")
_SLOW_MICRO_BATCH = float(os.environ.get("PRAISONAI_ACCEL_TEST_SLOW_MICRO_BATCH", "0"))
_PREFLIGHT = os.environ.get("PRAISONAI_ACCEL_TEST_PREFLIGHT", "")
_LAUNCHER_IMPORTS = os.environ.get("PRAISONAI_ACCEL_TEST_LAUNCHER_IMPORTS", "")
_MONITOR_INTERVAL = os.environ.get("PRAISONAI_ACCEL_TEST_MONITOR_INTERVAL", "")
_LLAMA_CPP_CRASH = os.environ.get("PRAISONAI_ACCEL_TEST_LLAMA_CPP_CRASH", "")
_HIDE_MODULE = os.environ.get("PRAISONAI_ACCEL_TEST_HIDE_MODULE", "")


def _rank0() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def _patch_accelerator(module) -> None:
    step, _, place = _SPEC.partition(":")
    original = module.Accelerator.save_state

    def save_state(self, output_dir=None, *args, **kwargs):
        if place == "state" and _rank0() and Path(str(output_dir)).name == f"checkpoint-{step}.tmp":
            os._exit(17)
        return original(self, output_dir, *args, **kwargs)

    module.Accelerator.save_state = save_state


def _patch_checkpoint(module) -> None:
    step, _, place = _SPEC.partition(":")
    original = module.CheckpointState.write

    def write(self, directory):
        if not place and _rank0() and self.global_step == int(step):
            os._exit(17)
        return original(self, directory)

    module.CheckpointState.write = write


def _patch_data(module) -> None:
    import time

    original = module.tokenize_dataset

    def tokenize_dataset(*args, **kwargs):
        if _rank0() and _PREPROCESS == "fail":
            raise RuntimeError("injected preprocessing failure")
        if _rank0() and _PREPROCESS.startswith("sleep:"):
            time.sleep(float(_PREPROCESS.split(":")[1]))
        return original(*args, **kwargs)

    module.tokenize_dataset = tokenize_dataset


def _patch_loss(module) -> None:
    import time

    rank, _, step = _HANG.partition(":")
    original = module.CausalLMLoss.forward
    calls = {"n": 0}

    def forward(self, *args, **kwargs):
        calls["n"] += 1
        if _HANG and int(os.environ.get("RANK", "0")) == int(rank) and calls["n"] == int(step):
            time.sleep(3600)
        if _SLOW_MICRO_BATCH:
            time.sleep(_SLOW_MICRO_BATCH)
        return original(self, *args, **kwargs)

    module.CausalLMLoss.forward = forward


def _patch_preflight(module) -> None:
    import time

    kind, rank, value = _PREFLIGHT.split(":", 2)
    if int(os.environ.get("RANK", "0")) != int(rank):
        return
    if kind == "late":
        original_all_reduce = module._all_reduce_within

        def all_reduce_within(*args):
            time.sleep(float(value))
            return original_all_reduce(*args)

        module._all_reduce_within = all_reduce_within
    elif kind == "version":
        name, _, version = value.partition("=")
        original_versions = module.package_versions
        module.package_versions = lambda: {**original_versions(), name: version}


def _patch_agent(module) -> None:
    original = module.WorkerSpec.__post_init__

    def __post_init__(self):
        original(self)
        self.monitor_interval = float(_MONITOR_INTERVAL)

    module.WorkerSpec.__post_init__ = __post_init__


def _patch_llama_cpp_child(module) -> None:
    def crash(request):
        import ctypes

        ctypes.string_at(0)  # a real segmentation fault, as llama.cpp's would be

    module.OPS[_LLAMA_CPP_CRASH] = crash


_PATCHES = {name: patch for name, patch, wanted in (
    ("accelerate.accelerator", _patch_accelerator, _SPEC), ("praisonai_accel.worker.checkpoint", _patch_checkpoint, _SPEC),
    ("praisonai_accel.data.preprocess", _patch_data, _PREPROCESS), ("praisonai_accel.methods.lm_loss", _patch_loss, _HANG or _SLOW_MICRO_BATCH),
    ("praisonai_accel.worker.preflight", _patch_preflight, _PREFLIGHT),
    ("torch.distributed.elastic.agent.server.api", _patch_agent, _MONITOR_INTERVAL),
    ("praisonai_accel.publish.gguf_engine", _patch_llama_cpp_child, _LLAMA_CPP_CRASH),
) if wanted}


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds the module as usual, then patches it right after it has executed."""

    def find_spec(self, name, path, target=None):
        if name not in _PATCHES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                break
        else:
            return None
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            _PATCHES[name](module)

        spec.loader.exec_module = exec_module
        return spec


if _PATCHES:
    sys.meta_path.insert(0, _PatchOnImport())


class _Hidden(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == _HIDE_MODULE or name.startswith(_HIDE_MODULE + "."):
            raise ModuleNotFoundError(f"No module named '{name}'", name=name)
        return None


if _HIDE_MODULE:
    sys.meta_path.insert(0, _Hidden())


def _record_launcher_imports() -> None:
    if sys.argv[0].endswith(os.path.join("praisonai_accel", "__main__.py")):  # only -m sets it, after start-up
        Path(_LAUNCHER_IMPORTS).write_text(f"transformers={'transformers' in sys.modules}")


if _LAUNCHER_IMPORTS:
    import atexit

    atexit.register(_record_launcher_imports)
