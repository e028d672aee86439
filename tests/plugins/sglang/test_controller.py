"""SGLang's HiCacheController backs pages up through our backend and prefetches them into its
host pool, bytes exact, for each host layout, MHA and MLA; a new process reads them too."""
import json
import subprocess
import sys

import pytest
import torch

from tests.plugins.sglang import harness as h

CASES = [("mha", layout) for layout in h.MHA_LAYOUTS] + [("mla", layout) for layout in h.MLA_LAYOUTS]


def fill(pool, pages: int, seed: int):
    """Random bytes in the pool, and the first `pages` pages as SGLang itself reads them out."""
    slots = pool.alloc(pages * h.PAGE)
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=torch.Generator().manual_seed(seed)))
    return slots, [pool.get_data_page(int(slots[i * h.PAGE])).clone() for i in range(pages)]


def pages_at(pool, slots, pages: int):
    return [pool.get_data_page(int(slots[i * h.PAGE])) for i in range(pages)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("attention,layout", CASES)
def test_backup_then_prefetch_is_bytes_exact(attention, layout, dynamic):
    pool = h.host_pool(attention, layout)
    tokens = list(range(500, 500 + 6 * h.PAGE + 2))     # 6 full pages and a partial one
    with h.controller(pool, "dynamic", dynamic) as ctl:
        assert ctl.page_get_func == ctl._page_get_zero_copy
        slots, ref = fill(pool, 6, seed=1)
        assert h.back_up(ctl, tokens, slots) == 6 * h.PAGE
        pool.free(slots)
        pool.kv_buffer.zero_()
        done, new = h.prefetch(ctl, pool, tokens)
        assert done == 6 * h.PAGE
        assert not torch.equal(new[:h.PAGE], slots[:h.PAGE])   # other slots than the ones written from
        for got, want in zip(pages_at(pool, new, 6), ref):
            assert torch.equal(got, want)
        miss, _ = h.prefetch(ctl, pool, list(range(9000, 9000 + 4 * h.PAGE)))
        assert miss == 0


READER = """
import json, sys, torch
from tests.plugins.sglang import cpu_stubs
cpu_stubs.install()
from tests.plugins.sglang import harness as h
pool = h.host_pool("mha", "page_head")
with h.published(model_path=sys.argv[3]), h.controller(pool, "dynamic", json.loads(sys.argv[1])) as ctl:
    done, slots = h.prefetch(ctl, pool, json.loads(sys.argv[2]))
    pages = [pool.get_data_page(int(slots[i * h.PAGE])).float().sum().item() for i in range(done // h.PAGE)]
print(json.dumps({"done": done, "sums": pages}))
"""


@pytest.mark.timeout(120)
def test_a_new_process_reads_what_another_wrote(dynamic, checkpoint):
    pool = h.host_pool("mha", "page_head")
    tokens = list(range(40, 40 + 5 * h.PAGE))
    with h.controller(pool, "dynamic", dynamic) as ctl:
        slots, ref = fill(pool, 5, seed=7)
        assert h.back_up(ctl, tokens, slots) == 5 * h.PAGE
    out = subprocess.run([sys.executable, "-c", READER, json.dumps(dynamic), json.dumps(tokens), str(checkpoint)],
                         capture_output=True, text=True, timeout=110, cwd=str(__import__("pathlib").Path.cwd()))
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["done"] == 5 * h.PAGE
    assert got["sums"] == pytest.approx([page.float().sum().item() for page in ref], abs=0)
