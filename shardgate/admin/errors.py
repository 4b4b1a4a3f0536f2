"""The admin API's errors: what a view or an action raises when a request cannot be answered,
each translated into one HTTP status by the JSON error middleware (`admin/guards.py`). Nothing
here knows HTTP."""

from __future__ import annotations


class NotFound(Exception):
    """A named thing (stream, subscription, client) does not exist; answered with 404."""


class Conflict(Exception):
    """The request cannot apply to the thing it names (a live-only subscription has no
    cursor); answered with 409."""


class BadRequest(Exception):
    """The request's body or parameters are wrong; answered with 400."""


class Unavailable(Exception):
    """In a cluster, the node that would answer cannot be reached now; answered with 503."""
