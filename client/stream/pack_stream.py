"""`PackStream`: a trainer rank's iterator of balanced packs, as torch tensors, from a Packfeed server.

    from packfeed.client import Connection, PackStream, PlanConfig

    stream = PackStream("loader:50051", job="run-7", rank=rank, seed=0,
                        plan=PlanConfig(dp=world, microbatches=4, pipeline_stages=4),
                        connection=Connection(token=token, tls_ca="ca.pem"))
    for step in stream:             # Step(epoch, step, packs=[M PackTensors in 1F1B order])
        for pack in step.packs:
            pack.input_ids, pack.labels, pack.cu_seqlens, pack.pixels, ...
        checkpoint["data"] = stream.state_dict()    # resumes at exactly the next step

A background thread (`packfeed.client.stream.receiver`) receives and converts the next `prefetch` steps while the
trainer computes. Tensors are built over the message bytes without a copy (read-only: clone before writing
in place), or copied once into pinned memory with `pin_memory=True` for `.to("cuda", non_blocking=True)`.
A broken connection is retried with exponential backoff from the first step not yet received, and a server
that restarted (jobs live in its memory) is asked to open the job again: plans are deterministic, so it
streams the very same packs from there. Errors that retrying cannot fix (unknown job, bad rank,
contradicting config, wrong token) raise `PackfeedError` at once.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from packfeed.client.stream.channel import Connection, PackfeedError, ServerChannel
from packfeed.client.stream.decode import DecodeOptions, PackDecoder
from packfeed.client.stream.loss_reports import LossReports
from packfeed.client.stream.producer import producer_token_of
from packfeed.client.stream.receiver import Receiver, seat_fields
from packfeed.client.stream.resume import checked_state, resume_dict, resume_from
from packfeed.client.stream.keywords import stream_arguments
from packfeed.client.stream.tensors import Step
from packfeed.v1 import packfeed_pb2 as pb
from packfeed.v1.layout import Seat
from packfeed.v1.options import PixelMode, PlanConfig

LENGTH_WAIT_S = 600.0  # the longest len(stream) waits for a server still counting a job's later epochs


class PackStream:
    """Iterate this rank's steps of a job, opening (or joining) it on the server first.

    `target` is "host:port", or several servers of one deployment: on failure the stream moves to the next
    and continues from the first step it has not fully received (`servers_from_redis` lists the live ones).
    With `index=` instead, an embedded server is started on loopback for this stream (`LocalServer` shares
    one between several ranks of a process). `plan` (dp, microbatches, strategy, caps, cost model, ...),
    `seed` and `epochs` must be the same on every rank: the server refuses a contradiction
    (FAILED_PRECONDITION). `seat` (`packfeed.v1.layout.Seat`): where this stream reads. `Seat(rank)` is a DP
    rank's; `lane`, with context parallelism (plan `context_parallel` C > 1), the GPU of the rank's CP group it
    feeds (0..C-1), which receives that GPU's share of every pack (its zigzag chunks of each sample and the images
    it encodes; docs/wire.md "Context-parallel shares"); `replica`, one of several readers of identical packs
    (the ranks of a tensor or sequence parallel group); `encoder=True`, with the encoder on ranks of its own
    (plan `encoder_ranks` E > 0), encoder rank `rank` (0..E-1), whose pack m holds the images it encodes for
    microbatch m of every LLM rank, with where each output goes (docs/wire.md "Encoder ranks"). Only a rank's
    lane 0, replica 0 acknowledges for it (an encoder rank's are reports; the LLM ranks' move the job); every
    seat holds a lease of its own; `seat=rank` is the short form of `Seat(rank)`. The keywords of earlier
    versions (`rank=`, `encoder_rank=`, `replica=` with `replicas=`, `cp_rank=`) still work
    (`packfeed.client.stream.keywords`). `resume`: the state_dicts of every
    rank of another job of the same dataset and seed, which ran with other plan settings (another DP or M): this
    job then plans what that job left of its epoch with its own settings and starts there (elastic resume; every
    sample still once per epoch). `producer_token`, for a live job: the token its producers must bring
    (docs/live.md "Who may put"; PACKFEED_PRODUCER_TOKEN when not given); `stream.policy_version = v` says
    which policy version it trains (sent with each acknowledgement), and a stream whose producers are gone raises
    `ProducersGone` (docs/live.md "Asynchronous RL").
    `connection` holds timeouts, retries, token and TLS. The flat keyword arguments of earlier versions (`dp=`,
    `microbatches=`, `strategy=`, `token=`, `tls_ca=`, `timeout=`, ...) still work: they fill `plan` and
    `connection`.
    """

    def __init__(self, target: str | list[str] | None = None, *, job: str, seat: Seat | int | None = None,
                 plan: PlanConfig | None = None, seed: int = 0, epochs: int = 1, dataset: str = "",
                 connection: Connection | None = None, prefetch: int = 2, pin_memory: bool = False,
                 acknowledge: bool = True, index: str | None = None, decode: DecodeOptions | None = None,
                 resume: list[dict[str, Any]] | None = None, producer_token: str | None = None, **earlier: Any):
        if (target is None) == (index is None):
            raise ValueError("give a server target ('host:port', or several for failover) or an index for an "
                             "embedded server, not both")
        self.seat, self.plan, self.connection, replicas = stream_arguments(seat, plan, connection, earlier)
        self.job, self.replicas = job, replicas
        self.prefetch, self.pin_memory, self.acknowledge = max(1, prefetch), pin_memory, acknowledge
        self._local = None
        if index is not None:
            from packfeed.client.stream.local import LocalServer

            self._local = LocalServer(index).start()
            target = self._local.target
        self.channel = ServerChannel([target] if isinstance(target, str) else list(target), self.connection)
        self._open_request = pb.OpenJobRequest(job=job, dataset=dataset, seed=seed, epochs=epochs,
                                               plan=self.plan.to_proto())
        if self.plan.live:  # a live job's producer token (PACKFEED_PRODUCER_TOKEN when not given)
            self._open_request.producer_token = producer_token_of(producer_token)
        if resume is not None:
            self._open_request.resume.CopyFrom(resume_from(resume, job, seed))
        self.info: pb.JobInfo = self.channel.call("OpenJob", self._open_request)
        if problems := self.seat.problems(PlanConfig.from_proto(self.info.plan).layout):
            raise PackfeedError(f"job {job!r}: " + "; ".join(problems))
        self.microbatches = self.info.plan.microbatches
        self.decoder = PackDecoder(decode, pin_memory) if self.info.pixels == PixelMode.ENCODED else None
        # the next step the trainer will get: a resumed job starts in the epoch its old job stopped in
        self._next: tuple[int, int] | None = (self.info.resume.epoch, 0) if resume is not None else (0, 0)
        self._restored = resume is not None  # a saved state or a resumed job: no restart to warn about
        self._consumed: tuple[int, int, list] | None = None  # (epoch, step, client skips): not the tensors
        self._acked: tuple[int, int] | None = None  # the last step this stream acknowledged
        self._acks = ThreadPoolExecutor(max_workers=1, thread_name_prefix="packfeed-ack")
        self._losses = LossReports()  # a loss-driven mixture's reports and decided windows
        self._receiver: Receiver | None = None
        self.wait_seconds = 0.0  # time the trainer spent blocked in next()
        # a live job: the policy version the trainer holds after its latest update, sent with each acknowledgement
        # (None: one update a step); the producers generate with it (docs/live.md "Asynchronous RL")
        self.policy_version: int | None = None

    @property
    def live_state(self) -> pb.LiveStatus | None:
        """A live job's state as its server last sent it while this stream waited for a step (its policy version,
        producers alive, reservations, why no step forms); None before any wait."""
        return self._receiver.live_state if self._receiver is not None else None

    @property
    def rank(self) -> int:
        """The rank this stream reads for (`seat.rank`; an encoder rank's number for an encoder seat)."""
        return self.seat.rank

    @property
    def targets(self) -> list[str]:
        return self.channel.targets

    @property
    def target(self) -> str:
        """The server this stream talks to now."""
        return self.channel.target

    @property
    def conventions(self) -> pb.ModelConventions:
        """What a model must know of the dataset (image policy, chat template, vocabulary, image token ids)."""
        return self.info.conventions

    # -- resumption -------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Where this rank is, and what an elastic resume needs of its job (its plan settings and seed)."""
        state = {"job": self.job, "rank": self.seat.rank, "encoder": self.seat.encoder,
                 "plan_fingerprint": self.info.plan_fingerprint,
                 "index_fingerprint": self.info.index_fingerprint, "next": list(self._next) if self._next else None,
                 "seed": self.info.seed, "plan": PlanConfig.from_proto(self.info.plan).to_dict()}
        if self.info.HasField("resume"):  # a resumed job's plan is a function of what it resumed, too
            state["resumed"] = resume_dict(self.info.resume)
        if self.info.HasField("mixture"):  # a loss-driven mixture's windows and reports: given again on resume
            self._losses.take(self.channel.call("GetJob", pb.GetJobRequest(job=self.job)).mixture.decided)
            state.update(self._losses.state())
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at exactly the step after the last one delivered when `state` was taken."""
        state = checked_state(state)
        if state["job"] != self.job or state["plan_fingerprint"] != self.info.plan_fingerprint:
            raise PackfeedError(f"state is of job {state['job']!r} (plan {state['plan_fingerprint']}), this stream "
                                f"is job {self.job!r} (plan {self.info.plan_fingerprint})")
        saved = Seat(state["rank"], encoder=state.get("encoder", False))
        if (saved.rank, saved.encoder) != (self.seat.rank, self.seat.encoder):
            raise PackfeedError(f"state is of {saved.name}, this stream is {self.seat.name}")
        self._stop_receiver()
        self._next = tuple(state["next"]) if state["next"] else None
        self._restored = True
        if state.get("mixture_decided") or state.get("loss_reports"):  # the windows the saved run drew
            self._losses.load(state, pb.AckStepRequest(job=self.job, **seat_fields(self.seat)))
            self.reopen()

    @property
    def loss_driven(self) -> bool:
        """Whether the job's mixture moves its weights by the losses its ranks report (a mixture file's `rule:`):
        then every rank reports every step (`report`), as the framework faces do by themselves."""
        return bool(self.info.mixture.rule)

    def weights(self) -> dict[int, dict[str, float]]:
        """A mixture whose weights move: each window planned so far (of the slowest rank's epoch) -> its weights by
        dataset, as the server has them now (`info` is the job as opened; this asks again: GetJob); {} for any
        other job."""
        info = self.channel.call("GetJob", pb.GetJobRequest(job=self.job))
        return {window.window: dict(window.weights) for window in info.mixture.windows}

    def report(self, losses_by_dataset: dict[str, float], counts: dict[str, float] | None = None,
               step: Step | None = None) -> None:
        """A loss-driven mixture (docs/planning.md "Mixtures that move"): this rank's mean loss per dataset over
        `step` (default: the step it received last), and what each mean is over (tokens or samples; 1 each when
        not given). Sent with that step's acknowledgement; the server decides later windows' weights from every
        rank's reports, so a rank reports every step, {} when it held no samples."""
        last = self._consumed or self._acked
        if last is None:
            raise PackfeedError("report(): no step was received yet; report a step's losses after training it")
        if step is not None:
            if (step.epoch, step.step) > tuple(last[:2]):
                raise PackfeedError(f"report(): step {step.epoch}:{step.step} was not received yet (the last was "
                                    f"{last[0]}:{last[1]}); report a step's losses after training it")
            last = (step.epoch, step.step)
        try:
            losses = {str(k): float(v) for k, v in losses_by_dataset.items()}
            counts = {str(k): float(v) for k, v in (counts or {}).items()}
        except (TypeError, ValueError, AttributeError):
            raise PackfeedError("report(): give losses (and counts) as {dataset: number}") from None
        request = pb.AckStepRequest(job=self.job, epoch=last[0], step=last[1], data_wait_s=self.wait_seconds,
                                    losses=losses, loss_counts=counts, reports_losses=True,
                                    **seat_fields(self.seat))
        self._losses.submit(self.channel, request)

    # -- iteration --------------------------------------------------------------------------------------

    def __len__(self) -> int:
        """The job's steps over all its epochs (`JobInfo.steps`: each epoch's own count, summed), what a stream
        from the job's start yields. A job of many epochs may still be counting its later ones (the server
        counts for `count_at_open_s` at open, the rest in the background): the server is asked again until it
        knows (at most LENGTH_WAIT_S). A windowed job's count is an estimate until every window is planned:
        a TypeError then says the length is not known yet, as for any iterable without one."""
        if self.info.plan.live and self.info.steps_estimated:
            raise TypeError(f"job {self.job!r} is live: its length is known once it ends (a producer ends it), or "
                            f"from the start when its plan gives steps (about {self.info.steps} steps formed now)")
        deadline = time.monotonic() + LENGTH_WAIT_S
        while self.info.steps_estimated:
            self.info = self.channel.call("GetJob", pb.GetJobRequest(job=self.job))
            if not self.info.steps_estimated or self.info.plan.window or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        if self.info.steps_estimated:
            what = ("is windowed and its step count is an estimate until every window is planned" if
                    self.info.plan.window else f"was still counting its epochs' steps after {LENGTH_WAIT_S:g} s")
            raise TypeError(f"job {self.job!r} {what} (about {self.info.steps} steps now)")
        return int(self.info.steps)

    def close_job(self) -> None:
        """End the job on the server (CloseJob): its state is dropped and its streams end; the status page lists
        it as closed. Once, from one rank, when training is over (a job left open is forgotten after the
        server's job_idle_s)."""
        self.channel.call("CloseJob", pb.CloseJobRequest(job=self.job))

    def step_number(self, epoch: int, step: int) -> int:
        """Step (epoch, step)'s place in the whole job, counting from 0 (epochs plan different step counts)."""
        return sum(int(n) for n in self.info.epoch_steps[:epoch]) + step

    def __iter__(self) -> Iterator[Step]:
        return self

    def __next__(self) -> Step:
        if self._consumed is not None:
            if self.loss_driven:
                self._losses.check_reported(self.job, *self._consumed[:2], self.info.mixture.rule)
            self._ack(*self._consumed)
            self._consumed = None
        if self._next is None:
            raise StopIteration
        if self._receiver is None:
            self._warn_if_restarting()
            self._receiver = Receiver(self.channel, self.job, self.seat, self.info, self._next, self.prefetch,
                                      self.pin_memory, self.reopen, self.decoder, self.replicas)
        started = time.perf_counter()
        item = self._receiver.get()
        self.wait_seconds += time.perf_counter() - started
        if isinstance(item, BaseException):
            self._stop_receiver()
            raise item
        if item is None:
            self._next = None
            raise StopIteration
        self._consumed = (item.step.epoch, item.step.step, item.step.client_skipped)
        self._next = item.following
        return item.step

    def _warn_if_restarting(self) -> None:
        """A job id whose rank already acknowledged steps, streamed again from its first step without the saved
        state: most often a restart that forgot `load_state_dict` (the job would silently start over)."""
        if self._next != (0, 0) or self._restored or self.seat.encoder or not self.seat.primary:
            return
        acked = next(((p.acked_epoch, p.acked_step) for p in self.info.ranks if p.rank == self.seat.rank), (-1, -1))
        if acked >= (0, 0):
            warnings.warn(f"job {self.job!r} rank {self.seat.rank} already acknowledged epoch {acked[0]} step "
                          f"{acked[1]}, "
                          "and this stream starts again at its first step: load the saved state "
                          "(stream.load_state_dict) to continue where it stopped, or open a new job id to start over",
                          RuntimeWarning, stacklevel=3)
        self._restored = True  # once

    def _ack(self, epoch: int, step: int, skipped: list[tuple[str, str]], closing: bool = False) -> None:
        """Acknowledge a consumed step, with the samples this client left out of it (the server records them);
        `closing`: the stream closes after it (the steps received beyond it are not the trainer's lag)."""
        if self.acknowledge:
            self._acked = (epoch, step)
            request = pb.AckStepRequest(job=self.job, epoch=epoch, step=step, data_wait_s=self.wait_seconds,
                                        closing=closing, policy_version=self.policy_version, **seat_fields(self.seat),
                                        skipped=[pb.SkippedSample(key=key, reason=reason, epoch=epoch, step=step)
                                                 for key, reason in skipped])
            self._acks.submit(self.channel.send, "AckStep", request)

    def reopen(self) -> None:
        """After a server restart (it keeps jobs in memory): open the job again. Plans are a pure function of
        the job's settings, so the new server streams the same packs, unless the dataset changed under it."""
        request = pb.OpenJobRequest(plan_fingerprint=self.info.plan_fingerprint)
        request.MergeFrom(self._open_request)  # a server that would plan otherwise refuses: it cannot capture the job
        info = self.channel.call("OpenJob", self._losses.opening(request))
        self._losses.resend(self.channel)  # a loss-driven mixture's: the server decides on every rank's reports
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
            self._ack(*self._consumed, closing=self._next is not None)
            self._consumed = None
        elif self._acked is not None and self._next is not None:
            self._ack(*self._acked, [], closing=True)
        self._stop_receiver()
        if self.decoder is not None:
            self.decoder.close()
        self._acks.shutdown(wait=True)
        self._losses.pool.shutdown(wait=True)
        self.channel.close()
        if self._local is not None:
            self._local.stop()

    def __enter__(self) -> PackStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
