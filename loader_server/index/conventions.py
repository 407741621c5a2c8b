"""A model's conventions from the command line and a config file: every field of the image policy and the chat
template, for `packfeed index` and `packfeed convert --index`.

Precedence: dataclass defaults < the chat template preset < the `--conventions FILE.yaml` file < single flags.
The file holds the two sections an index records:

    image_policy: {name: internvl, max_num: 6}
    chat_template: {preset: llava, system_prompt: "..."}

Marker flags take backslash escapes (`--user-prefix '<|im_start|>user\\n'`), since shells do not.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path
from typing import Any

import yaml

from packfeed.server.index.chat import PRESETS, ChatTemplate
from packfeed.server.index.image_policy import DEFAULT_POLICY, POLICIES

# Per image policy: its field -> the option (without dashes) that sets it. Options shared by policies mean the
# same thing in each (the tile or square side, placeholder tokens per tile or image, the ViT patch side).
POLICY_FLAGS: dict[str, dict[str, str]] = {
    "internvl": {"image_size": "image_size", "min_num": "min_tiles", "max_num": "max_tiles",
                 "use_thumbnail": "thumbnail", "tokens_per_tile": "image_tokens", "patch_size": "patch_size"},
    "qwen2vl": {"factor": "resize_factor", "min_pixels": "min_pixels", "max_pixels": "max_pixels",
                "patch_size": "patch_size"},
    "fixed": {"size": "image_size", "tokens": "image_tokens", "patch_size": "patch_size"},
}
_POLICY_HELP = {
    "image_size": "internvl: tile side; fixed: square side, px", "min_tiles": "internvl: min tiles per image",
    "max_tiles": "internvl: max tiles per sample", "thumbnail": "internvl: add a thumbnail tile to multi-tile grids",
    "image_tokens": "internvl: LLM tokens per tile; fixed: per image", "patch_size": "ViT patch side, px",
    "resize_factor": "qwen2vl: sides rounded to multiples of this (patch x merge)",
    "min_pixels": "qwen2vl: min pixels", "max_pixels": "qwen2vl: max pixels",
}
_TEMPLATE_FIELDS = [spec for spec in dataclasses.fields(ChatTemplate)]


def add_convention_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model conventions (image policy and chat template)")
    group.add_argument("--conventions", metavar="FILE.yaml",
                       help="image_policy: and chat_template: sections; single flags override it")
    group.add_argument("--image-policy", choices=sorted(POLICIES), help=f"default {DEFAULT_POLICY}")
    for flag, help_text in _POLICY_HELP.items():
        if flag == "thumbnail":
            group.add_argument("--thumbnail", action=argparse.BooleanOptionalAction, help=help_text)
        else:
            group.add_argument("--" + flag.replace("_", "-"), type=int, help=help_text)
    group.add_argument("--chat-template", choices=sorted(PRESETS),
                       help="template preset: internvl (ChatML, the default), qwen2vl, llava (Vicuna v1), llama3")
    for spec in _TEMPLATE_FIELDS:
        group.add_argument("--" + spec.name.replace("_", "-"), help=spec.metadata["help"])
    group.add_argument("--extend-tokenizer", action="store_true",
                       help="when the tokenizer lacks the template's special tokens, write a tokenizer.json that has "
                            "them beside the index (and record it) instead of refusing")


def conventions_of(args: argparse.Namespace, **policy_overrides: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(image policy dict, chat template dict) as the index records them."""
    sections = _read_file(args.conventions) if args.conventions else {}
    policy = dict(sections.get("image_policy") or {})
    if args.image_policy:
        if policy.get("name", args.image_policy) != args.image_policy:
            policy = {}  # another policy than the file's: its fields do not apply
        policy["name"] = args.image_policy
    name = policy.setdefault("name", DEFAULT_POLICY)
    flags = POLICY_FLAGS.get(name)
    if flags is None:
        raise ValueError(f"unknown image policy {name!r}; choose one of {', '.join(POLICIES)}")
    for flag in _POLICY_HELP:
        value = getattr(args, flag)
        if value is None:
            continue
        field_name = next((f for f, option in flags.items() if option == flag), None)
        if field_name is None:
            raise ValueError(f"--{flag.replace('_', '-')} does not apply to image policy {name}; its options are "
                             + ", ".join("--" + o.replace("_", "-") for o in flags.values()))
        policy[field_name] = value
    policy.update(policy_overrides)
    POLICIES[name](**{k: v for k, v in policy.items() if k != "name"})  # fail early on a bad field or value

    template = dict(sections.get("chat_template") or {})
    if args.chat_template:
        template = {"preset": args.chat_template, **{k: v for k, v in template.items() if k != "preset"}}
    for spec in _TEMPLATE_FIELDS:
        value = getattr(args, spec.name)
        if value is not None:
            template[spec.name] = _unescape(value) if spec.name != "system_prompt" else value
    return policy, ChatTemplate.from_dict(template).to_dict()


def _unescape(text: str) -> str:
    return re.sub(r"\\([nt\\])", lambda m: {"n": "\n", "t": "\t", "\\": "\\"}[m.group(1)], text)


def _read_file(path: str) -> dict[str, Any]:
    try:
        sections = yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as error:
        raise ValueError(f"conventions file {path}: not valid YAML: {error}") from None
    if not isinstance(sections, dict) or set(sections) - {"image_policy", "chat_template"}:
        raise ValueError(f"conventions file {path}: expected only the sections image_policy: and chat_template:")
    return sections
