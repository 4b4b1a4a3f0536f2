"""Wiring the security model into a running broker: `install_security` builds one `Security`
from the configuration and installs it in the front door's security port (`Edge.security`,
which the Edge and the protocols were built with: one swap, so every connected client's next
check asks it) and as `app.security`; `apply_rules_change` is what a change of the users or ACL
files does to connected clients (kicks, removed subscriptions, ended streams). Decisions
themselves are `auth.py`'s.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import AuthError
from .settings import AuthSettings, anonymous_setting, security_paths

if TYPE_CHECKING:
    from ..core.edge import SecurityPort
    from .auth import Security

# The security model's logger, as before this module was split from it.
log = logging.getLogger("shardgate.security.auth")


def apply_rules_change(app: Any, security: Security) -> None:
    """The users or ACL rules changed on a running broker: the clients of a removed user are
    disconnected (every protocol); MQTT subscriptions no longer allowed are removed (of
    offline persistent sessions too); gRPC consumer streams that may no longer read are ended
    with PERMISSION_DENIED; AMQP consumers on a queue bound to what their user may no longer
    read get basic.cancel."""
    edge = app.edge
    if security.removed_users:
        for info in edge.clients.list():
            if info.username is not None and info.username in security.removed_users and info.kickable:
                log.info("%s client %s of removed user %r disconnected", info.protocol, info.client_id,
                         info.username)
                edge.clients.kick(info.protocol, info.client_id, f"user {info.username!r} removed")
    for service in (getattr(app, "mqtt", None), getattr(app, "grpc", None), getattr(app, "amqp", None)):
        if service is not None:
            service.reauthorize()


def install_security(app: Any) -> Security:
    """Install one `Security` in a started-or-starting `Shardgate`: as the policy of the front
    door's security port (every protocol asks there, AMQP's login included), replacing the
    previous one whole, and as `app.security` for the admin API and metrics. Runs again on a
    running broker (the model is then built anew from the files).
    A users or ACL file that cannot be read raises `ConfigError`."""
    from ..config import ConfigError
    from .auth import Security
    from .login_guard import LoginGuard

    config = app.config
    settings = getattr(config, "auth", None) or AuthSettings()
    users_file, acl_file = security_paths(Path(config.data_dir), settings)
    try:
        security = Security(
            users_file, acl_file, allow_anonymous=anonymous_setting(settings.allow_anonymous),
            listener_host=config.listeners.host,
            guard=LoginGuard(base_delay_s=settings.login_delay_s,
                             max_delay_s=settings.login_max_delay_s),
        )
    except AuthError as exc:
        raise ConfigError(f"auth: {exc}") from exc
    security.on_rules_change.append(lambda current: apply_rules_change(app, current))
    previous = getattr(app, "security", None)
    if previous is not None and previous is not security:
        previous.stop_watching()
    try:
        security.watch()
    except RuntimeError:
        pass  # no running loop: a model built outside the broker, checked on use only
    # The one swap: from here on every check, of a client connected before too, asks `security`.
    port: SecurityPort = app.edge.security
    port.install(security)
    app.security = security
    if previous is not None and previous is not security:
        # What clients hold already (subscriptions, consumers, sessions of users gone) is
        # checked again under the new model, as after a change of its files.
        security.removed_users = frozenset(previous.users) - frozenset(security.users)
        try:
            apply_rules_change(app, security)
        except Exception:
            log.exception("applying the reinstalled users or ACL rules failed")
        finally:
            security.removed_users = frozenset()
    log.info("security: %d users, %s, anonymous access %s", len(security.users),
             f"{len(security.rules)} ACL rules" if security.rules is not None else "no ACL file",
             "on" if security.allow_anonymous else "off")
    return security
