"""The scheduler side, deterministic on every rank: the plugin and its request admission, the
tiered cache (radix tree and page residency, pools' bookkeeping, ack queues), the storage tier,
the prefetch decision and op tracing.
"""
