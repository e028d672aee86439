"""`hicache-async route`: an OpenAI-compatible front for vLLM servers that share one L3, sending
each prompt where its KV lives, by what Dynamo's standalone indexer (`python -m dynamo.indexer`)
has heard from the servers' KV events.

The overlap is the indexer's: `POST /query` answers, per instance, how many leading tokens of a
prompt it holds in GPU, in GPU or CPU, and in any tier (the STORAGE medium our connector
announces). The score is Dynamo's KV router's shape, thin: overlap credit in blocks (device 1.0,
host 0.75, own L3 0.25, shared pool 0.5; each tier credited only beyond the better ones; a
server's own L3 entries count 0.5 when its L3 is the shared pool) minus the work the server has
in flight: for each request sent to it and not yet answered, the blocks it was expected to
compute there, plus `load_blocks`. A count of every request ever sent would
balance the split but move a session off its server whenever the count drifts by a few, paying
its prefix again; work in flight moves it only when its server is busier than the prefix is worth.

The shared pool: every server's event stream is registered twice, under the server's own
instance and under instance `POOL` (one per server as its `dp_rank`; the indexer files a
stream's events under the rank the events carry, 0 for each server, so the pool is one tree,
the union of the servers' announcements, a chain a server continues from another's pages
included). The pool's `disk` answer is what any server announced in any tier; under write-through
every device page reaches L3, so that is what L3 holds, less backups still in flight. It is
credited to every server the router can reach. A dead server's instance is unregistered (its
device and host entries go); the pool keeps its L3 entries, since L3 outlives it, and hears it
again when it is back. L3 removals reach the pool only as a server sees them: our connector
withdraws a page (`BlockRemoved`, STORAGE) when a read finds it missing or damaged; Mooncake
evicts silently, so an evicted page stays credited until some server's read misses it.
"""
from __future__ import annotations

import argparse
import http.client
import json
import math
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from hicache_async.app.extensions import Command
from hicache_async.errors import HiCacheError, UsageError

POOL = 0                 # the pseudo-instance of the shared L3; servers are 1..N
CREDIT = {"device": 1.0, "host": 0.75, "disk": 0.25, "shared": 0.5}
LOAD_BLOCKS = 4.0        # blocks of overlap one request in flight costs, beyond what it computes
TIMEOUT_S = 600


class RouteFailed(HiCacheError):
    """No server could take a request, or the indexer did not answer."""


@dataclass
class Member:
    url: str                  # the vLLM server, http://HOST:PORT
    events: str               # its ZMQ KV-event endpoint, tcp://HOST:PORT
    replay: str | None = None   # its replay endpoint: events a late subscriber missed
    up: bool = True


def post(url: str, body: dict, timeout: float = 10) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.load(r)


@dataclass(frozen=True)
class Ticket:
    """A request sent to `server`, expected to compute `blocks` there; handed back when answered."""
    server: int
    blocks: float


