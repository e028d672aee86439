"""A backend whose writes fail on world rank 1 only (every other rank stores as memory does):
one rank's storage failing while its peers' succeed, as a disk full on one host would."""
import torch.distributed as dist

from hicache_async.storage.memory import MemoryStorage


class WritesFailOnRank1(MemoryStorage):
    def batch_set(self, keys, values):
        if dist.is_initialized() and dist.get_rank() == 1:
            return [False] * len(keys)
        return super().batch_set(keys, values)
