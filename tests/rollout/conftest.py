"""Fixtures for rollout tests: one real embedded tiny-qwen2 server for the whole package."""

from __future__ import annotations

import asyncio
import json
import os

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
        # The previous test's requests may still be on the server (its client has gone, and
        # the server notices closed connections asynchronously; a request can also sit
        # between the HTTP handler and the scheduler), and a flushing load refuses while
        # any run. An abort pause ends every one of them first, and a request that arrives
        # during the pause does not block the flush (SGLang's rule, which the server keeps).
        async with InferenceClient([url]) as client:
            await client.pause("abort")
            try:
                await client.update_weights_from_disk(srv.model_path, 0)
            finally:
                await client.resume()

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
