"""What every command shares: one-line errors, and the config and data loaded exactly as training loads them."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import NoReturn

import typer

from ..errors import ConfigError


def fail(message: str, code: int = 2) -> NoReturn:
    """`error: ` before each line: a config with several mistakes says each on its own line."""
    typer.echo("\n".join(f"error: {line}" for line in str(message).splitlines() or [""]), err=True)
    raise typer.Exit(code)


def one_line_errors(command):
    """The CLI's one handler for bad input: a ConfigError (or a data error) from anywhere in a command becomes
    `error: <its line>` and exit code 2, never a traceback."""

    @functools.wraps(command)
    def run(*args, **kwargs):
        from ..data import DataError
        from ..runtime.handoff import HandoffFailed

        try:
            return command(*args, **kwargs)
        except (ConfigError, DataError, HandoffFailed) as exc:
            fail(str(exc))

    return run


def load_config_or_fail(path: Path):
    from ..config import load_config

    return load_config(path)


def tokenized_or_fail(config):
    """The tokenizer and the tokenized datasets exactly as training sees them (the same cache), or one line.
    Preprocessing shows progress bars on a terminal."""
    import sys

    from ..data import load_datasets, load_tokenizer
    from ..logs import quiet_tokenizing

    quiet_tokenizing(progress=sys.stderr.isatty())
    try:
        tokenizer = load_tokenizer(config)
    except (OSError, ValueError) as exc:
        fail(cannot_load_tokenizer(config, exc))
    from ..methods import method_for

    return (tokenizer, *load_datasets(config, tokenizer, method_for(config).data(tokenizer)))


def cannot_load_tokenizer(config, exc: BaseException) -> str:
    from ..errors import first_line

    return f"model_name: cannot load the tokenizer of '{config.tokenizer_name or config.model_name}': {first_line(exc)}"
