"""The model runner owns every tensor: weights, the paged KV cache, and the flat batch of
each step. It takes the scheduler's step description and returns, per request, the tokens
it kept.

A step runs in three stages: input preparation (``input_batch.py``: the persistent batch
state, updated from the step's small changes, and the flat inputs), the forward pass, and
sampling (``sampling_stage.py``: logits, grammar masks, the sample, the acceptance of drafts,
prompt logprobs); prompt-only requests' embeddings and scores come from ``pooling_stage.py``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from travelator.config import ModelConfig
from travelator.model.pp_stage import PipelineStage
from travelator.model.tp_group import TPGroup
from travelator.engine.decode_graphs import DecodeGraphs, GraphCapture, bucket_sizes
from travelator.engine.draft_model import DraftJob, DraftModel
from travelator.engine.grammar_compiler import GrammarCompiler
from travelator.engine.grammar_masks import GrammarMasks
from travelator.engine.input_batch import InputBatch, StepInputs
from travelator.engine.pooling_stage import PoolingStage
from travelator.engine.sampling_stage import SamplingStage
from travelator.engine.scheduler_output import PromptLogprobs, RunnerOutput, SampledToken, SchedulerOutput
from travelator.engine.step_staging import StepStaging
from travelator.model import kv_layout
from travelator.model.arch import ModelArch
from travelator.model.device import building_on
from travelator.model.host_memory import retain_freed_memory
from travelator.model.llama import LlamaModel
from travelator.model.loader import ModelSource, WeightIterator
from travelator.model.ops import TorchOps, make_ops
from travelator.model.run_summary import describe_run


@dataclass(frozen=True, slots=True)
class RunnerSettings:
    """What the engine resolved for the runner from its ModelConfig, the checkpoint and the
    machine."""

    dtype: torch.dtype
    kv_dtype: torch.dtype
    device: torch.device
    max_model_len: int
    eos_token_ids: frozenset[int] = frozenset()
    # The scheduler's step limits: they size the CUDA staging buffers and graph buckets.
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 1024


@dataclass(frozen=True, slots=True)
class LaunchedStep:
    """A pipeline step the driver has sent off: its flat inputs (None: nothing to run) and
    its first stage's output rows, until its logits come back."""

    out: SchedulerOutput
    inputs: StepInputs | None
    hidden: torch.Tensor | None


