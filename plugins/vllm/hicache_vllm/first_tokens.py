"""Time to first token by tier: each request's first token, timed from its arrival and filed
under the tier that served most of its prompt, so the stats say what each tier's hits are
worth where a user waits (`ttft_<tier>_seconds`)."""
from __future__ import annotations

import time

from .request_pages import RequestPages

TIERS = ("device", "host", "l3", "none")    # where most of a prompt came from (none: computed)


class FirstTokens:
    def __init__(self) -> None:
        self.awaiting: dict[str, RequestPages] = {}     # no first token yet: timed by the tier that served it
        self.ttft: dict[str, list[float]] = {tier: [] for tier in TIERS}    # seconds, since the last take

    def asked(self, request, st: RequestPages) -> None:
        """vLLM asked for the request's hit: its first token is awaited, unless it has output
        already (asked again after a preemption: timed then)."""
        if not getattr(request, "num_output_tokens", 0):
            self.awaiting[request.request_id] = st

    def first_tokens(self) -> None:
        """After vLLM took a step's output: each awaited request's first token."""
        for req_id in list(self.awaiting):
            self.first_token(req_id)

    def first_token(self, req_id: str) -> None:
        """The request's first token, if it has one, timed and no longer awaited."""
        st = self.awaiting.get(req_id)
        request = st.request if st is not None else None
        if request is None or getattr(request, "num_output_tokens", 0) <= 0:
            return
        del self.awaiting[req_id]
        arrived = getattr(request, "arrival_time", None)
        if arrived is not None:
            l3, host = st.from_l3, st.from_host - st.from_l3
            tokens = (st.device, host, l3, request.num_prompt_tokens - st.device - host - l3)
            self.ttft[TIERS[tokens.index(max(tokens))]].append(time.time() - arrived)

    def finished(self, req_id: str) -> None:
        """vLLM frees a request its first token stopped before the step's output comes: timed
        now, and awaited no longer either way."""
        self.first_token(req_id)
        self.awaiting.pop(req_id, None)

    def take(self) -> dict[str, list[float]]:
        """First-token seconds by tier since the last take, for the stats (samples)."""
        out = {f"ttft_{tier}_seconds": samples for tier, samples in self.ttft.items() if samples}
        self.ttft = {tier: [] for tier in TIERS}
        return out
