"""The command line and the benchmark suite: the application, so the owner of what is the
process's to choose, chosen here, before anything loads torch.

torch's intra-op threads (libgomp's OpenMP workers) spin for about 10 ms after every
parallel op by default. On a machine of few cores the spinning worker takes a core from the
copier's and the storage calls' threads: the CPU copier measured 0.43x `tensor.copy_` right
after one, 0.68x with the workers asleep. So they go to sleep as soon as their work ends
(`OMP_WAIT_POLICY=PASSIVE`), unless the user chose a policy.

libgomp reads the policy once, as it loads. Preloaded (LD_PRELOAD, as vLLM's CPU set-up has
it, for its children too), it loaded before this module could set one: the command then runs
itself afresh with the policy in its environment (`sleeping_workers`).
"""
import os
import sys

CHOSEN = "OMP_WAIT_POLICY" in os.environ
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _gomp_loaded() -> bool:
    try:
        with open("/proc/self/maps") as maps:
            return "libgomp" in maps.read()
    except OSError:
        return False


TOO_LATE = not CHOSEN and _gomp_loaded()


def sleeping_workers() -> None:
    """For a program, not a library: replace this process with itself, the policy now set,
    if libgomp loaded before it was."""
    if TOO_LATE:
        os.execv(sys.executable, sys.orig_argv)
