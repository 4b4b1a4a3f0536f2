"""Health probes of the admin HTTP port, for systemd, Kubernetes and load balancers.

`/healthz`: the process is alive and its event loop answers (always 200 while it does).
`/readyz`: the node takes clients: start-up finished and not stopping, every configured
listener bound, the journal directory writable (a probe file is written, fsynced and removed)
and, in a cluster, the node registered in the view with a live lease, a controller known, every
stream of the catalog placed, and every shard the placement gives this node served here (led
under a live lease, not released by a drain, the stream known to the broker with the shard's
journal open when it is reliable). 200 with `{"ready": true,
"checks": {...}}`, else 503 with the checks that failed. Neither needs credentials: they say
nothing but ok or not, and probes carry none. Nothing here runs per message.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from aiohttp import web

HEALTH_PATHS = frozenset({"/healthz", "/readyz"})


def _journal_writable(data_dir: Path) -> tuple[bool, str]:
    directory = data_dir / "journal"
    if not directory.is_dir():
        directory = data_dir
    probe = directory / ".readyz-probe"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, b"ok")
            os.fsync(fd)
        finally:
            os.close(fd)
        probe.unlink()
    except OSError as exc:
        return False, f"cannot write in {directory}: {exc.strerror or exc}"
    return True, "writable"


def readiness(app: Any) -> dict[str, tuple[bool, str]]:
    """Each check's (passed, detail)."""
    checks: dict[str, tuple[bool, str]] = {}
    started = bool(getattr(app, "ready", False))
    checks["started"] = (started, "serving" if started else "starting or stopping")
    config = app.config
    listeners = getattr(app, "listeners", {}) or {}
    wanted = [name for name, port in (
        ("mqtt", config.listeners.mqtt_port), ("mqtt-ws", config.listeners.mqtt_ws_port),
        ("mqtts", config.listeners.mqtts_port), ("mqtt-wss", config.listeners.mqtt_wss_port),
        ("amqp", config.listeners.amqp_port), ("amqps", config.listeners.amqps_port),
        ("grpc", config.listeners.grpc_port), ("grpcs", config.listeners.grpcs_port),
    ) if port]
    missing = [name for name in wanted if name not in listeners]
    checks["listeners"] = (not missing, f"not bound: {', '.join(missing)}" if missing
                           else ", ".join(sorted(listeners)))
    checks["journal"] = _journal_writable(Path(config.data_dir))
    node = getattr(app, "cluster", None)
    if node is not None:
        view = node.view
        joined = node.node_id in view.registrations
        alive = bool(view.lease_alive())
        checks["cluster"] = (joined and alive, "joined" if joined and alive else
                             "lease not alive" if joined else "not joined")
        checks["placement"] = placement_served(getattr(app, "edge", None), view)
    return checks


def placement_served(edge: Any, view: Any) -> tuple[bool, str]:
    """Whether this node serves every shard the placement gives it (see the module)."""
    if view.controller_id is None:
        return False, "no controller elected"
    unplaced = sorted(name for name in view.streams if name not in view.placement)
    if unplaced:
        return False, f"streams not placed yet: {', '.join(unplaced[:5])}"
    mine = 0
    missing: list[str] = []
    for name, shards in sorted(view.placement.items()):
        for index, placed in enumerate(shards):
            if placed.leader != view.node_id:
                continue
            mine += 1
            stream = edge.streams.get(name) if edge is not None else None
            if not view.leads(name, index):
                missing.append(f"{name}/{index} (not led here)")
            elif stream is None or index >= len(stream.shards):
                missing.append(f"{name}/{index} (stream not open)")
            elif str(stream.config.mode) == "reliable" and stream.shards[index].log is None:
                missing.append(f"{name}/{index} (journal not open)")
    if missing:
        return False, f"not serving {len(missing)} of its {mine} shards: {', '.join(missing[:5])}"
    return True, f"serves its {mine} shards"


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


def readyz_handler(get_app: Any) -> Any:
    async def readyz(request: web.Request) -> web.Response:
        checks = readiness(get_app(request))
        ready = all(passed for passed, _ in checks.values())
        body = {"ready": ready,
                "checks": {name: {"ok": passed, "detail": detail}
                           for name, (passed, detail) in checks.items()}}
        return web.json_response(body, status=200 if ready else 503)

    return readyz
