"""Record the HTTP requests an embedded server receives (test helper)."""

from __future__ import annotations

import json
from typing import Any


def record_requests(server: Any) -> list[tuple[str, str, Any]]:
    """Make ``server.app()`` log every request as (method, path, JSON body or None) into the
    returned list, in arrival order. Call before ``start_in_thread(server)``."""
    from aiohttp import web

    seen: list[tuple[str, str, Any]] = []
    make_app = server.app

    @web.middleware
    async def record(request: web.Request, handler: Any) -> web.StreamResponse:
        raw = await request.read()
        seen.append((request.method, request.path, json.loads(raw) if raw.strip() else None))
        return await handler(request)

    def app() -> web.Application:
        application = make_app()
        application.middlewares.append(record)
        return application

    server.app = app
    return seen
