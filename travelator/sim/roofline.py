"""The analytical step cost: a roofline per operator, from a model's shape and a hardware
description.

Each operator of a step (the four projections of every layer, attention, the LM head) takes
the longer of its arithmetic at the device's peak FLOP/s and its memory traffic at the
device's bandwidth, each scaled by an efficiency factor (what a real kernel reaches of the
peak). Tensor parallelism divides both over the ranks and adds two all-reduces of the
step's activations per layer; pipeline parallelism divides the layers over the stages and
adds a send between stages. ``stage_times`` gives each stage's time and the send, which the
simulator uses to keep one step per stage in flight as the engine does (``sim/pipeline.py``);
``step_seconds`` is one step through all stages with none busy with another step (what one
micro-batch sees on its own).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from importlib import resources
from pathlib import Path

from travelator.model.arch import ModelArch
from travelator.sim.cost_model import StageTimes, StepShape


@dataclass(frozen=True, slots=True)
class Hardware:
    """One device (a GPU, or a CPU socket's share that the engine uses)."""

    name: str
    peak_flops: float  # dense 16-bit FLOP/s
    memory_bandwidth: float  # bytes/s
    memory_bytes: float
    compute_efficiency: float = 0.6
    memory_efficiency: float = 0.8
    interconnect_bandwidth: float = 0.0  # bytes/s one way, per device (NVLink; 0: none)
    interconnect_latency: float = 0.0  # seconds per collective
    step_overhead: float = 0.0  # seconds of host work per step: scheduling, launches

    @classmethod
    def load(cls, name_or_path: str) -> Hardware:
        """A description in the repository (``a100-sxm-80gb``) or a JSON file of these fields."""
        path = Path(name_or_path)
        if not path.is_file():
            path = resources.files("travelator.sim") / "hardware" / f"{name_or_path}.json"
            if not path.is_file():
                raise ValueError(f"no hardware description {name_or_path!r}; the repository has "
                                 f"{', '.join(known_hardware())}, or give a JSON file")
        data = json.loads(path.read_text())
        known = {f.name for f in fields(cls)}
        if unknown := set(data) - known - {"notes"}:
            raise ValueError(f"{name_or_path}: unknown hardware field(s) {sorted(unknown)}")
        return cls(**{k: v for k, v in data.items() if k in known})


def known_hardware() -> list[str]:
    folder = resources.files("travelator.sim") / "hardware"
    return sorted(p.name.removesuffix(".json") for p in folder.iterdir() if p.name.endswith(".json"))


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What the roofline needs of a dense decoder-only transformer."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    gated_mlp: bool = True  # SwiGLU (gate and up) or a plain two-matrix MLP (GPT-3)
    bytes_per_param: int = 2

    @classmethod
    def from_arch(cls, arch: ModelArch) -> ModelShape:
        return cls(arch.hidden_size, arch.intermediate_size, arch.num_layers, arch.num_heads,
                   arch.num_kv_heads, arch.head_dim, arch.vocab_size)

    @classmethod
    def load(cls, path: str | Path) -> ModelShape:
        return cls(**json.loads(Path(path).read_text()))

    def projections(self) -> list[tuple[int, int]]:
        """(out, in) of each linear layer of one transformer layer."""
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        up = (2 if self.gated_mlp else 1) * self.intermediate_size
        return [(q + 2 * kv, self.hidden_size), (self.hidden_size, q), (up, self.hidden_size),
                (self.hidden_size, self.intermediate_size)]

    @property
    def weight_bytes(self) -> int:
        per_layer = sum(n * k for n, k in self.projections())
        return (self.num_layers * per_layer + 2 * self.vocab_size * self.hidden_size) * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.bytes_per_param


class RooflineCostModel:
    def __init__(self, model: ModelShape, hardware: Hardware, tensor_parallel: int = 1,
                 pipeline_parallel: int = 1) -> None:
        if tensor_parallel < 1 or pipeline_parallel < 1:
            raise ValueError("tensor_parallel and pipeline_parallel must be positive")
        self.model, self.hw = model, hardware
        self.tp, self.pp = tensor_parallel, pipeline_parallel

    def _op(self, flops: float, bytes_moved: float) -> float:
        hw = self.hw
        return max(flops / (hw.peak_flops * hw.compute_efficiency),
                   bytes_moved / (hw.memory_bandwidth * hw.memory_efficiency))

    def _linear(self, rows: int, n: int, k: int) -> float:
        b = self.model.bytes_per_param
        return self._op(2 * rows * n * k / self.tp, (n * k / self.tp + rows * (n / self.tp + k)) * b)

    def _attention(self, shape: StepShape) -> float:
        m = self.model
        pairs = shape.prefill_pairs + shape.decode_context
        flops = 4 * m.num_heads * m.head_dim * pairs / self.tp
        keys_read = shape.decode_context + shape.prefill_tokens
        return self._op(flops, keys_read * m.kv_bytes_per_token / m.num_layers / self.tp)

    def _send(self, num_bytes: float, all_reduce: bool) -> float:
        hw = self.hw
        if hw.interconnect_bandwidth <= 0:
            raise ValueError(f"{hw.name} has no interconnect described: cannot split a model over devices")
        volume = 2 * (self.tp - 1) / self.tp * num_bytes if all_reduce else num_bytes
        return hw.interconnect_latency + volume / hw.interconnect_bandwidth

    @property
    def pipeline_stages(self) -> int:
        return self.pp

    def stage_times(self, shape: StepShape) -> StageTimes:
        """Each stage's layers (split as ``model/pp_stage.stage_bounds`` splits them: the first
        stages take one more when the stages do not divide the layers), the LM head on the last
        stage, the host's work per step on the first (the driver, which schedules and runs
        stage 0), and the send of the step's activations between two stages."""
        m = self.model
        rows = shape.prefill_tokens + shape.decode_tokens
        layer = sum(self._linear(rows, n, k) for n, k in m.projections()) + self._attention(shape)
        activations = rows * m.hidden_size * m.bytes_per_param
        if self.tp > 1:
            layer += 2 * self._send(activations, all_reduce=True)
        base, extra = divmod(m.num_layers, self.pp)
        stages = [(base + (s < extra)) * layer for s in range(self.pp)]
        stages[-1] += self._linear(shape.num_requests, m.vocab_size, m.hidden_size)
        stages[0] += self.hw.step_overhead
        send = self._send(activations, all_reduce=False) if self.pp > 1 else 0.0
        return StageTimes(tuple(stages), send)

    def step_seconds(self, shape: StepShape) -> float:
        """One step through every stage, none busy with another step."""
        return self.stage_times(shape).total

    def kv_blocks(self, block_size: int, memory_share: float = 0.9) -> int:
        """KV blocks that fit beside the weights in the devices' memory share."""
        m, devices = self.model, self.tp * self.pp
        free = self.hw.memory_bytes * devices * memory_share - m.weight_bytes
        if free <= 0:
            raise ValueError(f"the weights ({m.weight_bytes / 2**30:.1f} GiB) do not fit on {devices} "
                             f"{self.hw.name} at {memory_share:.0%} of memory")
        return int(free // (m.kv_bytes_per_token * block_size))
