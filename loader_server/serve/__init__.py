"""Stage 3 of the flow, `packfeed serve`: jobs over indexed datasets, streamed to trainer ranks over gRPC.

`config` is the server's settings; `jobs` holds each job's plans and per-rank progress; `preprocess` turns
an indexed sample into tokens and tiles, `packs` assembles them, `wire` serializes packs, `workers` runs
that in a process pool; `budget` bounds prepared bytes; `service` is the gRPC servicer, `network` binds
ports, TLS and auth, `observe` owns logs and Prometheus metrics, and `server` starts it all.
"""
