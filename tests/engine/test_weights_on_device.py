"""Weights go straight to an accelerator: the model's parameters are created on the device
before any weight is written, so the host holds one loaded tensor at a time, never the whole
model. The meta device stands in for the accelerator here (no GPU needed); the CPU keeps
building on the CPU."""

from __future__ import annotations

import pytest
import torch

from travelator.config import ModelConfig
from travelator.engine.model_runner import RunnerSettings, _load_model
from travelator.model.arch import preset
from travelator.model.llama import LlamaModel
from travelator.model.loader import open_model
from travelator.model.ops import TorchOps
from paths import STORIES, needs_stories


def _devices_when_written(monkeypatch) -> list[set[str]]:
    """Record the devices of the model's parameters when its weights start to be written."""
    seen: list[set[str]] = []
    for method in ("load_weights", "init_dummy_weights"):
        original = getattr(LlamaModel, method)

        def recording(self, *args, _original=original, **kwargs):
            seen.append({p.device.type for p in self.parameters()})
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(LlamaModel, method, recording)
    return seen


def _load(model: str, device: str, weights=None):
    arch = open_model(model).arch if weights is not None else preset(model.removeprefix("dummy:"))
    settings = RunnerSettings(torch.float32, torch.float32, torch.device(device), max_model_len=64)
    return _load_model(ModelConfig(model, kernels="torch"), arch, weights, settings, None, TorchOps())


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_parameters_are_made_on_the_device_before_weights_are_written(monkeypatch, device):
    seen = _devices_when_written(monkeypatch)
    model = _load("dummy:tiny", device)
    assert seen == [{device}]
    assert {p.device.type for p in model.parameters()} == {device}
    assert {b.device.type for b in model.buffers()} == {device}  # rope tables too


@needs_stories
def test_checkpoint_tensors_are_copied_to_the_device_as_they_are_read(monkeypatch):
    seen = _devices_when_written(monkeypatch)
    source = open_model(str(STORIES))
    read: list[str] = []

    def weights():
        for name, tensor in source.weights():
            read.append(name)
            yield name, tensor

    model = _load(str(STORIES), "meta", weights)
    assert seen == [{"meta"}] and read  # built on the device, then filled tensor by tensor
    assert {p.device.type for p in model.parameters()} == {"meta"}
