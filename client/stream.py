"""`PackStream`: a trainer rank's iterator of balanced packs, as torch tensors, from a Packfeed server.

    from packfeed.client import PackStream

    stream = PackStream("loader:50051", job="run-7", rank=rank, dp=world, microbatches=4, seed=0)
    for step in stream:             # Step(epoch, step, packs=[M PackTensors in 1F1B order])
        for pack in step.packs:
            pack.input_ids, pack.labels, pack.cu_seqlens, pack.pixels, ...
        checkpoint["data"] = stream.state_dict()    # resumes at exactly the next step

A background thread receives and converts the next `prefetch` steps while the trainer computes. Tensors
are built over the message bytes without a copy (read-only: clone before writing in place), or copied once
into pinned memory with `pin_memory=True` for `.to("cuda", non_blocking=True)`. A broken connection is
retried with exponential backoff from the first step not yet received, and a server that restarted (jobs
live in its memory) is asked to open the job again: plans are deterministic, so it streams the very same
packs from there. Errors that retrying cannot fix
(unknown job, bad rank, contradicting config, wrong token) raise `PackfeedError` at once.
"""

from __future__ import annotations

import queue
import threading
import time
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
import torch
from packfeed.client.wire import PackAssembler, array_of, split_pack
from packfeed.v1 import packfeed_pb2 as pb
from packfeed.v1 import packfeed_pb2_grpc as pb_grpc

RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED,
             grpc.StatusCode.ABORTED, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
TENSOR_NAMES = ("input_ids", "labels", "position_ids", "cu_seqlens", "pixels", "tile_shapes", "tile_image",
                "image_sample", "image_token_spans")


