"""Live jobs: put-to-pack throughput, latency and CPU per sample, against TransferQueue and a plain in-process queue
in the same run, each run as its users run it.

Run: .venv/bin/python -m pytest -q -s tests/benchmarks/test_bench_live.py -m benchmark

Workload: 2 producers x 128 rollouts of 1K-8K LLM tokens (log-uniform), each with a loss mask and a float32
advantage per token; "images": each rollout answers an indexed prompt with images (the demo index, InternVL
448 px tiles). A global step is 32 rollouts; 2 and 8 trainer ranks. Three rounds, the systems in turn in each:
each figure is the median of the rounds and their range.

- Packfeed: `packfeed serve --live-spool` (1 worker) on loopback; 2 producer processes `Producer.put` batches of
  16 (durable when it returns); the ranks are processes streaming `PackStream(plan=PlanConfig(live=True,
  step_samples=32))`. Images by reference to the prompt (the server reads, decodes and tiles them).
- TransferQueue 0.1.11 (the package index; its own environment, built once under /tmp, as verl runs it): a local
  Ray instance, `tq.init` with the `RankAwareSampler` in polling mode, producers as Ray tasks calling
  `client.put(TensorDict)` with jagged tensors, the ranks as Ray tasks reading a `StreamingDataLoader` (its
  tutorial 06). Images as their tiles (uint8, the bytes Packfeed's packs carry), put by the producer.
- In-process queue: `queue.Queue` between producer and rank threads of one process (numpy arrays, no copy):
  the floor, what a single-process script pays.

Latency: from a rollout's put call starting to its rank holding it (wall clocks of one machine). Throughput: the
rollouts over the time from the first put to the last arrival. CPU per sample: the CPU seconds of the system over the
rollouts: its own processes while the rollouts pass (Packfeed's server and workers; Ray's processes with
TransferQueue's controller and storage), plus each producer's and rank's inside its put and receive loops
(imports and start-up left out; every rank is set up before the first put).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.benchmark
PRODUCERS, PER_PRODUCER, STEP, BATCH, ROUNDS = 2, 128, 32, 16, 3
TQ_ENV = Path("/tmp/packfeed-bench-transferqueue")
TQ_PACKAGES = ["TransferQueue==0.1.11", "tensordict==0.15.3", "hydra-core==1.3.2", "omegaconf==2.3.0",
               "msgspec", "pyzmq", "antlr4-python3-runtime==4.9.3", "pyvers", "orjson", "cloudpickle"]
HERE = Path(__file__).resolve()


def rollouts(producer: int, prompts: list[dict] | None) -> list[dict]:
    """Producer `producer`'s rollouts: the same in every system."""
    rng = np.random.default_rng(1000 + producer)
    out = []
    for number in range(PER_PRODUCER):
        length = int(np.exp(rng.uniform(np.log(1024), np.log(8192))))
        tokens = rng.integers(100, 800, length).astype(np.int32)  # the demo tokenizer: 839 ids, specials below 5
        sample = {"id": f"p{producer}-{number}", "tokens": tokens, "loss_mask": (np.arange(length) >= 128)
                  .astype(np.uint8), "advantages": rng.normal(size=length).astype(np.float32)}
        if prompts:
            prompt = prompts[int(rng.integers(len(prompts)))]
            tokens[:len(prompt["tokens"])] = prompt["tokens"][:length]  # the prompt's tokens, placeholders and all
            sample.update(prompt=prompt["key"], tiles=prompt["tile_bytes"])
        out.append(sample)
    return out


def payload_bytes(sample: dict) -> int:
    return len(sample["tokens"]) * 9 + (sample["tiles"] if "tiles" in sample else 0)


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else 0.0


def summary(system: str, ranks: int, images: bool, put: dict, arrived: dict, cpu_s: float, payload: int) -> dict:
    latencies = [arrived[key] - put[key] for key in put]
    span = max(arrived.values()) - min(put.values())
    return {"system": system, "ranks": ranks, "images": images, "rollouts": len(put),
            "samples_per_s": round(len(put) / span, 1), "mb_per_s": round(payload / span / 1e6, 2),
            "latency_p50_ms": round(1000 * percentile(latencies, 50), 1),
            "latency_p99_ms": round(1000 * percentile(latencies, 99), 1),
            "cpu_ms_per_sample": round(1000 * cpu_s / len(put), 2)}


