"""Dataset mixtures: several indexes planned as one dataset, with weights that may move over the job.

`mixture_file` reads a mixture file; `loads` plans an epoch over the union of its datasets (whole, or window by
window through `packfeed.server.plan.windows`); `schedule` gives the weights a schedule sets over the job and the
exact counts a window draws; `draws` draws each window's samples from the datasets' passes by its weights, which
come from one weight source (`draws.WindowWeights`: the schedule, or a job's ledger deciding them from its trainers'
loss reports, `packfeed.server.serve.weight_ledger`, by a rule of `weight_rules`)."""