class PackfeedError(RuntimeError):
    """A request the server refused, or a stream that could not be restored within the retries."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None):
        super().__init__(message)
        self.code = code


@dataclass
class PackTensors:
    """One pack. Tensors (all int32 except `pixels`, uint8): input_ids, labels, position_ids (L); cu_seqlens
    (samples + 1); pixels (every tile's C*H*W bytes); tile_shapes (tiles x 3); tile_image (tiles);
    image_sample (images); image_token_spans (images x 2: start in input_ids, length)."""

    epoch: int
    step: int
    rank: int
    microbatch: int
    empty: bool
    sample_keys: list[str]
    loss_tokens: int
    step_loss_tokens: int
    skipped: list[tuple[str, str]]
    tensors: dict[str, torch.Tensor]
    nbytes: int = 0
    microbatches: int = 1
    last_in_epoch: bool = False

    def __getattr__(self, name: str) -> torch.Tensor:
        tensors = self.__dict__.get("tensors", {})
        if name in tensors:
            return tensors[name]
        raise AttributeError(name)

    def tiles(self) -> list[torch.Tensor]:
        """Every tile as a (C, H, W) uint8 view of `pixels`."""
        out, offset = [], 0
        for c, h, w in self.tile_shapes.tolist():
            out.append(self.pixels[offset:offset + c * h * w].view(c, h, w))
            offset += c * h * w
        return out


@dataclass
class Step:
    epoch: int
    step: int
    rank: int
    packs: list[PackTensors]
    last_in_epoch: bool = False

    @property
    def sample_keys(self) -> list[str]:
        return [key for pack in self.packs for key in pack.sample_keys]

    @property
    def step_loss_tokens(self) -> int:
        return self.packs[0].step_loss_tokens if self.packs else 0

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.packs)


def tensor_of(array: np.ndarray, pin_memory: bool = False) -> torch.Tensor:
    """A torch view of a read-only numpy view of the message bytes (or one copy into pinned memory)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        tensor = torch.from_numpy(array)
    return tensor.pin_memory() if pin_memory else tensor


def pack_of(message: bytes, pin_memory: bool = False) -> PackTensors:
    """A serialized `packfeed.v1.Pack` as torch tensors over the message's own bytes."""
    fields, wires = split_pack(message)
    tensors = {name: tensor_of(array_of(message, wire), pin_memory) for name, wire in wires.items()}
    return PackTensors(fields.epoch, fields.step, fields.rank, fields.microbatch, fields.empty,
                       list(fields.sample_keys), fields.loss_tokens, fields.step_loss_tokens,
                       [(s.key, s.reason) for s in fields.skipped], tensors,
                       sum(wire.nbytes for wire in wires.values()), fields.microbatches, fields.last_in_epoch)


class PackStream:
    """Iterate this rank's steps of a job, opening (or joining) it on the server first.

    `target` is "host:port"; with `index=` instead, an embedded server is started on loopback for this
    stream (see `packfeed.client.LocalServer` to share one between several ranks of one process).
    Plan settings (dp, microbatches, pipeline_stages, strategy, vision_cap/token_cap, oversize, seed,
    epochs, cost_model) must be the same on every rank: the server refuses a contradiction
    (FAILED_PRECONDITION). `target` may list several servers of one deployment: on failure the stream moves
    to the next and continues from the first step it has not fully received (`servers_from_redis` lists the
    live ones). TLS: `tls_ca` (PEM) verifies the server; `tls_cert` + `tls_key` add a client certificate for
    mutual TLS. `cost_model` = {vision_linear, vision_quadratic, llm_linear, llm_quadratic}, e.g.
    the coefficients `packfeed train` measured (OUT/cost_model.json); None = the server's default.
    """

    def __init__(self, target: str | None = None, *, job: str, rank: int, dp: int, microbatches: int = 1,
                 seed: int = 0, dataset: str = "", pipeline_stages: int = 1, strategy: str = "",
                 epochs: int = 1, vision_cap: int = 0, token_cap: int = 0, oversize: str = "",
                 prefetch: int = 2, pin_memory: bool = False, timeout: float = 60.0, retries: int = 5,
                 backoff: float = 0.5, token: str | None = None, acknowledge: bool = True,
                 index: str | None = None, max_message_mb: int = 256, cost_model: dict | None = None,
                 tls_ca: str | None = None, tls_cert: str | None = None, tls_key: str | None = None):
        if (target is None) == (index is None):
            raise ValueError("give a server target ('host:port', or several for failover) or an index for an "
                             "embedded server, not both")
        self._local = None
        if index is not None:
            from packfeed.client.local import LocalServer

            self._local = LocalServer(index).start()
            target = self._local.target
        self.targets = [target] if isinstance(target, str) else list(target)
        if not self.targets:
            raise ValueError("no server target given")
        self.job, self.rank = job, rank
        self.prefetch, self.pin_memory, self.timeout = max(1, prefetch), pin_memory, timeout
        self.retries, self.backoff, self.acknowledge = retries, backoff, acknowledge
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._message_size = max_message_mb << 20
        self._credentials = None
        if tls_ca or tls_cert:  # TLS: verify the server against tls_ca; present tls_cert/tls_key for mutual TLS
            read = lambda path: open(path, "rb").read() if path else None  # noqa: E731
            self._credentials = grpc.ssl_channel_credentials(read(tls_ca), read(tls_key), read(tls_cert))
        self._switching = threading.Lock()
        self._target_index = 0
        self._connect()
        self._open_request = pb.OpenJobRequest(job=job, dataset=dataset, seed=seed, epochs=epochs, plan=pb.PlanSpec(
            dp=dp, microbatches=microbatches, pipeline_stages=pipeline_stages, strategy=strategy,
            vision_cap=vision_cap, token_cap=token_cap, oversize=oversize,
            cost_model=pb.CostCoefficients(**cost_model) if cost_model else None))
        self.info: pb.JobInfo = self._call("OpenJob", self._open_request)
        if not 0 <= rank < self.info.plan.dp:
            raise PackfeedError(f"rank {rank} is outside the job's {self.info.plan.dp} ranks")
        self.microbatches = self.info.plan.microbatches
        self._next: tuple[int, int] | None = (0, 0)  # the next step the trainer will get
        self._consumed: tuple[int, int] | None = None
        self._acks = ThreadPoolExecutor(max_workers=1, thread_name_prefix="packfeed-ack")
        self._receiver: _Receiver | None = None
        self.wait_seconds = 0.0  # time the trainer spent blocked in next()

    # -- resumption -------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"job": self.job, "rank": self.rank, "plan_fingerprint": self.info.plan_fingerprint,
                "next": list(self._next) if self._next else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at exactly the step after the last one delivered when `state` was taken."""
        if state["job"] != self.job or state["plan_fingerprint"] != self.info.plan_fingerprint:
            raise PackfeedError(f"state is of job {state['job']!r} (plan {state['plan_fingerprint']}), this stream "
                                f"is job {self.job!r} (plan {self.info.plan_fingerprint})")
        if state["rank"] != self.rank:
            raise PackfeedError(f"state is of rank {state['rank']}, this stream is rank {self.rank}")
        self._stop_receiver()
        self._next = tuple(state["next"]) if state["next"] else None

    # -- iteration --------------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Step]:
        return self

    def __next__(self) -> Step:
        if self._consumed is not None:
            self._ack(*self._consumed)
            self._consumed = None
        if self._next is None:
            raise StopIteration
        if self._receiver is None:
            self._receiver = _Receiver(self, self._next)
        started = time.perf_counter()
        item = self._receiver.get()
        self.wait_seconds += time.perf_counter() - started
        if isinstance(item, BaseException):
            self._stop_receiver()
            raise item
        if item is None:
            self._next = None
            raise StopIteration
        self._consumed = (item.epoch, item.step)
        self._next = item.following
        return item.step_obj

    def _ack(self, epoch: int, step: int) -> None:
        if self.acknowledge:
            request = pb.AckStepRequest(job=self.job, rank=self.rank, epoch=epoch, step=step)
            self._acks.submit(self._stub.AckStep, request, timeout=self.timeout, metadata=self._metadata)

    # -- plumbing ---------------------------------------------------------------------------------------

    @property
    def target(self) -> str:
        """The server this stream talks to now."""
        return self.targets[self._target_index]

    def _connect(self) -> None:
        size = self._message_size
        options = [("grpc.max_receive_message_length", size), ("grpc.max_send_message_length", size)]
        self._channel = grpc.secure_channel(self.target, self._credentials, options=options) \
            if self._credentials else grpc.insecure_channel(self.target, options=options)
        self._stub = pb_grpc.PackfeedStub(self._channel)
        # Packs arrive as raw PackPart bytes (bounded messages, see packfeed.proto), joined by PackAssembler;
        # `pack_of` reads a pack without protobuf's copies of the tensor payload.
        self._stream_packs = self._channel.unary_stream(
            f"/{pb.DESCRIPTOR.services_by_name['Packfeed'].full_name}/StreamPackParts",
            request_serializer=pb.StreamPacksRequest.SerializeToString, response_deserializer=None)

    def _fail_over(self) -> None:
        """Move on to the next known server (round robin); a no-op with one target."""
        if len(self.targets) < 2:
            return
        with self._switching:
            old = self._channel
            self._target_index = (self._target_index + 1) % len(self.targets)
            self._connect()
        old.close()

    def _call(self, name: str, request):
        """A unary call by method name, retried with backoff, failing over between known servers."""
        for attempt in range(self.retries + 1):
            try:
                return getattr(self._stub, name)(request, timeout=self.timeout, metadata=self._metadata)
            except grpc.RpcError as error:
                if error.code() not in RETRYABLE or attempt == self.retries:
                    raise PackfeedError(f"{error.code().name}: {error.details()}", error.code()) from None
                self._fail_over()
                time.sleep(self.backoff * 2 ** attempt)
        raise AssertionError("unreachable")

    def _reopen(self) -> None:
        """After a server restart (it keeps jobs in memory): open the job again. Plans are a pure function of
        the job's settings, so the new server streams the same packs, unless the dataset changed under it."""
        info = self._call("OpenJob", self._open_request)
        if info.plan_fingerprint != self.info.plan_fingerprint:
            raise PackfeedError(f"job {self.job!r} was re-opened after a server restart with another plan "
                                f"({info.plan_fingerprint}, was {self.info.plan_fingerprint}): did the index change?",
                                grpc.StatusCode.FAILED_PRECONDITION)

    def _stop_receiver(self) -> None:
        if self._receiver is not None:
            self._receiver.stop()
            self._receiver = None

    def close(self) -> None:
        if self._consumed is not None:
            self._ack(*self._consumed)
            self._consumed = None
        self._stop_receiver()
        self._acks.shutdown(wait=True)
        self._channel.close()
        if self._local is not None:
            self._local.stop()

    def __enter__(self) -> PackStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class _Received:
    step_obj: Step
    epoch: int
    step: int
    following: tuple[int, int] | None


@dataclass
class _Receiver:
    """Background thread: reads the server stream, groups M packs into a Step, converts to tensors, and
    keeps up to `prefetch` steps ready. Reconnects from the first step it has not fully received."""

    stream: PackStream
    start: tuple[int, int]
    ready: queue.Queue = field(init=False)

    def __post_init__(self):
        self.ready = queue.Queue(maxsize=self.stream.prefetch)
        self._stopped = threading.Event()
        self._call = None
        self._thread = threading.Thread(target=self._run, name=f"packfeed-rank{self.stream.rank}", daemon=True)
        self._thread.start()

    def get(self):
        while True:
            try:
                return self.ready.get(timeout=0.5)
            except queue.Empty:
                if not self._thread.is_alive() and self.ready.empty():
                    return PackfeedError("the receiving thread ended unexpectedly")

    def stop(self) -> None:
        self._stopped.set()
        if self._call is not None:
            self._call.cancel()
        while self._thread.is_alive():
            try:
                self.ready.get_nowait()
            except queue.Empty:
                self._thread.join(timeout=0.1)

    def _put(self, item) -> bool:
        while not self._stopped.is_set():
            try:
                self.ready.put(item, timeout=0.2)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        s = self.stream
        cursor, failures = self.start, 0
        while not self._stopped.is_set():
            request = pb.StreamPacksRequest(job=s.job, rank=s.rank, first_epoch=cursor[0], first_step=cursor[1])
            try:
                self._call = s._stream_packs(request, metadata=s._metadata)
                packs: list[PackTensors] = []
                assembler = PackAssembler()
                for part in self._call:
                    message = assembler.add(part)
                    if message is None:
                        continue
                    pack = pack_of(message, s.pin_memory)
                    packs.append(pack)
                    if len(packs) < pack.microbatches:
                        continue
                    following = None if pack.last_in_epoch and pack.epoch + 1 >= s.info.epochs else (
                        (pack.epoch + 1, 0) if pack.last_in_epoch else (pack.epoch, pack.step + 1))
                    step = Step(pack.epoch, pack.step, pack.rank, packs, pack.last_in_epoch)
                    packs, failures = [], 0
                    if not self._put(_Received(step, pack.epoch, pack.step, following)):
                        return
                    if following is None:
                        self._put(None)
                        return
                    cursor = following
                if not self._stopped.is_set():  # the server ended the stream early: ask again from the cursor
                    raise _Retry("stream ended before the job's last step")
            except (grpc.RpcError, _Retry) as error:
                if self._stopped.is_set():
                    return
                code = error.code() if isinstance(error, grpc.RpcError) else grpc.StatusCode.UNAVAILABLE
                details = error.details() if isinstance(error, grpc.RpcError) else str(error)
                if code == grpc.StatusCode.NOT_FOUND and failures < s.retries:  # a restarted server forgot the job
                    failures += 1
                    try:
                        s._reopen()
                    except PackfeedError as reopen_error:
                        self._put(reopen_error)
                        return
                    continue
                if code not in RETRYABLE or failures >= s.retries:
                    self._put(PackfeedError(f"{code.name}: {details} (job {s.job!r}, rank {s.rank}, "
                                            f"step {cursor[0]}:{cursor[1]}, servers {s.targets})", code))
                    return
                s._fail_over()  # another server (when several are known) continues from the same step
                time.sleep(s.backoff * 2 ** failures)
                failures += 1
            except Exception as error:  # never leave the trainer waiting on a dead thread
                self._put(PackfeedError(f"receiving packs failed: {error!r}"))
                return


class _Retry(Exception):
    pass
