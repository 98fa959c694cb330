"""Who may call what: one table of gRPC methods → roles, the credentials each process holds, the
server interceptor that checks them and the client side that sends them.

Roles (``Role``): ``operator`` (people and their tools: CLI, dashboard), ``controller``,
``agent``, ``policy``. A caller proves a role with ``authorization: Bearer <token>`` or, on a
mutual-TLS link, with a client certificate whose common name the credentials map to a role.
Health and reflection are open; read-only status RPCs that carry no request data are open
(``PUBLIC``); everything else needs one of the roles the table lists. A method of a remp service
missing from the table is refused (deny by default; a unit test keeps the table complete).

Credentials come from a file (``REMP_CREDENTIALS_FILE``, JSON, refused when group/world
readable) and/or the environment (``REMP_TOKEN_<ROLE>``), never from argv. A value is either the
token itself (the process may *send* it) or ``sha256:<hex>`` (the process can only *verify* it):
a production agent holds its own token and the digests of the controller's and operator's.
``remp credentials create FILE`` writes a fresh set (0600).
"""

from __future__ import annotations

import contextvars
import enum
import hashlib
import hmac
import json
import os
import secrets
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from remp.errors import ConfigError

ENV_FILE = "REMP_CREDENTIALS_FILE"
ENV_TOKEN = "REMP_TOKEN_"  # + ROLE
ENV_ALLOW_UNAUTHENTICATED = "REMP_ALLOW_UNAUTHENTICATED"
# TLS for every link of a process that has no link-specific setting: its own certificate and key
# (served, and presented to servers it calls) and the CA it trusts (servers then require client
# certificates signed by it: mutual TLS; clients verify servers against it)
ENV_TLS_CERT, ENV_TLS_KEY, ENV_TLS_CA = "REMP_TLS_CERT", "REMP_TLS_KEY", "REMP_TLS_CA"
MAX_TOKEN_CHARS = 512


class Role(str, enum.Enum):
    OPERATOR = "operator"
    CONTROLLER = "controller"
    AGENT = "agent"
    POLICY = "policy"


PUBLIC: frozenset[Role] = frozenset()  # open: read-only state, no request data

_C, _A, _P = "/remp.controller.v1.Controller/", "/remp.node_agent.v1.NodeAgent/", \
    "/remp.policy.v1.Policy/"
_F = "/remp.node_agent.v1.FaultInjection/"  # served only with the agent's fault-injection setting
O, CT, AG, PO = Role.OPERATOR, Role.CONTROLLER, Role.AGENT, Role.POLICY

# The one table. Values: the roles that may call; PUBLIC: anyone.
RPC_ACCESS: dict[str, frozenset[Role]] = {
    # controller
    _C + "RegisterNode": frozenset({AG}),
    _C + "Heartbeat": frozenset({AG}),
    _C + "ListNodes": PUBLIC,
    _C + "GetState": PUBLIC,
    _C + "Plan": PUBLIC,
    _C + "Reconfigure": frozenset({O, PO}),
    _C + "Watch": PUBLIC,  # capped per caller and in total (controller)
    _C + "Abort": frozenset({O}),
    _C + "GetSwitch": PUBLIC,
    _C + "ListSwitches": PUBLIC,
    _C + "GetTraffic": PUBLIC,
    _C + "RecordRecommendation": frozenset({PO}),
    _C + "DrainNode": frozenset({O}),
    _C + "ListRecoveries": frozenset({O, PO, CT}),  # request ids
    _C + "Rollout": frozenset({O, PO}),  # like Reconfigure: it runs switches
    _C + "GetRollout": PUBLIC,
    _C + "ListRollouts": PUBLIC,
    _C + "ControlRollout": frozenset({O, PO}),
    # node agent: switches and epochs only from the controller
    _A + "Describe": PUBLIC,
    _A + "ExecuteSwitch": frozenset({CT}),
    _A + "AbortSwitch": frozenset({CT}),
    _A + "GetSwitch": PUBLIC,
    _A + "ListRequests": frozenset({CT, O}),  # request data
    _A + "MigrateRequest": frozenset({CT, O}),
    _A + "ImportRequest": frozenset({AG, CT}),  # agent to agent; controller: lost-node recompute
    _A + "SetDraining": frozenset({CT, O}),
    # node agent, test-only controls (tests and benchmarks)
    _F + "ArmSwitch": frozenset({CT, O}),
    _F + "ArmMigration": frozenset({CT, O}),
    _F + "Disarm": frozenset({CT, O}),
    # policy
    _P + "GetForecast": PUBLIC,
    _P + "GetRecommendation": PUBLIC,
    _P + "SetMode": frozenset({O}),
    _P + "ListDecisions": PUBLIC,
}
OWN_SERVICES = ("/remp.controller.v1.Controller/", "/remp.node_agent.v1.NodeAgent/",
                "/remp.policy.v1.Policy/", _F)
OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.v1alpha.ServerReflection/",
                 "/grpc.reflection.v1.ServerReflection/")


def digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def _parse_value(role: Role, value: object, where: str) -> tuple[str | None, bytes]:
    if not isinstance(value, str) or not value or len(value) > MAX_TOKEN_CHARS:
        raise ConfigError(f"{where}: the {role.value} credential must be a non-empty string "
                          f"of at most {MAX_TOKEN_CHARS} characters")
    if value.startswith("sha256:"):
        try:
            d = bytes.fromhex(value[7:])
        except ValueError:
            d = b""
        if len(d) != 32:
            raise ConfigError(f"{where}: the {role.value} digest must be sha256:<64 hex digits>")
        return None, d
    if len(value) < 16 or any(c.isspace() for c in value) or not value.isprintable():
        raise ConfigError(f"{where}: the {role.value} token must be at least 16 printable "
                          "characters without spaces")
    return value, digest(value)


@dataclass(frozen=True)
class Caller:
    """Who is calling (set for the duration of one RPC)."""

    role: Role | None  # None: anonymous (PUBLIC method, no credential)
    peer: str  # ip without the port

    @property
    def key(self) -> str:
        """What per-caller limits count by."""
        return self.role.value if self.role else f"anon@{self.peer}"


_caller: contextvars.ContextVar[Caller | None] = contextvars.ContextVar("remp_caller", default=None)


def current_caller() -> Caller | None:
    return _caller.get()


