"""A request whose keys cannot be built (its adapter's files vanish while being digested) gets
no hit and no save, and the scheduler goes on serving the others: the scheduler side under
test, with a stand-in for vLLM's Request."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import SimpleNamespace

from hicache_vllm import request_keys
from hicache_vllm.scheduler import SchedulerSide
from hicache_vllm.settings import Settings

PAGE = 4


@dataclass
class Req:
    request_id: str
    all_token_ids: list[int]
    lora_request: object = None
    cache_salt: str | None = None
    num_computed_tokens: int = 0
    prompt_embeds: object = None
    mm_features: list = field(default_factory=list)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.all_token_ids)


def answer(side: SchedulerSide, req: Req) -> tuple[int | None, bool]:
    """vLLM asks each step until the answer is not None (the adapter's digest runs meanwhile)."""
    deadline = time.monotonic() + 10
    while (got := side.matched(req, 0))[0] is None and time.monotonic() < deadline:
        side.build({}, lambda rid: [])
        time.sleep(0.01)
    return got


def test_an_adapter_that_vanishes_while_digested_gives_no_hit_and_no_save(tmp_path, monkeypatch):
    def vanished(path, names):
        raise FileNotFoundError(f"{path}/adapter_model.safetensors")

    monkeypatch.setattr(request_keys, "adapter_fingerprint", vanished)
    (tmp_path / "adapter_config.json").write_text("{}")
    side = SchedulerSide(Settings(storage="none", host_pages=8), PAGE, 1)
    lora = SimpleNamespace(lora_name="x", lora_int_id=1, lora_path=str(tmp_path), load_inplace=False)
    adapted, plain = Req("adapted", list(range(9)), lora_request=lora), Req("plain", list(range(9)))
    assert answer(side, adapted) == (0, False)
    assert answer(side, plain) == (0, False)
    for req in (adapted, plain):
        side.allocated(req, 0)
    plan = side.build({"adapted": 9, "plain": 9}, lambda rid: [10, 11, 12] if rid == "adapted" else [20, 21, 22])
    assert [(m.req_id, m.blocks) for m in plan.saves] == [("plain", [20, 21])]
