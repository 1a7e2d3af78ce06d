"""Test-only fault injection; never part of the package. Python imports this at start-up when tests/faults is on
PYTHONPATH (conftest.crash_env), in the launcher and in every worker.

PRAISONAI_ACCEL_TEST_CRASH_IN_SAVE=N        rank 0 dies in the save of step N after the weights, optimizer and
                                            scheduler are written, before the checkpoint is marked complete
PRAISONAI_ACCEL_TEST_CRASH_IN_SAVE=N:state  rank 0 dies as accelerator.save_state starts, before anything is written
"""

import importlib.abc
import os
import sys
from pathlib import Path

_SPEC = os.environ.get("PRAISONAI_ACCEL_TEST_CRASH_IN_SAVE", "")


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


_PATCHES = {"accelerate.accelerator": _patch_accelerator, "praisonai_accel.checkpoint": _patch_checkpoint}


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


if _SPEC:
    sys.meta_path.insert(0, _PatchOnImport())
