"""Mixtures whose weights move over the job (docs/planning.md "Mixtures that move"): each window draws its samples by
the weights at its middle, exactly, never a sample twice; the plan file follows the schedule; served to DP 2,
resumed on a restarted server and failed over to another, the same windows arrive; bad schedules are refused."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml

from packfeed.server.mixture.loads import MixtureLoads
from packfeed.server.mixture.mixture_file import Mixture
from packfeed.v1.options import PlanConfig
from test_mixture import lengths_index

CLI = [sys.executable, "-m", "packfeed.cli"]
ANNEAL = {"ocr": {0.0: 0.8, 1.0: 0.2}, "chat": {0.0: 0.2, 1.0: 0.8}}


def schedule_file(tmp_path, sizes: dict[str, int], samples: int | None = None, **top) -> object:
    datasets = {}
    for k, (name, n) in enumerate(sizes.items()):
        lengths_index(tmp_path / name / "index.parquet", n, k)
        datasets[name] = {"index": f"{name}/index.parquet", "weights": ANNEAL[name]}
    path = tmp_path / "anneal.yaml"
    path.write_text(yaml.safe_dump({"name": "anneal", "datasets": datasets, **top,
                                    **({"samples": samples} if samples else {})}))
    return path


def linear_share(progress: float) -> float:
    """ocr's share of the anneal schedule at `progress` (its weights sum to 1 everywhere)."""
    return 0.8 + (0.2 - 0.8) * progress


