"""The harness around the engines: `ranks` starts simulated ranks (our launcher, or torchrun's
processes) and `jobs` holds what runs on them (`simulate`, `replay`, the capacity sweep) with
the run harness they share."""
