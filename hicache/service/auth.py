"""Who may call, and for which tenants: bearer tokens, the principals they stand for, TLS / mTLS credentials.

Authentication is decided in one place, :class:`AuthInterceptor`, for every method of every service a
server carries (the node's ``hicache.v1.HiCache``, the router's ``hicache.v1.Router``, reflection, and any
method added later) except the standard health service, which stays open so load balancers and
Kubernetes probes need no secret. A call must carry ``authorization: Bearer <token>`` metadata naming a
known token. One that does not gets UNAUTHENTICATED from a handler that neither reads nor decodes its
request: the interceptor answers from the call's metadata alone, before the body is received, so an
unauthenticated caller cannot make the server parse anything (tens of MB of garbage included).

What an authenticated caller may do is its :class:`Principal`:

* ``serve.auth_token`` alone (the single-token mode, for one-tenant setups): every holder of the token is
  one principal that may act for every tenant and run the node-wide calls. The token keeps out callers
  without it; it does not keep tenants apart.
* ``serve.auth_tokens_file`` (:func:`load_tokens_file`): each token acts for the tenants listed for it
  (``"*"``: every tenant), and only an ``admin`` token runs the node-wide calls (Flush, a Clear of every
  tenant's pages; a token limited to some tenants clears theirs alone). The
  servicer refuses a call naming another tenant with PERMISSION_DENIED; see
  :mod:`hicache.service.servicer` for what each RPC checks. ``serve.auth_token``, when also set, is one
  more token, an admin one.

Tokens are looked up by their sha256 digest, so the lookup's timing says nothing about a token's bytes.
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import yaml

from hicache.config import ConfigError, token_problem
from hicache.service.validation import ServiceError

OPEN_PREFIXES = ("/grpc.health.v1.Health/",)  # methods any caller may call, token or not
EVERY_TENANT = "*"  # in a tokens file's tenants: every tenant
DENIED = "missing or wrong bearer token (metadata 'authorization: Bearer <token>')"
TOKENS_FILE_FIELD = "serve.auth_tokens_file"
_ENTRY_KEYS = frozenset({"name", "token", "tenants", "admin"})


@dataclass(frozen=True)
class Principal:
    """What the holder of one token may do."""

    name: str  # for messages and logs (a tokens file entry's name; never the token)
    tenants: frozenset[str] | None  # the tenants it may act for; None: every tenant
    admin: bool = False  # may run node-wide calls (Flush, Clear of every tenant)
    scope: str = ""  # request ids live per scope: one token cannot reach another's requests

    @property
    def every_tenant(self) -> bool:
        return self.tenants is None

    def may_act_for(self, tenant: str) -> bool:
        return self.tenants is None or tenant in self.tenants


# auth off, or serve.auth_token alone: one principal for every caller
EVERYONE = Principal("", None, admin=True)


def _digest(token: str | bytes) -> bytes:
    return hashlib.sha256(token.encode() if isinstance(token, str) else token).digest()


class Authenticator:
    """Known tokens -> their principals."""

    def __init__(self, principals: Mapping[str, Principal]) -> None:
        if not principals:
            raise ValueError("auth: at least one token is needed")
        for token in principals:
            if not token:
                raise ValueError("auth token: must be non-empty")
        self._by_digest = {_digest(t): p for t, p in principals.items()}

    @classmethod
    def single(cls, token: str) -> Authenticator:
        """The single-token mode: one token, standing for :data:`EVERYONE`."""
        return cls({token: EVERYONE})

    @classmethod
    def for_serve(cls, auth_token: str, tokens_file: str, section: str = "serve") -> Authenticator | None:
        """The node's: ``serve.auth_token`` (an admin token) and the tokens of ``serve.auth_tokens_file``;
        None when neither is set (auth off). :class:`ConfigError` for a bad tokens file. The router's are
        the same fields of its ``section``, ``router``."""
        field = f"{section}.auth_tokens_file"
        principals: dict[str, Principal] = {}
        if tokens_file:
            principals.update(load_tokens_file(tokens_file, field))
        if auth_token:
            if auth_token in principals:
                raise ConfigError(f"{field}: a token of the file is {section}.auth_token too", field)
            principals[auth_token] = EVERYONE
        return cls(principals) if principals else None

    @property
    def scoped(self) -> bool:
        """Whether some token is limited to some tenants (a tokens file)."""
        return any(p is not EVERYONE for p in self._by_digest.values())

    def principal(self, metadata: Iterable[Any] | None) -> Principal | None:
        """The principal of a call's metadata (``(key, value)`` pairs), or None: no known bearer token."""
        for key, value in metadata or ():
            if key == "authorization":
                got = value.encode() if isinstance(value, str) else bytes(value)
                if not got.startswith(b"Bearer "):
                    return None
                return self._by_digest.get(_digest(got[7:]))
        return None


