"""Engine configuration, validated once at start-up: the one definition of every setting.

Each field of a section (``ModelConfig``, ``CacheConfig``, ``SchedulerConfig``,
``ParallelConfig``) is annotated with a ``Setting``: its help text and how it is spelled on the
command line. ``engine_args.py`` reads these fields: it makes the engine flags
of ``generate``, ``serve`` and ``bench``, and the keywords of ``LLM(model, **kwargs)``. A field
added here shows up in all of them.
"""

from __future__ import annotations

import json
import types
import typing
from dataclasses import dataclass, field, fields
from typing import Annotated, Any, Literal

Batching = Literal["iteration", "orca", "dynamic", "static"]
REQUEST_LEVEL_BATCHING = ("static", "dynamic")  # a batch runs to completion; nobody joins it
SchedulingPolicy = Literal["fcfs", "priority"]
SpeculativeMethod = Literal["ngram", "draft"]
SpeculativePolicy = Literal["adaptive", "fixed"]
DType = Literal["auto", "float32", "bfloat16", "float16"]
KVCacheDType = Literal["auto", "float32", "bfloat16", "float16", "int8"]
LoadFormat = Literal["auto", "dummy"]
Kernels = Literal["auto", "native", "triton", "torch"]
Quantization = Literal["auto", "none", "int8", "int4"]
GemmCopies = Literal["auto", "off"]
ExecutorBackend = Literal["mp", "ray"]
LmHeadQuantization = Literal["auto", "none", "int8", "int4"]
KVEventsPublisher = Literal["null", "zmq"]
KVEventsLayout = Literal["map", "array"]


@dataclass(frozen=True, slots=True)
class Setting:
    """A config field's description and spelling, given as ``Annotated[type, Setting(...)]``."""

    help: str
    flag: str | None = None  # default: --<name with dashes>
    short_flag: str | None = None
    cli_unit: tuple[str, int] | None = None  # (name, factor): the flag takes value / factor
    old_keywords: tuple[str, ...] = ()  # former LLM keywords, accepted with a warning
    old_flags: tuple[str, ...] = ()  # former flags, accepted with a warning


def setting_of(section: type, name: str) -> Setting:
    """The ``Setting`` a field of a config section is annotated with."""
    hint = typing.get_type_hints(section, include_extras=True)[name]
    (found,) = [m for m in typing.get_args(hint)[1:] if isinstance(m, Setting)]
    return found


def field_choices(section: type) -> dict[str, tuple[Any, ...]]:
    """The allowed values of each Literal-typed field (or optional one) of a config section."""
    hints = typing.get_type_hints(section)
    return {f.name: values for f in fields(section)
            if (values := _literal_values(hints[f.name])) is not None}


def _literal_values(hint: Any) -> tuple[Any, ...] | None:
    if typing.get_origin(hint) is Literal:
        return typing.get_args(hint)
    for arg in typing.get_args(hint):  # Literal[...] | None
        if typing.get_origin(arg) is Literal:
            return typing.get_args(arg)
    return None


def _check_choices(section: object) -> None:
    for name, allowed in field_choices(type(section)).items():
        value = getattr(section, name)
        if value is not None and value not in allowed:
            raise ValueError(f"{name} must be one of {', '.join(map(str, allowed))}; got {value!r}")