class ModelRunner:
    def __init__(self, config: ModelConfig, arch: ModelArch, weights: WeightIterator | None,
                 settings: RunnerSettings, *, tp: TPGroup | None = None, stage: PipelineStage | None = None,
                 grammars: GrammarCompiler | None = None, draft: ModelSource | None = None) -> None:
        self.arch = arch
        device = settings.device
        self.device = device
        self.settings = settings
        self.dtype = settings.dtype
        self.kv_dtype = settings.kv_dtype
        self.eos_token_ids = settings.eos_token_ids
        self.ops = make_ops(config.kernels, device, batch_invariant=config.batch_invariant)
        if self.ops.attention_backend == "triton" and self.kv_dtype == torch.int8:
            raise ValueError("kv_cache_dtype int8 runs on the CPU kernels; the Triton attention "
                             "reads float caches (kv_cache_dtype auto)")
        # Tensor parallelism: this rank's shard of the weights and of the KV heads.
        self.tp_size = tp.size if tp is not None else 1
        if tp is not None and config.batch_invariant:
            tp.fixed_order_sums = True
        self.model = _load_model(config, arch, weights, settings, tp, self.ops, stage)
        # Pipeline parallelism: KV only for this stage's layers.
        self.num_local_layers = len(self.model.local_layers)
        # Speculative decoding with a draft model: it proposes in this runner, with its own KV
        # cache over the same block ids.
        self.draft = DraftModel(draft, dtype=settings.dtype, kv_dtype=settings.kv_dtype, device=device,
                                max_model_len=settings.max_model_len, ops=self.ops) if draft is not None else None
        # Structured outputs: masks for constrained rows (on the rank that samples).
        self.grammar = GrammarMasks(grammars, self.ops) if grammars is not None else None
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.batch = InputBatch(self.ops, device)
        # Decode-only steps as CUDA graphs (recorded once the KV cache exists): on one rank,
        # with the Triton attention, whose host-side launch decisions a graph can fix.
        self.graphs: DecodeGraphs | None = None
        self._record_graphs = (not config.enforce_eager and self.ops.attention_backend == "triton"
                               and device.type == "cuda" and tp is None and stage is None)
        self.sampler = SamplingStage(self.model, self.ops, self.grammar, self.eos_token_ids)
        self.pooler = PoolingStage()
        # Seconds spent per phase, summed over the run (on CUDA, kernels are asynchronous:
        # forward time then shows up where the host first waits, in "sample").
        self.phase_times: dict[str, float] = {"prepare": 0.0, "forward": 0.0, "sample": 0.0}
        if device.type == "cpu":
            # Each step's activations would otherwise page-fault anew (model/host_memory.py);
            # after loading, so that the loader's freed buffers are not kept.
            retain_freed_memory()

    def kv_bytes_per_block(self, block_size: int) -> int:
        a = self.arch
        draft = self.draft.kv_bytes_per_block(block_size) if self.draft is not None else 0
        return block_size * kv_layout.bytes_per_token(self.num_local_layers, a.num_kv_heads // self.tp_size, a.head_dim,
                                                     self.kv_dtype) + draft

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        a = self.arch
        shape = kv_layout.cache_shape(num_blocks, block_size, a.num_kv_heads // self.tp_size, a.head_dim,
                                     self.kv_dtype)
        self.kv_caches = [
            (torch.zeros(shape, dtype=self.kv_dtype, device=self.device),
             torch.zeros(shape, dtype=self.kv_dtype, device=self.device))
            for _ in range(self.num_local_layers)
        ]
        self.batch.block_size = block_size
        if self.draft is not None:
            self.draft.allocate_kv_cache(num_blocks, block_size)
        s = self.settings
        if self.device.type == "cuda":
            self.batch.staging = StepStaging(self.device, s.max_num_batched_tokens, s.max_num_seqs,
                                             -(-s.max_model_len // block_size))
        if self._record_graphs:
            self.graphs = DecodeGraphs(self.model, self.kv_caches, max_model_len=s.max_model_len,
                                       block_size=block_size, device=self.device, capture=GraphCapture(),
                                       buckets=bucket_sizes(min(s.max_num_seqs, s.max_num_batched_tokens)))

    def describe(self) -> str:
        """The dtype and kernel routes this runner chose, in one line (printed at start-up)."""
        return describe_run(self.ops, self.model.linear_weights(), self.dtype, self.kv_dtype, self.device)

    # ---- KV hand-off (prefill/decode disaggregation) ---------------------------------
    def read_kv_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """The blocks' K and V in every layer: [layers, 2, len(block_ids), kv heads, block_size, row]
        (row: head_dim, or head_dim + 4 bytes in an int8 cache)."""
        self._check_handoff()
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        return torch.stack([torch.stack((k.index_select(0, ids), v.index_select(0, ids)))
                            for k, v in self.kv_caches]).cpu()

    def write_kv_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Write ``read_kv_blocks``' output (of another engine) into these blocks."""
        self._check_handoff()
        expected = (len(self.kv_caches), 2, len(block_ids), *self.kv_caches[0][0].shape[1:])
        if tuple(data.shape) != expected:
            raise ValueError(f"handed-off KV has shape {tuple(data.shape)}, this pool wants {expected}")
        if data.dtype != self.kv_dtype:
            raise ValueError(f"handed-off KV is {data.dtype}, this pool holds {self.kv_dtype}")
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        data = data.to(self.device)
        for layer, (k, v) in enumerate(self.kv_caches):
            k.index_copy_(0, ids, data[layer, 0])
            v.index_copy_(0, ids, data[layer, 1])

    def _check_handoff(self) -> None:
        if self.draft is not None:
            raise ValueError("a KV hand-off does not carry a draft model's cache: no draft-model speculation")

    # ---- one step ------------------------------------------------------------------
    def held_request_ids(self) -> set[str]:
        return set(self.batch.states)

    def shutdown(self) -> None:
        """Stop the grammar's background thread; the runner lives in the engine's process."""
        if self.grammar is not None:
            self.grammar.shutdown()

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        t0 = time.perf_counter()
        self._apply_changes(out)
        if out.is_empty:
            return RunnerOutput()
        drafts_of = self._drafts_of(out)
        inputs = self.batch.prepare(out, drafts_of)
        t1 = time.perf_counter()
        logits, prompt_logprobs, pooled = self._forward(inputs)
        t2 = time.perf_counter()
        self.phase_times["prepare"] += t1 - t0
        self.phase_times["forward"] += t2 - t1
        if logits is None:
            return RunnerOutput(prompt_logprobs=prompt_logprobs, pooled=pooled)
        pooled.update(self.pooler.score(logits, inputs, self.batch.states))
        sampled, failed = self.sampler.sample(logits, inputs, self.batch.states, drafts_of)
        self._keep(out, sampled, drafts_of)
        self.phase_times["sample"] += time.perf_counter() - t2
        return RunnerOutput(sampled, prompt_logprobs, failed=failed, pooled=pooled)

    def _forward(self, inputs: StepInputs) -> tuple[torch.Tensor | None, dict[str, PromptLogprobs],
                                                    dict[str, list[float]]]:
        """The sampled rows' logits, the prompt logprobs and the embeddings finished: a
        recorded graph's replay for a decode-only step it takes, else the eager forward."""
        if self.graphs is not None and self.graphs.takes(inputs):
            return self.graphs.run(inputs), {}, {}
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
        embedded = self.pooler.embed(hidden, inputs, self.batch.states)
        return self.sampler.logits(hidden, inputs), self.sampler.prompt_logprobs(hidden, inputs), embedded

    # ---- pipeline parallelism: the driver's steps in flight ------------------------------
    def launch(self, out: SchedulerOutput) -> LaunchedStep:
        """A pipeline driver's first half of a step: apply its changes, run the first stage
        (which sends its hidden states on) and post the receives of the logits the last stage
        will send back, so that the next step can be launched before they arrive."""
        t0 = time.perf_counter()
        self._apply_changes(out)
        if out.is_empty:
            return LaunchedStep(out, None, None)
        inputs = self.batch.prepare(out, {})  # speculative decoding runs on one rank
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
        self.model.stage.expect_logits(self.sampler.logits_rows(inputs), self.arch.vocab_size, self.model.dtype)
        self.phase_times["forward"] += time.perf_counter() - t0
        return LaunchedStep(out, inputs, hidden)

    def land(self, step: LaunchedStep) -> RunnerOutput:
        """The second half, after every step launched before it has landed: receive its
        logits, sample, keep the tokens."""
        inputs = step.inputs
        if inputs is None:
            return RunnerOutput()
        t0 = time.perf_counter()
        logits = self.sampler.logits(step.hidden, inputs)
        prompt_logprobs = self.sampler.prompt_logprobs(step.hidden, inputs)
        if logits is None:
            return RunnerOutput(prompt_logprobs=prompt_logprobs)
        pooled = self.pooler.score(logits, inputs, self.batch.states)
        sampled, failed = self.sampler.sample(logits, inputs, self.batch.states, {})
        self._keep(step.out, sampled, {})
        self.phase_times["sample"] += time.perf_counter() - t0
        return RunnerOutput(sampled, prompt_logprobs, failed=failed, pooled=pooled)

    def follow(self, out: SchedulerOutput, sampled: list[tuple[str, int]]) -> None:
        """Run a step as a tensor-parallel worker: no sampling (the driver samples from the
        gathered logits). ``sampled`` are the tokens the driver's requests kept in the previous
        step; they extend this rank's copies of the sequences before the step's changes apply,
        exactly as they extended the driver's."""
        for rid, token in sampled:
            self.batch.append(rid, [token])
        self._apply_changes(out)
        if out.is_empty:
            return
        inputs = self.batch.prepare(out, {})  # speculative decoding runs on one rank
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
        self.sampler.logits(hidden, inputs)
        self.sampler.prompt_logprobs(hidden, inputs)  # the same gathers, in the same order

    def _apply_changes(self, out: SchedulerOutput) -> None:
        # A readmitted request's grammar matcher is rebuilt from its outputs, and the draft
        # model computes it again.
        for rid in self.batch.apply_changes(out):
            self.pooler.forget(rid)
            if self.grammar is not None:
                self.grammar.forget(rid)
            if self.draft is not None:
                self.draft.forget(rid)

    def _drafts_of(self, out: SchedulerOutput) -> dict[str, list[int]]:
        """Each drafting request's drafts: the scheduler's, or the draft model's proposal."""
        drafts_of = {rid: d.token_ids for rid, d in out.drafts.items() if d.token_ids}
        states = self.batch.states
        jobs = [DraftJob(rid, states[rid].token_ids, states[rid].block_ids, d.num_tokens)
                for rid, d in out.drafts.items() if not d.token_ids]
        if jobs:
            drafts_of.update(self.draft.propose(jobs))
        return drafts_of

    def _keep(self, out: SchedulerOutput, sampled: dict[str, list[SampledToken]],
              drafts_of: dict[str, list[int]]) -> None:
        """Extend the sequences with the tokens their requests kept."""
        for rid, toks in sampled.items():
            drafts = out.drafts.get(rid)
            if drafts is not None and not drafts.token_ids:  # the draft model's proposal
                num_tokens = len(self.batch.states[rid].token_ids)
                self.draft.accepted(rid, num_tokens, len(drafts_of[rid]), len(toks) - 1)
            self.batch.append(rid, [t.token_id for t in toks])


def _load_model(config: ModelConfig, arch: ModelArch, weights: WeightIterator | None,
                settings: RunnerSettings, tp: TPGroup | None, ops: TorchOps,
                stage: PipelineStage | None = None) -> LlamaModel:
    """The model (this rank's shard), on its device, its linear weights prepared for ``ops``."""
    method = None if config.quantization in ("auto", "none") else config.quantization
    device = settings.device
    if method is not None and device.type != "cpu":
        raise ValueError(f"quantization {method} runs on the CPU (the engine's CPU kernels); "
                         f"the device is {device}")
    with building_on(device):
        model = LlamaModel(arch, settings.dtype, max_positions=settings.max_model_len, tp=tp, ops=ops,
                           quantization=method, group_size=config.quantization_group_size,
                           keep_gguf_quants=config.quantization == "auto" and device.type == "cpu",
                           lm_head_quantization=config.lm_head_quantization, stage=stage)
    if weights is None:
        model.init_dummy_weights(config.seed)
    else:
        model.load_weights(weights(), source=config.model)
    model = model.to(device)  # the CPU's model; already there elsewhere
    ops.prepare(model.linear_weights(), settings.dtype, gemm_copies=config.quantized_gemm_copies == "auto")
    return model
