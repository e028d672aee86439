"""Bad connector config stops the engine at start-up with one line naming the bad key or value."""
from __future__ import annotations

import pytest
from hicache_vllm import settings

from hicache_async.errors import UsageError

from .engines import gen, start_engine


@pytest.mark.parametrize("extra, named", [
    ({"storage": "floppy"}, "'floppy'"),
    ({"storag": "file"}, "'storag'"),
    ({"host_pages": 0}, "host_pages must be a positive integer, got 0"),
    ({"host_pages": "many"}, "'many'"),
    ({"key_scheme": "random"}, "'random'"),
    ({"write_policy": "sometimes"}, "'sometimes'"),
    ({"l3_reads": "maybe"}, "unknown l3_reads 'maybe'; expected one of auto, always, never"),
    ({"storage_timeout": -1}, "got -1"),
    ({"storage_optional": "yes"}, "'yes'"),
    ({"late_copies": 1}, "late_copies must be true or false, got 1"),
    ({"storage": "none", "storage_path": "/tmp/x"}, "storage_path needs storage 'file'"),
    ({"storage": "none", "storage_secret_file": "/tmp/s"}, "needs a storage to seal"),
])
def test_bad_values_are_one_line_naming_them(extra, named):
    with pytest.raises(UsageError) as err:
        settings.parse(extra)
    assert named in str(err.value) and "\n" not in str(err.value)


def test_cli_spellings_are_accepted():
    s = settings.parse({"storage": "memory", "host-pages": 64, "key-scheme": "unified", "write-policy": "write_back"})
    assert (s.storage, s.host_pages, s.key_scheme, s.write_policy) == ("memory", 64, "unified", "write_back")
    assert not s.late_copies and settings.parse({"late-copies": True}).late_copies
    assert s.simulated_device is None and settings.parse({"simulated-device": 3}).simulated_device == 3


def test_a_real_engine_refuses_to_start_on_a_bad_value(llama, prompts, tmp_path):
    proc = start_engine(llama, [gen(prompts["p"])], {"storage": "floppy"})
    assert proc.returncode != 0
    assert "kv_connector_extra_config: unknown storage 'floppy'" in proc.stderr
    secret = tmp_path / "open-secret"
    secret.write_bytes(b"x" * 32)
    secret.chmod(0o644)
    proc = start_engine(llama, [gen(prompts["p"])], {"storage": "file", "storage_secret_file": str(secret)})
    assert proc.returncode != 0 and f"--storage-secret-file {secret}" in proc.stderr
