"""The jobs: `simulate` (the correctness harness, against a cache-less reference), `replay` (a
trace through the real plugin) and the capacity sweep, on one shared run harness."""