# -- the prompts -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    """The demo index (prompts with images) and, per prompt with images, its tokens (placeholders included, read
    from an ordinary prompt job) and its tiles' bytes."""
    from demo_data import indexed_demo
    from packfeed.client import LocalServer, PackStream, PlanConfig

    root = tmp_path_factory.mktemp("bench-live")
    _, index = indexed_demo(root, 60, 2, 5)
    found = []
    with LocalServer(index, workers=1) as server, \
            PackStream(server.target, job="prompts", rank=0, plan=PlanConfig(dp=1)) as stream:
        for step in stream:
            for pack in step.packs:
                cu = pack.cu_seqlens.tolist()
                sizes = pack.tile_shapes.prod(dim=1).tolist()
                image_of_tile = pack.tile_image.tolist()
                for k, key in enumerate(pack.sample_keys):
                    images = [i for i, owner in enumerate(pack.image_sample.tolist()) if owner == k]
                    if images and cu[k + 1] - cu[k] < 1024:
                        tile_bytes = sum(size for size, image in zip(sizes, image_of_tile) if image in images)
                        found.append({"key": key, "tokens": pack.input_ids[cu[k]:cu[k + 1]].numpy().copy(),
                                      "tile_bytes": int(tile_bytes)})
    return index, found


# -- Packfeed ----------------------------------------------------------------------------------------------------


def packfeed_producer(target: str, producer: int, prompts: list | None, out: str) -> None:
    from packfeed.client import Producer

    put = {}
    with Producer(target, job="bench", open_wait_s=60) as client:
        samples = rollouts(producer, prompts)
        cpu = time.process_time()
        for start in range(0, len(samples), BATCH):
            batch = samples[start:start + BATCH]
            began = time.time()
            client.put([{"id": s["id"], "tokens": s["tokens"], "loss_mask": s["loss_mask"],
                         "tensors": {"advantages": s["advantages"]}, "prompt": s.get("prompt", ""),
                         "group": s["id"]} for s in batch])
            put.update({s["id"]: began for s in batch})
        cpu = time.process_time() - cpu
    Path(out).write_text(json.dumps({"put": put, "cpu_s": cpu}))


def packfeed_rank(target: str, rank: int, ranks: int, out: str) -> None:
    from packfeed.client import PackStream, PlanConfig

    arrived = {}
    plan = PlanConfig(dp=ranks, microbatches=1, live=True, step_samples=STEP)
    with PackStream(target, job="bench", rank=rank, plan=plan) as stream:
        Path(f"{out}.ready").touch()  # opened: the producers may start
        cpu = time.process_time()
        for step in stream:
            now = time.time()
            arrived.update({key: now for key in step.sample_keys})
        cpu = time.process_time() - cpu
    Path(out).write_text(json.dumps({"arrived": arrived, "cpu_s": cpu}))


def run_packfeed(index: Path, prompts: list | None, ranks: int, folder: Path) -> dict:
    import multiprocessing

    from packfeed.client import LocalServer, Producer

    context = multiprocessing.get_context("spawn")
    folder.mkdir(parents=True, exist_ok=True)
    with LocalServer(index, workers=1, extra_args=["--live-spool", str(folder / "spool")]) as server:
        consumers = [context.Process(target=packfeed_rank, args=(server.target, r, ranks, str(folder / f"rank{r}")))
                     for r in range(ranks)]
        for process in consumers:
            process.start()
        wait_ready(folder, ranks)
        cpu_before = sum(cpu_by_process(server.process.pid).values())
        producers = [context.Process(target=packfeed_producer, args=(server.target, p, prompts, str(folder / f"p{p}")))
                     for p in range(PRODUCERS)]
        for process in producers:
            process.start()
        for process in producers:
            process.join()
        Producer(server.target, job="bench").end()
        for process in consumers:
            process.join()
        server_cpu = sum(cpu_by_process(server.process.pid).values()) - cpu_before
    return collect("packfeed", ranks, prompts, folder, server_cpu)


def collect(system: str, ranks: int, prompts, folder: Path, system_cpu: float) -> dict:
    put, arrived, cpu = {}, {}, system_cpu
    for p in range(PRODUCERS):
        data = json.loads((folder / f"p{p}").read_text())
        put.update(data["put"])
        cpu += data["cpu_s"]
    for r in range(ranks):
        data = json.loads((folder / f"rank{r}").read_text())
        arrived.update(data["arrived"])
        cpu += data["cpu_s"]
    assert sorted(arrived) == sorted(put), f"{system}: {len(arrived)} of {len(put)} rollouts arrived"
    payload = sum(payload_bytes(s) for p in range(PRODUCERS) for s in rollouts(p, prompts))
    return summary(system, ranks, bool(prompts), put, arrived, cpu, payload)


