import os
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

# CI also sets this: the native CPU kernels must build there, so their tests never skip.
REQUIRE_NATIVE = os.environ.get("TRAVELATOR_REQUIRE_NATIVE") == "1"
