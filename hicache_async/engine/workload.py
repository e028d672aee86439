"""A seeded multi-turn chat workload: conversations share system prompts and grow histories.

Turn t+1 of a conversation arrives when turn t finishes, so its prompt holds the previous
outputs: reuse across turns is the point, and wrong cached KV shows up as wrong tokens.
With `tenants` > 1, conversation c belongs to tenant c % tenants (its `cache_salt`), so
conversations of different tenants share system prompts the cache must not share.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from ..errors import UsageError
from ..request import Request


@dataclass(frozen=True)
class WorkloadSpec:
    requests: int = 48
    turns: int = 4
    system_prompts: int = 3
    system_len: int = 96
    user_len: tuple[int, int] = (16, 48)
    max_new: int = 8
    concurrency: int = 4
    vocab: int = 256
    seed: int = 0
    tenants: int = 1

    def __post_init__(self) -> None:
        for name in ("requests", "turns", "system_prompts", "max_new", "concurrency", "tenants"):
            if getattr(self, name) <= 0:
                raise UsageError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")

    @property
    def conversations(self) -> int:
        return -(-self.requests // self.turns)

    def max_prompt(self) -> int:
        return self.system_len + self.turns * (self.user_len[1] + self.max_new)

    def salt(self, conversation: int) -> str | None:
        """The conversation's tenant; one tenant needs no salt."""
        return f"tenant-{conversation % self.tenants}" if self.tenants > 1 else None


class Workload:
    """Hands out requests in an order that depends only on completions, never on time."""

    def __init__(self, spec: WorkloadSpec) -> None:
        self.spec = spec
        rng = random.Random(spec.seed)
        systems = [[rng.randrange(spec.vocab) for _ in range(spec.system_len)]
                   for _ in range(spec.system_prompts)]
        self._history = [list(systems[c % spec.system_prompts]) for c in range(spec.conversations)]
        self._users = [[[rng.randrange(spec.vocab) for _ in range(rng.randint(*spec.user_len))]
                        for _ in range(spec.turns)] for _ in range(spec.conversations)]
        self._turns_left = [min(spec.turns, spec.requests - c * spec.turns)
                            for c in range(spec.conversations)]
        self._next_conv = 0
        self._ready: list[tuple[int, int]] = []
        self.outputs: dict[tuple[int, int], list[int]] = {}
        self._issued = 0
        for _ in range(min(spec.concurrency, spec.conversations)):
            self._start_next()

    def _start_next(self) -> None:
        if self._next_conv < self.spec.conversations:
            self._ready.append((self._next_conv, 0))
            self._next_conv += 1

    def arrivals(self) -> list[Request]:
        out = []
        for conv, turn in self._ready:
            self._history[conv] += self._users[conv][turn]
            out.append(Request(self._issued, list(self._history[conv]), self.spec.max_new, tag=(conv, turn),
                               cache_salt=self.spec.salt(conv)))
            self._issued += 1
        self._ready = []
        return out

    def complete(self, req: Request) -> None:
        conv, turn = req.tag
        self.outputs[req.tag] = list(req.output)
        self._history[conv] += req.output
        if turn + 1 < self._turns_left[conv]:
            self._ready.append((conv, turn + 1))
        else:
            self._start_next()

    def results(self) -> dict[str, list[int]]:
        """Generated tokens per "conversation:turn", in a stable order, for comparing runs."""
        return {f"{c}:{t}": out for (c, t), out in sorted(self.outputs.items())}

    @property
    def done(self) -> bool:
        return len(self.outputs) == self.spec.requests
