"""The broker an admin application serves, and what is built from it, kept on the aiohttp
application under `SERVED_KEY`; `served_app(request)` is how a handler or a middleware reaches
the broker's application object."""

from __future__ import annotations

from typing import Any

from aiohttp import web


class Served:
    """The broker an admin application serves and what is built from it (the metrics
    registry, the traffic history), dropped when the server stops: aiohttp keeps up to 1,024
    recent applications in a module-level cache (its middleware LRU), which would otherwise
    keep a stopped broker alive with all its sessions and journals."""

    __slots__ = ("app", "registry", "history")

    def __init__(self, app: Any, registry: Any, history: Any) -> None:
        self.app = app
        self.registry = registry
        self.history = history

    def forget(self) -> None:
        self.app = self.registry = self.history = None


SERVED_KEY: web.AppKey[Served] = web.AppKey("served", Served)


def served_app(request: web.Request) -> Any:
    """The application (a `Shardgate`) the request's admin server serves."""
    return request.app[SERVED_KEY].app
