"""``tandem serve``: the start-up warning of a gateway that serves anyone (docs/security.md)."""

from __future__ import annotations

import pytest

from services.serve import exposure_warning


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.5", "[::]", "gateway.example.com"])
def test_beyond_loopback_without_a_key_warns(host):
    warning = exposure_warning(host, has_keys=False)
    assert warning is not None and host in warning and "TANDEM_API_KEY" in warning


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"])
def test_loopback_or_a_key_is_quiet(host):
    assert exposure_warning(host, has_keys=False) is None
    assert exposure_warning("0.0.0.0", has_keys=True) is None

