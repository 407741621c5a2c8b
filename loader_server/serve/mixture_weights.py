"""What an operator sees of a mixture whose weights move (docs/planning.md "Mixtures that move"): the window in
force, its weights and draws, and every window planned so far; for GetJob, the status page and Prometheus alike."""

from __future__ import annotations

from typing import Any

from packfeed.server.plan.windows import WindowedPlan
from packfeed.v1 import packfeed_pb2 as pb


def moving_plan(job, epoch: int) -> WindowedPlan | None:
    """The epoch's plan when its mixture's weights move, else None."""
    plan = job.epoch_plan(epoch) if job.failure is None and job.live is None else None
    return plan if isinstance(plan, WindowedPlan) and plan.draws is not None else None


def step_weights(job, epoch: int, step: int) -> dict[str, float] | None:
    """The weights of the window holding (epoch, step), by dataset; None for any other job."""
    plan = moving_plan(job, epoch)
    if plan is None or not plan.has_step(step):
        return None
    window = plan.locate(step)[0]
    return plan.draws.describe(window, plan.rows.names)["weights"]


def mixture_status(job) -> dict[str, Any] | None:
    """The slowest rank's epoch: the window holding its next step (the weights in force) and every window planned so
    far, with the first step each serves; None for a job whose weights do not move."""
    epoch, step = min((rank.acked for rank in list(job.ranks)), default=(-1, -1))
    epoch, step = max(epoch, 0), step + 1
    plan = moving_plan(job, min(epoch, job.spec.epochs - 1))
    if plan is None:
        return None
    in_force = plan.locate(step)[0] if plan.has_step(step) else plan.n_windows - 1
    windows = [{**plan.draws.describe(w, plan.rows.names), "first_step": plan.first_step(w)}
               for w in range(plan.planned_windows)]
    return {"epoch": epoch, "window": in_force, "windows": windows}


def mixture_proto(status: dict[str, Any]) -> pb.MixtureWeights:
    message = pb.MixtureWeights(epoch=status["epoch"], window=status["window"])
    for window in status["windows"]:
        message.windows.add(window=window["window"], progress=window["progress"], weights=window["weights"],
                            drawn=window["drawn"], first_step=window["first_step"])
    return message
