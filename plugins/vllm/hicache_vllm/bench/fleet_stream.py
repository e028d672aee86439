"""The fleet bench's load: multi-turn sessions over a few shared system prompts, seeded, and a
client that plays it against a fleet with a few requests in flight.

Each turn's prompt is the session so far (its system prompt, then every earlier turn's user
and reply tokens) plus a new user message; replies are seeded tokens, not the model's, so the
stream is the same in every arm whatever a server answers. Requests go out in one fixed order
(turn by turn, sessions shuffled), each once fewer than `in_flight` are out and its session's
previous turn is answered: arms differ in where a request goes, not in what is asked when.
"""
from __future__ import annotations

import json
import random
import threading
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from hicache_async.errors import HiCacheError


@dataclass(frozen=True)
class Shape:
    systems: int = 3
    system_tokens: int = 768
    sessions: int = 9           # odd: round-robin then moves a session between servers each turn
    turns: int = 7
    user_tokens: int = 96
    reply_tokens: int = 32
    in_flight: int = 3
    max_tokens: int = 4
    vocab: int = 2048


@dataclass(frozen=True)
class Turn:
    session: int
    turn: int
    prompt: list[int]


def stream(shape: Shape, seed: int = 0) -> list[Turn]:
    rng = random.Random(seed)

    def words(n: int) -> list[int]:
        return [rng.randrange(3, shape.vocab) for _ in range(n)]

    systems = [words(shape.system_tokens) for _ in range(shape.systems)]
    history = [list(systems[s % shape.systems]) for s in range(shape.sessions)]
    out = []
    for t in range(shape.turns):
        order = list(range(shape.sessions))
        rng.shuffle(order)
        for s in order:
            prompt = history[s] + words(shape.user_tokens)
            out.append(Turn(s, t, prompt))
            history[s] = prompt + words(shape.reply_tokens)
    return out


class ClientFailed(HiCacheError):
    """A request the fleet did not answer."""


@dataclass
class Answer:
    server: int
    ttft_s: float
    text: str


def complete(url: str, model: str, prompt: list[int], max_tokens: int, timeout_s: float = 300) -> tuple[float, str]:
    """A streamed greedy completion: seconds to its first token, and its text."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    req = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    started, first, text = time.perf_counter(), None, []
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        for line in r:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            piece = chunk["choices"][0].get("text", "") if chunk.get("choices") else ""
            if piece and first is None:
                first = time.perf_counter() - started
            text.append(piece)
    return (time.perf_counter() - started if first is None else first), "".join(text)


def play(turns: list[Turn], urls: list[str], model: str, pick: Callable[[list[int]], int], shape: Shape,
         on_answer: Callable[[int, Answer], None] | None = None) -> tuple[list[Answer], float]:
    """Every turn's answer, in stream order, and the seconds the whole stream took. `pick`
    names the server of a prompt; it is called in stream order, so a count it keeps is
    reproducible."""
    answers: list[Answer | None] = [None] * len(turns)
    done = {(t.session, t.turn): threading.Event() for t in turns}
    slots, errors = threading.Semaphore(shape.in_flight), []

    def run(i: int, server: int) -> None:
        try:
            ttft, text = complete(urls[server], model, turns[i].prompt, shape.max_tokens)
            answers[i] = Answer(server, ttft, text)
            if on_answer:
                on_answer(i, answers[i])
        except Exception as exc:      # noqa: BLE001 - reported below, naming the request
            errors.append(f"request {i} (session {turns[i].session} turn {turns[i].turn}) on {urls[server]}: {exc}")
        finally:
            done[(turns[i].session, turns[i].turn)].set()
            slots.release()

    started = time.perf_counter()
    with ThreadPoolExecutor(shape.in_flight) as pool:
        for i, t in enumerate(turns):
            if t.turn:
                done[(t.session, t.turn - 1)].wait()
            slots.acquire()
            if errors:
                slots.release()
                break
            pool.submit(run, i, pick(t.prompt))
    if errors:
        raise ClientFailed(errors[0])
    return answers, time.perf_counter() - started
