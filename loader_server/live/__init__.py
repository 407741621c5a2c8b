"""Live jobs: samples born during the run (rollouts, scored responses), put by producers while trainers stream.
`put_request` reads a producer's put in place, `samples` checks what it holds, `spool` keeps it durable (each
sample a typed row, `rows.LiveRow`), `steps` forms the job's steps and `step_plan` plans each."""
