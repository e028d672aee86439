"""`bench --only gpu-copies` on a machine without CUDA: one line, no figures, exit 0, and no vLLM
imported on the way (on a GPU the figures themselves run, in `bench`)."""
import json
import subprocess
import sys

import pytest
import torch

RUN = """
import sys
from hicache_async.app.cli import main
rc = main(["bench", "--only", "gpu-copies", "--json", sys.argv[1]])
print("vllm imported" if "vllm" in sys.modules else "no vllm")
sys.exit(rc)
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the bench measures")
def test_without_cuda_it_says_so_in_one_line_and_exits_0(tmp_path):
    out = tmp_path / "figures.json"
    proc = subprocess.run([sys.executable, "-c", RUN, str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["gpu-copies: no CUDA device here; nothing measured", "no vllm"]
    assert json.loads(out.read_text()) == []
