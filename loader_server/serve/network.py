"""How the server meets the network: ports (first free one of a range), TLS and mutual TLS, token auth,
message limits, the Prometheus endpoint, and the address it advertises to clients."""

from __future__ import annotations

import hmac
import re
from pathlib import Path

import grpc

from packfeed.server.serve.config import ServerConfig, port_candidates
from packfeed.server.serve.status import start_status_server


def client_host(peer: str) -> str:
    """'ipv4:10.0.0.7:51234' / 'ipv6:[::1]:51234' -> the host part: limits apply per client machine."""
    address = peer.split(":", 1)[1] if ":" in peer else peer
    return address.rsplit(":", 1)[0].strip("[]") if ":" in address else address


def bearer_matches(authorization: str, expected: bytes) -> bool:
    """`Bearer <token>` (the scheme in any case, as HTTP has it) naming the expected token, compared in constant
    time."""
    scheme, _, token = authorization.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), expected)


class TokenAuth(grpc.aio.ServerInterceptor):
    """Calls must carry `authorization: Bearer <token>` (the scheme in any case, as HTTP has it); health checks
    are open (for orchestrators)."""

    def __init__(self, token: str):
        self.expected = token.encode()

        def refusal(why: str):
            async def deny(request, context):
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"{why}: this server needs its token as "
                                    "metadata 'authorization: Bearer <token>' (the Python client sends "
                                    "$PACKFEED_AUTH_TOKEN, the variable the server reads its own from, or "
                                    "Connection(token=...))")
            return grpc.unary_unary_rpc_method_handler(deny)

        self.missing, self.wrong = refusal("no token was sent"), refusal("the token sent is not this server's")

    async def intercept_service(self, continuation, details):
        if details.method.startswith("/grpc.health.v1.Health/"):
            return await continuation(details)
        authorization = str(dict(details.invocation_metadata or ()).get("authorization", ""))
        if bearer_matches(authorization, self.expected):
            return await continuation(details)
        return self.wrong if authorization else self.missing


def grpc_options(config: ServerConfig) -> list[tuple[str, int]]:
    size = config.max_message_mb << 20
    # so_reuseport off: a second server on a taken port must fail to bind (and move on in its range), not
    # silently share the port and have the kernel split clients between the two
    return [("grpc.max_send_message_length", size), ("grpc.max_receive_message_length", size),
            ("grpc.so_reuseport", 0)]


def bind(server: grpc.aio.Server, config: ServerConfig) -> int:
    """Listen on the first free port of `config.listen` (host:port or host:first-last); returns it."""
    host, _, spec = config.listen.rpartition(":")
    credentials = None
    if config.tls_cert:
        client_ca = Path(config.tls_client_ca).read_bytes() if config.tls_client_ca else None
        credentials = grpc.ssl_server_credentials(
            [(Path(config.tls_key).read_bytes(), Path(config.tls_cert).read_bytes())],
            root_certificates=client_ca, require_client_auth=client_ca is not None)
    for candidate in port_candidates(spec):
        address = f"{host}:{candidate}"
        try:
            port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
        except RuntimeError:  # grpcio raises where older versions returned 0
            port = 0
        if port:
            return port
    raise OSError(f"cannot listen on {config.listen}: every port is taken, or {host} is not an address of this "
                  "machine; free a port, give a range (host:50051-50058), or change listen")


def start_metrics(config: ServerConfig, registry, report) -> int:
    """Prometheus `/metrics` and the status page (`packfeed.server.serve.status`) on the first free port of
    `metrics_port`; 0 when off."""
    host = config.listen.rpartition(":")[0].strip("[]") or "0.0.0.0"
    candidates = port_candidates(config.metrics_port)
    if candidates == [0]:
        return 0
    for candidate in candidates:
        try:
            token = config.auth_token.encode()
            start_status_server(host, candidate, registry, report,
                                (lambda header: bearer_matches(header, token)) if config.auth_token else None)
            return candidate
        except OSError:
            continue
    raise OSError(f"cannot serve metrics on {host}:{config.metrics_port}: every port is taken; give a free port "
                  "or a range (metrics_port: 9400-9407), or 0 for no metrics")


def advertised_address(config: ServerConfig, port: int) -> str:
    """Where clients reach this server: `advertise` (a host alone gets the bound port), else the listen host."""
    if config.advertise:
        return config.advertise if re.search(r":\d+$", config.advertise) else f"{config.advertise}:{port}"
    host = config.listen.rpartition(":")[0].strip("[]")
    return f"{'127.0.0.1' if host in ('', '0.0.0.0', '::') else host}:{port}"