class Router:
    """Scores the fleet's members for a prompt; `sent` counts what each was given, `queued` the
    blocks each has in flight."""

    def __init__(self, members: list[Member], indexer: str, model: str, block_size: int,
                 shared_pool: bool = True, load_blocks: float = LOAD_BLOCKS) -> None:
        self.members, self.indexer, self.model, self.block = members, indexer.rstrip("/"), model, block_size
        self.shared_pool, self.load_blocks = shared_pool, load_blocks
        self.sent = [0] * len(members)
        self.queued = [0.0] * len(members)
        self.lock = threading.Lock()

    def register(self) -> None:
        for i in range(len(self.members)):
            self._register(i)
            if self.shared_pool:
                self._register(i, POOL)

    def _register(self, i: int, instance: int | None = None) -> None:
        m = self.members[i]
        body = {"instance_id": i + 1 if instance is None else instance, "endpoint": m.events,
                "model_name": self.model, "block_size": self.block}
        if instance is not None:
            body["dp_rank"] = i + 1
        if m.replay:
            body["replay_endpoint"] = m.replay
        post(f"{self.indexer}/register", body)

    def down(self, i: int) -> None:
        """Member `i` stopped answering: its own entries leave the index (the pool's stay)."""
        with self.lock:
            if not self.members[i].up:
                return
            self.members[i].up = False
        post(f"{self.indexer}/unregister", {"instance_id": i + 1, "model_name": self.model})

    def back(self, i: int) -> None:
        """Member `i` serves again, with an empty cache: indexed afresh from its new events."""
        with self.lock:
            if self.members[i].up:
                return
            self._register(i)
            self.members[i].up = True

    def overlap(self, tokens: list[int]) -> dict[int, dict]:
        """Per instance, tokens held by tier (`gpu`; `cpu`: GPU or CPU; `disk`: any tier)."""
        try:
            found = post(f"{self.indexer}/query", {"token_ids": tokens, "model_name": self.model})["instances"]
        except (OSError, ValueError, KeyError) as exc:
            raise RouteFailed(f"indexer {self.indexer} did not answer a query: {exc}") from None
        return {int(k): v for k, v in found.items()}

    def credits(self, tokens: list[int]) -> list[float | None]:
        """Each member's overlap credit in blocks; None for one that is down."""
        found = self.overlap(tokens)
        pool = found.get(POOL, {}).get("disk", 0) if self.shared_pool else 0
        own_l3 = CREDIT["shared"] if self.shared_pool else CREDIT["disk"]     # the pool is its L3 too
        out: list[float | None] = []
        for i, m in enumerate(self.members):
            if not m.up:
                out.append(None)
                continue
            t = found.get(i + 1, {})
            gpu, cpu, disk = t.get("gpu", 0), t.get("cpu", 0), t.get("disk", 0)
            credit = (CREDIT["device"] * gpu + CREDIT["host"] * max(0, cpu - gpu)
                      + own_l3 * max(0, disk - max(gpu, cpu)) + CREDIT["shared"] * max(0, pool - disk))
            out.append(credit / self.block)
        return out

    def route(self, tokens: list[int], exclude: frozenset[int] = frozenset()) -> Ticket:
        """The member that is up with the most credit less its work in flight (ties: fewest sent,
        then first), this request's work counted in flight there until `done`."""
        credits = self.credits(tokens)
        with self.lock:
            live = [i for i, c in enumerate(credits) if c is not None and i not in exclude]
            if not live:
                raise RouteFailed("no server of the fleet is up")
            best = max(live, key=lambda i: (credits[i] - self.queued[i], -self.sent[i], -i))
            ticket = Ticket(best, max(0.0, math.ceil(len(tokens) / self.block) - credits[best]) + self.load_blocks)
            self.sent[best] += 1
            self.queued[best] += ticket.blocks
            return ticket

    def done(self, ticket: Ticket) -> None:
        """The ticket's request was answered (or failed): its work leaves its server's queue."""
        with self.lock:
            self.queued[ticket.server] = max(0.0, self.queued[ticket.server] - ticket.blocks)


def healthy(url: str) -> bool:
    try:
        return urllib.request.urlopen(f"{url}/health", timeout=2).status == 200
    except OSError:
        return False