@dataclass(slots=True)
class ModelConfig:
    model: Annotated[str, Setting(
        "HF-layout directory, .gguf file or dummy:<preset> (presets: tiny, llama-50m, llama-250m, "
        "llama-1b, llama-8b, qwen3-tiny, qwen3-50m); default: the built-in one")]
    dtype: Annotated[DType, Setting(
        "weights and activations (auto: bfloat16, a float32 checkpoint's too, on CUDA and "
        "wherever the native CPU kernels run; float32 elsewhere)")] = "auto"
    load_format: Annotated[LoadFormat, Setting(
        "dummy: random weights of the model's shape")] = "auto"
    max_model_len: Annotated[int | None, Setting(
        "context limit (default: the model's, or what the KV pool holds)")] = None
    seed: Annotated[int, Setting("seed of dummy weights")] = 0
    device: Annotated[str, Setting("cpu, cuda, cuda:N or auto")] = "auto"
    kernels: Annotated[Kernels, Setting(
        "native: travelator's C++ CPU kernels (paged attention in one call per layer, fused "
        "norms, SiLU and rope, pre-packed bf16 linear layers), built on first use; triton: "
        "paged attention in Triton on a CUDA device (the rest in torch); torch: plain torch; "
        "auto: native on the CPU where they build, triton on CUDA where it imports")] = "auto"
    quantization: Annotated[Quantization, Setting(
        "weights of the linear layers (QKV, output, gate/up, down) kept quantized on the CPU: int8 per "
        "output channel, or int4 in groups of quantization_group_size inputs, quantized at load; "
        "auto: a GGUF file's Q8_0/Q6_K tensors stay int8 and its Q4_0/Q4_1/Q4_K tensors int4, other "
        "checkpoints stay as they are; none: everything dequantized")] = "auto"
    quantization_group_size: Annotated[int, Setting(
        "int4: inputs per group sharing a scale and a zero point (32, 64, 128 or 256)")] = 128
    lm_head_quantization: Annotated[LmHeadQuantization, Setting(
        "with quantization int8 or int4, the untied LM head's weights: auto: int8 (its error goes "
        "straight into the logits); int4 (a quarter of bf16's bytes: the fastest batch-1 decode); "
        "none: as loaded")] = "auto"
    quantized_gemm_copies: Annotated[GemmCopies, Setting(
        "quantized weights on CPUs with a bf16 GEMM: auto: each also keeps a bf16 copy, which steps "
        "past the integer kernel's rows multiply (faster than dequantizing at every call; 2 bytes a "
        "parameter more), where all fit a quarter of the memory available; off: none, the least "
        "memory")] = "auto"
    batch_invariant: Annotated[bool, Setting(
        "a request's tokens and logprobs never depend on what else is in its step (linear "
        "layers in fixed tiles of rows; needs the native CPU kernels)")] = False
    enforce_eager: Annotated[bool, Setting(
        "run every step eagerly: no CUDA graphs (with kernels triton on a CUDA device, decode-only "
        "steps otherwise replay a graph recorded at start-up per batch-size bucket)")] = False

    def validate(self) -> None:
        _check_choices(self)
        if self.quantization_group_size not in (32, 64, 128, 256):
            raise ValueError("quantization_group_size must be 32, 64, 128 or 256")
        if self.lm_head_quantization != "auto" and self.quantization not in ("int8", "int4"):
            raise ValueError("lm_head_quantization applies with quantization int8 or int4; "
                             f"quantization is {self.quantization}")


