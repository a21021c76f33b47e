"""Exposure rule shared by every Hindsight service: loopback by default, API keys when exposed.

A service bound to a loopback address (127.0.0.0/8, ::1, localhost) may run without keys: only this
machine can reach it. Binding anything else (0.0.0.0, a LAN address, a hostname) without an API key
would publish an unauthenticated proxy to the policy engine or judge, so settings refuse it with a
message that names the fix. ``allow_unauthenticated`` is the explicit, logged opt-out for operators
who put their own authenticating gateway in front.
"""

from __future__ import annotations

import ipaddress


def is_loopback_host(host: str) -> bool:
    """True for loopback addresses and ``localhost``; False for wildcard, LAN, public or unknown names."""
    name = host.strip().strip("[]").lower()
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def check_exposure(service: str, host: str, api_key: str | None, *, allow_unauthenticated: bool = False) -> None:
    """Raise ValueError when ``service`` would listen beyond loopback without an API key."""
    if api_key or allow_unauthenticated or is_loopback_host(host):
        return
    raise ValueError(
        f"{service} would listen on {host!r} without an API key: set an API key (--api-key) to expose it, "
        "bind 127.0.0.1, or pass --allow-unauthenticated if an authenticating gateway sits in front"
    )
