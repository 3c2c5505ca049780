"""The soak's workload: a seeded mix of completions and chat, streaming or not, n > 1 and
prompt batches, stop strings, logprobs, greedy and seeded sampling, very short and
context-filling requests, clients that disconnect, bursts, and a few invalid requests."""

from __future__ import annotations

import random
from dataclasses import dataclass

from travelator.bench.soak import structured
from travelator.bench.soak.config import SoakConfig
from travelator.bench.soak.structured import Constraint

# Prompts: short ones, and long ones (a few hundred characters) to fill KV blocks fast.
SHORT_PROMPTS = ["Once upon a time", "Lily and Ben", "The dog", "One day, a little girl", "Tom had a big",
                 "Sue was sad because", "The sun", "A bird"]
_STORY = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park. "
          "One day, she saw a big, red ball. She wanted to play with it, but it was too high. ")
LONG_PROMPTS = [_STORY * 2, "Tom and Sue went to the park. " * 8, _STORY + "Then Ben came and said"]
CHAT_MESSAGES = [
    [{"role": "user", "content": "Tell me a story about a cat."}],
    [{"role": "system", "content": "You tell stories."}, {"role": "user", "content": "A dog and a ball."}],
    [{"role": "user", "content": _STORY}],
]
STOP_CHOICES = ["Lily", ".", "\n", " the", "!", ",", "zzz-never"]
# --everything: prompts that share their first blocks, so that the prefix cache hits.
SHARED_PREFIX_PROMPTS = [_STORY + tail for tail in ("Lily said", "Then her mom came", "The ball", "Ben saw her and")]
PRIORITIES = range(0, 10)  # any int is allowed; lower runs first
CONSTRAINED_RATE = 0.15
SHARED_PREFIX_RATE = 0.3


@dataclass
class Spec:
    index: int
    path: str
    body: dict
    stream: bool
    choices: int  # prompts x n
    max_tokens: int
    stops: list[str]
    include_stop: bool
    invalid: bool = False
    burst: bool = False
    disconnect: str | None = None  # None, "early", "mid", "wait"
    disconnect_after: float = 0.0  # seconds ("early", "wait") or chunks ("mid")
    constraint: Constraint | None = None

    @property
    def greedy(self) -> bool:
        """Greedy with one choice: its answer must equal the same request run alone."""
        return not self.invalid and self.choices == 1 and self.body.get("temperature") == 0


