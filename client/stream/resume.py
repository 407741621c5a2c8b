"""Saved stream states (`PackStream.state_dict()`): every field checked and bounded before anything is sized by it,
and the elastic resume that the states of every rank of an old job describe (`ResumeFrom`). The server checks
that the plan the states name is the one it re-computes from them (`packfeed.server.serve.datasets`)."""

from __future__ import annotations

from typing import Any

from packfeed.client.stream.channel import PackfeedError
from packfeed.client.stream.loss_reports import REPORTS_KEPT
from packfeed.v1 import packfeed_pb2 as pb
from packfeed.v1.options import MAX_EPOCHS, MAX_NAME, MAX_RESUME_CHAIN, PlanConfig


class ForwardsStreamState:
    """A face over one `PackStream` (`self.stream`) whose checkpointable state is the stream's position: saved and
    restored through the stream, so a checkpointer that saves the face continues it at exactly the next step."""

    stream: Any

    def state_dict(self) -> dict[str, Any]:
        return self.stream.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stream.load_state_dict(state)


def _bad_state(where: str, problem: str) -> PackfeedError:
    return PackfeedError(f"{where}: {problem}; give the state_dict() of a stream of that job, unedited")


def _count(value: Any, limit: int, where: str, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= limit:
        raise _bad_state(where, f"{field} is {value!r}, not an integer in 0..{limit}")
    return value


def _text(value: Any, where: str, field: str, required: bool = True) -> str:
    if not isinstance(value, str) or len(value) > MAX_NAME or (required and not value):
        raise _bad_state(where, f"{field} is {str(value)[:80]!r}, not a string of 1 to {MAX_NAME} characters")
    return value


MAX_DECIDED_WINDOWS = 1_000_000  # windows of all epochs a state may record (a job's are in the thousands)
MAX_DECIDED_DATASETS = 10_000


def checked_state(state: Any, where: str = "state") -> dict[str, Any]:
    """A saved state_dict with every field checked and bounded before anything is sized by it (a forged `dp` of
    2^32 must not allocate): the same rules as the server's for a request."""
    if not isinstance(state, dict):
        raise _bad_state(where, f"a {type(state).__name__}, not a dict")
    missing = sorted({"job", "rank", "plan_fingerprint", "next", "seed"} - set(state))
    if missing:
        raise _bad_state(where, f"fields {missing} are missing")
    _text(state["job"], where, "job")
    _text(state["plan_fingerprint"], where, "plan_fingerprint")
    _text(state.get("index_fingerprint", ""), where, "index_fingerprint", required=False)
    _count(state["seed"], 2**64 - 1, where, "seed")
    encoder = state.get("encoder", False)
    if not isinstance(encoder, bool):
        raise _bad_state(where, f"encoder is {str(encoder)[:80]!r}, not true or false")
    if "plan" in state:
        try:
            plan = PlanConfig.from_dict(state["plan"])
        except (TypeError, ValueError) as error:
            raise _bad_state(where, f"its plan does not parse ({error})") from None
        _count(state["rank"], (plan.encoder_ranks if encoder else plan.dp) - 1, where, "rank")
    else:
        _count(state["rank"], 2**31 - 1, where, "rank")
    position = state["next"]
    if position is not None:
        if not isinstance(position, (list, tuple)) or len(position) != 2:
            raise _bad_state(where, f"next is {str(position)[:80]!r}, not None or [epoch, step]")
        _count(position[0], MAX_EPOCHS - 1, where, "next[0] (the epoch)")
        _count(position[1], 2**63 - 1, where, "next[1] (the step)")
    _check_decided(state.get("mixture_decided", []), where)
    _check_reports(state.get("loss_reports", []), where)
    return state


def _check_decided(decided: Any, where: str) -> None:
    """A loss-driven mixture's decided windows ([{epoch, window, weights}]), bounded and plain (the server checks
    the weights themselves)."""
    if not isinstance(decided, list) or len(decided) > MAX_DECIDED_WINDOWS:
        raise _bad_state(where, f"mixture_decided is not a list of at most {MAX_DECIDED_WINDOWS:,} windows")
    for entry in decided:
        if not isinstance(entry, dict) or set(entry) != {"epoch", "window", "weights"} or \
                not isinstance(entry["weights"], dict) or len(entry["weights"]) > MAX_DECIDED_DATASETS or \
                not all(isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool)
                        for k, v in entry["weights"].items()):
            raise _bad_state(where, f"mixture_decided holds {str(entry)[:120]!r}, not {{epoch, window, weights: "
                                    "{dataset: number}}")
        _count(entry["epoch"], MAX_EPOCHS - 1, where, "mixture_decided epoch")
        _count(entry["window"], 2**31 - 1, where, "mixture_decided window")


def _check_reports(reports: Any, where: str) -> None:
    """A loss-driven mixture's kept reports ([epoch, step, {dataset: loss}, {dataset: count}]), bounded and plain."""
    if not isinstance(reports, list) or len(reports) > REPORTS_KEPT:
        raise _bad_state(where, f"loss_reports is not a list of at most {REPORTS_KEPT:,} reports")
    for report in reports:
        if not isinstance(report, (list, tuple)) or len(report) != 4 or not all(
                isinstance(values, dict) and len(values) <= MAX_DECIDED_DATASETS and all(
                    isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool)
                    for k, v in values.items()) for values in report[2:]):
            raise _bad_state(where, f"loss_reports holds {str(report)[:120]!r}, not [epoch, step, {{dataset: loss}}, "
                                    "{dataset: count}]")
        _count(report[0], MAX_EPOCHS - 1, where, "loss_reports epoch")
        _count(report[1], 2**63 - 1, where, "loss_reports step")


