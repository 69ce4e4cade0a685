"""Who sends a request: its API key (compared in constant time), or its connection when the server has no keys.

Routes: /health and /version are open to anyone; /reset_prefix_cache takes the admin key (open only on a server
with no keys at all); every other route takes an API key or the admin key.
"""

import hashlib
import hmac
from dataclasses import dataclass

from launch.api_server.errors import ApiError

OPEN_ROUTES = frozenset({"/health", "/version"})
ADMIN_ROUTES = frozenset({"/reset_prefix_cache"})


@dataclass(frozen=True)
class User:
    """The unit of fairness; salt: the cache salt of its key (--cache-salt-per-api-key), else None."""

    name: str
    salt: str | None = None

    def cache_salt(self, requested: str | None) -> str | None:
        """The salt sent to the engine: the key's salt first, so that no request can take another key's."""
        if self.salt is None:
            return requested
        return self.salt if requested is None else f"{self.salt}:{requested}"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class ApiKeys:
    def __init__(self, api_keys: list[str], admin_key: str | None, salt_per_key: bool) -> None:
        self.keys = [(_digest(k), User(f"key {i}", _salt(k) if salt_per_key else None)) for i, k in enumerate(api_keys)]
        self.admin = None if admin_key is None else _digest(admin_key)

    def user(self, path: str, authorization: str | None, client: tuple[str, int] | None) -> User:
        """The request's user, or ApiError 401/403."""
        if path in OPEN_ROUTES:
            return _connection(client)
        given = _bearer(authorization)
        is_admin = given is not None and self.admin is not None and hmac.compare_digest(given, self.admin)
        if path in ADMIN_ROUTES:
            if is_admin or (self.admin is None and not self.keys):
                return User("admin")
            if self.admin is None:
                raise ApiError(403, f"{path} is an admin route: start the server with --admin-api-key to use it")
            raise _unauthorized("this route needs the admin key")
        if is_admin:
            return User("admin")
        if not self.keys:
            return _connection(client)
        found = None
        for digest, user in self.keys:  # every key compared, so the time does not tell which one matched
            if given is not None and hmac.compare_digest(given, digest):
                found = user
        if found is None:
            raise _unauthorized("a valid API key is needed: send `Authorization: Bearer KEY`")
        return found


def _bearer(authorization: str | None) -> bytes | None:
    """The digest of the key in `Authorization: Bearer KEY`, or None."""
    if authorization is None:
        return None
    scheme, _, key = authorization.partition(" ")
    return _digest(key.strip()) if scheme.lower() == "bearer" else None


def _salt(key: str) -> str:
    """A digest of the key: the salt travels to the engine (and into KV events), the key never does."""
    return hashlib.sha256(b"kvengine cache salt\0" + key.encode()).hexdigest()[:32]


def _connection(client: tuple[str, int] | None) -> User:
    return User("connection " + (f"{client[0]}:{client[1]}" if client else "local"))


def _unauthorized(message: str) -> ApiError:
    return ApiError(401, message, headers={"WWW-Authenticate": "Bearer"})
