"""`shardgate health`: ask one or more nodes' `/readyz` (admin HTTP port) whether they take
clients, and with `--wait` wait until every one does: the readiness step of scripts, the
README's blocks and service managers (`ExecStartPost`).

Exit status 0 when every node is ready, 1 when one is not (or not reachable) at the end of
`--timeout`. Needs no credentials: the probes carry none.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from typing import Any

DEFAULT_HTTP_URL = "http://127.0.0.1:8080"


def add_health_command(sub: argparse._SubParsersAction) -> None:
    health = sub.add_parser("health", help="is the broker ready (its /readyz); --wait until it is")
    health.add_argument("--http-url", action="append", default=None, metavar="URL",
                        help="a node's admin API, repeatable (default $SHARDGATE_HTTP_URL or "
                        f"{DEFAULT_HTTP_URL})")
    health.add_argument("--wait", action="store_true", help="wait until every node is ready")
    health.add_argument("--timeout", type=float, default=60.0, metavar="S",
                        help="how long --wait waits (default 60)")
    health.add_argument("--json", action="store_true", help="print each node's checks as JSON")
    health.set_defaults(health_handler=run)


def readiness(url: str) -> tuple[bool, Any]:
    """(ready, the /readyz body or why it could not be read)."""
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/readyz", timeout=5) as response:
            return True, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        try:
            return False, json.loads(exc.read() or b"{}")
        except ValueError:
            return False, f"HTTP {exc.code}"
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "reason", None) or exc
        return False, f"not reachable ({reason})"


def _why(body: Any) -> str:
    if not isinstance(body, dict):
        return str(body)
    failed = [f"{name}: {check.get('detail')}" for name, check in body.get("checks", {}).items()
              if not check.get("ok")]
    return "; ".join(failed) or "not ready"


def run(args: argparse.Namespace) -> int:
    urls = args.http_url or [os.environ.get("SHARDGATE_HTTP_URL") or DEFAULT_HTTP_URL]
    deadline = time.monotonic() + args.timeout
    results: dict[str, tuple[bool, Any]] = {}
    while True:
        results = {url: readiness(url) for url in urls}
        if all(ready for ready, _ in results.values()) or not args.wait or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for url, (ready, body) in results.items():
        if args.json:
            print(json.dumps({"url": url, "ready": ready, "status": body}))
        else:
            print(f"{url}: {'ready' if ready else 'NOT READY: ' + _why(body)}",
                  file=sys.stdout if ready else sys.stderr)
    return 0 if all(ready for ready, _ in results.values()) else 1
