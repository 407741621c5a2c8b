"""Live jobs: samples born during the run (rollouts, scored responses), put by producers while trainers stream.
`samples` checks what a producer puts, `spool` keeps it durable, `steps` forms and plans the job's steps."""
