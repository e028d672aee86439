"""The scheduler side, deterministic on every rank: the plugin, the tiered cache (radix tree,
pools' bookkeeping, ack queues), the storage tier, the prefetch decision and op tracing.
"""
