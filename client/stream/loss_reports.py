"""A trainer's side of a loss-driven mixture (docs/planning.md "Mixtures that move"): the per-dataset losses its
rank reported, kept so another server can be given them again (after a restart or a failover, the server deciding
the next windows never saw them), and every window the job decided, which a new server must draw as decided."""

from __future__ import annotations

import collections
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from packfeed.client.stream.channel import PackfeedError, ServerChannel
from packfeed.v1 import packfeed_pb2 as pb

REPORTS_KEPT = 100_000  # steps of reports a rank keeps: at least the two windows a decision can still read


class LossReports:
    def __init__(self):
        self.sent: collections.deque[pb.AckStepRequest] = collections.deque(maxlen=REPORTS_KEPT)
        self.decided: dict[tuple[int, int], dict[str, float]] = {}  # (epoch, window) -> weights
        # in order, and apart from the plain acknowledgements: one of those may wait on the server for a window
        # that this very report lets it decide
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="packfeed-report")
        self.delivered_to: str | None = None  # the server the last report reached
        self.latest: tuple[int, int] = (-1, -1)  # the latest step reported
        self.warned = False

    def submit(self, channel: ServerChannel, request: pb.AckStepRequest) -> None:
        """One report (an acknowledgement with losses), kept at once (a state taken now holds it), then sent."""
        self.sent.append(request)
        self.latest = max(self.latest, (request.epoch, request.step))
        self.pool.submit(self._deliver, channel, request)

    def check_reported(self, job: str, epoch: int, step: int, rule: str) -> None:
        """Warn (once) when a step is left without a report: the job's windows then wait for it."""
        if self.warned or self.latest >= (epoch, step):
            return
        self.warned = True
        warnings.warn(f"job {job!r}: its mixture is loss-driven (rule {rule}) and step {epoch}:{step} was not "
                      "reported: every rank reports every step (PackStream.report, {} when it held no samples), or "
                      "each later window waits up to the rule's wait_s for the missing reports", RuntimeWarning,
                      stacklevel=3)

    def _deliver(self, channel: ServerChannel, request: pb.AckStepRequest) -> None:
        """Its answer's decided windows recorded. A report that fails is given again with the others when the
        stream re-opens its job on a server."""
        try:
            answer = channel.ask("AckStep", request)  # no failover of its own: the receiver moves the stream
        except PackfeedError:  # lost (a server gone, a call timed out): the next report that lands gives it again
            self.delivered_to = None
            return
        if self.delivered_to != channel.target:  # the first report here (a failover, a report lost with its server):
            self.resend(channel)                 # this server gets every report its decisions may read
        self.delivered_to = channel.target
        self.take(answer.mixture_decided)

    def take(self, decided) -> None:
        for entry in decided:
            self.decided[(entry.epoch, entry.window)] = dict(entry.weights)

    def opening(self, request: pb.OpenJobRequest) -> pb.OpenJobRequest:
        """`request` (an OpenJob of this stream's job) with the windows decided so far."""
        request.mixture_decided.extend(pb.DecidedWeights(epoch=epoch, window=window, weights=weights)
                                       for (epoch, window), weights in sorted(self.decided.items()))
        return request

    def resend(self, channel: ServerChannel) -> None:
        """Every kept report, to the server the stream now talks to (a report it holds already changes nothing)."""
        for request in list(self.sent):
            channel.send("AckStep", request)

    def state(self) -> dict[str, Any]:
        return {"mixture_decided": [{"epoch": e, "window": w, "weights": weights}
                                    for (e, w), weights in sorted(self.decided.items())],
                "loss_reports": [[r.epoch, r.step, dict(r.losses), dict(r.loss_counts)] for r in self.sent]}

    def load(self, state: dict[str, Any], request: pb.AckStepRequest) -> None:
        """A saved state's decisions and reports (`request`: this stream's acknowledgement fields)."""
        self.take(pb.DecidedWeights(**entry) for entry in state.get("mixture_decided", []))
        for epoch, step, losses, counts in state.get("loss_reports", []):
            report = pb.AckStepRequest()
            report.CopyFrom(request)
            report.epoch, report.step, report.reports_losses = epoch, step, True
            report.losses.update(losses)
            report.loss_counts.update(counts)
            self.sent.append(report)
