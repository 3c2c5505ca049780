"""The model a command uses when it is given no ``--model``.

The small trained story model beside a checkout, else random weights of the "tiny" preset,
so every command runs with no download. ``$TRAVELATOR_MODEL`` overrides both.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

_CANDIDATES = ("../shared/models/stories260K.gguf",)
_FALLBACK = "dummy:tiny"


def default_model() -> str:
    env = os.environ.get("TRAVELATOR_MODEL")
    if env:
        return env
    for candidate in _CANDIDATES:
        if Path(candidate).exists():
            return candidate
    return _FALLBACK


def resolve_model(args: argparse.Namespace) -> str:
    """``--model``, or the default, announced on stderr."""
    if args.model:
        return args.model
    model = default_model()
    print(f"no --model given: using the built-in default {model}", file=sys.stderr)
    return model
