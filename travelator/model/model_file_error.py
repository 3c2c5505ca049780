"""The error of a model file that cannot be read: damaged, truncated, or saying something
impossible. It names the file and, where one is at fault, the field (a metadata key, a config
key, a tensor), so a user sees what to fix instead of a reader's internals."""

from __future__ import annotations

from pathlib import Path


class ModelFileError(ValueError):
    def __init__(self, path: str | Path, field: str | None, problem: str) -> None:
        where = f"{path}: {field}" if field else str(path)
        super().__init__(f"{where}: {problem}")
        self.path = str(path)
        self.field = field
        self.problem = problem


def shown(value: object) -> str:
    """A value as an error message quotes it: its repr, cut short."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
