"""One sample -> one index row: its members checked, its images and videos costed by the image and video
policies, its conversation tokenised under the chat template, and everything wrong with it named in `reason`."""

from __future__ import annotations

from typing import Any

import numpy as np

from packfeed.media.chat import IGNORE_INDEX, cached_encoder
from packfeed.media.conversation import ConversationError, attach_images, conversation_turns, parse_json
from packfeed.media.image_policy import ImagePolicy
from packfeed.media.prompts import shared_prompt
from packfeed.media.samples import SampleError, describe_error, image_size
from packfeed.media.video import VideoError, VideoInfo, frames_fps, probe_video, video_placeholders
from packfeed.server.index.config import IndexConfig
from packfeed.server.index.shards import Member, RawSample
from packfeed.server.index.table import member_checksum
from packfeed.server.index.trajectories import fork_request, turn_record


def _video_infos(images: list[Member], videos: list[Member], doc: Any,
                 verify: str, policy: ImagePolicy) -> tuple[list[VideoInfo], float | None]:
    """The sample's videos as the container (or, for a frame sequence, its JSON and frames) describes them, and
    the frame sequence's rate (None when its images are images)."""
    rate = frames_fps(doc)
    if rate is None:
        return [probe_video(member.data, decode=verify == "decode") for member in videos], None
    if videos:
        raise SampleError("frame sequence and video files in one sample: give the frames or the files")
    if not images:
        raise SampleError('frame sequence without frames: "frames" needs numbered images KEY.0.jpg, KEY.1.jpg, ...')
    sizes = {image_size(member.data, verify, policy) for member in images}
    if len(sizes) > 1:
        raise SampleError(f"frame sequence: frames differ in size ({', '.join(f'{w}x{h}' for w, h in sorted(sizes))})")
    (width, height), = sizes
    return [VideoInfo(width, height, len(images), rate)], rate


def _tile_bytes(geometry) -> int:
    return sum(c * h * w for c, h, w in geometry.tile_shapes())


def cost_sample(raw: RawSample, config: IndexConfig) -> dict[str, Any]:
    """One index row (without sample_id and shard)."""
    images, videos = raw.image_members(), raw.video_members()
    doc = raw.json_member()
    row: dict[str, Any] = {
        "key": raw.key, "valid": False, "reason": None,
        "json_offset": doc.offset if doc else None, "json_size": doc.size if doc else None,
        "json_checksum": member_checksum(doc.data) if doc else None,
        "image_names": [m.suffix for m in images], "image_offsets": [m.offset for m in images],
        "image_sizes": [m.size for m in images], "image_checksums": [member_checksum(m.data) for m in images],
        "image_widths": [], "image_heights": [],
        "n_images": len(images), "vision_units": 0, "vision_tokens": 0, "vit_patches": 0, "vit_attn_sq": 0,
        "text_tokens": 0, "llm_tokens": 0, "loss_tokens": 0,
        "n_videos": len(videos), "video_names": [m.suffix for m in videos], "video_offsets": [m.offset for m in videos],
        "video_sizes": [m.size for m in videos], "video_checksums": [member_checksum(m.data) for m in videos],
        "video_widths": [], "video_heights": [], "video_frames": [], "video_rates": [], "video_sampled": [],
        "frames_fps": None, "pixel_bytes": 0,
    }
    try:
        if raw.error:
            raise SampleError(raw.error)
        if doc is None:
            raise SampleError("missing json")
        document = parse_json(doc.data)
        row.update(fork_request(document))
        turns = conversation_turns(document.get("conversations") if isinstance(document, dict) else None)
        policy = config.policy
        infos, sequence_rate = _video_infos(images, videos, document, config.verify_images, policy)
        if sequence_rate is not None:  # the images are one video's frames
            row.update(n_images=0, n_videos=1, video_names=["frames"], video_offsets=[0], video_sizes=[0],
                       video_checksums=[0], frames_fps=sequence_rate)
            row["image_widths"], row["image_heights"] = [infos[0].width] * len(images), [infos[0].height] * len(images)
            images = []
        turns = attach_images(turns, len(images), len(infos))
        costs, shapes = [], []
        for member in images:
            width, height = image_size(member.data, config.verify_images, policy)
            row["image_widths"].append(width)
            row["image_heights"].append(height)
            try:
                costs.append(policy.cost(width, height, len(images)))
                geometry = policy.geometry(width, height, len(images))
                shapes.append(geometry.tile_shapes())
                row["pixel_bytes"] += _tile_bytes(geometry)
            except ValueError as error:
                raise SampleError(f"image rejected by policy: {error}") from None
        video_items, video_times = [], []
        for info in infos:
            frames = config.video_sampling.frame_count(info.frames, info.rate, policy.frame_multiple)
            if frames < 1:
                raise SampleError(f"video too short: {info.frames} frames, the image policy takes them "
                                  f"{policy.frame_multiple} at a time")
            try:
                policy.check_pixels(info.width, info.height, "video frame")
                cost = policy.video_cost(info.width, info.height, frames)
                row["pixel_bytes"] += frames * _tile_bytes(policy.frame_geometry(info.width, info.height))
            except ValueError as error:
                raise SampleError(f"video rejected by policy: {error}") from None
            costs.append(cost)
            items, times = video_placeholders(config.template, config.video_sampling, policy, info, frames, cost)
            video_items.append(items)
            video_times.append(times)
            for name, value in (("widths", info.width), ("heights", info.height), ("frames", info.frames),
                                ("rates", info.rate), ("sampled", frames)):
                row[f"video_{name}"].append(value)
        encoder = cached_encoder(config.tokenizer, config.template)
        check_text_length(turns, config.max_sample_tokens, encoder.tokenizer)
        ends: list[int] = []
        ids, labels, starts = encoder.encode(
            turns, [c.llm_tokens for c in costs[:len(images)]], video_items, video_times, turn_ends=ends)
        if len(ids) > config.max_sample_tokens:
            raise SampleError(f"too long: {len(ids):,} tokens, over max_sample_tokens {config.max_sample_tokens:,}; "
                              "raise it with --max-sample-tokens")
    except (SampleError, ConversationError, VideoError) as error:
        row["reason"] = str(error)
        return row
    except Exception as error:  # anything else about one sample makes that sample invalid, never the index
        row["reason"] = f"unreadable sample: {type(error).__name__}: {describe_error(error)}"
        return row
    vision_tokens = sum(c.llm_tokens for c in costs)
    row.update(valid=True, vision_units=sum(c.units for c in costs), vision_tokens=vision_tokens,
               vit_patches=sum(c.vit_patches for c in costs), vit_attn_sq=sum(c.vit_attn_sq for c in costs),
               text_tokens=len(ids) - vision_tokens, llm_tokens=len(ids),
               loss_tokens=int((labels != IGNORE_INDEX).sum()))
    if not videos and sequence_rate is None:  # where each turn ends: what a fork shares (`index.trajectories`)
        row.update(turn_record(turns, ends, ids, [c.units for c in costs], shapes, row["image_checksums"]))
    if isinstance(document, dict) and "group" in document:
        row.update(_group_of(document["group"], ids, labels, starts, costs, row["image_checksums"], videos))
    return row