# -- a plain in-process queue ------------------------------------------------------------------------------------


def run_queue(prompts: list | None, ranks: int) -> dict:
    import queue
    import threading

    channel: queue.Queue = queue.Queue(maxsize=4 * STEP)
    put, arrived = {}, {}
    started = time.process_time()

    def produce(producer: int) -> None:
        for sample in rollouts(producer, prompts):
            if "tiles" in sample:
                sample["pixels"] = np.zeros(sample["tiles"], np.uint8)  # the tiles the producer made
            put[sample["id"]] = time.time()
            channel.put(sample)

    def consume() -> None:
        while (sample := channel.get()) is not None:
            arrived[sample["id"]] = time.time()

    threads = [threading.Thread(target=consume) for _ in range(ranks)]
    producers = [threading.Thread(target=produce, args=(p,)) for p in range(PRODUCERS)]
    for thread in threads + producers:
        thread.start()
    for thread in producers:
        thread.join()
    for _ in threads:
        channel.put(None)
    for thread in threads:
        thread.join()
    payload = sum(payload_bytes(s) for p in range(PRODUCERS) for s in rollouts(p, prompts))
    return summary("in-process queue", ranks, bool(prompts), put, arrived, time.process_time() - started, payload)


# -- TransferQueue (its own environment) ---------------------------------------------------------------------------


def transferqueue_env() -> Path:
    """TransferQueue and the packages it adds to this venv's torch, numpy and Ray, installed once beside it."""
    if not (TQ_ENV / "transfer_queue").is_dir():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--target", str(TQ_ENV), "--no-deps",
                        *TQ_PACKAGES], check=True)
    return TQ_ENV


