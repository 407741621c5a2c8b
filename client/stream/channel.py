"""How a client reaches Packfeed servers: `Connection` (timeouts, retries, token, TLS, message size) and
`ServerChannel`, a gRPC channel to one of several known servers that retries with exponential backoff and
fails over to the next server round robin."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from packfeed.v1 import packfeed_pb2 as pb
from packfeed.v1 import packfeed_pb2_grpc as pb_grpc

RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED,
             grpc.StatusCode.ABORTED, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
TOKEN_VARIABLE = "PACKFEED_AUTH_TOKEN"
_STREAM_PARTS = f"/{pb.DESCRIPTOR.services_by_name['Packfeed'].full_name}/StreamPackParts"


class PackfeedError(RuntimeError):
    """A request the server refused, or a stream that could not be restored within the retries."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None):
        super().__init__(message)
        self.code = code


class ProducersGone(PackfeedError):
    """A live job's stream waited for a step while no sample was put for its `producer_timeout_s`: its producers
    are gone (the message names the job and the producers its server heard from). Not retried."""

    def __init__(self, message: str, job: str):
        super().__init__(message, grpc.StatusCode.FAILED_PRECONDITION)
        self.job = job


@dataclass(frozen=True)
class Connection:
    """Client-side connection settings. TLS: `tls_ca` (PEM) verifies the server; `tls_cert` + `tls_key` add a
    client certificate for mutual TLS. `token` is sent as `authorization: Bearer <token>`; left out (None), it is
    the environment's `PACKFEED_AUTH_TOKEN`, the variable `packfeed serve` reads its own from (an empty string:
    no token whatever the environment says)."""

    timeout: float = 60.0  # seconds per unary call
    retries: int = 5  # attempts after the first, with exponential backoff
    backoff: float = 0.5  # seconds before the first retry, doubling
    max_backoff: float = 10.0  # seconds between two retries at most (where the doubling stops)
    token: str | None = field(default=None, repr=False)  # never in a repr (logs, tracebacks)
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    max_message_mb: int = 256
    stall_timeout: float = 120.0  # seconds without data on a pack stream before it is given up and retried

    def __post_init__(self):
        if self.token is None:
            object.__setattr__(self, "token", os.environ.get(TOKEN_VARIABLE) or None)
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("give both tls_cert and tls_key (mutual TLS), or neither")
        if min(self.retries, self.backoff, self.max_backoff) < 0 or self.timeout <= 0 or self.stall_timeout <= 0:
            raise ValueError("retries, backoff and max_backoff must be >= 0, timeout and stall_timeout > 0")

    def delay(self, attempt: int) -> float:
        """Seconds to wait before retry `attempt` (from 0): `backoff` doubling, never over `max_backoff` (uncapped,
        12 retries would sleep 7 minutes before the last)."""
        return min(self.backoff * 2 ** min(attempt, 60), self.max_backoff)

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    def credentials(self) -> grpc.ChannelCredentials | None:
        if not (self.tls_ca or self.tls_cert):
            return None
        read = lambda path: Path(path).read_bytes() if path else None  # noqa: E731
        return grpc.ssl_channel_credentials(read(self.tls_ca), read(self.tls_key), read(self.tls_cert))

    def channel(self, target: str) -> grpc.Channel:
        size = self.max_message_mb << 20
        options = [("grpc.max_receive_message_length", size), ("grpc.max_send_message_length", size)]
        credentials = self.credentials()
        return grpc.secure_channel(target, credentials, options=options) if credentials \
            else grpc.insecure_channel(target, options=options)


class _MovedOn(Exception):
    """A call started on a channel another thread's fail_over() closed between the call reading the stub and
    starting (grpc raises ValueError "closed channel"): not the server's answer, so the call goes again, to the
    server the channel moved to."""


def _closed_under(error: grpc.RpcError, moved: bool) -> bool:
    """A call cancelled because this client closed its channel (grpc says "Channel closed!"; a server never
    does), or the channel moved on meanwhile: the call goes again, to the server the channel moved to."""
    return moved or (error.code() == grpc.StatusCode.CANCELLED and error.details() == "Channel closed!")