@dataclass(slots=True)
class CacheConfig:
    block_size: Annotated[int, Setting("tokens per KV block")] = 16
    num_kv_blocks: Annotated[int | None, Setting(
        "exact KV pool size in blocks (wins over --kv-cache-gb)")] = None
    kv_cache_bytes: Annotated[int | None, Setting(
        "KV pool size in bytes; in GiB on the command line (default: on CUDA what "
        "gpu_memory_utilization leaves; on the CPU max_num_seqs full contexts, at most "
        "kv_memory_share of free memory)", flag="--kv-cache-gb", cli_unit=("GiB", 1 << 30))] = None
    kv_memory_share: Annotated[float, Setting(
        "CPU: share of the memory available (MemAvailable, or a container's memory limit's room "
        "where less) the KV pool may take when its size is not given")] = 0.3
    gpu_memory_utilization: Annotated[float, Setting(
        "CUDA: share of the device's total memory the engine may use when the KV pool's size is "
        "not given: the pool takes what is left after the weights, other memory in use and the "
        "largest step's activations (measured at start-up)")] = 0.9
    kv_cache_dtype: Annotated[KVCacheDType, Setting(
        "dtype of the KV cache (auto: the model's; int8: 8-bit codes with a scale per token "
        "and head, 1.9x the tokens of bf16 at head_dim 64)")] = "auto"
    enable_prefix_caching: Annotated[bool, Setting(
        "turn automatic prefix caching off", flag="--no-prefix-caching")] = True
    kv_events_config: Annotated[str | None, Setting(
        "publish the prefix cache's block-stored / block-removed / all-cleared events in vLLM's "
        "wire format for cluster routers: a JSON object with vLLM's --kv-events-config keys, e.g. "
        '\'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
        '"replay_endpoint": "tcp://*:5558"}\' (default: off)')] = None

    def kv_events(self) -> KVEventsConfig | None:
        """The parsed kv_events_config, or None when events are off."""
        if self.kv_events_config is None:
            return None
        parsed = KVEventsConfig.from_json(self.kv_events_config)
        return parsed if parsed.enable_kv_cache_events and parsed.publisher != "null" else None

    def validate(self) -> None:
        _check_choices(self)
        self.kv_events()  # raises on a malformed config
        if self.block_size < 1:
            raise ValueError("block_size must be positive")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError("num_kv_blocks must be positive")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            raise ValueError("kv_cache_bytes must be positive")
        if not 0 < self.kv_memory_share <= 1:
            raise ValueError("kv_memory_share must be in (0, 1]")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """vLLM's KVEventsConfig (same keys, same defaults), plus the layout of an event on the wire."""

    enable_kv_cache_events: bool = False
    publisher: KVEventsPublisher | None = None  # None: zmq when enabled (as vLLM)
    endpoint: str = "tcp://*:5557"  # PUB socket: bound if it has * or :: (or is ipc/inproc), else connected
    replay_endpoint: str | None = None  # ROUTER socket answering replay requests
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark
    max_queue_size: int = 100_000  # batches waiting for the sending thread
    topic: str = ""
    # map: each event a map tagged by "type" (vLLM since its 0.23); array: a positional array
    # led by the tag (vLLM up to 0.22, what older consumers decode).
    wire_layout: KVEventsLayout = "map"

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"kv_events_config is not JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise ValueError("kv_events_config must be a JSON object")
        hints = typing.get_type_hints(cls)
        for key, value in raw.items():
            if key not in hints:
                raise ValueError(f"kv_events_config: unknown key {key!r}; the keys are {', '.join(hints)}")
            if not _fits(value, hints[key]):
                raise ValueError(f"kv_events_config.{key}: {value!r} is not a valid {hints[key]}")
        config = cls(**raw)
        if min(config.buffer_steps, config.hwm, config.max_queue_size) < 1:
            raise ValueError("kv_events_config: buffer_steps, hwm and max_queue_size must be positive")
        return config


def _fits(value: Any, hint: Any) -> bool:
    """Whether a JSON value has a config field's type (bool is not an int here)."""
    if typing.get_origin(hint) is Literal:
        return value in typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(_fits(value, option) for option in typing.get_args(hint))
    return value is None if hint is type(None) else type(value) is hint