class _Front(BaseHTTPRequestHandler):
    router: Router
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        if self.path == "/health":
            return self._reply(200 if any(m.up for m in self.router.members) else 503, b"")
        if self.path == "/stats":
            return self._reply(200, json.dumps({"sent": self.router.sent, "queued": self.router.queued,
                                                "up": [m.up for m in self.router.members]}).encode())
        m = next((m for m in self.router.members if m.up), None)
        self._forward(m.url if m else None, None)

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.path not in ("/v1/completions", "/v1/chat/completions"):
            return self._reply(404, b'{"error": "the router serves /v1/completions and /v1/chat/completions"}')
        request = json.loads(body or b"{}")
        tried: set[int] = set()
        while True:
            try:
                ticket = self.router.route(self._tokens(request), frozenset(tried))
            except RouteFailed as exc:
                return self._reply(503, json.dumps({"error": str(exc)}).encode())
            try:
                if self._forward(self.router.members[ticket.server].url, body):
                    return
            finally:
                self.router.done(ticket)
            tried.add(ticket.server)
            self.router.down(ticket.server)

    def _tokens(self, request: dict) -> list[int]:
        """The prompt's token ids: given, or the first live server's tokenization of its text."""
        prompt = request.get("prompt")
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return prompt
        m = next(m for m in self.router.members if m.up)
        ask = {"model": request.get("model"), **({"messages": request["messages"]} if "messages" in request
                                                 else {"prompt": prompt})}
        try:
            return post(f"{m.url}/tokenize", ask)["tokens"]
        except OSError:
            return []       # no overlap to find: load alone decides

    def _forward(self, url: str | None, body: bytes | None) -> bool:
        """Relay to `url`; False when it cannot be reached (the caller tries another)."""
        if url is None:
            self._reply(503, b'{"error": "no server of the fleet is up"}')
            return True
        req = urllib.request.Request(url + self.path, body, {"Content-Type": "application/json"},
                                     method="POST" if body is not None else "GET")
        try:
            with urllib.request.urlopen(req, timeout=TIMEOUT_S) as r:
                self._reply(r.status, r.read(), r.headers.get("Content-Type"), url)
        except urllib.error.HTTPError as exc:
            self._reply(exc.code, exc.read(), exc.headers.get("Content-Type"), url)
        except (OSError, http.client.HTTPException):
            return False
        return True

    def _reply(self, code: int, data: bytes, kind: str | None = "application/json", server: str = "") -> None:
        self.send_response(code)
        self.send_header("Content-Type", kind or "application/json")
        self.send_header("Content-Length", str(len(data)))
        if server:
            self.send_header("x-hicache-server", server)
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


def _watch(router: Router, stop: threading.Event, every_s: float = 2.0) -> None:
    """A member found dead leaves the index; one back from a restart is indexed afresh."""
    while not stop.wait(every_s):
        for i, m in enumerate(router.members):
            alive = healthy(m.url)
            if m.up and not alive:
                router.down(i)
            elif not m.up and alive:
                router.back(i)


def _member(text: str) -> Member:
    url, sep, events = text.partition("=")
    endpoints = events.split(",")
    if not sep or not url.startswith("http") or not endpoints[0].startswith("tcp://") or len(endpoints) > 2:
        raise argparse.ArgumentTypeError(f"expected URL=tcp://HOST:PORT[,tcp://HOST:REPLAY_PORT], got {text!r}")
    return Member(url.rstrip("/"), endpoints[0], endpoints[1] if len(endpoints) == 2 else None)


def add_route_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--server", type=_member, action="append", required=True, metavar="URL=EVENTS[,REPLAY]",
                   help="a vLLM server and its --kv-events-config endpoints (repeat per server)")
    p.add_argument("--indexer", required=True, metavar="URL", help="a running `python -m dynamo.indexer`")
    p.add_argument("--model", required=True, help="the served model's name, as the indexer files it")
    p.add_argument("--block-size", type=int, required=True, help="the servers' --block-size")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--load-blocks", type=float, default=LOAD_BLOCKS,
                   help=f"overlap blocks one request in flight costs beyond its prefill (default {LOAD_BLOCKS})")
    p.add_argument("--no-shared-pool", action="store_true", help="the servers share no L3")


def serve(ns: argparse.Namespace) -> int:
    if ns.block_size <= 0 or ns.load_blocks < 0:
        raise UsageError(f"--block-size must be positive and --load-blocks >= 0, got {ns.block_size}, "
                         f"{ns.load_blocks}")
    router = Router(ns.server, ns.indexer, ns.model, ns.block_size, not ns.no_shared_pool, ns.load_blocks)
    try:
        router.register()
    except OSError as exc:
        raise RouteFailed(f"indexer {ns.indexer} refused registration: {exc}") from None
    handler = type("Front", (_Front,), {"router": router})
    httpd, stop = ThreadingHTTPServer((ns.host, ns.port), handler), threading.Event()
    threading.Thread(target=_watch, args=(router, stop), daemon=True).start()
    print(f"hicache-async route: serving on http://{ns.host}:{httpd.server_address[1]} "
          f"for {len(router.members)} servers", flush=True)
    try:
        httpd.serve_forever()
    finally:
        stop.set()
        httpd.server_close()
    return 0


COMMAND = Command(help="route requests to vLLM servers by what their tiers hold", add_flags=add_route_flags,
                  run=serve)     # `hicache-async route`, by the `hicache_async.commands` entry point