def caller(auth: Authenticator | None, metadata: Iterable[Any] | None) -> Principal:
    """Who makes a call: :data:`EVERYONE` when no token is scoped to tenants (``auth`` None), else the
    principal of its bearer token. The interceptor lets only known tokens through, so a miss here is a bug
    that still refuses the call."""
    if auth is None:
        return EVERYONE
    who = auth.principal(metadata)
    if who is None:  # pragma: no cover - AuthInterceptor refuses such a call before any handler
        raise ServiceError(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")
    return who

async def _deny(request_iterator: Any, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, DENIED)
    yield  # pragma: no cover - makes this an async generator


# A request-streaming handler whatever the method's kind (on the wire the kinds are alike): the server never
# reads a message for it, and without a deserializer nothing could be decoded anyway.
_DENY_HANDLER = grpc.stream_stream_rpc_method_handler(_deny)


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Every call but health must carry a known bearer token; others end with UNAUTHENTICATED unread. Put it
    first among a server's interceptors: the handler lookup (and every interceptor after it) only runs for
    authenticated calls."""

    def __init__(self, auth: Authenticator) -> None:
        self.auth = auth

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        if details.method.startswith(OPEN_PREFIXES) or self.auth.principal(details.invocation_metadata):
            return await continuation(details)
        return _DENY_HANDLER


def load_tokens_file(path: str, field: str = TOKENS_FILE_FIELD) -> dict[str, Principal]:
    """The tokens of a tokens file (YAML), by token; :class:`ConfigError` naming ``field`` and the entry
    (never quoting a token) when it cannot be read or is not of this form::

        tokens:
          - name: acme-app          # for messages and logs (default: tokens[i])
            token: "..."            # visible ASCII, each token once
            tenants: [acme]         # the tenants it may act for; "*": every tenant
          - name: ops
            token: "..."
            admin: true             # every tenant, and the node-wide calls (Flush, Clear of all)

    The tenant of a request that names none is the node's ``model.tenant`` (``""`` by default): list
    ``""`` for a token that may send such requests.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"{field}: {path}: {e.strerror or e}", field) from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{field}: {path}: not UTF-8 text (byte {e.start})", field) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{field}: {path}: not valid YAML ({getattr(e, 'problem', None) or type(e).__name__})",
                          field) from None
    if not isinstance(data, dict) or set(data) != {"tokens"} or not isinstance(data["tokens"], list) \
            or not data["tokens"]:
        raise ConfigError(f"{field}: {path}: must be a mapping with one key, tokens: a non-empty list of "
                          "{name, token, tenants, admin}", field)
    out: dict[str, Principal] = {}
    names: set[str] = set()
    for i, entry in enumerate(data["tokens"]):
        where = f"{field}: {path}: tokens[{i}]"
        if not isinstance(entry, dict):
            raise ConfigError(f"{where}: must be a mapping of name, token, tenants, admin", field)
        unknown = set(entry) - _ENTRY_KEYS
        if unknown:
            raise ConfigError(f"{where}: unknown keys {sorted(map(str, unknown))}; known: {sorted(_ENTRY_KEYS)}",
                              field)
        name = entry.get("name", f"tokens[{i}]")
        if not isinstance(name, str) or not name or name in names:
            raise ConfigError(f"{where}: name: must be a non-empty string, each name once", field)
        names.add(name)
        where = f"{field}: {path}: tokens[{i}] ({name})"
        token = entry.get("token")
        if not isinstance(token, str) or not token:
            raise ConfigError(f"{where}: token: required, a non-empty string", field)
        why = token_problem(token)
        if why is not None:
            raise ConfigError(f"{where}: token: {why}", field)
        if token in out:
            raise ConfigError(f"{where}: token: the same as {out[token].name}'s (each token once)", field)
        admin = entry.get("admin", False)
        if not isinstance(admin, bool):
            raise ConfigError(f"{where}: admin: must be true or false", field)
        tenants = entry.get("tenants", [])
        if not isinstance(tenants, list) or not all(isinstance(t, str) for t in tenants):
            raise ConfigError(f"{where}: tenants: must be a list of tenant names (\"*\": every tenant)", field)
        if not tenants and not admin:
            raise ConfigError(f"{where}: tenants: required (the tenants it may act for; \"*\": every tenant), "
                              "unless admin: true", field)
        every = admin or EVERY_TENANT in tenants
        out[token] = Principal(name, None if every else frozenset(tenants), admin, _digest(token).hex()[:16])
    return out


def server_credentials(cert: str, key: str, client_ca: str) -> grpc.ServerCredentials:
    """TLS with ``cert``/``key``; with ``client_ca`` clients must present a certificate it signed (mTLS)."""
    ca = Path(client_ca).read_bytes() if client_ca else None
    return grpc.ssl_server_credentials([(Path(key).read_bytes(), Path(cert).read_bytes())],
                                       root_certificates=ca, require_client_auth=ca is not None)
