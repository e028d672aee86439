"""The per-step agreement across real gloo processes: MIN semantics, bounded sends, divergence."""
import pytest

from hicache_async.errors import DivergenceError
from hicache_async.ranks.launcher import launch
from hicache_async.pp_sync import MAX_IN_FLIGHT_SENDS
from tests.agreement_targets import stage_zero_min


def test_ten_thousand_steps_keep_the_send_list_bounded():
    results = launch(tp=1, pp=2, cp=1, target="tests.agreement_targets:many_steps",
                     payload={"steps": 10_000}, timeout_s=30)
    for r in results:
        assert r["most_pending_sends"] <= MAX_IN_FLIGHT_SENDS
    assert results[0]["final_pending_sends"] <= MAX_IN_FLIGHT_SENDS
    assert results[1]["most_pending_sends"] == 0      # the last stage sends nothing


@pytest.mark.parametrize("tp,pp,cp", [(2, 2, 1), (1, 2, 2)])
def test_every_rank_retires_stage_zero_min(tp, pp, cp):
    results = launch(tp=tp, pp=pp, cp=cp, target="tests.agreement_targets:counts", payload={}, timeout_s=30)
    for step in range(50):
        want = stage_zero_min(tp, cp, step)
        assert all(r["seen"][step] == want for r in results), step


def test_divergence_between_two_first_stage_ranks_names_both():
    with pytest.raises(DivergenceError, match=r"step 5: first-stage ranks disagree \(rank 0 0x6, rank 1 0x3ee\)"):
        launch(tp=2, pp=1, cp=1, target="tests.agreement_targets:diverge",
               payload={"steps": 20, "odd_rank": 1, "at": 5}, timeout_s=20)


def test_divergence_on_a_later_stage_names_it():
    with pytest.raises(DivergenceError, match=r"step 3: rank 1 \(tp0 pp1 cp0\)"):
        launch(tp=1, pp=2, cp=1, target="tests.agreement_targets:diverge",
               payload={"steps": 20, "odd_rank": 1, "at": 3}, timeout_s=20)
