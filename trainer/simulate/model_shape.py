"""What a model costs per layer, for the cluster simulator: from a shape description, a preset, or a trainer's
measured costs (OUT/cost_model.json).

Every layer's cost is linear in one microbatch's load row (`LOAD_TERMS`): a constant, the vision tiles, the
sum of squared ViT sequence lengths, the LLM tokens and the sum of squared LLM attention spans. A layer table
holds, per layer, forward FLOPs per term (None for measured models), forward and backward seconds per term when
measured, the parameters (the DP gradient volume) and the bytes of its output activation per term (what a
pipeline boundary after it sends). Pure numpy; no torch.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

LOAD_TERMS = ("const", "tiles", "vision_square", "tokens", "token_square")
TILES, VISION_SQUARE, TOKENS, TOKEN_SQUARE = 1, 2, 3, 4
ACTIVATION_BYTES = 2  # bf16 activations cross stage boundaries
ENCODER_KINDS = ("vision", "projector")


@dataclass(frozen=True)
class Transformer:
    """A transformer stack's shape (per layer: attention + MLP)."""

    hidden: int
    layers: int
    heads: int
    ffn: int
    head_dim: int = 0  # 0: hidden // heads
    kv_heads: int = 0  # 0: heads (no GQA)
    gated: bool = False  # SwiGLU MLP: three matrices instead of two
    causal: bool = True
    vocab: int = 0  # > 0: an embedding and an output head

    def __post_init__(self):
        for name in ("hidden", "layers", "heads", "ffn"):
            if getattr(self, name) <= 0:
                raise ValueError(f"transformer {name} must be > 0, not {getattr(self, name)}")
        if self.kv_heads and self.heads % self.kv_heads:
            raise ValueError(f"heads {self.heads} must be a multiple of kv_heads {self.kv_heads}")

    @property
    def attention_width(self) -> int:
        return self.heads * (self.head_dim or self.hidden // self.heads)

    @property
    def kv_width(self) -> int:
        return (self.kv_heads or self.heads) * (self.head_dim or self.hidden // self.heads)

    @property
    def layer_params(self) -> int:
        attention = self.hidden * (self.attention_width + 2 * self.kv_width) + self.attention_width * self.hidden
        return attention + (3 if self.gated else 2) * self.hidden * self.ffn + 4 * self.hidden  # + norms

    @property
    def attention_flops_per_square(self) -> float:
        """Forward FLOPs of QK^T and AV per squared sequence length; a causal kernel skips half."""
        return 4.0 * self.attention_width * (0.5 if self.causal else 1.0)


@dataclass(frozen=True)
class ModelShape:
    """A VLM: a ViT over fixed-size tiles, a projector from each tile's patches to LLM tokens, an LLM."""

    name: str
    vision: Transformer
    llm: Transformer
    patches_per_tile: int  # ViT sequence length of one tile (InternViT: 32 x 32 + a class token)
    tokens_per_tile: int  # LLM tokens one tile becomes
    projector_params: int
    patch_pixels: int = 3 * 14 * 14

    def layer_table(self) -> LayerTable:
        v, l = self.vision, self.llm
        rows: list[tuple[str, dict[int, float], int, dict[int, float]]] = []
        vision_out = {TILES: float(self.patches_per_tile * v.hidden * ACTIVATION_BYTES)}
        for k in range(v.layers):
            flops = {TILES: 2.0 * v.layer_params * self.patches_per_tile, VISION_SQUARE: v.attention_flops_per_square}
            params = v.layer_params
            if k == 0:  # the patch embedding rides with the first layer
                flops[TILES] += 2.0 * self.patch_pixels * v.hidden * self.patches_per_tile
                params += self.patch_pixels * v.hidden
            rows.append(("vision", flops, params, vision_out))
        token_out = {TOKENS: float(l.hidden * ACTIVATION_BYTES)}
        rows.append(("projector", {TILES: 2.0 * self.projector_params * self.tokens_per_tile},
                     self.projector_params, {TILES: float(self.tokens_per_tile * l.hidden * ACTIVATION_BYTES)}))
        if l.vocab:
            rows.append(("embed", {}, l.vocab * l.hidden, token_out))
        for _ in range(l.layers):
            rows.append(("llm", {TOKENS: 2.0 * l.layer_params, TOKEN_SQUARE: l.attention_flops_per_square},
                         l.layer_params, token_out))
        if l.vocab:
            rows.append(("head", {TOKENS: 2.0 * l.vocab * l.hidden}, l.vocab * l.hidden, {}))
        table = LayerTable.from_rows(self.name, rows)
        # K and V per token of an LLM layer: its K/V heads x head size (GQA: fewer than the query heads)
        table.kv_bytes = np.array([2.0 * l.kv_width * ACTIVATION_BYTES if kind == "llm" else 0.0
                                   for kind in table.kinds])
        return table


@dataclass
class LayerTable:
    """Per-layer costs, in model order (encoder layers first). Arrays have one row per layer."""

    name: str
    kinds: list[str]
    forward_flops: np.ndarray | None  # (layers, terms) FLOPs; None when only seconds were measured
    measured_seconds: np.ndarray | None  # (layers, 2, terms): forward, backward seconds (measured models)
    params: np.ndarray  # (layers,)
    output_bytes: np.ndarray  # (layers, terms): activation bytes a boundary after the layer sends
    source: str = "shape"
    # (layers,) K and V bytes per token that context parallelism exchanges; None (a measured table, which knows
    # no heads): twice the layer's output bytes per token, an upper bound (no GQA)
    kv_bytes: np.ndarray | None = None

    def kv_bytes_per_token(self) -> np.ndarray:
        return self.kv_bytes if self.kv_bytes is not None else 2 * self.output_bytes[:, TOKENS]

    @classmethod
    def from_rows(cls, name: str, rows) -> LayerTable:
        flops = np.zeros((len(rows), len(LOAD_TERMS)))
        out = np.zeros((len(rows), len(LOAD_TERMS)))
        for i, (_, f, _, o) in enumerate(rows):
            for term, value in f.items():
                flops[i, term] = value
            for term, value in o.items():
                out[i, term] = value
        return cls(name, [r[0] for r in rows], flops, None, np.array([r[2] for r in rows], dtype=np.float64), out)

    def __len__(self) -> int:
        return len(self.kinds)

    @property
    def encoder(self) -> np.ndarray:
        """Mask of the layers that make image embeddings (ViT + projector)."""
        return np.array([k in ENCODER_KINDS for k in self.kinds])

    def seconds(self, flops_per_second: float) -> np.ndarray:
        """(layers, 2, terms) forward and backward seconds: measured, or FLOPs at the given rate with a backward
        of twice the forward (two matmuls per forward one)."""
        if self.measured_seconds is not None:
            return self.measured_seconds
        forward = self.forward_flops / flops_per_second
        return np.stack([forward, 2.0 * forward], axis=1)

    def describe(self) -> dict:
        encoder = self.encoder
        return {"name": self.name, "source": self.source, "encoder_layers": int(encoder.sum()),
                "llm_layers": int((~encoder).sum()), "encoder_params": float(self.params[encoder].sum()),
                "llm_params": float(self.params[~encoder].sum())}


def internvl_chat_1_5() -> ModelShape:
    """InternViT-6B + InternLM2-20B (OmniBal's setting): 448 px tiles of 32 x 32 patches + a class token,
    pixel-shuffled to 256 tokens, through an MLP projector (4 x 3200 -> 6144 -> 6144)."""
    vit = Transformer(hidden=3200, layers=45, heads=25, ffn=12800, head_dim=128, causal=False)
    llm = Transformer(hidden=6144, layers=48, heads=48, kv_heads=8, ffn=16384, head_dim=128, gated=True,
                      vocab=92544)
    return ModelShape("internvl-chat-1.5", vit, llm, patches_per_tile=1025, tokens_per_tile=256,
                      projector_params=4 * 3200 * 6144 + 6144 * 6144)


def vit22b_gpt175b() -> ModelShape:
    """ViT-22B + GPT-175B (Optimus's setting, its Tables 8-9): 224 px images of 16 x 16 patches of 14 px, one
    LLM token per patch through a linear projector."""
    vit = Transformer(hidden=6144, layers=48, heads=48, ffn=24576, head_dim=128, causal=False)
    llm = Transformer(hidden=12288, layers=96, heads=96, ffn=49152, head_dim=128, vocab=50257)
    return ModelShape("vit22b-gpt175b", vit, llm, patches_per_tile=256, tokens_per_tile=256,
                      projector_params=6144 * 12288)


PRESETS: dict[str, Callable[[], ModelShape]] = {
    "internvl-chat-1.5": internvl_chat_1_5,
    "vit22b-gpt175b": vit22b_gpt175b,
}


# The trainers' layer kinds (packfeed.trainer.models) as the simulator's.
MEASURED_KINDS = {"vision_embed": "vision", "vit": "vision", "projector": "projector", "text_embed": "embed",
                  "llm": "llm", "head": "head"}


def measured_table(path: str | Path, record: dict | None = None) -> LayerTable:
    """A trainer's OUT/cost_model.json (`record`: its contents, when read already): its "layers" list holds every
    layer's fitted forward and backward seconds (c0 + c1 * n + c2 * q, n = tiles for vision layers and tokens
    for the others) and its boundary activation bytes per unit, measured on the trainer's hardware."""
    if record is None:
        try:
            record = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise ValueError(f"--model {path}: cannot read a cost model ({error})") from error
    layers = record.get("layers") if isinstance(record, dict) else None
    if not layers:
        raise ValueError(f"--model {path}: no per-layer costs in it; a `packfeed train` run of this version writes "
                         "them to OUT/cost_model.json under \"layers\"")
    n = len(layers)
    seconds = np.zeros((n, 2, len(LOAD_TERMS)))
    out = np.zeros((n, len(LOAD_TERMS)))
    params = np.zeros(n)
    kinds = []
    for i, layer in enumerate(layers):
        kind = MEASURED_KINDS.get(layer["kind"], "llm")
        unit = TILES if kind in ENCODER_KINDS else TOKENS
        for direction, key in enumerate(("forward", "backward")):
            c0, c1, c2 = layer[key]  # the fit's square term is 0 for vision layers (tiles have one size)
            seconds[i, direction, [0, unit, TOKEN_SQUARE]] = c0, c1, c2
        out[i, unit] = layer.get("output_bytes_per_unit", 0.0)
        params[i] = layer.get("params", 0)
        kinds.append(kind)
    return LayerTable(str(path), kinds, None, seconds, params, out, source="measured")


def shape_from_description(record: dict, name: str) -> ModelShape:
    """A ModelShape from {"vision": {hidden, layers, heads, ffn, ...}, "llm": {...}, "patches_per_tile",
    "tokens_per_tile", "projector_params"} (the Transformer fields; unknown keys are refused)."""
    try:
        return ModelShape(name, Transformer(**{"causal": False, **record["vision"]}), Transformer(**record["llm"]),
                          int(record["patches_per_tile"]), int(record["tokens_per_tile"]),
                          int(record["projector_params"]))
    except (KeyError, TypeError) as error:
        raise ValueError(f"--model {name}: a shape description needs vision and llm (hidden, layers, heads, ffn; "
                         "optionally head_dim, kv_heads, gated, causal, vocab), patches_per_tile, tokens_per_tile "
                         f"and projector_params ({error})") from error


def load_model(name_or_path: str) -> tuple[LayerTable, ModelShape | None]:
    """A preset's layer table (and shape), a shape description's (JSON), or a measured cost model's."""
    if name_or_path in PRESETS:
        shape = PRESETS[name_or_path]()
        return shape.layer_table(), shape
    if Path(name_or_path).is_file():
        try:
            record = json.loads(Path(name_or_path).read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise ValueError(f"--model {name_or_path}: cannot read it ({error})") from error
        if isinstance(record, dict) and "vision" in record and "llm" in record:
            shape = shape_from_description(record, name_or_path)
            return shape.layer_table(), shape
        return measured_table(name_or_path, record), None
    raise ValueError(f"--model {name_or_path!r}: give a preset ({', '.join(PRESETS)}) or a trainer's "
                     "OUT/cost_model.json")
