"""Every command quoted in README.md and docs/ is checked here, so the docs cannot drift from the CLI:

- every `packfeed ...` line parses with the real command line (its subcommand and flags exist, its values are
  valid choices), and a `packfeed train` line's settings load (`section.key=value` names a real setting);
- those that can run on the demo data run for real, in a folder laid out as the docs assume (`index.parquet`,
  `tokenizer.json`, `mix.yaml`, the InternVL length files), and succeed; a `packfeed serve` line runs as quoted
  except that its addresses move to free loopback ports (tests bind 127.0.0.1 only), and must stream a step of
  its dataset and answer on its metrics port;
- any other command (docker, torchrun, make, python) sits in a block marked with what runs it or what it needs:
  `<!-- run by tests/test_x.py -->`, `<!-- needs: docker -->`, `<!-- needs: cluster -->`, `<!-- needs: gpu -->`.
  A block marked `<!-- synopsis -->` shows a command's usage, not a command.

The README's tour and the pipelined Hugging Face commands run in their own tests (test_readme_tour.py,
test_hf_pipeline_train.py), which their markers name.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from doc_commands import REPO, Command, quoted_commands

RUNNABLE = {"convert", "info", "plan", "stats", "simulate", "index", "serve"}  # quick on small data
COMMANDS = quoted_commands()


def test_the_docs_quote_commands():
    """The extraction sees the pages' commands (a check over none would pass by itself)."""
    programs = {c.argv[0] for c in COMMANDS}
    assert {"packfeed", "docker", "make"} <= programs and len(COMMANDS) >= 25


@pytest.mark.parametrize("command", [c for c in COMMANDS if c.argv[0] == "packfeed" and c.marker != "synopsis"],
                         ids=lambda c: f"{c.page}:{c.line}")
def test_every_packfeed_command_parses(command):
    from packfeed.cli import build_parser

    try:
        args = build_parser().parse_args(command.argv[1:])
    except SystemExit:
        pytest.fail(f"{command.page}:{command.line}: `{command.text}` does not parse (see the error above)")
    if args.command == "train" and "..." not in args.overrides:
        from packfeed.trainer.config import load_config

        overrides = [o for o in args.overrides if not o.startswith(("data.index=", "data.target="))]
        load_config(args.config, overrides)  # every setting named exists and takes its value


def test_every_other_command_says_what_runs_it():
    unmarked = [f"{c.page}:{c.line}: {c.text}" for c in COMMANDS if c.argv[0] != "packfeed" and not c.marker]
    assert unmarked == []
    for c in COMMANDS:
        if c.marker.startswith("run by tests/"):
            assert (REPO / c.marker.split()[2]).is_file(), f"{c.page}:{c.line}: {c.marker} names no test file"


@pytest.fixture(scope="module")
def docs_folder(tmp_path_factory, demo_dataset):
    """A folder as the docs assume one: index.parquet (the demo's) and the demo's shards as shards/train-*.tar,
    mix.yaml (two datasets), small stand-ins for the recipes the conversion examples name (LLaVA annotations with
    their images under playground/data/ and beside data.json, an InternVL meta file), a tokenizer that knows every
    preset's special tokens, the InternVL length files when the shared data is there."""
    import json

    from conftest import LENGTH_FILES, real_lengths_available
    from packfeed.media.chat import PRESETS
    from packfeed.server.index.config import IndexConfig
    from packfeed.server.index.indexer import build_index
    from packfeed.server.tools.demo import train_tokenizer
    from recipe_data import write_annotation

    folder = tmp_path_factory.mktemp("docs")
    train_tokenizer(folder / "tokenizer.json",
                    special_tokens=sorted({token for preset in PRESETS.values() for token in preset.special_tokens}))
    llava = write_annotation(folder, "llava", 12, seed=1, jsonl=False)
    llava.path.rename(folder / "llava_v1_5_mix665k.json")
    (folder / "playground").mkdir()
    llava.image_root.rename(folder / "playground" / "data")
    qwen = write_annotation(folder, "qwen", 8, seed=4, jsonl=False)  # data.json, its images beside it
    qwen.path.rename(folder / "data.json")
    (qwen.image_root / "sub").rename(folder / "sub")
    (folder / "shards").mkdir()
    for number, shard in enumerate(demo_dataset.shards):
        (folder / "shards" / f"train-{number:05d}.tar").symlink_to(shard)
    meta = {}
    for name, seed in (("chartqa", 2), ("docvqa", 3)):
        annotation = write_annotation(folder, name, 10, seed=seed, jsonl=True)
        meta[name] = {"root": annotation.image_root.name, "annotation": annotation.path.name, "repeat_time": 1}
    (folder / "internvl_1_2_finetune.json").write_text(json.dumps(meta))
    for name in ("index.parquet", "other.parquet"):
        build_index([str(p) for p in demo_dataset.shards], folder / name, IndexConfig(tokenizer=str(demo_dataset.tokenizer)),
                    workers=1, progress=False)
    (folder / "mix.yaml").write_text("name: mix\ndatasets:\n  charts: {index: index.parquet, repeat: 2}\n"
                                     "  documents: {index: other.parquet, repeat: 0.5}\n")
    if real_lengths_available():
        for path in LENGTH_FILES:
            (folder / path.name).symlink_to(path)
    return folder


