"""Authentication of every connection, before a byte of it reaches the inbox (ZAP).

``plain`` (the default) admits peers that present the group secret as a PLAIN
password; ``curve`` derives one CURVE keypair from the secret, which every member
shares, admits only that public key and encrypts; ``none`` configures nothing.
"""

from __future__ import annotations

import hashlib
from typing import Any

import zmq
import zmq.auth.thread

__all__ = ["configure_client", "configure_server", "curve_keypair"]

_ZAP_DOMAIN = "actorrpc"
_USER = "actorrpc"


def curve_keypair(secret: str) -> tuple[bytes, bytes]:
    """A CURVE keypair derived from the group secret: every member shares it."""
    secret_key = zmq.utils.z85.encode(hashlib.sha256(secret.encode()).digest())
    return zmq.curve_public(secret_key), secret_key


class _CurveKeyCheck:
    """ZAP callback that admits only the group's public key."""

    def __init__(self, public_key: bytes) -> None:
        self._public_key = public_key

    def callback(self, domain: str, key: bytes) -> bool:
        return zmq.utils.z85.encode(key) == self._public_key or key == self._public_key


def configure_server(
    socket: zmq.Socket[Any], context: zmq.Context[Any], security: str, secret: str
) -> zmq.auth.thread.ThreadAuthenticator | None:
    """Make ``socket`` (the inbox) authenticate its peers; returns the started ZAP
    authenticator to stop when closing (None for ``security="none"``)."""
    if security == "none":
        return None
    authenticator = zmq.auth.thread.ThreadAuthenticator(context)
    authenticator.start()
    socket.setsockopt_string(zmq.ZAP_DOMAIN, _ZAP_DOMAIN)
    if security == "plain":
        authenticator.configure_plain(_ZAP_DOMAIN, {_USER: secret})
        socket.setsockopt(zmq.PLAIN_SERVER, 1)
    else:
        public, secret_key = curve_keypair(secret)
        authenticator.configure_curve_callback(
            _ZAP_DOMAIN, credentials_provider=_CurveKeyCheck(public)
        )
        socket.setsockopt(zmq.CURVE_SERVER, 1)
        socket.setsockopt(zmq.CURVE_PUBLICKEY, public)
        socket.setsockopt(zmq.CURVE_SECRETKEY, secret_key)
    return authenticator


def configure_client(socket: zmq.Socket[Any], security: str, secret: str) -> None:
    """Make ``socket`` (a link to a peer) present the group's credentials."""
    if security == "plain":
        socket.setsockopt_string(zmq.PLAIN_USERNAME, _USER)
        socket.setsockopt_string(zmq.PLAIN_PASSWORD, secret)
    elif security == "curve":
        public, secret_key = curve_keypair(secret)
        socket.setsockopt(zmq.CURVE_SERVERKEY, public)
        socket.setsockopt(zmq.CURVE_PUBLICKEY, public)
        socket.setsockopt(zmq.CURVE_SECRETKEY, secret_key)
