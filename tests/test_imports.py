"""The torch-free parts stay torch-free: importing them loads neither torch nor tqdm; and
the processes that run an engine do not load torch's compiler stack, which would add seconds
to every start (or stall a running engine where it loads).

Each check runs in a fresh interpreter, since this one has long since imported torch.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from paths import STORIES, needs_stories

TORCH_FREE = [
    "travelator.engine.scheduler",
    "travelator.engine.iteration_scheduler",
    "travelator.engine.static_scheduler",
    "travelator.engine.block_manager",
    "travelator.engine.scheduler_factory",
    "travelator.engine_args",
]


def loaded_after_import(module: str, watched: tuple[str, ...] = ("torch", "tqdm", "numpy")) -> set[str]:
    code = (f"import sys, {module}; "
            f"print(' '.join(m for m in {watched!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(out.stdout.split())


@pytest.mark.parametrize("module", TORCH_FREE)
def test_importing_leaves_torch_out(module):
    assert loaded_after_import(module) == set()


def test_the_package_exports_still_load_on_use():
    code = "import travelator; print(travelator.LLM.__name__, travelator.SamplingParams.__name__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["LLM", "SamplingParams"]


def test_the_check_can_fail():
    """The probe does see torch when a module loads it."""
    assert "torch" in loaded_after_import("travelator.llm")


# What an engine process imports: the command line, a tensor-parallel worker, the server.
ENGINE_ENTRY_POINTS = ["travelator.cli", "travelator.engine.tp_worker", "travelator.server.app"]


@pytest.mark.parametrize("module", ENGINE_ENTRY_POINTS)
def test_an_engine_process_does_not_load_torchs_compiler(module):
    """llguidance's torch helpers apply torch.compile at import: structured outputs take
    llguidance's numpy helpers instead (engine/grammar_masks.py)."""
    assert loaded_after_import(module, ("torch._dynamo",)) == set()


@needs_stories
def test_a_constrained_request_does_not_load_torchs_compiler():
    """Nor does a structured output's first mask: a stall of seconds for every request in
    flight. The constrained text is checked too, so the masks were applied."""
    code = ("import sys; from travelator import LLM, SamplingParams; "
            "from travelator.structured import StructuredOutput; "
            f"llm = LLM({str(STORIES)!r}); "
            "params = SamplingParams(temperature=0, max_tokens=8, structured=StructuredOutput(choice=('big red dog',))); "
            "text = llm.generate(['Once upon a time'], params, use_tqdm=False)[0].outputs[0].text; "
            "print(text, '|', 'torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "big red dog | False"
