"""A dataset's model conventions as the contract carries them (`JobInfo.conventions`): what a trainer must know
of the samples, image policy, chat template, vocabulary and image token ids, without reading the index."""

from __future__ import annotations

import json
from pathlib import Path

from packfeed.media.chat import ChatTemplate, load_tokenizer
from packfeed.media.image_policy import policy_from_dict
from packfeed.media.video import VideoSampling
from packfeed.server.index.table import IndexInfo
from packfeed.v1 import packfeed_pb2 as pb


def model_conventions(info: IndexInfo, tokenizer_path: str | Path) -> pb.ModelConventions:
    policy = policy_from_dict(info.image_policy)
    template = ChatTemplate.from_dict(info.chat_template)
    tokenizer = load_tokenizer(tokenizer_path, template)
    image_policy = pb.ImagePolicy(name=policy.name, tile_size=policy.tile_size, tokens_per_tile=policy.tokens_per_tile,
                                  patch_size=policy.patch_size, patches_per_unit=policy.patches_per_unit,
                                  parameters_json=json.dumps(policy.to_dict(), sort_keys=True),
                                  image_mean=policy.image_mean, image_std=policy.image_std,
                                  temporal_patch_size=policy.temporal_patch)
    chat = pb.ChatTemplate(**{name: value if isinstance(value, bool) else value or ""
                              for name, value in template.to_dict().items()},
                           **_chatml_turn_markers(template))
    return pb.ModelConventions(image_policy=image_policy, chat_template=chat,
                               vocab_size=tokenizer.get_vocab_size(),
                               image_start_id=tokenizer.token_to_id(template.image_start) if template.image_start else None,
                               image_end_id=tokenizer.token_to_id(template.image_end) if template.image_end else None,
                               image_context_id=tokenizer.token_to_id(template.image_context),
                               video_context_id=(tokenizer.token_to_id(template.video_context)
                                                 if template.video_context else None),
                               video_policy=pb.VideoPolicy(**VideoSampling.from_dict(info.video_policy).to_dict()))


def _chatml_turn_markers(template: ChatTemplate) -> dict[str, str]:
    """The deprecated turn_start / turn_end of contract clients written before per-role markers."""
    start = template.user_prefix.removesuffix("user\n")
    roles = ("system", "user", "assistant")
    if all(getattr(template, f"{role}_prefix") == f"{start}{role}\n" for role in roles) and \
            len({getattr(template, f"{role}_suffix") for role in roles}) == 1:
        return {"turn_start": start, "turn_end": template.user_suffix}
    return {"turn_start": "", "turn_end": ""}
