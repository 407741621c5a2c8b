"""Model conventions from the command line: chat template presets (ChatML, Qwen2-VL, LLaVA/Vicuna, Llama-3),
every template and image policy field as a flag or a config file, tokenizers that lack the template's special
tokens refused (or extended on disk and recorded), and the image placeholder checked at index time."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from packfeed.media.chat import (IGNORE_INDEX, PRESETS, ChatEncoder, ChatTemplate, MissingTokensError,
                                        load_tokenizer)
from packfeed.media.image_policy import POLICIES
from packfeed.server.index.conventions import POLICY_FLAGS, add_convention_options, conventions_of
from packfeed.server.tools.demo import train_tokenizer

CLI = [sys.executable, "-m", "packfeed.cli"]
TURNS = [{"role": "user", "value": "<image>\nWhat is it?"}, {"role": "assistant", "value": "A cat."}]


def tokenizer_with(tmp_path: Path, template: ChatTemplate, name: str) -> Path:
    return train_tokenizer(tmp_path / name / "tokenizer.json", special_tokens=template.special_tokens)


def decoded(tokenizer, ids) -> list[str]:
    return [tokenizer.id_to_token(int(i)) for i in ids]


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_each_preset_renders_its_model_format(tmp_path, preset):
    template = PRESETS[preset]
    tokenizer = load_tokenizer(tokenizer_with(tmp_path, template, preset), template)
    ids, labels, starts = ChatEncoder(tokenizer, template).encode(TURNS, [3])
    tokens = decoded(tokenizer, ids)
    context = template.image_context
    assert tokens[starts[0]:starts[0] + 3] == [context] * 3 and tokens.count(context) == 3
    before, after = tokens[starts[0] - 1], tokens[starts[0] + 3]
    if template.image_start:
        assert (before, after) == (template.image_start, template.image_end)
    else:  # LLaVA's bare run: no wrapper tokens around the placeholders
        assert before not in template.special_tokens and after not in template.special_tokens
    if template.bos:
        assert tokens[0] == template.bos
    trained = [t for t, label in zip(tokens, labels) if label != IGNORE_INDEX]
    assert tokenizer.decode([int(i) for i, label in zip(ids, labels) if label != IGNORE_INDEX],
                            skip_special_tokens=True) == "A cat."
    assert trained[-1] == {"internvl": "<|im_end|>", "qwen2vl": "<|im_end|>", "llava": "</s>",
                           "llama3": "<|eot_id|>"}[preset]
    text = tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)
    expected_user = {"internvl": "<|im_start|>user\n", "qwen2vl": "<|im_start|>user\n", "llava": "USER: ",
                     "llama3": "<|start_header_id|>user<|end_header_id|>\n\n"}[preset]
    assert expected_user in text
    if template.system_prompt:
        assert template.system_prompt in text


def cli_args(*argv: str):
    import argparse

    parser = argparse.ArgumentParser()
    add_convention_options(parser)
    return parser.parse_args(list(argv))


def test_every_template_and_policy_field_has_a_flag(tmp_path):
    for name, policy in POLICIES.items():
        assert set(POLICY_FLAGS[name]) == {f.name for f in dataclasses.fields(policy)} - {"name"}
    policy, template = conventions_of(cli_args(
        "--chat-template", "llava", "--user-prefix", r"Human:\n", "--bos", "<s>", "--image-policy", "internvl",
        "--image-size", "336", "--min-tiles", "2", "--max-tiles", "6", "--no-thumbnail", "--image-tokens", "144",
        "--patch-size", "16"))
    assert policy == {"name": "internvl", "image_size": 336, "min_num": 2, "max_num": 6, "use_thumbnail": False,
                      "tokens_per_tile": 144, "patch_size": 16}
    assert template["user_prefix"] == "Human:\n" and template["assistant_suffix"] == "</s>"
    texts = [spec.name for spec in dataclasses.fields(ChatTemplate) if spec.name != "wrap_video"]
    flags = cli_args("--wrap-video", *[arg for name in texts for arg in (f"--{name.replace('_', '-')}", f"<t{name}>")])
    _, template = conventions_of(flags)
    assert template == {name: f"<t{name}>" for name in texts} | {"wrap_video": True}
    assert "wrap_video" not in conventions_of(cli_args("--wrap-video", "--video-timestamps", ""))[1]
    policy, _ = conventions_of(cli_args("--image-policy", "qwen2vl", "--resize-factor", "32", "--min-pixels", "1024",
                                        "--max-pixels", "4096", "--patch-size", "16"))
    assert policy == {"name": "qwen2vl", "factor": 32, "min_pixels": 1024, "max_pixels": 4096, "patch_size": 16}
    with pytest.raises(ValueError, match="--max-tiles does not apply to image policy qwen2vl"):
        conventions_of(cli_args("--image-policy", "qwen2vl", "--max-tiles", "4"))


def test_a_conventions_file_is_read_and_flags_override_it(tmp_path):
    path = tmp_path / "conventions.yaml"
    path.write_text("image_policy: {name: fixed, size: 224, tokens: 256}\n"
                    "chat_template: {preset: llama3, system_prompt: Be brief.}\n")
    policy, template = conventions_of(cli_args("--conventions", str(path), "--image-tokens", "64"))
    assert policy == {"name": "fixed", "size": 224, "tokens": 64}
    assert template == {**PRESETS["llama3"].to_dict(), "system_prompt": "Be brief."}
    path.write_text("chat_template: {preset: mistral}\n")
    with pytest.raises(ValueError, match="unknown chat template preset 'mistral'"):
        conventions_of(cli_args("--conventions", str(path)))
    path.write_text("chat_template: {user_prefx: x}\n")
    with pytest.raises(ValueError, match="unknown chat template field"):
        conventions_of(cli_args("--conventions", str(path)))


def test_templates_recorded_before_per_role_markers_read_back_the_same():
    old = {"turn_start": "<|im_start|>", "turn_end": "<|im_end|>", "image_start": "<img>", "image_end": "</img>",
           "image_context": "<IMG_CONTEXT>", "system_prompt": None}
    assert ChatTemplate.from_dict(old) == ChatTemplate()


def test_impossible_templates_are_refused():
    with pytest.raises(ValueError, match="system prompt cannot hold <image>"):
        ChatTemplate(system_prompt="Look at <image> first.")
    with pytest.raises(ValueError, match="image_context 'IMG' must be one special token"):
        ChatTemplate(image_context="IMG")
    with pytest.raises(ValueError, match="needs an image_context"):
        ChatTemplate(image_context="")


def index(shards, out: Path, tokenizer: Path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(CLI + ["index", *map(str, shards), "--out", str(out), "--tokenizer", str(tokenizer),
                                 "--quiet", "--workers", "1", *flags], capture_output=True, text=True, timeout=300)


def test_the_qwen_mistake_is_an_error_at_index_time(tmp_path, demo_dataset):
    """A Qwen2-VL tokenizer with `--image-policy qwen2vl` alone would have given packs InternVL's image tokens;
    now indexing stops and names the tokens, and `--chat-template qwen2vl` gives Qwen's."""
    qwen = tokenizer_with(tmp_path, PRESETS["qwen2vl"], "qwen")
    done = index(demo_dataset.shards[:1], tmp_path / "a" / "index.parquet", qwen, "--image-policy", "qwen2vl")
    assert done.returncode == 2
    assert "lacks the special token(s) <img>, </img>, <IMG_CONTEXT>" in done.stderr and "--chat-template" in done.stderr
    assert not (tmp_path / "a" / "index.parquet").exists()

    out = tmp_path / "b" / "index.parquet"
    done = index(demo_dataset.shards[:1], out, qwen, "--image-policy", "qwen2vl", "--chat-template", "qwen2vl")
    assert done.returncode in (0, 3), done.stderr  # 3: the demo's deliberately broken samples
    from packfeed.server.index.table import read_index
    from packfeed.server.serve.preprocess import SampleReader

    table, info = read_index(out)
    row = next(r for r in table.to_pylist() if r["valid"] and r["n_images"])
    sample = SampleReader(info, qwen).load(row)
    tokenizer = load_tokenizer(qwen, PRESETS["qwen2vl"])
    assert tokenizer.id_to_token(int(sample.input_ids[sample.image_starts[0]])) == "<|image_pad|>"
    assert tokenizer.id_to_token(int(sample.input_ids[sample.image_starts[0] - 1])) == "<|vision_start|>"


