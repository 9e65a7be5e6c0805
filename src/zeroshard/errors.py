"""Errors shared across the package's layers (imports nothing of zeroshard's, so every
module can raise them without an import cycle)."""

from __future__ import annotations

__all__ = ["UsageError"]


class UsageError(ValueError):
    """A bad command-line value; the message names the value and the fix. ``zeroshard``'s
    CLI (cli.py) prints it as one line and exits with status 2."""
