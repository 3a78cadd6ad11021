"""Clients are tested through the real proxy: its fixture is shared with the proxy's own tests."""

from tests.services.proxy.conftest import proxy  # noqa: F401
