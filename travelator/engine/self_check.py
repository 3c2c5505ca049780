"""The engine's own accounting, for leak hunting (``GET /debug/engine``, the soak, the fuzzer).

``engine_self_check(engine)`` must run with the engine quiescent: between steps, on the step
thread (``AsyncEngine.self_check``), or offline.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from travelator.engine.block_manager import BlockAccountingError, KVCacheManager

if TYPE_CHECKING:
    from travelator.engine.engine import LLMEngine


def engine_self_check(engine: LLMEngine) -> dict:
    """Report the KV pool (free and used blocks, counted independently, so "free + used =
    total" can fail; blocks per owning request), the scheduler's queues,
    ``KVCacheManager.check_consistency()``, and ``problems``: state that no live request accounts
    for (blocks owned by unknown requests or by nobody, detokenizers of finished requests, model
    runner states of finished requests on any tensor-parallel rank, a request in no queue).
    ``leaked_blocks`` counts used blocks that no live request holds; at rest (``idle``) every
    used block is leaked.
    """
    sched = engine.scheduler
    live = set(sched.requests)
    problems: list[str] = []
    kv_report = _kv_report(engine.kv, live, problems)
    queued = {r.request_id for r in sched.running} | {r.request_id for r in sched.waiting}
    if queued != live:
        problems.append(f"requests in no queue: {sorted(live - queued)}; "
                        f"queued but unknown: {sorted(queued - live)}")
    detokenizers = engine.output_processor.detokenizers
    stale_detok = sorted(set(detokenizers) - live)
    if stale_detok:
        problems.append(f"detokenizers of finished requests: {stale_detok[:10]}")
    runner_states = _runner_states(engine, live, problems)
    c = engine.counters
    return {
        "ok": not problems,
        "problems": problems,
        "idle": not live,
        "kv": kv_report,
        "requests": {
            "running": len(sched.running),
            "waiting": len(sched.waiting),
            "unfinished": len(live),
            "running_ids": [r.request_id for r in sched.running],
            "waiting_ids": [r.request_id for r in sched.waiting],
        },
        "detokenizers": len(detokenizers),
        "runner_states": runner_states,
        "counters": {
            "steps": c.steps,
            "preemptions": c.preemptions,
            "prompt_tokens": c.prompt_tokens,
            "generation_tokens": c.generation_tokens,
            "finished": dict(c.finished),
        },
    }


def _kv_report(kv: KVCacheManager, live: set[str], problems: list[str]) -> dict:
    """The KV pool's accounting; what does not add up goes to ``problems``."""
    owners = kv.owners()
    try:
        kv.check_consistency()
        consistency = "ok"
    except BlockAccountingError as exc:
        consistency = f"failed: {exc}"
        problems.append(f"KV cache consistency check {consistency}")
    free, used, total = kv.num_free_blocks, kv.num_used_blocks, kv.num_blocks
    if free + used != total:
        problems.append(f"free {free} + used {used} != total {total} blocks")
    held = {b for rid in owners if rid in live for b in kv.held_block_ids(rid)}
    unknown = {rid: n for rid, n in owners.items() if rid not in live}
    if unknown:
        problems.append(f"blocks held by requests the scheduler does not know: {unknown}")
    leaked = used - len(held)
    if leaked:
        problems.append(f"{leaked} used blocks held by no live request")
    return {
        "total_blocks": total,
        "free_blocks": free,
        "used_blocks": used,
        "cached_blocks": kv.num_cached_blocks,
        "block_size": kv.block_size,
        "free_plus_used_equals_total": free + used == total,
        "leaked_blocks": leaked,
        "owners": owners,
        "consistency": consistency,
    }


def _runner_states(engine: LLMEngine, live: set[str], problems: list[str]) -> int:
    """How many request states the model runner holds (on any rank); stale ones are problems.

    The runner forgets a finished request at its next step; until then the scheduler lists it
    as freed, so only a state that neither side accounts for is a leak.
    """
    try:
        held = engine.runner.held_request_ids()
    except RuntimeError as exc:  # a broken tensor-parallel group cannot answer
        problems.append(f"the model runner's states could not be read: {exc}")
        return 0
    stale = sorted(held - live - set(engine.scheduler.pending_freed_ids))
    if stale:
        problems.append(f"runner states of finished requests: {stale[:10]}")
    return len(held)
