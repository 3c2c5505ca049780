"""The prompt forms ``LLM.generate`` takes, as vLLM's offline API does.

A prompt is a string, a list of token ids, ``{"prompt": "..."}`` or ``{"prompt_token_ids":
[...]}``; a dict may add ``"cache_salt"``, which keeps its prefix-cache blocks apart from those of
prompts without the same salt. ``generate`` takes one prompt or a sequence of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

_DICT_KEYS = {"prompt", "prompt_token_ids", "cache_salt"}

PromptInput = str | list[int] | dict[str, Any]


@dataclass(frozen=True, slots=True)
class Prompt:
    text: str | None
    token_ids: list[int] | None  # exactly one of text and token_ids is set
    cache_salt: str | None = None

    @property
    def engine_input(self) -> str | list[int]:
        return self.text if self.text is not None else self.token_ids  # type: ignore[return-value]


def parse_prompts(prompts: Any) -> list[Prompt]:
    """One prompt or a sequence of them, in any of the forms above. Token ids are checked
    against the vocabulary later, by the engine."""
    if isinstance(prompts, (str, dict)) or (_is_ids(prompts) and prompts and isinstance(prompts[0], int)):
        return [_parse_one(prompts)]
    if not _is_ids(prompts):
        raise TypeError(f"prompts must be a prompt or a sequence of prompts, not "
                        f"{type(prompts).__name__}")
    return [_parse_one(p) for p in prompts]


def _is_ids(value: Any) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, str)


def _parse_one(prompt: Any) -> Prompt:
    if isinstance(prompt, str):
        return Prompt(prompt, None)
    if _is_ids(prompt):
        return Prompt(None, list(prompt))
    if not isinstance(prompt, dict):
        raise TypeError(f"a prompt is a string, a list of token ids or a dict, not "
                        f"{type(prompt).__name__}")
    unknown = set(prompt) - _DICT_KEYS
    if unknown:
        raise ValueError(f"unsupported prompt fields {sorted(unknown)}: a prompt dict takes "
                         f"'prompt' or 'prompt_token_ids', and optionally 'cache_salt'")
    salt = prompt.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise TypeError("cache_salt must be a string")
    if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
        raise ValueError("a prompt dict takes exactly one of 'prompt' and 'prompt_token_ids'")
    if "prompt" in prompt:
        if not isinstance(prompt["prompt"], str):
            raise TypeError("'prompt' must be a string; token ids go in 'prompt_token_ids'")
        return Prompt(prompt["prompt"], None, salt)
    if not _is_ids(prompt["prompt_token_ids"]):
        raise TypeError("'prompt_token_ids' must be a list of token ids")
    return Prompt(None, list(prompt["prompt_token_ids"]), salt)