def test_each_window_draws_the_weights_at_its_middle_exactly_and_never_a_sample_twice(tmp_path):
    """80/20 moving to 20/80: every window's counts are within one sample of window x weights and sum to the window;
    no window draws a sample twice; over the epoch each dataset gives each sample floor(R) or ceil(R) times; a
    plan that draws window 7 first draws what one drawing in order does."""
    path = schedule_file(tmp_path, {"ocr": 300, "chat": 500}, samples=2_000)
    mixture = MixtureLoads(Mixture.load(path), None, mapped=True)
    config = PlanConfig(dp=2, microbatches=1, window=160)
    plan = mixture.windowed(config, 3, 0)
    drawn = {"ocr": Counter(), "chat": Counter()}
    shares = []
    for window in range(plan.n_windows):
        size = min(160, 2_000 - 160 * window)
        progress = (160 * window + size / 2) / 2_000
        datasets, ids = plan.draws.rows(window)
        counts = dict(zip(plan.rows.names, np.bincount(datasets, minlength=2).tolist()))
        assert sum(counts.values()) == size and abs(counts["ocr"] - size * linear_share(progress)) < 1
        shares.append(counts["ocr"] / size)
        for k, name in enumerate(plan.rows.names):
            mine = ids[datasets == k].tolist()
            assert len(set(mine)) == len(mine), f"window {window} drew a {name} sample twice"
            drawn[name].update(mine)
    assert shares[0] > 0.75 and shares[-1] < 0.25 and shares == sorted(shares, reverse=True)
    for name, size in (("ocr", 300), ("chat", 500)):
        total = sum(drawn[name].values())
        assert set(drawn[name].values()) <= {total // size, -(-total // size)} and len(drawn[name]) == size
    fresh = mixture.windowed(config, 3, 0)
    assert all(np.array_equal(a, b) for a, b in zip(fresh.draws.rows(7), plan.draws.rows(7)))
    assert mixture.windowed(config, 4, 0).draws.rows(0)[1].tolist() != plan.draws.rows(0)[1].tolist()


def test_a_dataset_smaller_than_its_share_gives_all_it_has_and_the_rest_goes_to_the_others(tmp_path):
    path = schedule_file(tmp_path, {"ocr": 40, "chat": 900}, samples=1_000)
    plan = MixtureLoads(Mixture.load(path), None, mapped=True).windowed(PlanConfig(dp=2, window=100), 0, 0)
    datasets, ids = plan.draws.rows(0)  # ocr's share is 0.77 of 100: it holds 40
    ocr = plan.rows.names.index("ocr")
    assert np.bincount(datasets).tolist()[ocr] == 40 and len(datasets) == 100
    assert sorted(ids[datasets == ocr].tolist()) == list(range(40))


def test_served_windows_hold_each_sample_at_most_once_and_every_draw_is_served(tmp_path):
    """The windows as planned: carried steps move samples a window later, never into a window holding their
    twin (a small dataset drawn whole window after window), and the epoch serves exactly what was drawn."""
    path = schedule_file(tmp_path, {"ocr": 60, "chat": 400}, samples=1_200)
    plan = MixtureLoads(Mixture.load(path), None, mapped=True).windowed(PlanConfig(dp=4, window=100), 0, 0)
    served = Counter()
    for window in range(plan.n_windows - 1):
        rows = plan.window(window).members
        keys = list(zip(plan.rows.datasets[rows].tolist(), plan.rows.sample_ids[rows].tolist()))
        assert len(keys) == len(set(keys)), f"window {window} serves a sample twice"
        served.update(keys)
    served.update(zip(plan.rows.datasets[plan.window(plan.n_windows - 1).members].tolist(),
                      plan.rows.sample_ids[plan.window(plan.n_windows - 1).members].tolist()))
    drawn = Counter()
    for window in range(plan.n_windows):
        datasets, ids = plan.draws.rows(window)
        drawn.update(zip(datasets.tolist(), ids.tolist()))
    assert served == drawn


def test_the_plan_file_follows_the_schedule_window_by_window(tmp_path):
    """`packfeed plan --mixture schedule.yaml --dp 8 --window N --out plan.parquet`: the summary gives each window's
    weights and draws, the file's `dataset` column follows them, and a second run writes the same plan."""
    path = schedule_file(tmp_path, {"ocr": 900, "chat": 1_500})
    command = CLI + ["plan", "--mixture", str(path), "--dp", "8", "--window", "400"]
    done = subprocess.run(command + ["--out", str(tmp_path / "plan.parquet")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    windows = summary["windows_drawn"]
    assert len(windows) == summary["windows"] == 6 and summary["samples"] == 2_400
    assert [w["weights"]["ocr"] for w in windows] == sorted((w["weights"]["ocr"] for w in windows), reverse=True)
    table = pq.read_table(tmp_path / "plan.parquet").to_pandas()
    table = table[~table["empty"]]
    assert len(table) == 2_400 and summary["datasets"] == table.dataset.value_counts().to_dict()
    by_step = table.groupby("step").dataset.apply(lambda d: (d == "ocr").mean())
    first, last = by_step.iloc[: len(by_step) // 6].mean(), by_step.iloc[-len(by_step) // 6:].mean()
    assert first > 0.6 and last < 0.4  # 0.75 and 0.25 drawn; carried steps blur the edges a little
    meta = json.loads(pq.read_schema(tmp_path / "plan.parquet").metadata[b"packfeed.plan"])
    starts = meta["window_first_steps"]
    assert sorted(table.window.unique()) == list(range(6)) and len(starts) == 6
    assert table.groupby("window").step.min().tolist() == starts  # each window's first step, as the file says
    for window, rows in table[table.window < 5].groupby("window"):  # no sample twice in a window (but the last)
        assert not rows.duplicated(["dataset", "sample_id"]).any(), window
    again = subprocess.run(command + ["--out", str(tmp_path / "again.parquet")], capture_output=True, text=True)
    assert json.loads(again.stdout.strip().splitlines()[-1])["plan_fingerprint"] == summary["plan_fingerprint"]
    assert pq.read_table(tmp_path / "again.parquet").equals(pq.read_table(tmp_path / "plan.parquet"))


def test_the_fingerprint_covers_the_schedule(tmp_path):
    path = schedule_file(tmp_path, {"ocr": 200, "chat": 300})
    before = MixtureLoads(Mixture.load(path)).fingerprint
    raw = yaml.safe_load(path.read_text())
    raw["interpolate"] = "step"
    path.write_text(yaml.safe_dump(raw))
    assert MixtureLoads(Mixture.load(path)).fingerprint != before


@pytest.mark.parametrize("edit, message", [
    (lambda raw: raw["datasets"]["ocr"].update(repeat=2), "both `repeat:` and `weights:`"),
    (lambda raw: raw["datasets"]["chat"].pop("weights"), "give no `weights:` while others do"),
    (lambda raw: raw["datasets"]["ocr"].update(weights={0.0: 0.8, 0.5: 0.2}), "give a weight at 1.0"),
    (lambda raw: raw["datasets"]["ocr"].update(weights={0.2: 0.8, 1.0: 0.2}), "give a weight at 0.0"),
    (lambda raw: raw["datasets"]["ocr"].update(weights={0.0: -1, 1.0: 0.2}), "give a number >= 0"),
    (lambda raw: [raw["datasets"][d].update(weights={0.0: 0, 1.0: 0}) for d in ("ocr", "chat")], "every weight is 0"),
    (lambda raw: raw.update(interpolate="cubic"), "interpolate 'cubic'"),
    (lambda raw: raw.update(samples="many"), "samples 'many'"),
    (lambda raw: raw.update(rules="softmax"), "unknown keys ['rules']"),
])
def test_bad_schedules_are_refused_naming_the_file_and_dataset(tmp_path, edit, message):
    path = schedule_file(tmp_path, {"ocr": 50, "chat": 50})
    raw = yaml.safe_load(path.read_text())
    edit(raw)
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ValueError, match="mixture file") as refused:
        Mixture.load(path)
    assert message in str(refused.value)


def test_a_moving_mixture_is_refused_without_windows_saying_why(tmp_path):
    path = schedule_file(tmp_path, {"ocr": 50, "chat": 50})
    done = subprocess.run(CLI + ["plan", "--mixture", str(path), "--dp", "2"], capture_output=True, text=True)
    assert done.returncode != 0 and "planned in windows" in done.stderr and "--window" in done.stderr


def contents(step) -> tuple:
    """A step's samples and every tensor's bytes."""
    return step.step, step.sample_keys, [sorted((name, t.numpy().tobytes()) for name, t in pack.tensors.items())
                                         for pack in step.packs]


def served_schedule(tmp_path, tokenizer) -> object:
    from test_integrity import conversation, index, write_tar

    datasets = {}
    for name, n in {"ocr": 14, "chat": 18}.items():
        write_tar(tmp_path / f"{name}.tar", [{"__key__": f"{name}-{i}", "json": conversation(f"Q{i}?", "A." * (i + 1))}
                                             for i in range(n)])
        index([tmp_path / f"{name}.tar"], tmp_path / f"{name}.parquet", tokenizer)
        datasets[name] = {"index": f"{name}.parquet", "weights": ANNEAL[name]}
    path = tmp_path / "anneal.yaml"
    path.write_text(yaml.safe_dump({"name": "anneal", "samples": 60, "datasets": datasets}))
    return path


def test_a_schedule_served_to_dp2_is_resumed_and_failed_over_to_the_same_windows(tmp_path, demo_dataset):
    """Two ranks stream a whole job of 60 samples in windows of 12; GetJob and the status page give the windows'
    weights and draws, Prometheus the weights in force; rank 0 killed mid-job and resumed on a restarted server,
    and rank 1 failed over from a killed server to another, receive the same steps, byte for byte."""
    import grpc

    from packfeed.client import LocalServer, PackStream
    from packfeed.v1 import packfeed_pb2 as pb
    from packfeed.v1 import packfeed_pb2_grpc as pb_grpc
    from ports import free_port
    from test_status_page import get

    path = served_schedule(tmp_path, demo_dataset.tokenizer)
    extra = ["--mixture", str(path)]
    options = dict(dataset="anneal", dp=2, microbatches=1, window=12, prefetch=1)

    def whole(target, job, rank):
        with PackStream(target, job=job, rank=rank, **options) as stream:
            return [contents(step) for step in stream]

    port = free_port()
    with LocalServer(None, workers=1, metrics_port=port, extra_args=extra) as server:
        straight = {rank: whole(server.target, "straight", rank) for rank in range(2)}
        info = pb_grpc.PackfeedStub(grpc.insecure_channel(server.target)).GetJob(pb.GetJobRequest(job="straight"))
        status = json.loads(get(f"http://127.0.0.1:{port}/status.json")[1])
        metrics = get(f"http://127.0.0.1:{port}/metrics")[1].decode()
        with PackStream(server.target, job="killed", rank=0, **options) as stream:
            steps = iter(stream)
            first = [contents(next(steps)) for _ in range(len(straight[0]) // 2)]
            state = stream.state_dict()
    windows = info.mixture.windows
    assert len(windows) == 5 and sum(sum(w.drawn.values()) for w in windows) == 60
    assert windows[0].weights["ocr"] > 0.7 and windows[-1].weights["ocr"] < 0.3
    assert [w.first_step for w in windows] == sorted(w.first_step for w in windows)
    served = Counter(key for rank in range(2) for _, keys, _ in straight[rank] for key in keys)
    assert dict(info.samples_by_dataset) == {name: sum(n for key, n in served.items() if key.startswith(name + "-"))
                                             for name in ("ocr", "chat")}
    assert sum(served.values()) == 60
    job = next(job for job in status["jobs"] if job["job"] == "straight")
    assert [w["weights"] for w in job["mixture"]["windows"]] == [dict(w.weights) for w in windows]
    assert 'packfeed_mixture_weight{dataset="ocr",job="straight"}' in metrics

    with LocalServer(None, workers=1, extra_args=extra) as restarted:
        with pytest.raises(Exception, match="planned in windows"):  # a whole-epoch job is refused, saying why
            with PackStream(restarted.target, job="whole", rank=0, **{**options, "window": 0}) as stream:
                next(iter(stream))
        with PackStream(restarted.target, job="killed", rank=0, **options) as stream:
            stream.load_state_dict(state)
            rest = [contents(s) for s in stream]
    assert first + rest == straight[0]

    one, other = (LocalServer(None, workers=1, extra_args=extra).start() for _ in range(2))
    try:
        with PackStream([one.target, other.target], job="moved", rank=1, retries=8, backoff=0.2, **options) as stream:
            steps = iter(stream)
            received = [contents(next(steps))]
            one.process.kill()
            received += [contents(s) for s in steps]
    finally:
        one.stop()
        other.stop()
    assert received == straight[1]


def test_stats_draws_a_schedules_weights_and_counts_over_the_epoch(tmp_path):
    """`packfeed stats --mixture schedule.yaml --window N`: a table and a figure of each window's weights and draws,
    every dataset's repeat as its windows drew it; without --window, the reason."""
    path = schedule_file(tmp_path, {"ocr": 300, "chat": 500}, samples=1_000)
    done = subprocess.run(CLI + ["stats", "--mixture", str(path), "--dp", "2", "--window", "250", "--out",
                                 str(tmp_path / "r")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    windows = report["schedule"]
    assert len(windows) == 4 and [sum(w["drawn"].values()) for w in windows] == [250] * 4
    assert windows[0]["weights"]["ocr"] > windows[-1]["weights"]["ocr"]
    drawn = sum(w["drawn"]["ocr"] for w in windows)
    assert report["datasets"]["ocr"]["in_epoch_0"] == drawn and report["datasets"]["ocr"]["repeat"] == \
        round(drawn / 300, 3)
    assert (tmp_path / "r" / "schedule.png").stat().st_size > 5_000
    assert "Weights over the epoch" in (tmp_path / "r" / "report.md").read_text()
    assert "Weights over the epoch" in (tmp_path / "r" / "report.html").read_text()
    refused = subprocess.run(CLI + ["stats", "--mixture", str(path), "--dp", "2", "--out", str(tmp_path / "x")],
                             capture_output=True, text=True)
    assert refused.returncode != 0 and "planned in windows" in refused.stderr


def test_the_docs_commands_run_as_written(tmp_path, demo_dataset):
    """docs/planning.md "Mixtures that move": its stats, plan and serve lines, in a folder holding ocr/ and chat/
    indexes of real shards and an anneal.yaml (the docs' schedule, on 32 samples: one window); the server streams
    the job's first step to a trainer that asks for the docs' window."""
    import contextlib
    import shlex

    from doc_commands import commands_run_by
    from packfeed.client import LocalServer, PackStream

    (tmp_path / "made").mkdir()
    served = served_schedule(tmp_path / "made", demo_dataset.tokenizer)
    raw = yaml.safe_load(served.read_text())
    for name in ("ocr", "chat"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "index.parquet").write_bytes((tmp_path / "made" / f"{name}.parquet").read_bytes())
        raw["datasets"][name]["index"] = f"{name}/index.parquet"
    raw.pop("samples")
    (tmp_path / "anneal.yaml").write_text(yaml.safe_dump(raw))
    commands = commands_run_by("tests/test_moving_mixture.py")
    assert [c.split()[1] for c in commands] == ["stats", "plan", "serve"]
    for command in commands[:2]:
        done = subprocess.run(CLI + shlex.split(command)[1:], cwd=tmp_path, capture_output=True, text=True)
        assert done.returncode == 0, f"{command}\n{done.stderr[-2000:]}"
    assert json.loads((tmp_path / "report" / "report.json").read_text())["schedule"][0]["drawn"] == \
        {"chat": 18, "ocr": 14}
    assert set(pq.read_table(tmp_path / "plan.parquet").column("dataset").to_pylist()) >= {"ocr", "chat"}
    with contextlib.chdir(tmp_path), LocalServer(extra_args=shlex.split(commands[2])[2:]) as server:
        with PackStream(server.target, job="docs", rank=0, dataset="anneal", dp=1, microbatches=1,
                        window=100_000) as stream:
            assert next(iter(stream)).sample_keys


RULE = {"name": "softmax", "temperature": 0.5, "min_weight": 0.1, "max_weight": 0.9, "max_change": 0.3,
        "wait_s": 60}


def synthetic_loss(dataset: str, step: int) -> float:
    """ocr hard at first and learnt fast, chat the other way round: the softmax rule moves weight between them."""
    return 3.0 - 0.25 * step if dataset == "ocr" else 1.0 + 0.1 * step


def train(target, job: str, rank: int, state: dict | None = None, stop_after: int = 0, kill=None) -> tuple:
    """One rank of a DP 2 job of the loss-driven mixture: every step's contents, each reported with the step's
    synthetic losses per dataset (counted by its samples); with `stop_after`, its state after that many steps;
    `kill()` called after the first step (the server it talks to dies)."""
    from packfeed.client import PackStream

    got = []
    targets = target if isinstance(target, list) else [target]
    # a cap of 50 tokens (the longest sample): a pack holds one or two samples, a window of 12 three steps or so
    with PackStream(targets, job=job, rank=rank, dataset="anneal", dp=2, microbatches=1, window=12, prefetch=1,
                    token_cap=50, vision_cap=64, retries=8, backoff=0.2) as stream:
        if state is not None:
            stream.load_state_dict(state)
        for step in stream:
            got.append(contents(step))
            sources = Counter(step.sample_sources)
            stream.report({d: synthetic_loss(d, step.step) for d in sources}, dict(sources))
            if kill is not None and len(got) == 1:
                kill()
            if stop_after and len(got) == stop_after:
                return got, stream.state_dict()
    return got, None


def both_ranks(target, job: str, states=(None, None), stop_after: int = 0, kill=None) -> list[tuple]:
    """Both ranks at once (a window waits for every rank's reports)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        runs = [pool.submit(train, target, job, rank, states[rank], stop_after, kill if rank == 0 else None)
                for rank in range(2)]
        return [run.result(timeout=600) for run in runs]


def test_loss_driven_weights_replay_exactly_and_resume_and_fail_over_to_the_same_windows(tmp_path, demo_dataset):
    """A softmax rule over reported losses, DP 2: windows 2 on move off the schedule within the rule's bounds and
    max_change; a rerun reporting the same losses gets the same weights and packs; both ranks stopped mid-job and
    resumed on a restarted server, and failed over from a killed server to another, get the same steps."""
    import grpc

    from packfeed.client import LocalServer
    from packfeed.v1 import packfeed_pb2 as pb
    from packfeed.v1 import packfeed_pb2_grpc as pb_grpc

    path = served_schedule(tmp_path, demo_dataset.tokenizer)
    raw = yaml.safe_load(path.read_text())
    path.write_text(yaml.safe_dump({**raw, "rule": RULE}))
    extra = ["--mixture", str(path)]
    with LocalServer(None, workers=1, extra_args=extra) as server:
        first = both_ranks(server.target, "first")
        again = both_ranks(server.target, "again")
        stub = pb_grpc.PackfeedStub(grpc.insecure_channel(server.target))
        infos = [stub.GetJob(pb.GetJobRequest(job=job)).mixture for job in ("first", "again")]
        stopped = both_ranks(server.target, "stopped", stop_after=5)
    assert [steps for steps, _ in first] == [steps for steps, _ in again]
    weights = [[dict(d.weights) for d in info.decided] for info in infos]
    assert weights[0] == weights[1] and len(weights[0]) == 5
    assert all(info.windows_on_partial_reports == 0 and not info.reports_ignored for info in infos), infos
    ocr = [w["ocr"] for w in weights[0]]
    for window in (0, 1):  # the schedule's
        assert ocr[window] == pytest.approx(0.8 - 0.6 * ocr_progress(infos[0], window), abs=1e-9)
    assert ocr[2] != pytest.approx(0.8 - 0.6 * ocr_progress(infos[0], 2), abs=1e-3)  # the rule's, from window 2
    assert all(0.1 - 1e-9 <= w <= 0.9 + 1e-9 for w in ocr) and max(abs(a - b) for a, b in zip(ocr[1:], ocr)) <= 0.3 + 1e-9

    def partial(server, job: str) -> int:  # windows decided without every rank's reports: none, all along
        stub = pb_grpc.PackfeedStub(grpc.insecure_channel(server.target))
        return stub.GetJob(pb.GetJobRequest(job=job)).mixture.windows_on_partial_reports

    with LocalServer(None, workers=1, extra_args=extra) as restarted:
        rest = both_ranks(restarted.target, "stopped", states=[state for _, state in stopped])
        assert partial(restarted, "stopped") == 0  # the states' reports and decisions were given to it
    for rank in range(2):
        assert stopped[rank][0] + rest[rank][0] == first[rank][0]

    one, other = (LocalServer(None, workers=1, extra_args=extra).start() for _ in range(2))
    try:
        moved = both_ranks([one.target, other.target], "moved", kill=one.process.kill)
        assert partial(other, "moved") == 0  # each rank gave its reports again to the server it moved to
    finally:
        one.stop()
        other.stop()
    assert [steps for steps, _ in moved] == [steps for steps, _ in first]


def ocr_progress(info, window: int) -> float:
    return next(w.progress for w in info.windows if w.window == window)


def test_packfeed_train_trains_a_scheduled_mixture_and_refuses_a_loss_driven_one(tmp_path, demo_dataset):
    """The reference trainer: `data.mixture` and `data.window` train the anneal schedule on an embedded server; a
    mixture with a rule is refused at the start, naming it (this trainer reports no per-dataset losses)."""
    from trainer_workers import SMALL_MODEL, packfeed_train

    path = served_schedule(tmp_path, demo_dataset.tokenizer)
    common = [*[f"model.{k}={v}" for k, v in SMALL_MODEL.items()], "data.microbatches=1", "data.server_workers=1",
              "parallel.pp=1", "parallel.dp=1", "recompute.mode=none", "data.window=12", "data.token_cap=64",
              "data.vision_cap=64", "optim.steps=6"]
    _, records = packfeed_train(1, common + [f"data.mixture={path}"], tmp_path / "scheduled")
    drawn = Counter()
    for record in records:
        drawn.update(record["samples_by_dataset"])
    assert len(records) == 6 and set(drawn) == {"ocr", "chat"}, records
    assert drawn["ocr"] > drawn["chat"]  # the schedule's start: 80/20
    raw = yaml.safe_load(path.read_text())
    (tmp_path / "driven.yaml").write_text(yaml.safe_dump({**raw, "rule": RULE}))
    done = subprocess.run([sys.executable, "-m", "packfeed.cli", "train", "--nproc", "1", *common,
                           f"data.mixture={tmp_path / 'driven.yaml'}", f"out={tmp_path / 'driven'}"],
                          capture_output=True, text=True, timeout=400)
    assert done.returncode != 0 and "rule softmax" in done.stderr and "does not report per-dataset losses" in \
        done.stderr, done.stderr[-3000:]


def test_a_stream_waiting_for_a_loss_driven_window_is_kept_alive_and_the_window_counted_once(tmp_path, demo_dataset):
    """Rank 1 reports its first step 20 s late: window 2 waits for it (wait_s 40) while rank 0's stream has
    nothing to send. The server sends empty pieces meanwhile, so a 15 s stall watch never drops the stream (its
    connection allows no retry: a drop would end it in an error), and the window is decided once, on full
    reports."""
    import time

    import grpc

    from packfeed.client import Connection, LocalServer, PackStream
    from packfeed.v1 import packfeed_pb2 as pb
    from packfeed.v1 import packfeed_pb2_grpc as pb_grpc

    path = served_schedule(tmp_path, demo_dataset.tokenizer)
    raw = yaml.safe_load(path.read_text())
    path.write_text(yaml.safe_dump({**raw, "rule": {**RULE, "wait_s": 40}}))
    strict = Connection(retries=0, stall_timeout=15.0)

    def rank(number: int) -> list[int]:
        steps = []
        with PackStream(server.target, job="patient", rank=number, dataset="anneal", dp=2, microbatches=1,
                        window=12, prefetch=1, token_cap=50, vision_cap=64, connection=strict) as stream:
            for step in stream:
                if number == 1 and not steps:
                    time.sleep(20)  # longer than the stall watch, shorter than wait_s
                sources = Counter(step.sample_sources)
                stream.report({d: synthetic_loss(d, step.step) for d in sources}, dict(sources))
                steps.append(step.step)
            seen[number] = stream.weights()  # the weights decided after the stream opened the job
        return steps

    seen: dict[int, dict] = {}

    from concurrent.futures import ThreadPoolExecutor

    with LocalServer(None, workers=1, extra_args=["--mixture", str(path)]) as server:
        with ThreadPoolExecutor(2) as pool:
            runs = [pool.submit(rank, number) for number in range(2)]
            steps = [run.result(timeout=600) for run in runs]  # a dropped stream raises here
        stub = pb_grpc.PackfeedStub(grpc.insecure_channel(server.target))
        info = stub.GetJob(pb.GetJobRequest(job="patient"))
        assert info.mixture.windows_on_partial_reports == 0 and not info.mixture.reports_ignored
        for step in (len(steps[0]), 20_000):  # past the job's last window: left out, counted, never held
            stub.AckStep(pb.AckStepRequest(job="patient", rank=0, epoch=0, step=step, losses={"ocr": 1.0},
                                           reports_losses=True))
        ignored = stub.GetJob(pb.GetJobRequest(job="patient")).mixture.reports_ignored
    assert steps[0] == steps[1] == list(range(len(steps[0]))) and len(info.mixture.decided) >= 3
    assert dict(ignored) == {"step past the job's last window": 2}
    decided = {d.window: dict(d.weights) for d in info.mixture.decided}
    assert seen[0] == seen[1] and sorted(seen[0]) == sorted(decided) and len(decided) >= 3
    assert all(seen[0][w] == pytest.approx(decided[w], abs=1e-6) for w in decided) and decided[2] != decided[1]


def test_the_docs_loss_driven_mixture_is_read_as_written(tmp_path, demo_dataset):
    """docs/planning.md "Weights the loss moves": its mixture file, as written, beside ocr/ and chat/ indexes."""
    import re
    from pathlib import Path

    from packfeed.server.mixture.mixture_file import Mixture

    page = (Path(__file__).resolve().parents[1] / "docs" / "planning.md").read_text()
    section = page[page.index("#### Weights the loss moves"):]
    block = re.search(r"^```yaml\n(.*?)^```", section, flags=re.M | re.S).group(1)
    (tmp_path / "made").mkdir()
    served_schedule(tmp_path / "made", demo_dataset.tokenizer)
    for name in ("ocr", "chat"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "index.parquet").write_bytes((tmp_path / "made" / f"{name}.parquet").read_bytes())
    (tmp_path / "online.yaml").write_text(block)
    mixture = Mixture.load(tmp_path / "online.yaml")
    assert mixture.rule.name == "softmax" and mixture.rule.wait_s == 600 and mixture.samples == 2_000_000
    assert mixture.schedule.weights(0.0).tolist() == [0.5, 0.5]
