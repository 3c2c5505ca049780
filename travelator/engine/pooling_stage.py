"""The runner's stage for prompt-only requests (``SamplingParams.pooling``): embeddings pooled
from the final hidden states, and scores read from the last prompt row's logits.

A mean over a prompt computed in several chunks adds each chunk's rows to a running float32
sum kept here until the last chunk; a request the scheduler drops (finished, aborted,
preempted) is forgotten, and a readmitted one starts again from its first token (a mean never
takes prompt tokens from the prefix cache).
"""

from __future__ import annotations

import torch

from travelator.engine.input_batch import RunnerRequestState, StepInputs


class PoolingStage:
    def __init__(self) -> None:
        self._sums: dict[str, tuple[torch.Tensor, int]] = {}  # request id -> (sum, rows in it)

    def forget(self, request_id: str) -> None:
        self._sums.pop(request_id, None)

    def embed(self, hidden: torch.Tensor, inputs: StepInputs,
              states: dict[str, RunnerRequestState]) -> dict[str, list[float]]:
        """The embeddings of the requests whose prompts end this step."""
        done = {}
        for rid, first, count, final in inputs.pool_spans:
            state = states[rid]
            params = state.sampling_params.pooling
            if params.task != "embed":
                continue
            total, seen = self._sums.pop(rid, (0.0, 0))
            total = hidden[first:first + count].float().sum(dim=0) + total
            seen += count
            if not final:
                self._sums[rid] = (total, seen)
                continue
            if params.pooling == "mean":
                if seen != state.num_prompt_tokens:
                    raise RuntimeError(f"{rid}: a mean over {seen} of {state.num_prompt_tokens} prompt tokens")
                total = total / seen
            vector = total[:params.dimensions]
            if params.normalize:
                vector = torch.nn.functional.normalize(vector, dim=0)
            done[rid] = vector.tolist()
        return done

    @staticmethod
    def score(logits: torch.Tensor, inputs: StepInputs,
              states: dict[str, RunnerRequestState]) -> dict[str, list[float]]:
        """Each scoring request's label tokens' log-probabilities after its prompt (its
        sampled row: the last prompt token's). Before sampling, which may scale the logits."""
        done = {}
        if not inputs.pool_spans:  # no prompt-only request ends this step: nothing to read
            return done
        for row, rid in enumerate(inputs.sampled_ids):
            params = states[rid].sampling_params.pooling
            if params is not None and params.task == "score":
                labels = torch.tensor(params.label_token_ids, dtype=torch.long, device=logits.device)
                done[rid] = torch.log_softmax(logits[row].float(), dim=-1)[labels].tolist()
        return done