@dataclass(slots=True)
class SchedulerConfig:
    batching: Annotated[Batching, Setting(
        "iteration: iteration-level scheduling with chunked prefill (Sarathi-Serve); orca: "
        "iteration-level, a joining prompt computed whole in one step; dynamic: a batch of up to "
        "--max-num-seqs formed when full or when its first request has waited "
        "--max-queue-delay-ms, run to completion (Triton); static: the waiting requests form a "
        "batch as soon as the previous one is done, run to completion (FasterTransformer)",
        old_keywords=("scheduler",), old_flags=("--scheduler",))] = "iteration"
    max_num_seqs: Annotated[int, Setting("most requests in one step (the batch size)")] = 128
    max_queue_delay_ms: Annotated[float, Setting(
        "dynamic batching: the longest a request waits for its batch to fill")] = 100.0
    max_num_batched_tokens: Annotated[int, Setting(
        "token budget of one step; longer prompts are chunked")] = 1024
    scheduling_policy: Annotated[SchedulingPolicy, Setting(
        "fcfs: first come first served; priority: lower request priority first, and the "
        "lowest-priority latest request is preempted first",
        old_keywords=("scheduling_order",))] = "fcfs"
    max_overtakes: Annotated[int, Setting(
        "times a waiting request that does not fit the free blocks may be overtaken by later ones "
        "that do; then nobody is admitted past it until it fits")] = 16
    speculative_method: Annotated[SpeculativeMethod | None, Setting(
        "speculative decoding: ngram proposes the tokens that followed the latest earlier "
        "occurrence of a request's last tokens (prompt lookup), draft a smaller model's greedy "
        "tokens (--draft-model); the step verifies them")] = None
    draft_model: Annotated[str | None, Setting(
        "the draft model of --speculative-method draft (same vocabulary as the model): an "
        "HF-layout directory, .gguf file or dummy:<preset>")] = None
    num_speculative_tokens: Annotated[int, Setting("most draft tokens per request and step")] = 4
    prompt_lookup_min: Annotated[int, Setting("ngram: shortest suffix looked up")] = 1
    prompt_lookup_max: Annotated[int, Setting("ngram: longest suffix looked up")] = 4
    speculative_policy: Annotated[SpeculativePolicy, Setting(
        "adaptive: drafts per request from its measured acceptance and the batch's load (none "
        "from --speculation-saturation-rows running requests on); fixed: always "
        "--num-speculative-tokens")] = "adaptive"
    speculation_saturation_rows: Annotated[int, Setting(
        "adaptive: running requests from which nobody speculates; below it, drafts are priced "
        "by the measured cost of a row (until measured: running / this)")] = 128

    def validate(self) -> None:
        _check_choices(self)
        if self.speculative_method is not None:
            if self.batching in REQUEST_LEVEL_BATCHING:
                raise ValueError("speculative decoding needs iteration-level batching")
            if (self.speculative_method == "draft") != (self.draft_model is not None):
                raise ValueError("speculative_method draft needs draft_model, and draft_model needs it")
            if self.num_speculative_tokens < 1:
                raise ValueError("num_speculative_tokens must be positive")
            if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
                raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
            if self.speculation_saturation_rows < 1:
                raise ValueError("speculation_saturation_rows must be positive")
        if self.scheduling_policy == "priority" and self.batching != "iteration":
            raise ValueError("priority scheduling needs --batching iteration")
        if not 0 <= self.max_queue_delay_ms < float("inf"):
            raise ValueError("max_queue_delay_ms must be a non-negative number of milliseconds")
        if self.max_overtakes < 0:
            raise ValueError("max_overtakes must be non-negative")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be positive")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be positive")


@dataclass(slots=True)
class ParallelConfig:
    tensor_parallel_size: Annotated[int, Setting(
        "split the model over N ranks (Megatron-style; gloo on CPU, NCCL on CUDA); the engine "
        "launches N-1 workers here, or run every rank under torchrun", short_flag="-tp")] = 1
    expert_parallel: Annotated[bool, Setting(
        "mixtures of experts under tensor parallelism: place whole experts on the ranks (expert e "
        "on rank e mod N) instead of splitting every expert's intermediate size over them")] = False
    pipeline_parallel_size: Annotated[int, Setting(
        "split the model's layers into N contiguous stages, one per rank (gloo point-to-point "
        "between stages); launched like tensor parallelism", short_flag="-pp")] = 1
    distributed_executor_backend: Annotated[ExecutorBackend, Setting(
        "who starts ranks 1..N-1: mp, the engine on this machine (or torchrun); ray, actors in a "
        "placement group of the Ray cluster this process joins (RAY_ADDRESS, else the local one)")] = "mp"

    def validate(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size must be positive")
        if self.pipeline_parallel_size < 1:
            raise ValueError("pipeline_parallel_size must be positive")
        if self.tensor_parallel_size > 1 and self.pipeline_parallel_size > 1:
            raise ValueError("tensor and pipeline parallelism together are not supported: set "
                             "tensor_parallel_size or pipeline_parallel_size to 1")

    @property
    def world_size(self) -> int:
        """Ranks of the engine: one parallelism at a time, so the larger size."""
        return max(self.tensor_parallel_size, self.pipeline_parallel_size)


@dataclass(slots=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def validate(self) -> None:
        self.model.validate()
        self.cache.validate()
        self.scheduler.validate()
        self.parallel.validate()
        if self.scheduler.speculative_method is not None and self.parallel.world_size > 1:
            raise ValueError("speculative decoding runs on one rank for now (tensor_parallel_size and "
                             "pipeline_parallel_size 1)")
