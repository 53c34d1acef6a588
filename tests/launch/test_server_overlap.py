"""The trainer ranks start beside the generation servers, not after them
(``LocalBackend.start_servers(wait=False)`` then ``servers_ready``): the rollouts of a
fresh run wait for the servers' ``/health`` (:mod:`realscale.inference.health`); a
server that never comes up still ends the run before any step, in one line naming its
log; a URL nobody serves is named when the wait runs out."""

from __future__ import annotations

import http.server
import os
import threading
import time

import pytest

from realscale.config import load_config
from realscale.errors import LaunchError
from realscale.inference.health import answers_health, wait_until_serving
from realscale.launcher.local import LocalBackend
from realscale.parallel.net import free_port


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's API
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_waits_for_a_server_that_starts_late_and_names_one_that_never_does() -> None:
    port = free_port("127.0.0.1")
    url = f"http://127.0.0.1:{port}"
    assert not answers_health(url)  # nobody listens yet: refused, not an exception
    httpd: list[http.server.HTTPServer] = []

    def start_late() -> None:
        time.sleep(1.0)
        httpd.append(http.server.HTTPServer(("127.0.0.1", port), _Health))
        httpd[0].serve_forever()

    threading.Thread(target=start_late, daemon=True).start()
    t0 = time.monotonic()
    try:
        wait_until_serving([url], timeout=30)
        assert 0.9 < time.monotonic() - t0 < 30
        silent = f"http://127.0.0.1:{free_port('127.0.0.1')}"
        with pytest.raises(TimeoutError, match=f"{silent}.*within 1 s"):
            wait_until_serving([url, silent], timeout=1.0)
    finally:
        while not httpd:
            time.sleep(0.05)
        httpd[0].shutdown()


@pytest.mark.multiproc
def test_start_returns_before_the_server_answers_and_a_dead_one_fails_the_wait(tmp_path) -> None:
    """A real embedded server of a model directory that is not there: ``start_servers``
    hands back its URL at once; ``servers_ready`` raises once the process has exited."""
    cfg = load_config(None, ["data.source=task:arith", f"run.output_dir={tmp_path}", "run.name=r",
                             "launch.health_timeout=120"])
    backend = LocalBackend(cfg, str(tmp_path / "r"))
    backend.prepare()
    try:
        t0 = time.monotonic()
        urls = backend.start_servers(str(tmp_path / "no-model"), {}, wait=False)
        assert len(urls) == 1 and time.monotonic() - t0 < 2.0  # not waited for (a server takes seconds)
        assert backend.servers[0].proc.poll() is None  # still starting
        with pytest.raises(LaunchError, match=r"exited with code \d+ before it was ready; see .*server0\.log"):
            backend.servers_ready()
        assert os.path.exists(backend.servers[0].log_path)
    finally:
        backend.stop()
