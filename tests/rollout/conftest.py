"""Fixtures for rollout tests: one real embedded tiny-qwen2 server for the whole package."""

from __future__ import annotations

import asyncio
import json
import os
import time

import pytest


@pytest.fixture(scope="package")
def _server():
    from realscale.serve.server import EmbeddedServer, start_in_thread

    server = EmbeddedServer("tiny-qwen2", max_running=32, context_length=512)
    url, stop = start_in_thread(server)
    yield url, server
    stop()


@pytest.fixture()
def server(_server):
    """(url, EmbeddedServer), reset to weight version 0 (tests move the version on)."""
    from realscale.inference.client import InferenceClient

    url, srv = _server

    async def reset() -> None:
        async with InferenceClient([url]) as client:
            await client.update_weights_from_disk(srv.model_path, 0)

    # The previous test's client has gone; the server aborts its requests as it notices the
    # closed connections (asynchronously), and a flushing load refuses while any remain.
    deadline = time.monotonic() + 60
    while (srv.engine.running or srv.engine.waiting) and time.monotonic() < deadline:
        time.sleep(0.05)
    asyncio.run(reset())
    return url, srv


@pytest.fixture(scope="package")
def tokenizer(_server):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(_server[1].model_path)


@pytest.fixture()
def arith_jsonl(tmp_path):
    """A 12-row arithmetic JSONL dataset; returns its path."""
    path = os.path.join(tmp_path, "arith.jsonl")
    with open(path, "w") as fh:
        for i in range(12):
            fh.write(json.dumps({"prompt": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n")
    return path