def test_missing_special_tokens_are_refused_or_written_to_an_extended_tokenizer(tmp_path, demo_dataset):
    with pytest.raises(MissingTokensError, match="<s>, </s>, <image>"):
        load_tokenizer(demo_dataset.tokenizer, PRESETS["llava"])  # never added silently in memory

    out = tmp_path / "llava" / "index.parquet"
    done = index(demo_dataset.shards[:1], out, demo_dataset.tokenizer, "--chat-template", "llava",
                 "--image-policy", "fixed", "--extend-tokenizer")
    assert done.returncode in (0, 3), done.stderr
    from packfeed.server.index.table import read_index
    from packfeed.server.serve.model_conventions import model_conventions as served_conventions
    from tokenizers import Tokenizer

    _, info = read_index(out)
    extended = out.parent / "tokenizer.json"
    assert info.tokenizer["path"] == str(extended.resolve())
    assert info.tokenizer["added_tokens"] == ["<s>", "</s>", "<image>"]
    assert info.tokenizer["extended_from"]["path"] == str(demo_dataset.tokenizer.resolve())
    original = Tokenizer.from_file(str(demo_dataset.tokenizer)).get_vocab_size()
    conventions = served_conventions(info, extended)
    assert conventions.vocab_size == original + 3
    assert not conventions.HasField("image_start_id")  # LLaVA's bare run has no wrapper token
    assert conventions.chat_template.turn_start == ""  # not ChatML-shaped
    assert conventions.image_context_id == Tokenizer.from_file(str(extended)).token_to_id("<image>")
    assert json.loads(extended.read_text())["added_tokens"][-1]["content"] == "<image>"


def test_marker_text_is_encoded_as_the_server_encodes_it(tmp_path, demo_dataset):
    """Index and server share one encoder: the length the index records is what the server produces, for a
    template set entirely from flags."""
    flags = ["--user-prefix", r"<|im_start|>human\n", "--assistant-prefix", r"<|im_start|>bot\n",
             "--separator", "", "--system-prompt", "You describe images."]
    out = tmp_path / "index.parquet"
    done = index(demo_dataset.shards[:1], out, demo_dataset.tokenizer, *flags)
    assert done.returncode in (0, 3), done.stderr
    from packfeed.server.index.table import read_index
    from packfeed.server.serve.preprocess import SampleReader

    table, info = read_index(out)
    assert info.chat_template["user_prefix"] == "<|im_start|>human\n" and info.chat_template["separator"] == ""
    reader = SampleReader(info, demo_dataset.tokenizer)
    rows = [r for r in table.to_pylist() if r["valid"]][:5]
    for row in rows:
        sample = reader.load(row)
        assert len(sample.input_ids) == row["llm_tokens"]
        assert int(np.count_nonzero(sample.labels != IGNORE_INDEX)) == row["loss_tokens"]
