"""A mooncake_master started for a run dies with the process that started it, even on SIGKILL."""
import os
import signal
import subprocess
import sys
import time

STARTER = """
import sys, time
from hicache_mooncake import MooncakeMaster
master = MooncakeMaster(holder_bytes=64 << 20).__enter__()
print(master._proc.pid, master._holder.pid, flush=True)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:        # a zombie is dead, only not yet reaped
        return f.read().split(")")[-1].split()[0] != "Z"


def test_master_and_holder_die_with_a_killed_owner():
    owner = subprocess.Popen([sys.executable, "-c", STARTER], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in owner.stdout.readline().split()]
        assert len(pids) == 2 and all(_alive(p) for p in pids)
    finally:
        owner.send_signal(signal.SIGKILL)      # no chance to clean up
        owner.wait(timeout=10)
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in pids if _alive(p)]