@dataclass(frozen=True)
class Credentials:
    """The tokens a process may send (``tokens``) and those it accepts (``digests``), plus
    certificate common names accepted as roles on mutual-TLS links."""

    tokens: Mapping[Role, str] = field(default_factory=dict)
    digests: Mapping[Role, bytes | tuple[bytes, ...]] = field(default_factory=dict)
    tls_identities: Mapping[str, Role] = field(default_factory=dict)
    source: str = "none"
    allow_unauthenticated: bool = False

    # ------------------------------------------------------------------ loading
    @classmethod
    def generate(cls) -> "Credentials":
        toks = {r: secrets.token_urlsafe(32) for r in Role}
        return cls(toks, {r: digest(t) for r, t in toks.items()}, {}, "generated")

    @classmethod
    def from_mapping(cls, data: Mapping, where: str) -> "Credentials":
        if not isinstance(data, Mapping):
            raise ConfigError(f"{where}: expected a JSON object")
        unknown = set(data) - {"tokens", "tls_identities", "version"}
        if unknown:
            raise ConfigError(f"{where}: unknown keys {sorted(unknown)}")
        tokens, digests = {}, {}
        for name, value in (data.get("tokens") or {}).items():
            try:
                role = Role(name)
            except ValueError:
                raise ConfigError(f"{where}: unknown role {name!r} (roles: "
                                  f"{', '.join(r.value for r in Role)})") from None
            # a list during a rotation: every entry is accepted, the first token is sent
            values = value if isinstance(value, list) and value else [value]
            ds = []
            for v in values:
                tok, d = _parse_value(role, v, where)
                ds.append(d)
                if tok is not None and role not in tokens:
                    tokens[role] = tok
            digests[role] = tuple(ds)
        ids = {}
        for cn, name in (data.get("tls_identities") or {}).items():
            try:
                ids[str(cn)] = Role(name)
            except ValueError:
                raise ConfigError(f"{where}: tls_identities: unknown role {name!r}") from None
        return cls(tokens, digests, ids, where)

    @classmethod
    def load(cls, path: str | Path | None = None, env: Mapping[str, str] | None = None
             ) -> "Credentials":
        """From ``path`` (or ``$REMP_CREDENTIALS_FILE``), then ``$REMP_TOKEN_<ROLE>`` on top."""
        env = os.environ if env is None else env
        path = path or env.get(ENV_FILE) or None
        creds = cls()
        if path:
            p = Path(path)
            try:
                st = p.stat()
            except OSError as exc:
                raise ConfigError(f"credentials file {p}: {exc.strerror}") from None
            if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
                raise ConfigError(f"credentials file {p} is readable by others "
                                  f"(mode {stat.S_IMODE(st.st_mode):04o}); chmod 600 it")
            try:
                data = json.loads(p.read_text())
            except (OSError, ValueError) as exc:
                raise ConfigError(f"credentials file {p}: {exc}") from None
            creds = cls.from_mapping(data, str(p))
        tokens, digests = dict(creds.tokens), dict(creds.digests)
        for role in Role:
            v = env.get(ENV_TOKEN + role.name)
            if v:  # replaces the file's entry for that role
                tok, d = _parse_value(role, v, f"${ENV_TOKEN}{role.name}")
                digests[role] = (d,)
                tokens.pop(role, None)
                if tok is not None:
                    tokens[role] = tok
        allow = env.get(ENV_ALLOW_UNAUTHENTICATED, "") in ("1", "true", "yes")
        source = creds.source if path else ("environment" if digests else "none")
        return cls(tokens, digests, dict(creds.tls_identities), source, allow)

    def write(self, path: str | Path) -> Path:
        """Write the tokens this process holds to ``path``, mode 0600 from the first byte."""
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        data = {"version": 1, "tokens": {r.value: t for r, t in self.tokens.items()}}
        if self.tls_identities:
            data["tls_identities"] = {cn: r.value for cn, r in self.tls_identities.items()}
        tmp = p.with_name(p.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
        os.chmod(tmp, 0o600)
        os.replace(tmp, p)
        return p

    def only(self, *roles: Role) -> "Credentials":
        """The same verification, sending only ``roles``' tokens (a process's own identity)."""
        return Credentials({r: t for r, t in self.tokens.items() if r in roles}, self.digests,
                           self.tls_identities, self.source, self.allow_unauthenticated)

    # ------------------------------------------------------------------ use
    @property
    def enforcing(self) -> bool:
        return bool(self.digests or self.tls_identities)

    def require_for_server(self, what: str) -> None:
        """Servers refuse to start with nothing to check unless explicitly told to."""
        if not self.enforcing and not self.allow_unauthenticated:
            raise ConfigError(
                f"{what}: no credentials configured: set {ENV_FILE} (create one with "
                f"`remp credentials create FILE`) or {ENV_TOKEN}<ROLE>; "
                f"{ENV_ALLOW_UNAUTHENTICATED}=1 serves without authentication (never in production)")

    def role_of(self, token: str) -> Role | None:
        if not token or len(token) > MAX_TOKEN_CHARS:
            return None
        d = digest(token)
        found = None
        for role, want in self.digests.items():
            for w in (want if isinstance(want, tuple) else (want,)):
                if hmac.compare_digest(d, w):
                    found = role
        return found

    def token_for(self, method: str) -> str | None:
        """The token to send on ``method``: the first allowed role we hold a token for."""
        allowed = RPC_ACCESS.get(method)
        if allowed is None:
            return None
        if not allowed:  # public: send one anyway when we hold exactly one identity
            return next(iter(self.tokens.values())) if len(self.tokens) == 1 else None
        for role in Role:
            if role in allowed and role in self.tokens:
                return self.tokens[role]
        return None

    def metadata(self, method: str) -> tuple[tuple[str, str], ...]:
        tok = self.token_for(method)
        return (("authorization", f"Bearer {tok}"),) if tok else ()

    def authorize(self, method: str, metadata: Iterable, peer: str,
                  auth_context: Mapping | None = None) -> Caller:
        """The caller of ``method``, or raise :class:`Denied` (UNAUTHENTICATED / PERMISSION_DENIED)."""
        ip = _peer_ip(peer)
        allowed = RPC_ACCESS.get(method)
        if method.startswith(OPEN_PREFIXES):
            return Caller(None, ip)
        if allowed is None:
            if method.startswith(OWN_SERVICES):
                raise Denied(grpc.StatusCode.PERMISSION_DENIED,
                             f"{method} is not in the access table")
            return Caller(None, ip)
        role = None
        header = ""
        for k, v in metadata or ():
            if k == "authorization":
                header = v if isinstance(v, str) else ""
                break
        if header:
            if not header.startswith("Bearer ") or len(header) > MAX_TOKEN_CHARS + 7:
                raise Denied(grpc.StatusCode.UNAUTHENTICATED,
                             "malformed authorization header: send 'authorization: Bearer <token>'")
            role = self.role_of(header[7:])
            if role is None:
                raise Denied(grpc.StatusCode.UNAUTHENTICATED, "the credential was not accepted")
        elif auth_context and self.tls_identities:
            for cn in auth_context.get("x509_common_name", ()):
                cn = cn.decode(errors="replace") if isinstance(cn, bytes) else str(cn)
                if cn in self.tls_identities:
                    role = self.tls_identities[cn]
                    break
        if not allowed:
            return Caller(role, ip)
        if not self.enforcing and self.allow_unauthenticated:
            return Caller(role, ip)
        name = method.rsplit("/", 1)[-1]
        need = " or ".join(sorted(r.value for r in allowed))
        if role is None:
            raise Denied(grpc.StatusCode.UNAUTHENTICATED,
                         f"{name} needs a credential ({need}): send 'authorization: Bearer <token>'")
        if role not in allowed:
            raise Denied(grpc.StatusCode.PERMISSION_DENIED,
                         f"{name} is not allowed for role {role.value} (needs {need})")
        return Caller(role, ip)


class Denied(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


def _peer_ip(peer: str) -> str:
    # "ipv4:127.0.0.1:5555", "ipv6:[::1]:5555", "unix:/path"
    kind, _, rest = (peer or "").partition(":")
    if kind == "ipv4":
        return rest.rsplit(":", 1)[0]
    if kind == "ipv6":
        return rest.rsplit(":", 1)[0].strip("[]")
    return (peer or "unknown")[:64]


# ---------------------------------------------------------------------------- server side

class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Checks every call against :data:`RPC_ACCESS` before the servicer sees the request and
    sets :func:`current_caller` for it."""

    def __init__(self, creds: Credentials):
        self.creds = creds

    def _check(self, method: str, context) -> Caller:
        try:
            auth_ctx = context.auth_context() if self.creds.tls_identities else None
        except Exception:  # noqa: BLE001 - no TLS on this link
            auth_ctx = None
        return self.creds.authorize(method, context.invocation_metadata(), context.peer(),
                                    auth_ctx)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(OPEN_PREFIXES):
            return handler
        check = self._check

        async def gate(context) -> None:
            try:
                _caller.set(check(method, context))
            except Denied as d:
                await context.abort(d.code, str(d))

        kw = dict(request_deserializer=handler.request_deserializer,
                  response_serializer=handler.response_serializer)
        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def uu(request, context):
                await gate(context)
                return await inner(request, context)
            return grpc.unary_unary_rpc_method_handler(uu, **kw)
        if handler.unary_stream is not None:
            inner_us = handler.unary_stream

            async def us(request, context):
                await gate(context)
                async for item in inner_us(request, context):
                    yield item
            return grpc.unary_stream_rpc_method_handler(us, **kw)
        if handler.stream_unary is not None:
            inner_su = handler.stream_unary

            async def su(request_iterator, context):
                await gate(context)
                return await inner_su(request_iterator, context)
            return grpc.stream_unary_rpc_method_handler(su, **kw)
        inner_ss = handler.stream_stream

        async def ss(request_iterator, context):
            await gate(context)
            async for item in inner_ss(request_iterator, context):
                yield item
        return grpc.stream_stream_rpc_method_handler(ss, **kw)


# ---------------------------------------------------------------------------- client side

def _token_to_add(creds: Credentials, details) -> tuple[tuple[str, str], ...]:
    """The ``authorization`` metadata a client call should get: none when the caller set one
    itself (tests send wrong ones on purpose) or the method needs none."""
    if any(k == "authorization" for k, _ in (details.metadata or ())):
        return ()
    method = details.method
    return creds.metadata(method if isinstance(method, str) else method.decode())


def _with_token(creds: Credentials, details):
    md = _token_to_add(creds, details)
    return details._replace(metadata=[*(details.metadata or ()), *md]) if md else details


def aio_client_interceptors(creds: Credentials) -> list:
    """grpc.aio channel interceptors that attach the right token to every call."""

    def fix(d):
        md = _token_to_add(creds, d)
        if not md:
            return d
        have = grpc.aio.Metadata(*list(d.metadata or ()))
        for k, v in md:
            have.add(k, v)
        return grpc.aio.ClientCallDetails(d.method, d.timeout, have, d.credentials,
                                          d.wait_for_ready)

    class UU(grpc.aio.UnaryUnaryClientInterceptor):
        async def intercept_unary_unary(self, continuation, d, request):
            return await continuation(fix(d), request)

    class US(grpc.aio.UnaryStreamClientInterceptor):
        async def intercept_unary_stream(self, continuation, d, request):
            return await continuation(fix(d), request)

    class SU(grpc.aio.StreamUnaryClientInterceptor):
        async def intercept_stream_unary(self, continuation, d, request_iterator):
            return await continuation(fix(d), request_iterator)

    class SS(grpc.aio.StreamStreamClientInterceptor):
        async def intercept_stream_stream(self, continuation, d, request_iterator):
            return await continuation(fix(d), request_iterator)

    return [UU(), US(), SU(), SS()]


class _SyncInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                       grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    def __init__(self, creds: Credentials):
        self.creds = creds

    def _d(self, d):
        return _with_token(self.creds, d)

    def intercept_unary_unary(self, continuation, d, request):
        return continuation(self._d(d), request)

    def intercept_unary_stream(self, continuation, d, request):
        return continuation(self._d(d), request)

    def intercept_stream_unary(self, continuation, d, request_iterator):
        return continuation(self._d(d), request_iterator)

    def intercept_stream_stream(self, continuation, d, request_iterator):
        return continuation(self._d(d), request_iterator)


def _tls_files(env: Mapping[str, str]) -> tuple[Path | None, Path | None, Path | None]:
    cert, key, ca = (env.get(k) or None for k in (ENV_TLS_CERT, ENV_TLS_KEY, ENV_TLS_CA))
    if bool(cert) != bool(key):
        raise ConfigError(f"{ENV_TLS_CERT} and {ENV_TLS_KEY} go together")
    for p in filter(None, (cert, key, ca)):
        if not Path(p).is_file():
            raise ConfigError(f"TLS file {p} does not exist")
    return (Path(cert) if cert else None, Path(key) if key else None, Path(ca) if ca else None)


def server_tls_files_from_env(env: Mapping[str, str] | None = None
                              ) -> tuple[Path, Path, Path | None] | None:
    """(cert, key, client CA or None) from $REMP_TLS_*, or None when no certificate is set."""
    cert, key, ca = _tls_files(os.environ if env is None else env)
    return None if cert is None else (cert, key, ca)


def channel_tls(ca: Path, cert: Path | None = None, key: Path | None = None
                ) -> grpc.ChannelCredentials:
    """Client TLS: servers checked against ``ca``; with ``cert``/``key`` we present our own
    certificate (mutual TLS). The one builder every client link uses."""
    return grpc.ssl_channel_credentials(
        root_certificates=ca.read_bytes(), private_key=key.read_bytes() if key else None,
        certificate_chain=cert.read_bytes() if cert else None)


def client_tls_from_env(env: Mapping[str, str] | None = None) -> grpc.ChannelCredentials | None:
    """Channel credentials from $REMP_TLS_CA (+ our certificate for mutual TLS), or None."""
    cert, key, ca = _tls_files(os.environ if env is None else env)
    return channel_tls(ca, cert, key) if ca is not None else None


def aio_channel(address: str, creds: Credentials | None, *,
                channel_credentials: grpc.ChannelCredentials | None = None,
                options=None) -> grpc.aio.Channel:
    """A grpc.aio channel that sends ``creds``' token on every call; TLS with
    ``channel_credentials``, else with $REMP_TLS_CA when set."""
    ic = aio_client_interceptors(creds) if creds is not None and creds.tokens else None
    channel_credentials = channel_credentials or client_tls_from_env()
    if channel_credentials is not None:
        return grpc.aio.secure_channel(address, channel_credentials, options=options,
                                       interceptors=ic)
    return grpc.aio.insecure_channel(address, options=options, interceptors=ic)


def intercept(channel: grpc.Channel, creds: Credentials | None) -> grpc.Channel:
    """An existing sync channel that also sends ``creds``' token where the table asks for one."""
    if creds is None or not creds.tokens:
        return channel
    return grpc.intercept_channel(channel, _SyncInterceptor(creds))


def sync_channel(address: str, creds: Credentials | None, *,
                 channel_credentials: grpc.ChannelCredentials | None = None,
                 options=None) -> grpc.Channel:
    channel_credentials = channel_credentials or client_tls_from_env()
    ch = (grpc.secure_channel(address, channel_credentials, options=options)
          if channel_credentials is not None else grpc.insecure_channel(address, options=options))
    if creds is not None and creds.tokens:
        return grpc.intercept_channel(ch, _SyncInterceptor(creds))
    return ch
