"""Stage 3 of the flow, `packfeed serve`: jobs over indexed datasets, streamed to trainer ranks over gRPC.

`config` is the server's settings; `datasets` the served datasets and `planning` how their epochs are planned
(one index or a mixture's union, one interface); `job_spec` what a job is, `jobs` each job's plans and
per-rank progress, `registry` their life and limits; `index_rows` the index columns serving reads,
`shard_reader` a sample's bytes read and verified, `preprocess` an indexed sample into tokens and tiles (the
pixel modes are `packfeed.media.pixel_modes`), `packs` assembles them, `wire` serializes packs, `workers`
runs that in a process pool (forks of a fork server that `worker_preload` readies;
`packfeed.media.refused_imports` names what server processes do without); `budget` bounds prepared bytes; `service`
is the gRPC servicer, `network` binds ports, TLS and auth, `observe` owns logs and Prometheus metrics, and `server`
starts it all.
"""
