"""Typed reads of a GGUF file's metadata: a value of the wrong type, out of range or missing is
a ModelFileError naming the key, instead of whatever int() or float() of it would raise."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from travelator.model.arch_check import MAX_SIZE
from travelator.model.model_file_error import ModelFileError, shown

REQUIRED = object()  # a default meaning: the key must be there


class GgufMetadata:
    """The metadata of ``reader`` (a gguf.GGUFReader of the file at ``path``), its keys read
    under ``prefix`` ("llama." reads "llama.block_count" as "block_count")."""

    def __init__(self, reader, path: Path, prefix: str = "") -> None:
        self.reader, self.path, self.prefix = reader, path, prefix

    def under(self, prefix: str) -> GgufMetadata:
        return GgufMetadata(self.reader, self.path, prefix)

    def value(self, key: str, default: Any = None) -> Any:
        """The value as the reader decodes it (a number, a string, a list)."""
        full = self.prefix + key
        field = self.reader.fields.get(full)
        if field is None:
            if default is REQUIRED:
                raise ModelFileError(self.path, full, "is missing")
            return default
        try:
            return field.contents()
        except (ValueError, IndexError) as e:  # undecodable UTF-8, a part missing
            raise ModelFileError(self.path, full, f"cannot be read: {e}") from None

    def int(self, key: str, default: Any = REQUIRED, low: int = 1, high: int = MAX_SIZE) -> int:
        value = self.value(key, default)
        if value is default and default is not REQUIRED:
            return value
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ModelFileError(self.path, self.prefix + key, f"must be an integer from {low} to {high}, "
                                                               f"got {shown(value)}")
        return value

    def float(self, key: str, default: Any = REQUIRED) -> float:
        value = self.value(key, default)
        if value is default and default is not REQUIRED:
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ModelFileError(self.path, self.prefix + key, f"must be a finite number, got {shown(value)}")
        return float(value)

    def str(self, key: str, default: Any = REQUIRED) -> str:
        value = self.value(key, default)
        if value is default and default is not REQUIRED:
            return value
        if not isinstance(value, str):
            raise ModelFileError(self.path, self.prefix + key, f"must be a string, got {shown(value)}")
        return value