class Workload:
    def __init__(self, cfg: SoakConfig, prompt_tokens: dict[str, int], chat_tokens: list[int | None],
                 max_model_len: int) -> None:
        self.cfg = cfg
        self.prompt_tokens = prompt_tokens
        self.chat_tokens = chat_tokens
        self.max_model_len = max_model_len
        # Only the prompts that fit the server's context.
        self.short = [t for t in SHORT_PROMPTS if t in prompt_tokens]
        self.long = [t for t in LONG_PROMPTS if t in prompt_tokens] or self.short
        self.chats = [i for i, n in enumerate(chat_tokens) if n is not None]
        self.shared = [t for t in SHARED_PREFIX_PROMPTS if t in prompt_tokens]
        # Disaggregated serving refuses structured outputs (the grammar's state does not move).
        self.constrained = cfg.everything and not cfg.disaggregate

    def _room(self, n_prompt: int) -> int:
        return max(1, self.max_model_len - n_prompt - 1)

    def _max_tokens(self, rng: random.Random, n_prompt: int, long: bool) -> tuple[int, bool]:
        room = self._room(n_prompt)
        if long:
            return max(1, min(room, rng.randint(room // 2, room))), True
        if rng.random() < 0.3:
            return min(room, rng.randint(1, 3)), False
        return min(room, rng.randint(6, 40)), rng.random() < 0.3

    def make(self, index: int, burst: bool = False) -> Spec:
        cfg = self.cfg
        rng = random.Random(cfg.seed * 1_000_003 + index)
        if not burst and rng.random() < cfg.invalid_rate:
            return self._invalid(index, rng)
        long = not burst and rng.random() < cfg.long_rate
        chat = not burst and rng.random() < 0.3
        stream = not burst and rng.random() < 0.5
        n = 1 if burst or rng.random() < 0.75 else rng.randint(2, 3)
        body: dict = {}  # no "model": the server's default
        if chat:
            which = 2 if long and 2 in self.chats else rng.choice([i for i in self.chats if i < 2] or self.chats)
            body["messages"] = CHAT_MESSAGES[which]
            n_prompt = self.chat_tokens[which]
            prompts = 1
            path = "/v1/chat/completions"
        else:
            path = "/v1/completions"
            r = rng.random()
            if long:  # a long prompt, or a short one with a long output
                text = rng.choice(self.long if rng.random() < 0.5 else self.short)
                body["prompt"] = text
                n_prompt, prompts = self.prompt_tokens[text], 1
            elif r < 0.12 and not burst:
                texts = rng.sample(self.short, 2)
                body["prompt"] = texts
                n_prompt, prompts = max(self.prompt_tokens[t] for t in texts), 2
            elif r < 0.22 and not burst:
                ids = [1] + [rng.randrange(3, 500) for _ in range(rng.randint(1, 30))]
                body["prompt"] = ids
                n_prompt, prompts = len(ids), 1
            else:
                text = rng.choice(self.short)
                body["prompt"] = text
                n_prompt, prompts = self.prompt_tokens[text], 1
        # A burst's requests hold their seats for a while (16-32 tokens each): short ones could
        # be served as fast as a fast machine sends them, and never fill the waiting queue.
        max_tokens, ignore_eos = (rng.randint(16, 32), True) if burst else self._max_tokens(rng, n_prompt, long)
        body["max_tokens"] = max_tokens
        if ignore_eos:
            body["ignore_eos"] = True
        if n > 1:
            body["n"] = n
        if rng.random() < 0.4:
            body["temperature"] = 0
        else:
            body["temperature"] = round(rng.uniform(0.5, 1.0), 2)
            body["seed"] = rng.randrange(1 << 30)
        stops, include = [], False
        if not burst and rng.random() < 0.3:
            stops = rng.sample(STOP_CHOICES, rng.randint(1, 2))
            body["stop"] = stops if len(stops) > 1 or rng.random() < 0.5 else stops[0]
            include = rng.random() < 0.3
            if include:
                body["include_stop_str_in_output"] = True
        if not burst and rng.random() < 0.1:
            if chat:
                body.update(logprobs=True, top_logprobs=2)
            else:
                body["logprobs"] = 2
        if stream:
            body["stream"] = True
            if rng.random() < 0.5:
                body["stream_options"] = {"include_usage": True}
        spec = Spec(index, path, body, stream, prompts * n, max_tokens, stops, include, burst=burst)
        if cfg.everything:
            self._everything(spec, n_prompt, random.Random(f"{cfg.seed}-{index}-everything"))
        if not burst and rng.random() < cfg.disconnect_rate:
            mode = rng.choice(["early", "mid", "wait"] if stream else ["early", "wait"])
            spec.disconnect = mode
            if mode == "early":
                spec.disconnect_after = rng.uniform(0.0, 0.05)
            elif mode == "mid":
                spec.disconnect_after = rng.randint(1, 4)
            else:
                spec.disconnect_after = rng.uniform(0.02, 0.5)
        return spec

    def _everything(self, spec: Spec, n_prompt: int, rng: random.Random) -> None:
        """Priorities, shared-prefix prompts and constraints on top of the regular mix (their
        own random stream, so the rest of the mix is the same as without them)."""
        body = spec.body
        body["priority"] = rng.choice(PRIORITIES)
        if spec.burst:
            return
        if self.shared and isinstance(body.get("prompt"), str) and rng.random() < SHARED_PREFIX_RATE:
            text = rng.choice(self.shared)
            body["prompt"] = text
            n_prompt = self.prompt_tokens[text]
            spec.max_tokens = body["max_tokens"] = min(spec.max_tokens, self._room(n_prompt))
        if self.constrained and rng.random() < CONSTRAINED_RATE:
            spec.constraint, fields = structured.pick(rng)
            body.update(fields)
            # Room to finish the grammar; no stop strings or ignore_eos, which would cut it.
            spec.max_tokens = body["max_tokens"] = min(64, self._room(n_prompt))
            for key in ("stop", "include_stop_str_in_output", "ignore_eos"):
                body.pop(key, None)
            spec.stops, spec.include_stop = [], False

    def _invalid(self, index: int, rng: random.Random) -> Spec:
        bodies = [
            ("/v1/completions", {"prompt": ""}),
            ("/v1/completions", {"prompt": "Once", "max_tokens": -1}),
            ("/v1/completions", {"prompt": "Once", "temperature": -1}),
            ("/v1/completions", {"prompt": "Once", "n": 10_000}),
            ("/v1/completions", {"prompt": "Once", "max_tokens": 10 * self.max_model_len}),
            ("/v1/completions", {"prompt": "Once", "model": "no-such-model"}),
            ("/v1/completions", {"prompt": [1, 10**9]}),
            ("/v1/chat/completions", {"messages": []}),
            ("/v1/chat/completions", {"messages": [{"content": "no role"}]}),
        ]
        path, body = rng.choice(bodies)
        return Spec(index, path, body, False, 1, 0, [], False, invalid=True)
