"""Many servers, one job: the small shared state (job registry, rank leases, acknowledged cursors, skipped
samples, live servers), in this process (`coordinator`) or in Redis (`redis_coordinator`), the one a server's
URL names (`connect`). The Redis key layout is part of the contract
(`packfeed.v1.redis_keys`), so clients can discover servers without importing this package.
"""
