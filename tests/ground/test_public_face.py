"""The package's public face: every exported name resolves, and importing it stays light."""
import subprocess
import sys

import pytest

import hicache_async
import hicache_async.telemetry


@pytest.mark.parametrize("package", [hicache_async, hicache_async.telemetry])
def test_every_exported_name_resolves(package):
    for name in package.__all__:
        assert getattr(package, name).__name__ == name
    with pytest.raises(AttributeError, match="Nope"):
        package.Nope


def test_importing_the_face_loads_neither_torch_nor_the_sdk():
    code = ("import sys, hicache_async, hicache_async.telemetry, hicache_async.partition; "
            "print(sorted(m for m in ('torch', 'opentelemetry.sdk') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"
