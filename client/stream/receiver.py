"""The background thread behind `PackStream`: reads a rank's pack stream, joins PackPart pieces into packs,
groups M packs into a `Step`, converts them to tensors and keeps up to `prefetch` steps ready.

A broken connection is retried with exponential backoff from the first step not fully received, on the
next known server when there are several; so is a stream that stays silent for `stall_timeout` seconds while
the receiver waits for data (a hung server), which a watchdog cancels. A server that forgot the job (it
restarted) is asked to open it again through `reopen`. Errors retrying cannot fix are handed to the trainer
as `PackfeedError`.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from packfeed.client.stream.channel import RETRYABLE, PackfeedError, ProducersGone, ServerChannel
from packfeed.client.stream.decode import PackDecoder
from packfeed.client.stream.tensors import PackTensors, Step, pack_of
from packfeed.client.stream.wire import PackAssembler
from packfeed.v1 import packfeed_pb2 as pb
from packfeed.v1.layout import Seat


@dataclass
class Received:
    step: Step
    following: tuple[int, int] | None  # the step after this one, None at the end of the job


def seat_fields(seat: Seat) -> dict:
    """A request's fields for `seat`: the `seat` message, and v1's separate fields saying the same, which servers
    from before the seat message read instead."""
    return dict(seat=pb.Seat(rank=seat.rank, replica=seat.replica, lane=seat.lane, encoder=seat.encoder),
                rank=seat.rank, replica=seat.replica, cp_rank=seat.lane, encoder=seat.encoder)


class _Retry(Exception):
    """The server ended the stream before the job's last step: ask again from the cursor."""


class Receiver:
    def __init__(self, channel: ServerChannel, job: str, seat: Seat, info: pb.JobInfo, start: tuple[int, int],
                 prefetch: int, pin_memory: bool, reopen: Callable[[], None], decoder: PackDecoder | None = None,
                 replicas: int = 1):
        self.channel, self.job, self.seat, self.replicas = channel, job, seat, replicas
        self.decoder = decoder  # pixels: encoded: images become tiles here, while the trainer computes
        self.epochs, self.plan_fingerprint = info.epochs, info.plan_fingerprint
        self.pin_memory, self.reopen = pin_memory, reopen
        self.ready: queue.Queue = queue.Queue(maxsize=prefetch)
        self._stopped = threading.Event()
        self._call = None
        self.cursor, self.failures = start, 0  # the first step not yet received; consecutive failures
        self._heard = time.monotonic()  # last sign of life from the server (or from the trainer taking a step)
        self._stalled = False
        self.live_state: pb.LiveStatus | None = None  # a live job's state, as its waiting stream last sent it
        self._thread = threading.Thread(target=self._run, name=f"packfeed-{seat.lease_name}", daemon=True)
        self._thread.start()
        threading.Thread(target=self._watch, name=f"packfeed-watch-{seat.lease_name}", daemon=True).start()

    def get(self) -> Received | BaseException | None:
        """The next step, an error to raise, or None at the end of the job."""
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

    def _elsewhere(self, code: grpc.StatusCode | None) -> bool:
        """A server that holds another plan of the job (FAILED_PRECONDITION) is not the job's: with several
        servers known, try the next."""
        return code == grpc.StatusCode.FAILED_PRECONDITION and len(self.channel.targets) > 1

    def _put(self, item) -> bool:
        while not self._stopped.is_set():
            try:
                self.ready.put(item, timeout=0.2)
                return True
            except queue.Full:
                self._heard = time.monotonic()  # waiting for the trainer, not for the server
        return False

    def _watch(self) -> None:
        """Cancel a stream that has been silent for `stall_timeout` while the receiver waits on it."""
        stall = self.channel.connection.stall_timeout
        while not self._stopped.wait(min(1.0, stall / 4)) and self._thread.is_alive():
            if self._call is not None and time.monotonic() - self._heard > stall:
                self._stalled = True
                self._call.cancel()

    def _following(self, pack: PackTensors) -> tuple[int, int] | None:
        if not pack.last_in_epoch:
            return pack.epoch, pack.step + 1
        return (pack.epoch + 1, 0) if pack.epoch + 1 < self.epochs else None

    def _receive(self) -> bool:
        """Stream from `self.cursor`, handing out whole steps and moving the cursor past each; True when there
        is nothing more to receive (the job is done, or the receiver was stopped)."""
        request = pb.StreamPacksRequest(job=self.job, first_epoch=self.cursor[0], first_step=self.cursor[1],
                                        plan_fingerprint=self.plan_fingerprint, replicas=self.replicas,
                                        **seat_fields(self.seat))
        self._heard = time.monotonic()
        self._call = self.channel.stream_parts(request)
        packs: list[PackTensors] = []
        assembler = PackAssembler()
        for part in self._call:
            self._heard = time.monotonic()
            message = assembler.add(part)
            if assembler.waiting is not None:
                self.live_state, assembler.waiting = assembler.waiting, None
            if message is None:
                continue
            packs.append(pack_of(message, self.pin_memory))
            if len(packs) < packs[-1].microbatches:
                continue
            pack = packs[-1]
            step = Step(pack.epoch, pack.step, pack.rank, packs, pack.last_in_epoch)
            if self.decoder is not None:
                step.client_skipped = self.decoder.decode(packs)
            received = Received(step, self._following(pack))
            packs, self.failures = [], 0
            if not self._put(received):
                return True
            if received.following is None:
                self._put(None)
                return True
            self.cursor = received.following
        if self._stopped.is_set():
            return True
        raise _Retry("stream ended before the job's last step")

    def _run(self) -> None:
        retries = self.channel.connection.retries
        while not self._stopped.is_set():
            try:
                if self._receive():
                    return
            except (grpc.RpcError, _Retry) as error:
                self._call = None
                if self._stopped.is_set():
                    return
                code = error.code() if isinstance(error, grpc.RpcError) else grpc.StatusCode.UNAVAILABLE
                details = error.details() if isinstance(error, grpc.RpcError) else str(error)
                if self.live_state is not None and self.live_state.producers_gone:  # not retried, nor elsewhere
                    self._put(ProducersGone(f"{details} ({self.seat.name})", self.job))
                    return
                if self._stalled:  # our watchdog cancelled a silent stream: a server problem, retry elsewhere
                    self._stalled = False
                    code, details = grpc.StatusCode.UNAVAILABLE, (f"no data for "
                                                                  f"{self.channel.connection.stall_timeout:g} s")
                if code == grpc.StatusCode.NOT_FOUND and self.failures < retries:  # a restarted server forgot the job
                    self.failures += 1
                    try:
                        self.reopen()
                        continue
                    except PackfeedError as reopen_error:
                        if not self._elsewhere(reopen_error.code):
                            self._put(reopen_error)
                            return
                        code, details = reopen_error.code, str(reopen_error)
                if not (code in RETRYABLE or self._elsewhere(code)) or self.failures >= retries:
                    self._put(PackfeedError(f"{code.name}: {details} (job {self.job!r}, {self.seat.name}, step "
                                            f"{self.cursor[0]}:{self.cursor[1]}, servers {self.channel.targets})",
                                            code))
                    return
                self.channel.fail_over()  # another server (when several are known) continues from the same step
                time.sleep(self.channel.connection.delay(self.failures))
                self.failures += 1
            except Exception as error:  # never leave the trainer waiting on a dead thread
                self._put(PackfeedError(f"receiving packs failed: {error!r}"))
                return