def _group_of(label: Any, ids: np.ndarray, labels: np.ndarray, starts: list[int], costs, image_checksums,
              videos) -> dict[str, Any]:
    """A sample's group (its JSON's `group`: a string or an integer) and the prompt it shares with the group's
    members of the same prompt (`packfeed.media.prompts`). `group_key` names the group and that prompt; None where
    the sample shares nothing (a group label of another type, an image after the prompt, a video)."""
    images_end = max((start + cost.llm_tokens for start, cost in zip(starts, costs)), default=0)
    prompt = shared_prompt(ids, labels != IGNORE_INDEX, images_end, image_checksums)
    if isinstance(label, bool) or not isinstance(label, (str, int)) or videos or prompt is None:
        return {"group_key": None, "prefix_tokens": 0}
    prefix, key = prompt
    return {"group_key": f"{type(label).__name__}:{label}\0{key}", "prefix_tokens": prefix}


def check_text_length(turns: list[dict[str, str]], max_tokens: int, tokenizer) -> None:
    """Refuse text far over `max_tokens` after tokenising only about `max_tokens` of it: tokenising 10 MB in one
    call costs seconds and gigabytes (the tokenizer keeps every token's string and offsets). The text is counted in
    pieces cut just before a space that follows a word, where byte-level and sentencepiece pre-tokenizers cut too,
    less one token per cut for safety: a lower bound, so nothing within the limit is refused here (the exact
    count after encoding decides)."""
    text = "".join(turn["value"] for turn in turns)
    if len(text.encode("utf-8", "surrogatepass")) <= max_tokens:  # a token holds at least a byte
        return
    counted, start = 0, 0
    while start < len(text) and counted <= max_tokens:
        end = _word_boundary(text, start + TEXT_PIECE_CHARS)
        counted += len(tokenizer.encode(text[start:end], add_special_tokens=False).ids) - 1
        start = end
    if counted > max_tokens:
        raise SampleError(f"too long: over {max_tokens:,} tokens of text (counted {counted:,} before stopping), over "
                          f"max_sample_tokens; raise it with --max-sample-tokens")


TEXT_PIECE_CHARS = 1 << 16


def _word_boundary(text: str, at: int) -> int:
    """The first position from `at` just before a space that follows a non-space (the text's end if none)."""
    found = text.find(" ", max(at, 1))
    while found != -1 and text[found - 1].isspace():
        found = text.find(" ", found + 1)
    return len(text) if found == -1 else found
