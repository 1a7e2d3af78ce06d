"""Turning exceptions into the one-line messages users see. Standard library only: the CLI imports it for --help."""

from __future__ import annotations


# Ctrl-C: the shell's code for SIGINT, with which a training worker, an eval rank and the commands that wait on them
# leave when interrupted
INTERRUPTED_EXIT_CODE = 130


class ConfigError(Exception):
    """A config problem (or any bad input the user can fix), already phrased as one line for the user."""


def first_line(exc: BaseException, default: str | None = None) -> str:
    """The first non-empty line of an exception's message, for one-line errors (the type name if it has none)."""
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    return lines[0] if lines else (type(exc).__name__ if default is None else default)