def run_transferqueue(prompts: list | None, ranks: int, folder: Path) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "prompts.json").write_text(json.dumps([{"key": p["key"], "tokens": p["tokens"].tolist(),
                                                      "tile_bytes": p["tile_bytes"]} for p in prompts or []]))
    env = {**os.environ, "PYTHONPATH": f"{transferqueue_env()}:{HERE.parent}:{HERE.parents[1]}",
           "RAY_AUTH_MODE": "disabled", "RAY_DEDUP_LOGS": "0"}
    done = subprocess.run([sys.executable, str(HERE), "transferqueue", str(ranks), str(folder),
                           "images" if prompts else "text"], env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def transferqueue_main(ranks: int, folder: Path, images: bool) -> None:
    """In TransferQueue's environment: a local Ray instance with its controller and one storage unit, the
    producers and ranks as Ray tasks (its tutorial 06's way)."""
    import ray
    import transfer_queue as tq
    from omegaconf import OmegaConf
    from transfer_queue import RankAwareSampler

    ray.init(num_cpus=PRODUCERS + ranks + 2, include_dashboard=False, namespace="bench", log_to_driver=False)
    tq.init(OmegaConf.create({"controller": {"sampler": RankAwareSampler, "polling_mode": True},
                              "backend": {"SimpleStorage": {"num_data_storage_units": 1}}},
                             flags={"allow_objects": True}))
    role = ray.remote(num_cpus=0.5)(transferqueue_role)
    consumers = [role.remote(ranks, str(folder), images, f"rank{r}") for r in range(ranks)]
    wait_ready(folder, ranks)
    before = cpu_by_process(os.getpid())
    producers = [role.remote(ranks, str(folder), images, f"p{p}") for p in range(PRODUCERS)]
    clients = set(ray.get(producers + consumers))  # each task's process: counted by its own loop, below
    after = cpu_by_process(os.getpid())
    infrastructure = sum(cpu - before.get(pid, 0.0) for pid, cpu in after.items() if pid not in clients)
    tq.close()
    ray.shutdown()
    prompts = load_prompts(folder) if images else None
    print(json.dumps(collect("TransferQueue", ranks, prompts, folder, infrastructure)))


def transferqueue_role(ranks: int, folder: str, images: bool, role: str) -> int:
    """A producer ("p0") or rank ("rank1") task; writes what it put or received, and the CPU of its loop."""
    import warnings

    warnings.filterwarnings("ignore")
    import ray
    import torch
    import transfer_queue as tq
    from tensordict import TensorDict
    from transfer_queue import StreamingDataLoader, StreamingDataset

    tq.init()
    folder = Path(folder)
    prompts = load_prompts(folder) if images else None
    if role.startswith("p"):
        producer, client, put = int(role[1:]), tq.get_client(), {}
        samples = rollouts(producer, prompts)
        cpu = time.process_time()
        for start in range(0, len(samples), BATCH):
            batch = samples[start:start + BATCH]
            began = time.time()
            fields = {name: torch.nested.nested_tensor([torch.from_numpy(s[name]) for s in batch], layout=torch.jagged)
                      for name in ("tokens", "loss_mask", "advantages")}
            if images:  # the prompt's tiles, made by the producer (its processor) and put with each rollout
                fields["pixels"] = torch.nested.nested_tensor([torch.zeros(s["tiles"], dtype=torch.uint8)
                                                               for s in batch], layout=torch.jagged)
            fields["number"] = torch.tensor([producer * PER_PRODUCER + start + k for k in range(len(batch))])
            client.put(TensorDict(fields, batch_size=len(batch)), partition_id="train")
            put.update({s["id"]: began for s in batch})
        (folder / role).write_text(json.dumps({"put": put, "cpu_s": time.process_time() - cpu}))
        return os.getpid()
    controller = ray.get_actor("TransferQueueController", namespace="transfer_queue")
    dataset = StreamingDataset(config=ray.get(controller.get_config.remote()), batch_size=STEP // ranks,
                               micro_batch_size=STEP // ranks, partition_id="train", task_name="update",
                               data_fields=["tokens", "loss_mask", "advantages", "number"] + (["pixels"] if images
                                                                                              else []),
                               dp_rank=int(role[4:]), should_check_consumption_status=False)
    arrived, wanted = {}, PRODUCERS * PER_PRODUCER // ranks
    loader = StreamingDataLoader(dataset=dataset, num_workers=0)
    (folder / f"{role}.ready").touch()  # set up: the producers may start
    cpu = time.process_time()
    for batch, _ in loader:
        now = time.time()
        for number in batch["number"].tolist():
            arrived[f"p{number // PER_PRODUCER}-{number % PER_PRODUCER}"] = now
        if len(arrived) >= wanted:
            break
    (folder / role).write_text(json.dumps({"arrived": arrived, "cpu_s": time.process_time() - cpu}))
    return os.getpid()


def wait_ready(folder: Path, ranks: int, timeout_s: float = 300.0) -> None:
    """Until every rank has set up (torch imported, the job opened): the producers start after, in every
    system, so no rank's start-up lands in the measured time."""
    deadline = time.monotonic() + timeout_s
    while not all((folder / f"rank{r}.ready").exists() for r in range(ranks)):
        assert time.monotonic() < deadline, "the ranks did not start"
        time.sleep(0.1)
    time.sleep(1.0)  # their first request reaches the server


def cpu_by_process(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of a process and of every descendant alive now, by pid."""
    import psutil

    out = {}
    root = psutil.Process(pid)
    for process in [root, *root.children(recursive=True)]:
        try:
            times = process.cpu_times()
            out[process.pid] = times.user + times.system
        except psutil.NoSuchProcess:
            pass
    return out


def load_prompts(folder: Path) -> list[dict]:
    return [{**p, "tokens": np.asarray(p["tokens"], np.int32)} for p in json.loads((folder / "prompts.json").read_text())]


# -- the benchmark -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("images", [False, True], ids=["text", "images"])
@pytest.mark.parametrize("ranks", [2, 8])
def test_put_to_pack(prompts, tmp_path, ranks, images):
    index, found = prompts
    chosen = found if images else None
    rounds = {"packfeed": [], "TransferQueue": [], "in-process queue": []}
    for number in range(ROUNDS):  # the systems in turn, each round: the machine's noise falls on all of them
        folder = tmp_path / f"round{number}"
        for result in (run_packfeed(index, chosen, ranks, folder / "packfeed"),
                       run_transferqueue(chosen, ranks, folder / "transferqueue"), run_queue(chosen, ranks)):
            assert result["rollouts"] == PRODUCERS * PER_PRODUCER
            rounds[result["system"]].append(result)
    for system, results in rounds.items():
        print(json.dumps({"system": system, "ranks": ranks, "images": images, "rounds": ROUNDS,
                          **{name: median_and_range([r[name] for r in results]) for name in METRICS}}))


METRICS = ("samples_per_s", "mb_per_s", "latency_p50_ms", "latency_p99_ms", "cpu_ms_per_sample")


def median_and_range(values: list[float]) -> str:
    return f"{float(np.median(values)):.4g} ({min(values):.4g}-{max(values):.4g})"


if __name__ == "__main__" and sys.argv[1:2] == ["transferqueue"]:
    transferqueue_main(int(sys.argv[2]), Path(sys.argv[3]), sys.argv[4] == "images")

