"""What the commands share: exit codes, and the flags that make an `IndexConfig` and a `PlanConfig`."""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
from pathlib import Path

from packfeed.media.image_policy import VERIFY_MODES  # light: dataclasses only
from packfeed.v1.options import CpMode, Oversize, PlanConfig, Staleness, Strategy

EXIT_OK, EXIT_SKIPPED, EXIT_USAGE, EXIT_EMPTY = 0, 3, 2, 4  # EXIT_EMPTY: nothing to train on


def add_index_options(parser: argparse.ArgumentParser) -> None:
    from packfeed.server.index.conventions import add_convention_options

    parser.add_argument("--tokenizer", help="HF tokenizers tokenizer.json (the tokenizer the trainer uses)")
    add_convention_options(parser)
    parser.add_argument("--verify-images", choices=VERIFY_MODES, default="decode",
                        help="decode (catch corrupt image data) or header (faster)")
    parser.add_argument("--max-sample-tokens", type=int, metavar="N",
                        help="samples of more LLM tokens (text and placeholders) are invalid (default 262,144)")


def add_plan_options(parser: argparse.ArgumentParser) -> None:
    """One flag per field of the plan specification (`packfeed.v1.options.PlanConfig`): --dp, --strategy, ...
    Defaults stay in the dataclass: an omitted flag is None and the field keeps its default."""
    for spec in dataclasses.fields(PlanConfig):
        flag, default = "--" + spec.name.replace("_", "-"), _field_default(spec)
        help_text = spec.metadata["help"]
        if spec.name == "cost_model":
            parser.add_argument(flag, metavar="FILE.json", help=help_text)
            continue
        if str(spec.type) == "bool":  # on by default: --no-FLAG turns it off
            action = argparse.BooleanOptionalAction if spec.default else "store_true"
            parser.add_argument(flag, action=action, default=None, help=help_text)
            continue
        kind = {"int": int, "float": float, "int | None": int}.get(str(spec.type))
        choices = {kind.__name__: [member.value for member in kind]
                   for kind in (Strategy, Oversize, CpMode, Staleness)}.get(str(spec.type))
        shown = f" (default {default})" if default is not None else ""
        parser.add_argument(flag, type=kind, choices=choices, help=help_text + shown)


def _field_default(spec: dataclasses.Field):
    return spec.default.value if isinstance(spec.default, enum.Enum) else \
        None if spec.default is dataclasses.MISSING else spec.default


def plan_config_of(args: argparse.Namespace, **overrides) -> PlanConfig:
    """The PlanConfig the plan flags give (omitted flags keep the dataclass defaults)."""
    values = {spec.name: getattr(args, spec.name) for spec in dataclasses.fields(PlanConfig)}
    values = {name: value for name, value in values.items() if value is not None}
    if "cost_model" in values:
        values["cost_model"] = json.loads(Path(values["cost_model"]).read_text())
    return PlanConfig(**{**values, **overrides})


def parse_encoders(values: list[str]) -> dict[str, bool]:
    """--encoder NAME[:padded] flags as {name: padded}."""
    encoders = {}
    for value in values:
        name, _, mode = value.partition(":")
        if mode not in ("", "padded") or name in encoders:
            raise ValueError(f"--encoder {value!r}: give NAME or NAME:padded, each name once")
        encoders[name] = mode == "padded"
    return encoders
