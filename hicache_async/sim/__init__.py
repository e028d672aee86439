"""The harness around the reference engines: the rank launcher and rank entry points, the
cache-less reference run, `simulate`, `replay`, the oracle and the capacity sweep.
"""