def _starting(method, request, **options):
    """`method(request, **options)`, grpc's "closed channel" ValueError raised as _MovedOn."""
    try:
        return method(request, **options)
    except ValueError as error:
        if "closed channel" not in str(error):
            raise
        raise _MovedOn from error


def _unavailable(why: str) -> PackfeedError:
    return PackfeedError(f"UNAVAILABLE: {why}", grpc.StatusCode.UNAVAILABLE)


class ServerChannel:
    """A channel to the current one of `targets`; `fail_over()` moves to the next."""

    def __init__(self, targets: list[str], connection: Connection):
        if not targets:
            raise ValueError("no server target given")
        self.targets, self.connection = list(targets), connection
        self._index = 0
        self._switching = threading.Lock()
        self._connect()

    @property
    def target(self) -> str:
        """The server this channel talks to now."""
        return self.targets[self._index]

    def _connect(self) -> None:
        self._channel = self.connection.channel(self.target)
        self._stub = pb_grpc.PackfeedStub(self._channel)
        # Packs arrive as raw PackPart bytes (no deserializer): the client reads tensors without protobuf copies
        self._parts = self._channel.unary_stream(_STREAM_PARTS, request_serializer=pb.StreamPacksRequest.SerializeToString,
                                                 response_deserializer=None)

    def fail_over(self) -> None:
        """Move on to the next known server (round robin); a no-op with one target."""
        if len(self.targets) < 2:
            return
        with self._switching:
            old = self._channel
            self._index = (self._index + 1) % len(self.targets)
            self._connect()
        old.close()

    def call(self, name: str, request, final: tuple[grpc.StatusCode, ...] = ()):
        """A unary call by method name, retried with backoff, failing over between known servers; codes in
        `final` are raised at once (the caller waits on them its own way)."""
        retries = self.connection.retries
        for attempt in range(retries + 1):
            stub = self._stub
            try:
                return self._invoke(stub, name, request)
            except grpc.RpcError as error:
                if _closed_under(error, stub is not self._stub) and attempt < retries:  # another thread's fail_over()
                    continue
                if error.code() not in RETRYABLE or error.code() in final or attempt == retries:
                    raise PackfeedError(f"{error.code().name}: {error.details()}", error.code()) from None
                self.fail_over()
            except _MovedOn:
                if attempt == retries:
                    raise _unavailable(f"the channel moved to {self.target} as the call started") from None
                continue
            time.sleep(self.connection.delay(attempt))
        raise AssertionError("unreachable")

    def ask(self, name: str, request):
        """A unary call to the server this channel talks to now, once: no retry and no failover (the stream's
        receiver owns those), an error raised as PackfeedError (UNAVAILABLE when another thread moved the channel
        on during the call)."""
        stub = self._stub
        try:
            return self._invoke(stub, name, request)
        except grpc.RpcError as error:
            if _closed_under(error, stub is not self._stub):
                raise _unavailable(f"the channel moved to {self.target} during the call") from None
            raise PackfeedError(f"{error.code().name}: {error.details()}", error.code()) from None
        except _MovedOn:
            raise _unavailable(f"the channel moved to {self.target} as the call started") from None

    def send(self, name: str, request) -> None:
        """A unary call whose answer nobody waits for (acknowledgements): no retry, errors ignored."""
        try:
            self._invoke(self._stub, name, request)
        except (grpc.RpcError, _MovedOn):
            pass  # the next acknowledgement covers this one: cursors only move forward

    def _invoke(self, stub, name: str, request):
        return _starting(getattr(stub, name), request, timeout=self.connection.timeout,
                         metadata=self.connection.metadata)

    def stream_parts(self, request: pb.StreamPacksRequest) -> Iterator[bytes]:
        """StreamPackParts as raw serialized PackPart messages (a call object: `cancel()` ends it)."""
        try:
            return _starting(self._parts, request, metadata=self.connection.metadata)
        except _MovedOn:
            return self._parts(request, metadata=self.connection.metadata)  # the server another thread moved to

    def close(self) -> None:
        self._channel.close()
