"""A model's conventions from the command line and a config file: every field of the image policy and the chat
template, for `packfeed index` and `packfeed convert --index`.

Precedence: dataclass defaults < the model `--preset` < the `--conventions FILE.yaml` file < single flags.
The file holds the two sections an index records, and is how to write a preset of your own:

    image_policy: {name: internvl, max_num: 6}
    chat_template: {preset: llava, system_prompt: "..."}
    video_policy: {fps: 1, max_frames: 16, sampling: random}

Marker flags take backslash escapes (`--user-prefix '<|im_start|>user\\n'`), since shells do not.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path
from typing import Any

import yaml

from packfeed.media.chat import PRESETS, ChatTemplate
from packfeed.media.image_policy import DEFAULT_POLICY, HALF_MEAN, HALF_STD, POLICIES
from packfeed.media.video import SAMPLINGS, VideoSampling

# Per image policy: its field -> the option (without dashes) that sets it. Options shared by policies mean the
# same thing in each (the tile or square side, placeholder tokens per tile or image, the ViT patch side).
_COMMON = {"patch_size": "patch_size", "image_mean": "image_mean", "image_std": "image_std",
           "max_image_pixels": "max_image_pixels"}
POLICY_FLAGS: dict[str, dict[str, str]] = {
    "internvl": {"image_size": "image_size", "min_num": "min_tiles", "max_num": "max_tiles",
                 "use_thumbnail": "thumbnail", "tokens_per_tile": "image_tokens", "multi_image": "multi_image",
                 **_COMMON},
    "qwen2vl": {"factor": "resize_factor", "min_pixels": "min_pixels", "max_pixels": "max_pixels",
                "video_min_pixels": "video_min_pixels", "video_max_pixels": "video_max_pixels",
                "temporal_patch_size": "temporal_patch_size", "pad_frames": "pad_frames", **_COMMON},
    "fixed": {"size": "image_size", "tokens": "image_tokens", "resize": "resize", **_COMMON},
}


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers R,G,B, got {text!r}") from None


# option -> (help, argparse keywords)
_POLICY_OPTIONS: dict[str, tuple[str, dict[str, Any]]] = {
    "image_size": ("internvl: tile side; fixed: square side, px", {"type": int}),
    "min_tiles": ("internvl: min tiles per image", {"type": int}),
    "max_tiles": ("internvl: max tiles per sample", {"type": int}),
    "thumbnail": ("internvl: add a thumbnail tile to multi-tile grids", {"action": argparse.BooleanOptionalAction}),
    "multi_image": ("internvl: several images split the tile budget (split: InternVL's training code) or each get "
                    "all of it (each: the HF processor)", {"choices": ("split", "each")}),
    "image_tokens": ("internvl: LLM tokens per tile; fixed: per image", {"type": int}),
    "resize": ("fixed: squash to the square, or crop (short side to the size, then the centre: CLIP/LLaVA)",
               {"choices": ("squash", "crop")}),
    "resize_factor": ("qwen2vl: sides rounded to multiples of this (patch x merge)", {"type": int}),
    "min_pixels": ("qwen2vl: min pixels", {"type": int}),
    "max_pixels": ("qwen2vl: max pixels", {"type": int}),
    "video_min_pixels": ("qwen2vl: min pixels of a video frame", {"type": int}),
    "video_max_pixels": ("qwen2vl: max pixels of a video frame", {"type": int}),
    "temporal_patch_size": ("qwen2vl: video frames per ViT patch in time", {"type": int}),
    "pad_frames": ("qwen2vl: any video frame count, the last temporal patch filled up with the last frame "
                   "(Qwen3-VL); off: counts rounded down to whole patches", {"action": argparse.BooleanOptionalAction}),
    "patch_size": ("ViT patch side, px", {"type": int}),
    "max_image_pixels": ("images (and video frames) of more pixels are invalid, refused before decoding "
                         "(default 50,000,000; decoding costs the server ~10 bytes a pixel)", {"type": int}),
    "image_mean": ("normalisation mean R,G,B (pixels / 255)", {"type": _floats, "metavar": "R,G,B"}),
    "image_std": ("normalisation std R,G,B", {"type": _floats, "metavar": "R,G,B"}),
}
_TEMPLATE_FIELDS = [spec for spec in dataclasses.fields(ChatTemplate)]
# VideoSampling field -> (option, help, argparse keywords)
_VIDEO_OPTIONS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "fps": ("video_fps", "frames sampled per second of video (0: always --max-frames)", {"type": float}),
    "min_frames": ("min_frames", "fewest frames sampled from a video (when it has them)", {"type": int}),
    "max_frames": ("max_frames", "most frames sampled from a video", {"type": int}),
    "sampling": ("frame_sampling", "which frames: uniform (Qwen2-VL), linspace (the first to the last: Qwen3-VL), "
                                   "segment (the middle of equal segments: InternVL's evaluation) or random (a "
                                   "random frame per segment, from seed, epoch and sample: InternVL's training)",
                 {"choices": SAMPLINGS}),
}

# Video sampling as the model families train: InternVL a fixed number of frames, one drawn at random from each
# equal segment (its fine-tuning script: 8 to 32 frames; the count is fixed here so that a video's cost is known
# when planning); Qwen-VL 2 frames a second, 4 to 768 of them (the Hugging Face video processor's defaults).
_INTERNVL_VIDEO = {"fps": 0, "min_frames": 1, "max_frames": 16, "sampling": "random"}
_QWEN_VIDEO = {"fps": 2.0, "min_frames": 4, "max_frames": 768, "sampling": "uniform"}  # Qwen3-VL: linspace

# A model's published conventions: image policy (geometry, tokens, normalisation) and chat template (turns, image
# tokens). `--preset NAME` starts from one; a conventions file with the same two sections is a preset of your own.
MODEL_PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "internvl2_5": {"image_policy": {"name": "internvl"}, "chat_template": {"preset": "internvl"},
                    "video_policy": _INTERNVL_VIDEO},
    "internvl3": {"image_policy": {"name": "internvl"}, "chat_template": {"preset": "internvl"},
                  "video_policy": _INTERNVL_VIDEO},
    "qwen2_vl": {"image_policy": {"name": "qwen2vl", "max_pixels": 12845056},
                 "chat_template": {"preset": "qwen2vl"}, "video_policy": _QWEN_VIDEO},
    "qwen2_5_vl": {"image_policy": {"name": "qwen2vl", "max_pixels": 12845056},
                   "chat_template": {"preset": "qwen2vl"}, "video_policy": _QWEN_VIDEO},
    "qwen3_vl": {"image_policy": {"name": "qwen2vl", "factor": 32, "patch_size": 16, "min_pixels": 65536,
                                  "max_pixels": 16777216, "image_mean": list(HALF_MEAN), "image_std": list(HALF_STD),
                                  "video_min_pixels": 128 * 32 * 32, "video_max_pixels": 768 * 32 * 32,
                                  "pad_frames": True},
                 "chat_template": {"preset": "qwen2vl", "system_prompt": None, "video_timestamps": "<{:.1f} seconds>"},
                 "video_policy": {**_QWEN_VIDEO, "sampling": "linspace"}},
    "llava_1_5": {"image_policy": {"name": "fixed", "size": 336, "tokens": 576, "resize": "crop"},
                  "chat_template": {"preset": "llava"}},
}


def add_convention_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model conventions (image policy and chat template)")
    group.add_argument("--preset", choices=sorted(MODEL_PRESETS),
                       help="a model's published conventions (image policy, normalisation, chat template)")
    group.add_argument("--conventions", metavar="FILE.yaml",
                       help="image_policy: and chat_template: sections (your own preset); single flags override it")
    group.add_argument("--image-policy", choices=sorted(POLICIES), help=f"default {DEFAULT_POLICY}")
    for option, (help_text, keywords) in _POLICY_OPTIONS.items():
        group.add_argument("--" + option.replace("_", "-"), help=help_text, **keywords)
    group.add_argument("--chat-template", choices=sorted(PRESETS),
                       help="template preset: internvl (ChatML, the default), qwen2vl, llava (Vicuna v1), llama3")
    for spec in _TEMPLATE_FIELDS:
        keywords = {"action": argparse.BooleanOptionalAction} if spec.type in (bool, "bool") else {}
        group.add_argument("--" + spec.name.replace("_", "-"), help=spec.metadata["help"], **keywords)
    for name, (option, help_text, keywords) in _VIDEO_OPTIONS.items():
        group.add_argument("--" + option.replace("_", "-"), help=help_text, **keywords)
    group.add_argument("--extend-tokenizer", action="store_true",
                       help="when the tokenizer lacks the template's special tokens, write a tokenizer.json that has "
                            "them beside the index (and record it) instead of refusing")


def conventions_of(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """(image policy dict, chat template dict) as the index records them: the preset, then the file's sections,
    then single flags."""
    preset = MODEL_PRESETS[args.preset] if getattr(args, "preset", None) else {}
    sections = _read_file(args.conventions) if args.conventions else {}
    policy = _layered(preset.get("image_policy"), sections.get("image_policy"))
    if args.image_policy:
        if policy.get("name", args.image_policy) != args.image_policy:
            policy = {}  # another policy than the preset's or the file's: their fields do not apply
        policy["name"] = args.image_policy
    name = policy.setdefault("name", DEFAULT_POLICY)
    flags = POLICY_FLAGS.get(name)
    if flags is None:
        raise ValueError(f"unknown image policy {name!r}; choose one of {', '.join(POLICIES)}")
    for option in _POLICY_OPTIONS:
        value = getattr(args, option)
        if value is None:
            continue
        field_name = next((f for f, o in flags.items() if o == option), None)
        if field_name is None:
            raise ValueError(f"--{option.replace('_', '-')} does not apply to image policy {name}; its options are "
                             + ", ".join("--" + o.replace("_", "-") for o in flags.values()))
        policy[field_name] = list(value) if isinstance(value, tuple) else value
    POLICIES[name](**{k: v for k, v in policy.items() if k != "name"})  # fail early on a bad field or value

    template = _layered(preset.get("chat_template"), sections.get("chat_template"))
    if args.chat_template:
        template = {"preset": args.chat_template, **{k: v for k, v in template.items() if k != "preset"}}
    for spec in _TEMPLATE_FIELDS:
        value = getattr(args, spec.name)
        if value is not None:
            template[spec.name] = _unescape(value) if isinstance(value, str) and spec.name != "system_prompt" else value
    return policy, ChatTemplate.from_dict(template).to_dict()


def video_policy_of(args: argparse.Namespace) -> dict[str, Any]:
    """The video policy as the index records it: the preset's, then the file's section, then single flags."""
    preset = MODEL_PRESETS[args.preset] if getattr(args, "preset", None) else {}
    sections = _read_file(args.conventions) if getattr(args, "conventions", None) else {}
    policy = {**VideoSampling().to_dict(), **preset.get("video_policy", {}), **(sections.get("video_policy") or {})}
    for name, (option, _, _) in _VIDEO_OPTIONS.items():
        if getattr(args, option, None) is not None:
            policy[name] = getattr(args, option)
    return VideoSampling.from_dict(policy).to_dict()  # fails early on a bad field or value


def _layered(base: dict[str, Any] | None, over: dict[str, Any] | None) -> dict[str, Any]:
    """`over` on top of `base`; an `over` naming another image policy or template preset replaces `base`."""
    base, over = dict(base or {}), dict(over or {})
    for key in ("name", "preset"):
        if key in over and base.get(key, over[key]) != over[key]:
            return over
    return {**base, **over}


def _unescape(text: str) -> str:
    return re.sub(r"\\([nt\\])", lambda m: {"n": "\n", "t": "\t", "\\": "\\"}[m.group(1)], text)


def _read_file(path: str) -> dict[str, Any]:
    try:
        sections = yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as error:
        raise ValueError(f"conventions file {path}: not valid YAML: {error}") from None
    if not isinstance(sections, dict) or set(sections) - {"image_policy", "chat_template", "video_policy"}:
        raise ValueError(f"conventions file {path}: expected only the sections image_policy:, chat_template: and "
                         f"video_policy:")
    return sections
