"""A real mooncake_master on free loopback ports, and adapters connected to it."""
from __future__ import annotations

import pytest

from hicache_mooncake import MooncakeMaster, MooncakeStorage


@pytest.fixture(scope="module")
def mooncake_master(tmp_path_factory):
    log = tmp_path_factory.mktemp("mooncake") / "master.log"
    with MooncakeMaster(log_path=str(log)) as master:
        yield master


@pytest.fixture
def mooncake_storage(mooncake_master):
    adapter = MooncakeStorage(master=mooncake_master.address, metadata_url=mooncake_master.metadata_url,
                              segment_bytes=64 << 20, buffer_bytes=16 << 20)
    yield adapter
    adapter.close()
