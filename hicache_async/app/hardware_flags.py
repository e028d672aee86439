"""The planner's flags: the served model and the machine `replay` times every transfer with.

Each flag is the `HardwareModel` field of the same name, which validates it, so a bad value
is the same one-line usage error from the command line and from a sweep.
"""
from __future__ import annotations

import argparse
import dataclasses

from ..engine.replay.hardware import PRESETS, HardwareModel

_DEFAULTS = HardwareModel()
_MACHINE = {
    "--pcie-gbps": "L1 <-> L2 bandwidth a rank, GB/s each way",
    "--l3-read-gbps": "L3 read bandwidth a rank, GB/s",
    "--l3-write-gbps": "L3 write bandwidth a rank, GB/s",
    "--l3-latency-us": "latency of each L3 storage call, us",
}


def _number(parse):
    def read(text: str):
        try:
            return parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    return read


def add_hardware_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("hardware model (transfer times in a replay)")
    g.add_argument("--model", default=_DEFAULTS.model, metavar="NAME",
                   help=f"the served model: {', '.join(PRESETS)} (default {_DEFAULTS.model})")
    g.add_argument("--kv-bytes-per-token", type=_number(int), metavar="BYTES",
                   help="KV bytes a token over all layers and heads (default: the model's)")
    for flag, what in _MACHINE.items():
        dest = flag[2:].replace("-", "_")
        g.add_argument(flag, type=_number(float), default=getattr(_DEFAULTS, dest), metavar="N",
                       help=f"{what} (default {getattr(_DEFAULTS, dest):g})")


def hardware_model(ns: argparse.Namespace) -> HardwareModel:
    """The flags as a model; the preset's costs unless --prefill-us-per-token or
    --decode-us-per-step override them."""
    fields = {f.name: getattr(ns, f.name) for f in dataclasses.fields(HardwareModel)}
    return HardwareModel(**fields)
