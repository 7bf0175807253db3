"""Deterministic workloads. A workload is a list of sessions; a session is a list of requests sent
one after the other (turn t+1 only after turn t finished). The random dataset has one request per
session.

- random: random token ids, input and output lengths uniform in ranges (the field's offline
  workload).
- prefix: many single requests sharing one long system prompt, plus multi-turn chats in which every
  turn's prompt is the previous turn's prompt + an assistant answer + a new user message.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class LengthRange:
    low: int
    high: int  # inclusive

    @classmethod
    def parse(cls, text: str, ratio: float = 0.0) -> LengthRange:
        """'N' (widened to N*(1-ratio)..N*(1+ratio)) or 'LO:HI'."""
        if ":" in text:
            lo, hi = (int(x) for x in text.split(":", 1))
        else:
            n = int(text)
            lo, hi = max(1, round(n * (1 - ratio))), round(n * (1 + ratio))
        if not 1 <= lo <= hi:
            raise ValueError(f"length range {text!r}: need 1 <= low <= high")
        return cls(lo, hi)

    def sample(self, rng: random.Random) -> int:
        return rng.randint(self.low, self.high)

    def __str__(self) -> str:
        return str(self.low) if self.low == self.high else f"{self.low}:{self.high}"


@dataclass(frozen=True)
class BenchRequest:
    prompt_ids: list[int]
    output_len: int


Session = list[BenchRequest]

FIRST_ID = 3  # skip <unk>, <s>, </s>


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(FIRST_ID, vocab) for _ in range(n)]


def random_dataset(num_prompts: int, input_len: LengthRange, output_len: LengthRange, vocab: int,
                   seed: int = 0) -> list[Session]:
    rng = random.Random(seed)
    sessions = []
    for _ in range(num_prompts):
        n_in, n_out = input_len.sample(rng), output_len.sample(rng)
        sessions.append([BenchRequest(_ids(rng, n_in, vocab), n_out)])
    return sessions


@dataclass(frozen=True)
class PrefixShape:
    system_len: int = 1024  # shared system prompt
    num_shared: int = 32  # single requests: system prompt + a question
    question_len: int = 32
    num_chats: int = 8
    turns: int = 4
    # new user message per turn (the first turn also starts with the system prompt)
    user_len: int = 64
    answer_len: int = 32  # assistant answer inserted into the history between turns
    output_len: LengthRange = LengthRange(32, 32)  # tokens generated per request


def prefix_dataset(shape: PrefixShape, vocab: int, seed: int = 0) -> list[Session]:
    rng = random.Random(seed)
    system = _ids(rng, shape.system_len, vocab)
    sessions: list[Session] = [
        [BenchRequest(system + _ids(rng, shape.question_len, vocab), shape.output_len.sample(rng))]
        for _ in range(shape.num_shared)
    ]
    for _ in range(shape.num_chats):
        history = list(system)
        chat: Session = []
        for turn in range(shape.turns):
            if turn:
                history += _ids(rng, shape.answer_len, vocab)
            history += _ids(rng, shape.user_len, vocab)
            chat.append(BenchRequest(list(history), shape.output_len.sample(rng)))
        sessions.append(chat)
    return sessions


def rounds(sessions: list[Session]) -> list[list[BenchRequest]]:
    """Turn t of every session that has one: the batches an offline run submits one after the
    other."""
    depth = max((len(s) for s in sessions), default=0)
    return [[s[t] for s in sessions if t < len(s)] for t in range(depth)]


def all_requests(sessions: list[Session]) -> list[BenchRequest]:
    return [r for s in sessions for r in s]
