"""Ranks working as one: topology and groups, bounded waits on collectives, and the per-step
agreement that makes every rank retire the same ops.
"""
