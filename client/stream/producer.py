"""`Producer`: put samples born during the run (rollouts, scored responses) into a live job (PlanConfig live).

    from packfeed.client import Producer

    with Producer("loader:50051", job="grpo-7") as producer:
        producer.put({"id": "p17-r3", "tokens": ids, "loss_mask": mask, "group": "p17",
                      "policy_version": 12, "tensors": {"advantages": adv}, "prompt": "sample-000017"})
        producer.end()  # the job's last step forms; the trainers' iteration ends there

`put` returns once the server has the samples durable (in its spool), with one `PutResult` each; a sample the
job refuses (its field and reason said) raises `SampleRefused` after the others were kept, or is returned
with `on_refused="return"`. Retried puts are idempotent: a sample's `id` (chosen here when not given) is
stored once whatever the retries; the same id with other content is refused, naming the id. A full spool (the
trainers are behind) makes `put` wait and retry, up to `full_wait_s`. `submit` buffers without waiting; `flush`
sends what is buffered and waits until it is durable.

A job the trainers have not opened yet: with `plan=` (the trainers' PlanConfig, and their `dataset` and
`seed`) the producer opens it itself, on every server it reaches that does not know it; without, it is told at
once (PackfeedError NOT_FOUND, saying what to do), or waits up to `open_wait_s` for a trainer to open it. Servers
are tried in turn: one that lost the job (restarted) or does not hold it (another server holds its lease) sends
the put to the next.

A job opened with a producer token (`PackStream(..., producer_token=...)`, `Producer(plan=..., producer_token=...)`)
takes puts and its end only with it: give it as `producer_token=` or in PACKFEED_PRODUCER_TOKEN.

Asynchronous RL (docs/live.md "Asynchronous RL"): a producer says it is alive every `heartbeat_s` (its trainers are
told when no producer is), `policy_version` is the version the trainers train now (from every answer), `reserve`
asks before generating under staleness wait, and `claim` takes an unfinished rollout to continue.
"""

from __future__ import annotations

import base64
import os
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from packfeed.client.stream.channel import Connection, PackfeedError, ServerChannel
from packfeed.client.stream.claims import HEARTBEAT_S, LEASE_HEARTBEATS, Heartbeats, Reservation, Rollout, \
    new_producer_id
from packfeed.v1 import packfeed_pb2 as pb
from packfeed.v1.options import PlanConfig

PRODUCER_TOKEN_VARIABLE = "PACKFEED_PRODUCER_TOKEN"


@dataclass
class Sample:
    """One live sample. `tokens`: its LLM token ids, final (never re-tokenised), image placeholders included;
    `loss_mask`: 1 where a token is trained on (default: every token); `tensors`: per-token floats by name;
    `group`: the prompt it answers; `policy_version`: the policy that generated it; its images either
    `prompt`, the key of the indexed sample whose images it uses, or `images`, image files (bytes or paths);
    `values`: per-sample numbers by name (a reward: filter_groups judges groups on one). A rollout put in parts:
    `unfinished` (its prefix so far), `part` (0, 1, ...) and `token_versions` (each token's policy version; made
    by `Rollout.continued`). A multi-turn trajectory (docs/live.md "Trajectories"): `turns`, each {"role",
    "tokens", "images"} (who produced it, its tokens, the images it brings), and a fork `parent` (the id of the
    trajectory of its group it continues) with `fork_turn` (the turns it shares with it; its images are then
    those of its own turns only)."""

    tokens: Any
    id: str = ""
    loss_mask: Any = None
    tensors: Mapping[str, Any] = field(default_factory=dict)
    group: str = ""
    policy_version: int = 0
    prompt: str = ""
    images: list = field(default_factory=list)
    values: Mapping[str, float] = field(default_factory=dict)
    unfinished: bool = False
    part: int = 0
    token_versions: Any = None
    turns: list = field(default_factory=list)
    parent: str = ""
    fork_turn: int = 0

    @classmethod
    def of(cls, value: Sample | Mapping[str, Any], base: Path | None = None) -> Sample:
        """A Sample from itself or a mapping of its fields (a JSON line: image paths relative to `base`, or
        {"base64": ...})."""
        if isinstance(value, Sample):
            return value
        unknown = set(value) - {f for f in cls.__dataclass_fields__}
        if unknown:
            raise ValueError(f"unknown sample fields {sorted(unknown)}: give {sorted(cls.__dataclass_fields__)}")
        if "tokens" not in value:
            raise ValueError("a sample needs its tokens")
        fields_ = dict(value)
        fields_["images"] = [_image_bytes(image, base) for image in fields_.get("images") or []]
        return cls(**fields_)

    def to_proto(self) -> pb.LiveSample:
        message = pb.LiveSample(id=self.id, group=self.group, policy_version=int(self.policy_version),
                                prompt=self.prompt, images=[_image_bytes(image, None) for image in self.images],
                                values={name: float(value) for name, value in self.values.items()},
                                unfinished=self.unfinished, part=self.part)
        message.tokens.CopyFrom(_tensor(self.tokens, np.int32))
        if self.loss_mask is not None:
            message.loss_mask.CopyFrom(_tensor(self.loss_mask, np.uint8))
        for name, values in self.tensors.items():
            message.tensors[name].CopyFrom(_tensor(values, np.float32))
        if self.token_versions is not None:
            message.token_versions.CopyFrom(_tensor(self.token_versions, np.int64))
        message.turns.extend(_turn(turn) for turn in self.turns)
        message.parent, message.fork_turn = self.parent, int(self.fork_turn)
        return message


