"""What an operator sees of a mixture whose weights move (docs/planning.md "Mixtures that move"): the window in
force, its weights and draws, and every window planned so far; for GetJob, the status page and Prometheus alike."""

from __future__ import annotations

from typing import Any

from packfeed.server.plan.windows import WindowedPlan
from packfeed.server.serve.job_spec import JobError
from packfeed.v1 import packfeed_pb2 as pb


def moving_plan(job, epoch: int) -> WindowedPlan | None:
    """The epoch's plan when its mixture's weights move, else None."""
    plan = job.epoch_plan(epoch) if job.failure is None else None
    return plan if plan is not None and plan.draws is not None else None


def step_weights(job, epoch: int, step: int) -> dict[str, float] | None:
    """The weights of the window holding (epoch, step), a step sent (so planned), by dataset; None for any other
    job. Called on the event loop for every step sent: it neither plans nor waits."""
    plan = moving_plan(job, epoch) if job.spec.plan_config.window else None  # a moving mixture is windowed
    window = plan.window_of(step) if plan is not None else None
    return None if window is None else plan.draws.describe(window, plan.rows.names)["weights"]


def mixture_status(job) -> dict[str, Any] | None:
    """The slowest rank's epoch: the window holding its next step (the weights in force) and every window planned so
    far, with the first step each serves; None for a job whose weights do not move."""
    epoch, step = min((rank.acked for rank in list(job.ranks)), default=(-1, -1))
    epoch, step = max(epoch, 0), step + 1
    plan = moving_plan(job, min(epoch, job.spec.epochs - 1))
    if plan is None:
        return None
    in_force = plan.window_of(step)  # not planned here (a loss-driven window may be waiting for reports)
    in_force = plan.planned_windows - 1 if in_force is None else in_force
    windows = [{**plan.draws.describe(w, plan.rows.names), "first_step": plan.first_step(w)}
               for w in range(plan.planned_windows)]
    status = {"epoch": epoch, "window": in_force, "windows": windows}
    if job.ledger is not None:  # a loss-driven mixture: what a trainer's state keeps, and the reports left out
        status["rule"] = job.ledger.rule.name
        status["decided"] = decided_windows(job.ledger)
        status["reports_ignored"] = dict(job.ledger.ignored)
        status["windows_on_partial_reports"] = job.ledger.partial_windows
    return status


def mixture_proto(status: dict[str, Any]) -> pb.MixtureWeights:
    message = pb.MixtureWeights(epoch=status["epoch"], window=status["window"],
                                reports_ignored=status.get("reports_ignored", {}),
                                windows_on_partial_reports=status.get("windows_on_partial_reports", 0),
                                rule=status.get("rule", ""))
    for window in status["windows"]:
        message.windows.add(window=window["window"], progress=window["progress"], weights=window["weights"],
                            drawn=window["drawn"], first_step=window["first_step"])
    for decided in status.get("decided", []):
        message.decided.add(**decided)
    return message


def report_losses(job, rank: int, request: pb.AckStepRequest) -> str:
    """A trainer's per-dataset losses of one step into its job's ledger: "taken", or why it was left out."""
    if job.ledger is None:
        return "the job's mixture has no rule"
    plan = job.planned(request.epoch)  # on the event loop: never plans, never waits for the job's lock
    known = plan.steps_known if plan is not None else 0  # 0 until every window of the epoch is planned
    if not 0 <= request.epoch < job.spec.epochs or (known and request.step >= known):
        return job.ledger.ignore("step past the job's last window")  # no window is ever decided on it
    reason = job.ledger.report(rank, request.epoch, request.step, dict(request.losses), dict(request.loss_counts))
    return reason or "taken"


def decided_windows(ledger) -> list[dict[str, Any]]:
    """Every window a loss-driven job decided so far, as DecidedWeights' fields."""
    return [{"epoch": epoch, "window": window, "weights": dict(zip(ledger.names, weights))}
            for epoch, windows in ledger.recorded().items() for window, weights in windows.items()]


def decided_answer(job) -> pb.AckStepResponse:
    """A loss report's answer: every window the job decided so far."""
    answer = pb.AckStepResponse()
    for decided in decided_windows(job.ledger) if job.ledger is not None else []:
        answer.mixture_decided.add(**decided)
    return answer


def restore_decided(job, decided) -> None:
    """OpenJobRequest.mixture_decided into the job's ledger (a resumed trainer's state)."""
    if not decided:
        return
    if job.ledger is None:
        raise JobError("INVALID_ARGUMENT", f"job {job.spec.job!r} is not of a loss-driven mixture: it takes no "
                                           "decided weights")
    names = job.ledger.names
    recorded: dict[int, dict[int, list[float]]] = {}
    for entry in decided:
        if set(entry.weights) != set(names):
            raise JobError("INVALID_ARGUMENT", f"decided weights of epoch {entry.epoch}, window {entry.window} name "
                                               f"{sorted(entry.weights)}, the mixture's datasets are {names}")
        recorded.setdefault(entry.epoch, {})[entry.window] = [entry.weights[name] for name in names]
    try:
        job.ledger.restore(recorded)
    except ValueError as error:
        raise JobError("FAILED_PRECONDITION", str(error)) from None