def resume_dict(message: pb.ResumeFrom) -> dict[str, Any]:
    """A job's own resume (JobInfo.resume) as a state_dict holds it: plain values, for any checkpoint format."""
    out = {"plan": PlanConfig.from_proto(message.plan).to_dict(), "epoch": message.epoch, "step": message.step,
           "plan_fingerprint": message.plan_fingerprint, "index_fingerprint": message.index_fingerprint,
           "seed": message.seed}
    if message.HasField("previous"):
        out["previous"] = resume_dict(message.previous)
    return out


def _resume_message(saved: Any, depth: int) -> pb.ResumeFrom:
    """A state_dict's record of its job's own resume, checked as the states are."""
    where = f"resume: the old job's own resume (link {depth})"
    if depth >= MAX_RESUME_CHAIN:
        raise _bad_state(where, f"a chain of more than {MAX_RESUME_CHAIN} resumed jobs")
    if not isinstance(saved, dict) or not {"plan", "epoch", "step", "plan_fingerprint", "seed"} <= set(saved):
        raise _bad_state(where, "not a dict with plan, epoch, step, plan_fingerprint and seed")
    try:
        plan = PlanConfig.from_dict(saved["plan"])
    except (TypeError, ValueError) as error:
        raise _bad_state(where, f"its plan does not parse ({error})") from None
    message = pb.ResumeFrom(plan=plan.to_proto(), epoch=_count(saved["epoch"], MAX_EPOCHS - 1, where, "epoch"),
                            step=_count(saved["step"], 2**63 - 1, where, "step"),
                            plan_fingerprint=_text(saved["plan_fingerprint"], where, "plan_fingerprint"),
                            index_fingerprint=_text(saved.get("index_fingerprint", ""), where, "index_fingerprint",
                                                    required=False),
                            seed=_count(saved["seed"], 2**64 - 1, where, "seed"))
    if saved.get("previous") is not None:
        message.previous.CopyFrom(_resume_message(saved["previous"], depth + 1))
    return message


def resume_from(states: list[dict[str, Any]], job: str, seed: int) -> pb.ResumeFrom:
    """The elastic resume that the old job's ranks' state_dicts (one per rank, all of them) describe. Every old
    rank must have stopped at the same step: a checkpoint of a synchronous job is taken between global steps.
    Every field is checked before use; the server checks that the plan they name is the one it re-computes."""
    if not isinstance(states, (list, tuple)) or not states:
        raise PackfeedError("resume: give the state_dict of every rank of the old job, as a list")
    states = [checked_state(state, f"resume: state {k}") for k, state in enumerate(states)]
    # an encoder rank's position is the LLM ranks' (it streams what they consume): the LLM ranks' states say it
    states = [state for state in states if not state.get("encoder", False)]
    if not states:
        raise PackfeedError("resume: the states are all of encoder ranks; give the LLM ranks' state_dicts")
    first = states[0]
    if "plan" not in first:
        raise PackfeedError("resume: these states were saved by a Packfeed that did not record the plan settings; "
                            "they can resume only at the same DP and microbatches (load_state_dict)")
    identity = lambda state: (state["job"], state["plan_fingerprint"], state.get("index_fingerprint", ""),  # noqa: E731
                              state["seed"], repr(state.get("plan")), repr(state.get("resumed")))
    if any(identity(state) != identity(first) for state in states):
        raise PackfeedError("resume: the states are of different jobs or plans: "
                            f"{sorted({(state['job'], state['plan_fingerprint']) for state in states})}")
    if first["job"] == job:
        raise PackfeedError(f"resume: give the resumed job an id of its own (the old job is {job!r})")
    if first["seed"] != seed:
        raise PackfeedError(f"resume: the old job ran with seed {first['seed']}, this one asks for {seed}")
    plan = PlanConfig.from_dict(first["plan"])  # checked already: dp is within PlanConfig's limits
    dp = plan.dp
    ranks = sorted(state["rank"] for state in states)
    if ranks != list(range(dp)):
        missing = sorted(set(range(dp)) - set(ranks))[:20]
        raise PackfeedError(f"resume: the old job had {dp} ranks; the states cover ranks {ranks[:20]} (missing "
                            f"{missing}, or some twice): give one state_dict per old rank")
    positions = {tuple(state["next"]) if state["next"] else None for state in states}
    if len(positions) != 1:
        where = {state["rank"]: state["next"] for state in states[:20]}
        raise PackfeedError(f"resume: the old ranks stopped at different steps ({where}); resume from a checkpoint "
                            "taken at one global step")
    position = positions.pop()
    if position is None:
        raise PackfeedError("resume: the old job had finished every epoch; open a new job instead")
    epoch, step = position
    message = pb.ResumeFrom(plan=plan.to_proto(), epoch=epoch, step=step,
                            plan_fingerprint=first["plan_fingerprint"],
                            index_fingerprint=first.get("index_fingerprint", ""), seed=first["seed"])
    if first.get("resumed") is not None:
        message.previous.CopyFrom(_resume_message(first["resumed"], 0))
    return message
