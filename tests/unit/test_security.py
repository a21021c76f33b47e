"""engine.security: loopback binds may run keyless; exposed binds need a key or an explicit opt-out."""

from __future__ import annotations

import pytest

from engine.security import check_exposure, is_loopback_host

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "host,loopback",
    [
        ("127.0.0.1", True),
        ("127.0.0.53", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("LOCALHOST", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.0.0.5", False),
        ("192.168.1.2", False),
        ("example.org", False),
        ("", False),
    ],
)
def test_is_loopback_host(host, loopback):
    assert is_loopback_host(host) is loopback


def test_exposed_without_key_is_refused_with_the_fix_named():
    with pytest.raises(ValueError, match="0.0.0.0.*--api-key.*127.0.0.1.*--allow-unauthenticated"):
        check_exposure("judge", "0.0.0.0", None)


@pytest.mark.parametrize(
    "host,key,allow", [("0.0.0.0", "k", False), ("0.0.0.0", None, True), ("127.0.0.1", None, False)]
)
def test_allowed_combinations(host, key, allow):
    check_exposure("judge", host, key, allow_unauthenticated=allow)


@pytest.mark.parametrize(
    "cmd",
    [
        ["-m", "judge_server.cli", "--backend", "rules", "--host", "0.0.0.0"],
        ["-m", "devkit.dev_server.cli", "--model-path", "/nonexistent", "--host", "0.0.0.0"],
    ],
)
@pytest.mark.process
def test_services_refuse_to_start_exposed_without_key(cmd):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, *cmd], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "without an API key" in proc.stderr