TURN_ROLES = {"policy": pb.TURN_ROLE_POLICY, "environment": pb.TURN_ROLE_ENVIRONMENT, "tool": pb.TURN_ROLE_TOOL,
              "user": pb.TURN_ROLE_USER, "system": pb.TURN_ROLE_SYSTEM}


def _turn(turn: Mapping[str, Any] | tuple) -> pb.Turn:
    """A turn from {"role": "policy" | "environment" | "tool" | "user" | "system", "tokens": n, "images": k} or
    (role, tokens, images)."""
    role, tokens, images = (turn.get("role", ""), turn.get("tokens", 0), turn.get("images", 0)) \
        if isinstance(turn, Mapping) else tuple(turn)
    if role not in TURN_ROLES:
        raise ValueError(f"turn role {role!r}: give one of {sorted(TURN_ROLES)}")
    return pb.Turn(role=TURN_ROLES[role], tokens=int(tokens), images=int(images))


@dataclass(frozen=True)
class PutResult:
    id: str
    accepted: bool  # durable in the job (a duplicate too)
    duplicate: bool = False  # its id was accepted before (a retry): stored once
    field: str = ""  # refused: what is wrong ...
    reason: str = ""  # ... and why


class SampleRefused(PackfeedError):
    """Samples the job refused (the others of the put were kept): `results` holds every sample's outcome."""

    def __init__(self, results: list[PutResult]):
        refused = [r for r in results if not r.accepted]
        shown = "; ".join(f"{r.id}: {r.field}: {r.reason}" for r in refused[:5])
        super().__init__(f"{len(refused)} of {len(results)} samples refused: {shown}")
        self.results = results


