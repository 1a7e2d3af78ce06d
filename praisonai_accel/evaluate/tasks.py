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
    except ImportError:
        raise ConfigError(EXTRA_LINE) from None
    return lm_eval


def parse_task_names(spec: str) -> list[str]:
    names = [name.strip() for name in spec.split(",") if name.strip()]
    if not names:
        raise ConfigError("--tasks: name at least one task (comma-separated)")
    return names


def check_include_path(include_path: Path | None) -> None:
    """Every YAML under the include path must parse as lm-eval reads it (lm-eval itself skips one that does not, and
    its tasks then read as unknown)."""
    if include_path is None:
        return
    if not include_path.is_dir():
        raise ConfigError(f"--include-path {include_path}: no such directory")
    from lm_eval.tasks._yaml_loader import load_yaml  # private: lm-eval's minor version is pinned in [eval]

    for path in sorted(include_path.rglob("*.yaml")):
        try:
            config = load_yaml(path, resolve_func=False)
        except Exception as exc:  # yaml's errors, an include cycle, a missing included file
            raise ConfigError(f"{path}: not a valid lm-eval task YAML: {first_line(exc)}") from None
        if not isinstance(config, dict):
            raise ConfigError(f"{path}: not a valid lm-eval task YAML: expected a mapping")


def task_manager(include_path: Path | None):
    import_lm_eval()
    check_include_path(include_path)
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(include_path) if include_path else None)


def build_tasks(names: list[str], include_path: Path | None):
    """(the TaskManager, lm-eval's task dict) or one line naming the task that cannot be built."""
    import logging

    manager = task_manager(include_path)
    known = set(manager.all_tasks)
    for name in names:
        if name not in known and not manager.match_tasks([name]):
            where = f" or under {include_path}" if include_path else " (a local YAML task needs --include-path DIR)"
            raise ConfigError(f"--tasks: lm-eval knows no task '{name}'{where}")
    logging.getLogger("lm_eval").setLevel(logging.ERROR)
    try:
        return manager, manager.load(names)
    except Exception as exc:  # the Hub unreachable (offline), a data file missing, a template that does not render
        raise ConfigError(f"--tasks {','.join(names)}: cannot build the task: {_why(exc)}") from None


def _why(exc: BaseException) -> str:
    text = first_line(exc)
    offline = ("offline" in text.lower() or "connection" in text.lower()
               or type(exc).__name__ in ("ConnectionError", "OfflineModeIsEnabled", "LocalEntryNotFoundError"))
    if offline:
        return (f"its data is on the Hugging Face Hub, which cannot be reached ({text}); run once online to "
                "cache it, or use a local YAML task")
    return text
