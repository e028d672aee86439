"""The command line and the benchmark suite: the application, so the owner of what is the
process's to choose, chosen here, before anything loads torch.

torch's intra-op threads (libgomp's OpenMP workers) spin for about 10 ms after every
parallel op by default. On a machine of few cores the spinning worker takes a core from the
copier's and the storage calls' threads: the CPU copier measured 0.43x `tensor.copy_` right
after one, 0.68x with the workers asleep. So they go to sleep as soon as their work ends
(`OMP_WAIT_POLICY=PASSIVE`), unless the user chose a policy.
"""
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
