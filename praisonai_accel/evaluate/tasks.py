"""lm-eval's tasks, checked and built before any model loads: a task lm-eval does not know, a YAML task that does not
parse, a missing include path or a Hub task whose data cannot be fetched is one line. lm-eval is the `[eval]` extra,
imported here only."""

from __future__ import annotations

from pathlib import Path

from ..errors import ConfigError, first_line

EXTRA_LINE = "lm-eval is not installed: pip install 'praisonai-accel[eval]'"


def import_lm_eval():
    try:
        import lm_eval
        import lm_eval.evaluator
    except ImportError:
        raise ConfigError(EXTRA_LINE) from None
    # simple_evaluate records the working directory's git commit with `git describe`, whose "fatal: not a git
    # repository" reached the user's console from any other directory: the same lookup, its stderr kept out
    lm_eval.evaluator.get_git_commit_hash = _git_commit_hash
    return lm_eval


def _git_commit_hash() -> str | None:
    import subprocess

    try:
        out = subprocess.run(["git", "describe", "--always"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def parse_task_names(spec: str) -> list[str]:
    names = [name.strip() for name in spec.split(",") if name.strip()]
    if not names:
        raise ConfigError("--tasks: name at least one task (comma-separated)")
    return names


def check_include_path(include_path: Path | None, what: str = "--include-path") -> None:
    """Every YAML under the include path must parse as lm-eval reads it (lm-eval itself skips one that does not, and
    its tasks then read as unknown)."""
    if include_path is None:
        return
    if not include_path.is_dir():
        raise ConfigError(f"{what} {include_path}: no such directory")
    from lm_eval.tasks._yaml_loader import load_yaml  # private: lm-eval's minor version is pinned in [eval]

    for path in sorted(include_path.rglob("*.yaml")):
        try:
            config = load_yaml(path, resolve_func=False)
        except Exception as exc:  # yaml's errors, an include cycle, a missing included file
            raise ConfigError(f"{path}: not a valid lm-eval task YAML: {first_line(exc)}") from None
        if not isinstance(config, dict):
            raise ConfigError(f"{path}: not a valid lm-eval task YAML: expected a mapping")


def task_manager(include_path: Path | None, what: str = "--include-path", names: list[str] | None = None):
    """(lm-eval's TaskManager, whether it left lm-eval's built-in tasks out). It leaves them out (their ~14,000
    YAMLs take seconds to index, in every rank) where every one of `names` is the include path's own."""
    import_lm_eval()
    check_include_path(include_path, what)
    from lm_eval.tasks import TaskManager

    if include_path is not None and names:
        local = TaskManager(include_path=str(include_path), include_defaults=False)
        if all(name in local.all_tasks for name in names):
            return local, True
    return TaskManager(include_path=str(include_path) if include_path else None), False


def _load(manager, local_only: bool, names: list[str], include_path: Path | None, what: str):
    """(the manager, lm-eval's task dict); a local index that cannot load them (a local group of built-in tasks)
    gives way to the whole one."""
    try:
        return manager, manager.load(names)
    except Exception:
        if not local_only:
            raise
    manager, _ = task_manager(include_path, what)
    return manager, manager.load(names)


def build_tasks(names: list[str], include_path: Path | None, keys: tuple[str, str] = ("--tasks", "--include-path"),
                images: bool = False):
    """(the TaskManager, lm-eval's task dict) or one line naming the task that cannot be built. `keys` name the
    option or config key of the tasks and of the include path in that line. `images`: the model that scores them
    can be given a task's images (lm-eval's API models); our HFLM scores text, a vision-language model's too."""
    import logging

    import datasets

    manager, local_only = task_manager(include_path, keys[1], names)
    known = set(manager.all_tasks)
    for name in names:
        if name not in known and not manager.match_tasks([name]):
            where = f" or under {include_path}" if include_path else f" (a local YAML task needs {keys[1]} DIR)"
            raise ConfigError(f"{keys[0]}: lm-eval knows no task '{name}'{where}")
    logging.getLogger("lm_eval").setLevel(logging.ERROR)
    shown = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # a split of a few local rows: its bar would stand above a one-line error
    try:
        manager, task_dict = _load(manager, local_only, names, include_path, keys[1])
    except Exception as exc:  # the Hub unreachable (offline), a data file missing, a template that does not render
        raise ConfigError(f"{keys[0]} {','.join(names)}: cannot build the task: {_why(exc)}") from None
    finally:
        if shown:
            datasets.enable_progress_bars()
    with_images = [task.config.task for task in leaf_tasks(task_dict) if getattr(task, "MULTIMODAL", False)]
    if with_images and not images:  # lm-eval would refuse them only after the model has loaded
        raise ConfigError(f"{keys[0]}: {', '.join(with_images)}: the task gives the model images (doc_to_image); "
                          "praisonai-accel scores text tasks only (a vision model's too); lm-eval's own "
                          "`--model hf-multimodal` scores image tasks")
    return manager, task_dict


def task_metrics(task_dict) -> dict[str, list[str]]:
    """{task: its metric names (without lm-eval's filter)} of a built task dict, groups opened."""
    return {task.config.task: list(task.aggregation()) for task in leaf_tasks(task_dict)}


def leaf_tasks(task_dict):
    for value in task_dict.values():
        if isinstance(value, dict):
            yield from leaf_tasks(value)
        elif hasattr(value, "aggregation"):
            yield value


def metric_key(task: str, metric: str) -> str:
    """How a task score is logged during training: <task>/<metric>, lm-eval's filter kept unless it is none."""
    return f"{task}/{metric.removesuffix(',none')}"


def scores(results: dict) -> dict[str, float]:
    """{<task>/<metric>: value} from lm-eval's results (standard errors left out)."""
    out = {}
    for task, metrics in results.get("results", {}).items():
        for key, value in metrics.items():
            if "," in key and "_stderr" not in key and isinstance(value, (int, float)) and not isinstance(value, bool):
                out[metric_key(task, key)] = float(value)
    return out


def _why(exc: BaseException) -> str:
    text = first_line(exc)
    offline = ("offline" in text.lower() or "connection" in text.lower()
               or type(exc).__name__ in ("ConnectionError", "OfflineModeIsEnabled", "LocalEntryNotFoundError"))
    if offline:
        return (f"its data is on the Hugging Face Hub, which cannot be reached ({text}); run once online to "
                "cache it, or use a local YAML task")
    return text
