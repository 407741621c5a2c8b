"""Dataset mixtures: exact repeat counts and subset sizes, deterministic in (seed, epoch), planned over the
union so packs mix datasets; the plan file names each row's dataset; mismatched conventions are refused."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from dataclasses import replace

import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml

from packfeed.server.index.lengths import write_lengths_index
from packfeed.server.mixture.loads import (MixtureLoads, check_epoch_rows, count_mixture_steps,
                                           make_mixture_plan)
from packfeed.server.mixture.mixture_file import Mixture
from packfeed.v1.options import PlanConfig

CLI = [sys.executable, "-m", "packfeed.cli"]
REPEATS = {"charts": 2, "diagrams": 1, "documents": 0.4}


def lengths_index(path, n: int, seed: int, invalid: int = 0):
    rng = np.random.default_rng(seed)
    vision = rng.integers(0, 13, n)
    tokens = rng.integers(64, 4000, n)
    tokens[:invalid] = 0  # length records that cannot be planned: invalid rows
    write_lengths_index(vision, tokens, (vision > 0).astype(np.int64), path, [path.name], np.zeros(n, np.int32))
    return path


@pytest.fixture
def mixture_file(tmp_path):
    sizes = {"charts": (400, 0), "diagrams": (300, 7), "documents": (250, 0)}
    datasets = {}
    for k, (name, (n, invalid)) in enumerate(sizes.items()):
        lengths_index(tmp_path / name / "index.parquet", n, k, invalid)
        datasets[name] = {"index": f"{name}/index.parquet", "repeat": REPEATS[name]}
    path = tmp_path / "mix.yaml"
    path.write_text(yaml.safe_dump({"name": "sft-mix", "datasets": datasets}))
    return path


def plan_rows(mixture_file, out, epoch: int, seed: int = 0) -> tuple[list[dict], dict]:
    done = subprocess.run(CLI + ["plan", "--mixture", str(mixture_file), "--dp", "4", "--microbatches", "2",
                                 "--seed", str(seed), "--epoch", str(epoch), "--out", str(out)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return pq.read_table(out).to_pylist(), json.loads(done.stdout.strip().splitlines()[-1])


def test_every_sample_arrives_exactly_its_repeat_count(mixture_file, tmp_path):
    mixture = MixtureLoads(Mixture.load(mixture_file))
    valid = {entry.name: set(np.flatnonzero(loads.valid).tolist())
             for entry, loads in zip(mixture.mixture.datasets, mixture.loads)}
    rows, summary = plan_rows(mixture_file, tmp_path / "plan0.parquet", epoch=0)
    counts = {name: Counter() for name in REPEATS}
    for row in rows:
        if not row["empty"]:
            counts[row["dataset"]][row["sample_id"]] += 1
    assert set(counts["charts"]) == valid["charts"] and set(counts["charts"].values()) == {2}
    assert set(counts["diagrams"]) == valid["diagrams"] and set(counts["diagrams"].values()) == {1}
    assert len(valid["diagrams"]) == 293  # the invalid rows stay out
    subset = set(counts["documents"])
    assert subset <= valid["documents"] and set(counts["documents"].values()) == {1}
    assert len(subset) == round(0.4 * len(valid["documents"]))
    assert summary["datasets"] == {"charts": 800, "diagrams": 293, "documents": len(subset)}
    # ISF and balancing run over the union: packs mix datasets
    packs: dict[tuple, set] = {}
    for row in rows:
        if not row["empty"]:
            packs.setdefault((row["step"], row["rank"], row["microbatch"]), set()).add(row["dataset"])
    assert any(len(sources) > 1 for sources in packs.values())
    # another epoch draws another subset; the same epoch again is the same plan
    rows1, _ = plan_rows(mixture_file, tmp_path / "plan1.parquet", epoch=1)
    assert {r["sample_id"] for r in rows1 if r["dataset"] == "documents"} != subset
    again, summary_again = plan_rows(mixture_file, tmp_path / "again.parquet", epoch=0)
    assert again == rows and summary_again["plan_fingerprint"] == summary["plan_fingerprint"]


def test_a_windowed_mixture_plan_delivers_every_repeat_and_mixes_its_windows(mixture_file, tmp_path):
    """Windows over the epoch's rows: each sample its repeat count (the same subset as whole-epoch planning
    draws), windows mixing datasets, the same plan computed twice, and `packfeed plan --window` on it."""
    from packfeed.server.plan.windows import WindowedPlan

    mixture = MixtureLoads(Mixture.load(mixture_file), mapped=True)
    config = PlanConfig(dp=4, microbatches=2, window=300)
    plan = mixture.windowed(config, seed=0, epoch=0)
    assert isinstance(plan, WindowedPlan) and plan.n_windows == 4
    rows = [ids for step in range(plan.n_steps) for ids in (plan.step_members(step),)]
    counts = Counter(zip(plan.rows.datasets[np.concatenate(rows)].tolist(),
                         plan.rows.sample_ids[np.concatenate(rows)].tolist()))
    whole = mixture.epoch(0, 0)
    assert counts == Counter(zip(whole.datasets.tolist(), whole.sample_ids.tolist()))
    assert set(plan.rows.datasets[plan.window(1).members].tolist()) == {0, 1, 2}
    again = mixture.windowed(config, seed=0, epoch=0)
    assert all(np.array_equal(plan.step_members(s), again.step_members(s)) for s in range(plan.n_steps))
    done = subprocess.run(CLI + ["plan", "--mixture", str(mixture_file), "--dp", "4", "--microbatches", "2",
                                 "--window", "300"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["windows"] == 4 and summary["samples"] == len(whole.datasets) and summary["steps"] == plan.n_steps


def test_a_counted_mixture_epoch_has_its_plans_steps(mixture_file):
    """Each epoch draws its own rows (fractional repeats), so each is counted over its own rows."""
    mixture = MixtureLoads(Mixture.load(mixture_file))
    for config in (PlanConfig(dp=4, microbatches=2), PlanConfig(dp=3, strategy="random")):
        planned = [make_mixture_plan(mixture, config, 5, epoch).n_steps for epoch in range(4)]
        assert [count_mixture_steps(mixture, config, 5, epoch, None) for epoch in range(4)] == planned


def test_the_fingerprint_covers_every_index_and_weight(mixture_file, tmp_path):
    base = MixtureLoads(Mixture.load(mixture_file))
    config = PlanConfig(dp=4)
    plan = make_mixture_plan(base, config, 0, 0)
    raw = yaml.safe_load(mixture_file.read_text())
    raw["datasets"]["diagrams"]["repeat"] = 1.5
    reweighted = tmp_path / "reweighted.yaml"
    reweighted.write_text(yaml.safe_dump(raw))
    other = MixtureLoads(Mixture.load(reweighted))
    assert other.fingerprint != base.fingerprint
    assert make_mixture_plan(other, config, 0, 0).fingerprint() != plan.fingerprint()
    lengths_index(tmp_path / "charts" / "index.parquet", 400, 99)  # the same name, other content
    assert MixtureLoads(Mixture.load(mixture_file)).fingerprint != base.fingerprint


@pytest.mark.parametrize("datasets, message", [
    ({"a": {"index": "missing.parquet"}}, "not found"),
    ({"a": {"index": "charts/index.parquet", "repeat": 0}}, "give a number > 0"),
    ({"a": {"index": "charts/index.parquet", "weight": 2}}, "nothing else"),
    ({}, "needs `name:` and `datasets:"),
    ({"a": {"index": "charts/index.parquet", "repeat": "two"}}, "dataset 'a' has repeat 'two'; give a number"),
    ({"a": {"index": "charts/index.parquet", "repeat": 1e12}}, "dataset 'a' has repeat 1000000000000.0; .* at most 1000"),
    ({"a": {"index": "charts/index.parquet", "repeat": True}}, "dataset 'a' has repeat True"),
    ({"a": {"index": 3}}, "dataset 'a' has index 3"),
])
def test_bad_mixture_files_are_refused_with_the_reason(mixture_file, tmp_path, datasets, message):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"name": "bad", "datasets": datasets}))
    with pytest.raises(ValueError, match=message) as refused:
        Mixture.load(bad)
    assert str(bad) in str(refused.value)  # every error names the file


def test_mixture_edges_are_refused_naming_file_and_field_or_read_as_meant(mixture_file, tmp_path):
    """An index path that is not Parquet, a dataset given twice, a repeat that gives no sample: each refused naming
    the file and the dataset. `repeat: 1e3` (YAML reads it as a string) is the number 1000."""
    text = mixture_file.read_text()
    (tmp_path / "notes.parquet").write_text("not a parquet file")
    cases = {
        "not parquet": (text.replace("charts/index.parquet", "notes.parquet"),
                        r"dataset 'charts': .*notes.parquet is not a Packfeed index: not a Parquet file"),
        "twice": (text.replace("  diagrams:", "  charts:\n    index: diagrams/index.parquet\n  diagrams:", 1),
                  "key 'charts' is given twice"),
    }
    for name, (body, message) in cases.items():
        bad = tmp_path / f"{name.replace(' ', '-')}.yaml"
        bad.write_text(body)
        with pytest.raises(ValueError, match=message) as refused:
            Mixture.load(bad)
        assert str(bad) in str(refused.value), name
    tiny = tmp_path / "tiny.yaml"
    tiny.write_text(text.replace("repeat: 0.4", "repeat: 1.0e-300"))
    with pytest.raises(ValueError, match=f"mixture file {tiny}: dataset 'documents': repeat 1e-300 of its 250 valid "
                                         "samples gives none per epoch; give at least 0.004"):
        MixtureLoads(Mixture.load(tiny))
    spelled = tmp_path / "spelled.yaml"
    spelled.write_text(text.replace("repeat: 2", "repeat: 1e3"))
    assert yaml.safe_load(spelled.read_text())["datasets"]["charts"]["repeat"] == "1e3"  # what YAML gives
    assert Mixture.load(spelled).datasets[0].repeat == 1000.0


def test_a_mixture_too_large_to_hold_is_refused_by_the_command_naming_file_and_dataset(mixture_file, tmp_path):
    raw = yaml.safe_load(mixture_file.read_text())
    raw["datasets"]["charts"]["repeat"] = 1e12
    bad = tmp_path / "huge.yaml"
    bad.write_text(yaml.safe_dump(raw))
    done = subprocess.run(CLI + ["plan", "--mixture", str(bad), "--dp", "4", "--out", str(tmp_path / "p.parquet")],
                          capture_output=True, text=True)
    assert done.returncode != 0 and "MemoryError" not in done.stderr and "Traceback" not in done.stderr
    assert f"mixture file {bad}: dataset 'charts' has repeat" in done.stderr
    # within the per-dataset bound, an epoch too large to hold is refused before anything is allocated
    mixture = Mixture.load(mixture_file)
    with pytest.raises(ValueError, match=f"mixture file {mixture_file}: dataset 'charts': repeat 1000 x 3,000,000"):
        check_epoch_rows(replace(mixture, datasets=(replace(mixture.datasets[0], repeat=1000),)),
                         [np.arange(3_000_000)])


def test_datasets_with_other_conventions_cannot_be_mixed(tmp_path, demo_dataset):
    from test_integrity import conversation, index, write_tar

    write_tar(tmp_path / "one.tar", [{"__key__": "q", "json": conversation("Q?", "A.")}])
    index([tmp_path / "one.tar"], tmp_path / "tiles.parquet", demo_dataset.tokenizer)
    index([tmp_path / "one.tar"], tmp_path / "resized.parquet", demo_dataset.tokenizer,
          image_policy={"name": "qwen2vl"})
    mix = tmp_path / "mix.yaml"
    mix.write_text(yaml.safe_dump({"name": "m", "datasets": {"tiles": {"index": "tiles.parquet"},
                                                             "resized": {"index": "resized.parquet"}}},
                                  sort_keys=False))
    with pytest.raises(ValueError, match="datasets 'tiles' and 'resized' disagree on the image policy"):
        MixtureLoads(Mixture.load(mix))


def test_info_gives_the_quick_look_before_training(mixture_file, tmp_path, demo_dataset):
    """`packfeed info` on a mixture (per dataset, with repeats), an index, a directory and raw shards."""
    done = subprocess.run(CLI + ["info", str(mixture_file), "--json"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    mixture = json.loads(done.stdout)
    assert mixture["kind"] == "mixture" and set(mixture["datasets"]) == set(REPEATS)
    diagrams = mixture["datasets"]["diagrams"]
    assert (diagrams["samples"], diagrams["valid"], diagrams["invalid"]) == (300, 293, 7)
    assert diagrams["invalid_by_reason"] == {"bad length record (vit_num < 0 or token_num <= 0)": 7}
    assert mixture["datasets"]["charts"]["samples_per_epoch"] == 800
    assert mixture["datasets"]["documents"]["samples_per_epoch"] == round(0.4 * 250)
    assert mixture["samples_per_epoch"] == 800 + 293 + 100
    assert mixture["datasets"]["charts"]["distributions"]["llm_tokens"]["max"] < 4000
    text = subprocess.run(CLI + ["info", str(mixture_file)], capture_output=True, text=True, check=True).stdout
    assert "diagrams: repeat 1 -> 293 per epoch" in text and "7 bad length record" in text

    directory = json.loads(subprocess.run(CLI + ["info", str(mixture_file.parent / "charts"), "--json"],
                                          capture_output=True, text=True, check=True).stdout)
    assert directory["kind"] == "index" and directory["samples"] == 400
    shards = subprocess.run(CLI + ["info", str(demo_dataset.shards[0].parent), "--json"], capture_output=True,
                            text=True, check=True)
    seen = json.loads(shards.stdout)
    assert seen["kind"] == "shards" and seen["shards"] == len(demo_dataset.shards) and seen["samples"] == 60


def test_stats_report_on_a_mixture(mixture_file, tmp_path):
    done = subprocess.run(CLI + ["stats", "--mixture", str(mixture_file), "--dp", "4", "--out", str(tmp_path / "r")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    assert {name: d["in_epoch_0"] for name, d in report["datasets"].items()} == \
        {"charts": 800, "diagrams": 293, "documents": 100}
    assert report["datasets"]["diagrams"]["invalid"] == 7 and report["invalid"] == 7
    assert report["samples"] == 1193 and [row["strategy"] for row in report["comparison"]] == \
        ["random", "length-group", "isf", "isf+balance", "isf+balance, not collective-safe"]
    assert "Datasets of the mixture" in (tmp_path / "r" / "report.md").read_text()
    assert (tmp_path / "r" / "report.html").stat().st_size > 0


def served_mixture(tmp_path, demo_dataset):
    from test_integrity import conversation, index, write_tar

    sizes = {"charts": 12, "diagrams": 9, "documents": 10}
    datasets = {}
    for name, n in sizes.items():
        write_tar(tmp_path / f"{name}.tar", [{"__key__": f"{name}-{i}", "json": conversation(f"Q{i}?", "A." * (i + 1))}
                                             for i in range(n)])
        index([tmp_path / f"{name}.tar"], tmp_path / f"{name}.parquet", demo_dataset.tokenizer)
        datasets[name] = {"index": f"{name}.parquet", "repeat": REPEATS[name]}
    mix = tmp_path / "mix.yaml"
    mix.write_text(yaml.safe_dump({"name": "sft-mix", "datasets": datasets}))
    return mix


def test_a_mixture_stream_resumes_on_a_restarted_server_exactly_where_it_was(tmp_path, demo_dataset):
    """Resume works as for one dataset: half an epoch, state_dict, a new server process, load_state_dict, the
    rest: together exactly the epoch one uninterrupted stream gets."""
    from packfeed.client import LocalServer, PackStream

    mix = served_mixture(tmp_path, demo_dataset)
    options = dict(job="resumed", rank=0, dataset="sft-mix", dp=1, microbatches=2)
    with LocalServer(None, workers=1, extra_args=["--mixture", str(mix)]) as server:
        with PackStream(server.target, **options) as stream:
            straight = [(step.step, step.sample_keys) for step in stream]
        with PackStream(server.target, **{**options, "job": "interrupted"}) as stream:
            steps = iter(stream)
            first = [(step.step, step.sample_keys) for step in (next(steps) for _ in range(len(straight) // 2))]
            state = stream.state_dict()
    with LocalServer(None, workers=1, extra_args=["--mixture", str(mix)]) as restarted:
        with PackStream(restarted.target, **{**options, "job": "interrupted"}) as stream:
            stream.load_state_dict(state)
            rest = [(step.step, step.sample_keys) for step in stream]
    assert first + rest == straight


@pytest.mark.parametrize("window", [0, 10])
def test_a_mixture_is_served_as_one_dataset(tmp_path, demo_dataset, window):
    """Three shard datasets mixed 2 / 1 / 0.4 and served over gRPC under the mixture's name: per epoch every
    sample arrives exactly its repeat count (the subset exactly round(0.4 n)), packs say where each sample
    came from, two epochs draw other subsets, GetJob counts per dataset; planned whole or in windows of 10
    rows."""
    import grpc

    from packfeed.client import LocalServer, PackStream
    from packfeed.v1 import packfeed_pb2 as pb
    from packfeed.v1 import packfeed_pb2_grpc as pb_grpc
    mix = served_mixture(tmp_path, demo_dataset)
    epochs = {}
    with LocalServer(None, workers=1, extra_args=["--mixture", str(mix)]) as server:
        for rank in range(2):
            with PackStream(server.target, job="mixed", rank=rank, dataset="sft-mix", dp=2, microbatches=2,
                            epochs=2, window=window) as stream:
                for step in stream:
                    for key, source in zip(step.sample_keys, step.sample_sources):
                        assert key.startswith(source + "-")
                        epochs.setdefault(step.epoch, Counter())[key] += 1
        info = pb_grpc.PackfeedStub(grpc.insecure_channel(server.target)).GetJob(pb.GetJobRequest(job="mixed"))
    for epoch, counts in epochs.items():
        assert all(counts[f"charts-{i}"] == 2 for i in range(12))
        assert all(counts[f"diagrams-{i}"] == 1 for i in range(9))
        documents = {key for key in counts if key.startswith("documents-")}
        assert len(documents) == 4 and all(counts[key] == 1 for key in documents)  # round(0.4 * 10)
    assert {k for k in epochs[0] if k.startswith("documents")} != {k for k in epochs[1] if k.startswith("documents")}
    assert dict(info.samples_by_dataset) == {"charts": 48, "diagrams": 18, "documents": 8}
    assert info.plan.window == window


def test_a_mixture_stream_fails_over_to_another_server(tmp_path, demo_dataset):
    """Failover works as for one dataset: the server feeding the stream is killed mid-epoch and the next one
    continues from the first step not received, with the same samples as an uninterrupted stream."""
    from packfeed.client import LocalServer, PackStream

    mix = served_mixture(tmp_path, demo_dataset)
    options = dict(rank=0, dataset="sft-mix", dp=1, microbatches=2, prefetch=1, retries=8, backoff=0.2)
    first, second = (LocalServer(None, workers=1, extra_args=["--mixture", str(mix)]).start() for _ in range(2))
    try:
        with PackStream(second.target, job="reference", **options) as stream:
            straight = [step.sample_keys for step in stream]
        with PackStream([first.target, second.target], job="moved", **options) as stream:
            steps = iter(stream)
            received = [next(steps).sample_keys]
            first.process.kill()
            received += [step.sample_keys for step in steps]
    finally:
        first.stop()
        second.stop()
    assert received == straight


def test_the_status_page_shows_a_mixture_jobs_balance(tmp_path, demo_dataset):
    """A mixture is served as one dataset in every respect, the status page's plan balance included (computed over
    the mixture plan's rows, not a single index's)."""
    from packfeed.client import LocalServer, PackStream
    from ports import free_port
    from test_status_page import get

    mix, port = served_mixture(tmp_path, demo_dataset), free_port()
    with LocalServer(None, workers=1, metrics_port=port, extra_args=["--mixture", str(mix)]) as server:
        with PackStream(server.target, job="watched-mix", rank=0, dataset="sft-mix", dp=2, microbatches=2) as stream:
            next(iter(stream))
            code, body = get(f"http://127.0.0.1:{port}/status.json")
    assert code == 200, body[-500:]
    (job,) = [j for j in json.loads(body)["jobs"] if j["job"] == "watched-mix"]
    assert job["balance"]["known"] and job["balance"]["steps"] > 0 and 0 <= job["balance"]["llm_dist"] < 1


def test_a_mixture_plans_with_context_parallelism(mixture_file, tmp_path):
    """A CP plan of a mixture: every row once per its repeats, each with its degree and GPUs, none over N."""
    done = subprocess.run(CLI + ["plan", "--mixture", str(mixture_file), "--dp", "2", "--context-parallel", "4",
                                 "--max-tokens-per-gpu", "1500", "--out", str(tmp_path / "cp.parquet")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["context_parallel"]["peak_tokens_per_gpu"] <= 1500
    assert {"1", "2", "4"} <= set(summary["context_parallel"]["degrees"])
    rows = pq.read_table(tmp_path / "cp.parquet").to_pylist()
    plain, _ = plan_rows(mixture_file, tmp_path / "plain.parquet", epoch=0)
    assert sorted((r["dataset"], r["sample_id"]) for r in rows if not r["empty"]) == \
        sorted((r["dataset"], r["sample_id"]) for r in plain if not r["empty"])
    assert {r["cp"] for r in rows} == {1, 2, 4} and all(r["cp_group"] * r["cp"] < 4 for r in rows)
