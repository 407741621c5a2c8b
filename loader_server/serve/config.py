"""`packfeed serve` configuration: a YAML/JSON file, then environment overrides, then command-line flags.

    listen: 0.0.0.0:50051       # or a port range, 0.0.0.0:50051-50058: the first free one (scaled replicas on one host)
    metrics_port: 9400          # Prometheus /metrics and /status; 0 = off; a range (9400-9407) like listen
    workers: 4                  # pre-processing processes
    prefetch_steps: 4           # steps prepared ahead per rank stream
    memory_budget_mb: 2048      # prepared packs held in memory across all streams (and a quarter of that of
                                # shared-memory files kept between steps, to write the next ones into)
    max_message_mb: 256
    pack_part_kb: 1024          # packs go out in pieces of this size (bounds what gRPC holds per slow stream)
    auth_token: ""              # when set, calls must carry `authorization: Bearer <token>`
    redis_url: redis://redis:6379/0   # several servers share jobs through Redis (default: none, one server)
    redis_password: ""
    advertise: loader-1:50051   # address clients use to reach this server (listed in Redis for discovery);
                                # a host name alone gets the bound port
    lease_ttl_s: 10             # a rank whose server died is taken over by another after this long
    tls_cert: /certs/server.pem # TLS (with tls_key); add tls_client_ca for mutual TLS
    tls_key: /certs/server.key
    max_streams_per_client: 64  # concurrent pack streams per client host
    address_file: /tmp/packfeed.address  # host:port written once serving; `packfeed health` checks it
    max_jobs: 64                # jobs held at once (RESOURCE_EXHAUSTED beyond)
    job_idle_s: 3600            # a job without streams or calls for this long is forgotten
    count_at_open_s: 2          # an open counts its epochs' steps this long, the rest in the background
    prepare_timeout_s: 300      # a step stuck in preparation this long fails its stream (the client retries)
    max_skipped_fraction: 0.5   # a step that loses more of its samples fails loudly (FAILED_PRECONDITION)
    range_cache_dir: /cache/ranges  # object-store shards: ranges kept on local disk for later epochs
    range_cache_mb: 10240
    live_spool: /spool          # live jobs (PlanConfig live): where put samples stay until consumed ("" = no live jobs)
    live_spool_max_gb: 50       # what the spool may hold (0 = no bound): producers wait beyond it
    live_max_samples: 1000000   # samples a live job holds unconsumed (their rows are in memory, ~1.5 KB each)
    datasets:
      demo:
        index: /data/demo/index.parquet
        tokenizer: /data/demo/tokenizer.json   # default: the path recorded in the index
        shard_root: /data/demo/shards          # default: the shard paths recorded in the index
        pixels: exact                          # exact (as the HF processors), fast (OpenCV) or encoded
      sft-mix:
        mixture: /data/sft-mix.yaml            # a mixture of indexes, served under this name
        pixels: fast

Environment: PACKFEED_LISTEN, PACKFEED_METRICS_PORT, PACKFEED_WORKERS, PACKFEED_PREFETCH_STEPS,
PACKFEED_MEMORY_BUDGET_MB, PACKFEED_MAX_MESSAGE_MB, PACKFEED_PACK_PART_KB, PACKFEED_AUTH_TOKEN, PACKFEED_REDIS_URL,
PACKFEED_REDIS_PASSWORD, PACKFEED_ADVERTISE, PACKFEED_LEASE_TTL_S, PACKFEED_TLS_CERT, PACKFEED_TLS_KEY,
PACKFEED_TLS_CLIENT_CA, PACKFEED_MAX_STREAMS_PER_CLIENT, PACKFEED_ADDRESS_FILE, PACKFEED_MAX_JOBS,
PACKFEED_JOB_IDLE_S, PACKFEED_COUNT_AT_OPEN_S, PACKFEED_PREPARE_TIMEOUT_S, PACKFEED_MAX_SKIPPED_FRACTION,
PACKFEED_RANGE_CACHE_DIR, PACKFEED_RANGE_CACHE_MB, PACKFEED_LIVE_SPOOL, PACKFEED_LIVE_SPOOL_MAX_GB,
PACKFEED_LIVE_MAX_SAMPLES, and for a single dataset
PACKFEED_INDEX / PACKFEED_TOKENIZER / PACKFEED_SHARD_ROOT. Image policy and chat template always come from
the index: they decided the token counts the plan balances, so serving with others would break it.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from packfeed.media.pixel_modes import parse_pixels
from packfeed.server.index.table import read_index_info
from packfeed.server.mixture.mixture_file import read_yaml
from packfeed.server.serve.step_work import DatasetSource
from packfeed.v1.options import PixelMode
from packfeed.v1.redis_url import SENTINEL_SCHEME, parse_sentinel_url


@dataclass(frozen=True)
class MixtureSource:
    """A dataset that is a mixture of indexes (`packfeed.server.mixture.loads`), served under one name."""

    mixture: str
    pixels: PixelMode = PixelMode.EXACT

ENV_PREFIX = "PACKFEED_"


@dataclass
class ServerConfig:
    listen: str = "127.0.0.1:50051"  # host:port or host:first-last (binds the first free port of the range)
    metrics_port: int | str = 0  # a port, a range "first-last", or 0 = no metrics endpoint
    workers: int = max(1, (os.cpu_count() or 2) - 1)
    prefetch_steps: int = 4
    memory_budget_mb: int = 2048
    max_message_mb: int = 256
    pack_part_kb: int = 1024  # StreamPackParts piece size: what gRPC may hold per slow stream
    auth_token: str = ""
    # Several servers sharing jobs: coordination in Redis (empty = in this process, one server).
    # redis://host:6379/0, rediss:// for TLS, or redis+sentinel://host:26379[,host:26379...]/SERVICE[/db] for a
    # replicated Redis found through its sentinels
    redis_url: str = ""
    redis_password: str = ""
    advertise: str = ""  # host:port clients reach this server at (default: the listen host and bound port)
    lease_ttl_s: float = 10.0  # a rank whose server stops renewing is free for another after this long
    # TLS: server certificate + key (PEM files); with tls_client_ca, clients must present a certificate it
    # signed (mutual TLS). Empty = plaintext (loopback, or a trusted network).
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    max_streams_per_client: int = 64  # concurrent StreamPacks per client host; 0 = no limit
    address_file: str = ""  # written with this server's host:port once it serves (`packfeed health` reads it)
    max_jobs: int = 64  # jobs held at once; OpenJob of another is RESOURCE_EXHAUSTED
    job_idle_s: float = 3600.0  # a job without streams or calls for this long is forgotten (re-opened on demand)
    # OpenJob plans every epoch for its step count for at most this long; later epochs are counted in the
    # background (JobInfo.steps_estimated until then; `len(PackStream)` waits for the exact count)
    count_at_open_s: float = 2.0
    prepare_timeout_s: float = 300.0  # a step whose preparation takes longer fails its stream (UNAVAILABLE)
    max_skipped_fraction: float = 0.5  # a step losing more of its samples than this fails loudly
    # Object-store shards: ranges read kept on local disk for later epochs ("" = no cache), at most this much.
    range_cache_dir: str = ""
    range_cache_mb: int = 10240
    # Live jobs (PlanConfig.live): the folder their put samples are kept in until consumed ("" = no live jobs),
    # and what it may hold (0 = no bound; producers get RESOURCE_EXHAUSTED and wait beyond it)
    live_spool: str = ""
    live_spool_max_gb: float = 50.0
    live_max_samples: int = 1_000_000  # per live job, held unconsumed: its rows are in memory (0 = no bound)
    datasets: dict[str, DatasetSource | MixtureSource] = field(default_factory=dict)

    def validate(self) -> "ServerConfig":
        problems = []
        for name, spec in (("listen", self.listen.rpartition(":")[2]), ("metrics_port", self.metrics_port)):
            try:
                port_candidates(spec)
            except ValueError as error:
                problems.append(f"{name}: {error}")
        if ":" not in self.listen:
            problems.append(f"listen {self.listen!r} is not host:port")
        if self.workers < 1:
            problems.append("workers must be >= 1")
        if not 16 <= self.pack_part_kb <= self.max_message_mb << 10:
            problems.append("pack_part_kb must be at least 16 and fit in max_message_mb")
        if self.prefetch_steps < 1:
            problems.append("prefetch_steps must be >= 1")
        if self.memory_budget_mb < 1:
            problems.append("memory_budget_mb must be >= 1")
        if self.lease_ttl_s <= 0:
            problems.append("lease_ttl_s must be > 0")
        if self.max_jobs < 1 or self.job_idle_s <= 0 or self.prepare_timeout_s <= 0:
            problems.append("max_jobs must be >= 1, job_idle_s and prepare_timeout_s > 0")
        if self.count_at_open_s < 0:
            problems.append("count_at_open_s must be >= 0")
        if not self.live_spool_max_gb >= 0 or self.live_max_samples < 0:
            problems.append("live_spool_max_gb and live_max_samples must be >= 0 (0: no bound)")
        if not 0 <= self.max_skipped_fraction <= 1:
            problems.append("max_skipped_fraction must be between 0 and 1")
        if bool(self.tls_cert) != bool(self.tls_key):
            problems.append("give both tls_cert and tls_key (PEM files), or neither")
        if self.tls_client_ca and not self.tls_cert:
            problems.append("tls_client_ca (mutual TLS) needs tls_cert and tls_key too")
        for name in ("tls_cert", "tls_key", "tls_client_ca"):
            if getattr(self, name) and not Path(getattr(self, name)).is_file():
                problems.append(f"{name} {getattr(self, name)} not found")
        if self.redis_url.startswith(SENTINEL_SCHEME):
            try:
                parse_sentinel_url(self.redis_url)
            except ValueError as error:
                problems.append(f"redis_url: {error}")
        if not self.datasets:
            problems.append("no dataset: give --index, PACKFEED_INDEX, or `datasets:` in the config file")
        for name, source in self.datasets.items():
            if isinstance(source, MixtureSource):
                if not Path(source.mixture).is_file():
                    problems.append(f"dataset {name}: mixture file {source.mixture} not found")
            elif not Path(source.index).exists():
                problems.append(f"dataset {name}: index {source.index} not found")
            elif not Path(source.tokenizer).exists():
                problems.append(f"dataset {name}: tokenizer {source.tokenizer} not found (set `tokenizer:`)")
        if problems:
            raise ValueError("invalid server config: " + "; ".join(problems))
        return self


def port_candidates(spec: int | str) -> list[int]:
    """"50051" -> [50051]; "50051-50058" -> those 8 ports, tried in order; "0" -> [0] (any free port)."""
    first, dash, last = str(spec).strip().partition("-")
    try:
        ports = list(range(int(first), int(last if dash else first) + 1))
    except ValueError:
        raise ValueError(f"{spec!r} is not a port or a range like 50051-50058") from None
    if not ports or not all(0 <= p < 65536 for p in ports):
        raise ValueError(f"{spec!r}: ports run from 0 to 65535, the first of a range no larger than the last")
    return ports


def dataset_source(index: str, tokenizer: str | None = None, shard_root: str | None = None,
                   pixels: str | PixelMode = PixelMode.EXACT) -> DatasetSource:
    """A dataset entry; the tokenizer defaults to the one the index was built with."""
    pixels = parse_pixels(pixels)
    if tokenizer is None:
        recorded = (read_index_info(index).tokenizer or {}) if Path(index).exists() else {}
        tokenizer = recorded.get("path", "")
    return DatasetSource(str(index), str(tokenizer), str(shard_root) if shard_root else None, pixels)


def mixture_source(mixture: str, pixels: str | PixelMode = PixelMode.EXACT) -> MixtureSource:
    pixels = parse_pixels(pixels)
    return MixtureSource(str(mixture), pixels)


def load_config(path: str | Path | None = None, environ: dict[str, str] | None = None, **flags) -> ServerConfig:
    """File, then environment, then non-None keyword flags (the CLI's), each overriding the one before."""
    environ = os.environ if environ is None else environ
    raw = read_yaml(path, "server config") if path else {}
    if not isinstance(raw, (dict, type(None))):
        raise ValueError(f"server config {path}: a mapping of settings (and `datasets:`) is needed")
    raw = dict(raw or {})
    datasets = {name: mixture_source(**entry) if "mixture" in entry else dataset_source(**entry)
                for name, entry in (raw.pop("datasets", None) or {}).items()}
    known = {f.name: f for f in dataclasses.fields(ServerConfig) if f.name != "datasets"}
    unknown = set(raw) - set(known)
    if unknown:
        raise ValueError(f"unknown server config keys: {', '.join(sorted(unknown))}")
    values = dict(raw)
    for name, spec in known.items():
        env = environ.get(ENV_PREFIX + name.upper())
        if env is not None:
            values[name] = int(env) if spec.type in (int, "int") else float(env) if spec.type in (float, "float") \
                else env
    values.update({k: v for k, v in flags.items() if v is not None and k in known})
    if flags.get("mixture"):
        from packfeed.server.mixture.mixture_file import Mixture

        datasets[Mixture.load(flags["mixture"]).name] = MixtureSource(str(flags["mixture"]))
    index = flags.get("index") or environ.get(ENV_PREFIX + "INDEX")
    if index:
        datasets[flags.get("dataset") or Path(index).parent.name or "default"] = dataset_source(
            index, flags.get("tokenizer") or environ.get(ENV_PREFIX + "TOKENIZER"),
            flags.get("shard_root") or environ.get(ENV_PREFIX + "SHARD_ROOT"))
    return ServerConfig(**values, datasets=datasets).validate()


def describe(config: ServerConfig) -> str:
    shown = dataclasses.asdict(config)
    shown["auth_token"] = "***" if config.auth_token else ""
    shown["redis_password"] = "***" if config.redis_password else ""
    return json.dumps(shown, sort_keys=True)
