"""A real mooncake_master and its segment holder on free loopback ports, and adapters connected
to it that mount no segment of their own (objects land in the holder's, as in a deployment)."""
from __future__ import annotations

import pytest
from hicache_mooncake import MooncakeMaster, MooncakeStorage


@pytest.fixture(scope="module")
def mooncake_master(tmp_path_factory):
    log = tmp_path_factory.mktemp("mooncake") / "master.log"
    with MooncakeMaster(holder_bytes=256 << 20, log_path=str(log)) as master:
        yield master


@pytest.fixture
def mooncake_storage(mooncake_master):
    adapter = MooncakeStorage(master=mooncake_master.address, metadata_url=mooncake_master.metadata_url,
                              buffer_bytes=16 << 20)
    yield adapter
    adapter.close()
