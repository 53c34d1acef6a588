"""Fixtures for generation tests: embedded servers in background threads."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def tiny_server():
    """A tiny-qwen2 embedded server on a free port; yields (url, EmbeddedServer)."""
    from realscale.generate.server import EmbeddedServer, start_in_thread

    server = EmbeddedServer("tiny-qwen2", max_running=16, context_length=256)
    url, stop = start_in_thread(server)
    yield url, server
    stop()