class Producer:
    """Puts samples into live job `job` on `target` ("host:port", or several servers of one deployment)."""

    def __init__(self, target: str | list[str], *, job: str, token: str | None = None,
                 connection: Connection | None = None, batch_samples: int = 256, batch_bytes: int = 16 << 20,
                 on_refused: str = "raise", full_wait_s: float = 600.0, plan: PlanConfig | None = None,
                 dataset: str = "", seed: int = 0, open_wait_s: float = 0.0, producer_token: str | None = None,
                 name: str = "", heartbeat_s: float = HEARTBEAT_S):
        if on_refused not in ("raise", "return"):
            raise ValueError("on_refused is 'raise' or 'return'")
        if connection is not None and token is not None:
            raise ValueError("give the token in connection=Connection(token=...) or as token=, not both")
        if plan is not None and not plan.live:
            raise ValueError("a producer opens live jobs only: give plan=PlanConfig(..., live=True, step_samples=...)")
        self.connection = connection or Connection(token=token)
        self.job, self.on_refused, self.full_wait_s, self.open_wait_s = job, on_refused, full_wait_s, open_wait_s
        self.producer_token = producer_token_of(producer_token)
        self._open_request = None if plan is None else pb.OpenJobRequest(
            job=job, dataset=dataset, seed=seed, epochs=1, plan=plan.to_proto(), producer_token=self.producer_token)
        self.batch_samples, self.batch_bytes = batch_samples, batch_bytes
        self.channel = ServerChannel([target] if isinstance(target, str) else list(target), self.connection)
        self._buffer: list[pb.LiveSample] = []
        self._buffered_bytes = 0
        self.results: list[PutResult] = []  # of what `submit` sent, since the last flush
        self.ended = False
        self.id, self.name, self.heartbeat_s = new_producer_id(), name, heartbeat_s
        self.policy_version = 0  # the job's: what its trainers train now (every answer says it)
        self._heartbeats = Heartbeats(self._beat, heartbeat_s) if heartbeat_s > 0 else None

    def _beat(self, leaving: bool = False) -> None:
        state = self.channel.ask("Heartbeat", pb.ProducerHeartbeat(
            job=self.job, producer=self.id, name=self.name, lease_s=self.heartbeat_s * LEASE_HEARTBEATS,
            leaving=leaving, producer_token=self.producer_token))
        self.policy_version = state.policy_version

    def reserve(self, group: str, samples: int = 0, policy_version: int | None = None,
                wait_s: float | None = None) -> Reservation:
        """Under staleness wait: the right to generate `samples` (0: the job's group_size) samples of `group` with
        `policy_version` (None: the job's version: load it first), asked before generating. Waits for the grant
        up to `wait_s` (default `full_wait_s`): the trainers take steps, and room opens. Under staleness drop it is
        granted at once (nothing is reserved)."""
        request = pb.ReserveRequest(job=self.job, producer=self.id, group=group, samples=samples,
                                    policy_version=policy_version, producer_token=self.producer_token)
        limit = self.full_wait_s if wait_s is None else wait_s
        answer = self._ask_until("Reserve", request, "granted", limit)
        if not answer.granted:
            raise PackfeedError(f"job {self.job!r} granted no reservation of {group!r} within {limit:g} s: "
                                f"{answer.reason}")
        return Reservation(group, samples, answer.policy_version)

    def claim(self, policy_version: int | None = None, wait_s: float = 0.0) -> Rollout | None:
        """An unfinished rollout of the job to continue (yours alone while this producer is alive), or None when
        none is waiting (after trying for `wait_s`). Continue it with newer weights and put
        `rollout.continued(...)`."""
        request = pb.ClaimRolloutRequest(job=self.job, producer=self.id, policy_version=policy_version,
                                         producer_token=self.producer_token)
        answer = self._ask_until("ClaimRollout", request, "claimed", wait_s)
        return Rollout.from_proto(answer.rollout) if answer.claimed else None

    def _ask_until(self, method: str, request, yes: str, wait_s: float):
        """`method` asked again after each answer's `retry_s` until its field `yes` is set or `wait_s` would pass;
        the last answer (each one tells the job's policy version)."""
        start = time.monotonic()
        while True:
            answer = self._call(request, method)
            self.policy_version = answer.policy_version_now
            if getattr(answer, yes) or time.monotonic() - start + answer.retry_s > wait_s:
                return answer
            time.sleep(answer.retry_s)

    def put(self, samples: Sample | Mapping | Iterable[Sample | Mapping]) -> PutResult | list[PutResult]:
        """Put one sample (a PutResult back) or many (a list); returns when they are durable."""
        one = isinstance(samples, (Sample, Mapping))
        messages = [self._message(sample) for sample in ([samples] if one else samples)]
        results = []
        for start in range(0, len(messages), self.batch_samples):
            results += self._send(messages[start:start + self.batch_samples])
        self._check(results)
        return results[0] if one else results

    def submit(self, sample: Sample | Mapping) -> None:
        """Buffer a sample; sent once the buffer holds `batch_samples` or `batch_bytes` (or at `flush`)."""
        message = self._message(sample)
        self._buffer.append(message)
        self._buffered_bytes += message.ByteSize()
        if len(self._buffer) >= self.batch_samples or self._buffered_bytes >= self.batch_bytes:
            self._send_buffer()

    def flush(self) -> list[PutResult]:
        """Send what `submit` buffered and wait until it is durable; every submitted sample's result since the
        last flush."""
        self._send_buffer()
        results, self.results = self.results, []
        self._check(results)
        return results

    def end(self) -> None:
        """Flush, then end the job: what is pending forms its last step, and later puts are refused."""
        self.flush()
        self._call(pb.PutSamplesRequest(job=self.job, end=True, producer_token=self.producer_token, producer=self.id))
        self.ended = True

    def close(self) -> None:
        """Flush and let go of the connection (the job goes on: another producer may end it)."""
        try:
            self.flush()
        finally:
            self._leave()
            self.channel.close()

    def _leave(self) -> None:
        """Stop the heartbeats and tell the job this producer leaves (what it reserved and claimed goes back)."""
        if self._heartbeats is None:
            return
        self._heartbeats.stop()
        self._heartbeats = None
        try:
            self._beat(leaving=True)
        except PackfeedError:
            pass  # its lease lapses instead

    def __enter__(self) -> Producer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _message(self, sample: Sample | Mapping) -> pb.LiveSample:
        sample = Sample.of(sample)
        if not sample.id:
            sample.id = uuid.uuid4().hex  # chosen once: every retry of this put sends the same id
        return sample.to_proto()

    def _send_buffer(self) -> None:
        if self._buffer:
            batch, self._buffer, self._buffered_bytes = self._buffer, [], 0
            self.results += self._send(batch)

    def _send(self, messages: list[pb.LiveSample]) -> list[PutResult]:
        response = self._call(pb.PutSamplesRequest(job=self.job, samples=messages, producer_token=self.producer_token,
                                                   producer=self.id))
        self.policy_version = response.policy_version
        return [PutResult(r.id, r.accepted, r.duplicate, r.field, r.reason) for r in response.results]

    def _call(self, request, method: str = "PutSamples"):
        """The put (or another of a producer's calls), retried (the same ids: idempotent). A full spool is waited
        out up to `full_wait_s`; a server that does not know the job sends it to the next one, where `plan` opens
        it, else up to `open_wait_s`."""
        start, pause = time.monotonic(), self.connection.backoff or 0.5
        missing: set[str] = set()  # the servers that did not know the job, in this round
        opened: set[str] = set()  # where this call opened it (once each: a server that forgets it at once is missing)
        while True:
            try:
                return self.channel.call(method, request, final=(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                                                 grpc.StatusCode.NOT_FOUND))
            except PackfeedError as error:
                waited = time.monotonic() - start
                if error.code is grpc.StatusCode.NOT_FOUND:
                    if self._open_request is not None and self.channel.target not in opened:
                        opened.add(self.channel.target)
                        self._open_where_missing()
                        continue
                    missing.add(self.channel.target)
                    if len(missing) < len(self.channel.targets):
                        self.channel.fail_over()  # another server may hold it
                        continue
                    if waited + pause > self.open_wait_s:
                        raise PackfeedError(
                            f"job {self.job!r} is not open on {', '.join(sorted(missing))}: no trainer opened it "
                            f"(waited {waited:.0f} s): start the trainers first, give Producer(plan=...) (`packfeed "
                            "put --plan`) the trainers' plan to open it from here, or open_wait_s= to wait",
                            error.code) from None
                    missing.clear()
                    self.channel.fail_over()
                elif error.code is not grpc.StatusCode.RESOURCE_EXHAUSTED or waited + pause > self.full_wait_s:
                    raise
                time.sleep(pause)
                pause = min(pause * 2, 5.0)

    def _open_where_missing(self) -> None:
        """OpenJob with the producer's plan on the server the channel talks to (a second opening of the same
        settings joins the job; other settings are refused, naming them)."""
        self.channel.call("OpenJob", self._open_request)

    def _check(self, results: list[PutResult]) -> None:
        if self.on_refused == "raise" and not all(r.accepted for r in results):
            raise SampleRefused(results)


def producer_token_of(given: str | None) -> str:
    """A live job's producer token: as given, else the environment's PACKFEED_PRODUCER_TOKEN ("": none)."""
    return os.environ.get(PRODUCER_TOKEN_VARIABLE, "") if given is None else given


def _tensor(values, dtype) -> pb.Tensor:
    array = np.ascontiguousarray(np.asarray(values), dtype=np.dtype(dtype).newbyteorder("<")).reshape(-1)
    return pb.Tensor(dtype=np.dtype(dtype).name, shape=[len(array)], data=array.tobytes())


def _image_bytes(image, base: Path | None) -> bytes:
    if isinstance(image, (bytes, bytearray, memoryview)):
        return bytes(image)
    if isinstance(image, Mapping) and "base64" in image:
        return base64.b64decode(image["base64"])
    if isinstance(image, (str, Path)):
        path = Path(image)
        return (path if path.is_absolute() or base is None else base / path).read_bytes()
    raise ValueError(f"an image is bytes, a file path or {{'base64': ...}}, not {type(image).__name__}")