def to_run(command: Command) -> bool:
    """An unmarked quick command: every one of these must run here."""
    return not command.marker and command.argv[0] == "packfeed" and command.argv[1] in RUNNABLE


def missing_inputs(command: Command, folder: Path) -> list[str]:
    """The input files the command names that the folder lacks (its outputs are not inputs)."""
    import braceexpand

    argv = command.argv
    inputs = [word for word in argv[2:] if re.search(r"\.(parquet|yaml|json|tar)$", word) and not word.startswith("-")]
    outputs = {argv[i + 1] for i, word in enumerate(argv[:-1]) if word == "--out"}
    return [path for word in inputs if word not in outputs for path in braceexpand.braceexpand(word)
            if not (folder / path).exists()]


@pytest.mark.slow
def test_the_docs_commands_that_run_on_the_demo_data_succeed(docs_folder, tmp_path):
    from conftest import LENGTH_FILES, real_lengths_available

    ran, missing, folders = [], [], {}
    for command in filter(to_run, COMMANDS):
        if lacking := missing_inputs(command, folders.get(command.block, docs_folder)):
            missing += [(command.text, path) for path in lacking]
            continue
        if command.block not in folders:  # each block as in a fresh folder, its commands one after another
            folders[command.block] = shutil.copytree(docs_folder, tmp_path / str(command.block), symlinks=True)
        folder = folders[command.block]
        if command.argv[1] == "serve":
            serve_as_quoted(command, folder)
        else:
            argv = [sys.executable, "-m", "packfeed.cli", *command.argv[1:]]
            done = subprocess.run(argv, cwd=folder, capture_output=True, text=True, timeout=300)
            assert done.returncode in (0, 3), f"{command.page}:{command.line}: {command.text}\n{done.stderr[-3000:]}"
        ran.append(command.text)
    print("\n".join(["ran:", *ran]))
    # only the shared InternVL length files may be missing, and only where ../shared is not next to the clone
    assert all(path in {f.name for f in LENGTH_FILES} and not real_lengths_available() for _, path in missing), missing
    assert len(ran) >= 12, ran  # convert (3), index, info (2), plan (whole, windowed, mixture), stats, serve (2)
    assert sum(text.startswith("packfeed serve") for text in ran) >= 2, ran


def serve_as_quoted(command: Command, folder: Path) -> None:
    """The quoted `packfeed serve` line, run in `folder` with `--listen` and `--metrics-port` moved to free
    loopback ports; it must stream the first step of its (only) dataset and answer /metrics."""
    import contextlib
    import urllib.request

    from packfeed.client import LocalServer, PackStream
    from ports import free_port

    argv, metrics_port = command.argv[2:], free_port()
    for flag, value in (("--listen", "127.0.0.1:0"), ("--metrics-port", str(metrics_port))):
        if flag in argv:
            argv[argv.index(flag) + 1] = value
    with contextlib.chdir(folder), LocalServer(extra_args=argv) as server:
        with PackStream(server.target, job="docs", rank=0, dp=1, microbatches=2) as stream:
            step = next(iter(stream))
        assert step.sample_keys and len(step.packs) == 2, f"{command.page}:{command.line}: no step streamed"
        if "--metrics-port" in argv:
            with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as reply:
                assert b"packfeed_" in reply.read()
