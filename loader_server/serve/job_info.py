"""A job as GetJob, OpenJob and ListJobs answer it (`JobInfo`): its plan, length, ranks' progress, skips, and a
live job's or a moving mixture's state."""

from __future__ import annotations

from packfeed.server.serve.jobs import Job
from packfeed.server.serve.live_control import live_status
from packfeed.server.serve.mixture_weights import mixture_proto, mixture_status
from packfeed.v1 import packfeed_pb2 as pb


def job_info(job: Job) -> pb.JobInfo:
    """What GetJob (and OpenJob, ListJobs) answer of a job."""
    plan = job.epoch_plan(0)
    counts, estimated = job.step_counts()
    info = pb.JobInfo(job=job.spec.job, dataset=job.spec.dataset, plan=job.spec.plan_config.to_proto(),
                      seed=job.spec.seed, epochs=job.spec.epochs, steps_per_epoch=plan.steps_known,
                      steps=sum(counts), epoch_steps=counts, steps_estimated=estimated,
                      plan_fingerprint=plan.fingerprint(), index_fingerprint=job.dataset.fingerprint,
                      skipped_count=job.skipped_count, vision_cap=job.caps.vision_cap if job.caps else 0,
                      token_cap=job.caps.token_cap if job.caps else 0, conventions=job.dataset.conventions,
                      pixels=job.dataset.pixels.value,
                      resume=job.spec.resume.to_proto() if job.spec.resume else None)
    for listed, states in ((info.ranks, job.ranks), (info.encoder_ranks, job.encoders)):
        for rank, state in enumerate(states):
            listed.add(rank=rank, acked_epoch=state.acked[0], acked_step=state.acked[1], queued_steps=state.queued,
                       streamed_epoch=state.streamed[0], streamed_step=state.streamed[1])
    for key, reason, epoch, step in list(job.skipped):
        info.skipped.add(key=key, reason=reason, epoch=epoch, step=step)
    info.samples_by_dataset.update(job.delivered)
    if job.live is not None:
        info.live.CopyFrom(live_status(job))
    mixture = mixture_status(job)
    if mixture is not None:
        info.mixture.CopyFrom(mixture_proto(mixture))
    return info
