"""Context parallelism for a `transformers` Qwen2-VL (`packfeed train model.hf=qwen2_vl parallel.cp=C`), on the
model's own layers (`packfeed.trainer.models.hf.model.HFLayerModel`) and the same plan, shares and runner as
the reference model (`packfeed.trainer.parallel.context_parallel`). What differs is the model's side:

- each GPU runs the vision tower on the items its share holds pixels of (their Qwen patches and grids,
  `packfeed.client.model.context_parallel.share_qwen_pixels`), and the pack's features are gathered as for the
  reference model;
- the decoder layers rotate by M-RoPE positions of the unsplit pack (`share_mrope_positions`: the share
  carries every item's geometry), and their attention is the runner's, registered with `transformers` under
  its own name for the text model only (the vision tower keeps its attention): K and V gathered over the pack's
  GPUs (grouped K/V heads, before they are repeated), varlen flash-attention on CUDA, sdpa per chunk elsewhere;
  packs at degree 1 run Packfeed's varlen kernel as without context parallelism;
- the loss is the model's own head on each local token, predicting the next token of its unsplit sample.

Qwen2-VL only: Qwen2.5-VL and Qwen3-VL (window order, DeepStack) and the tile families are refused.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F

from packfeed.trainer.config import CP_MODELS
from packfeed.trainer.models.reference import IGNORE_INDEX
from packfeed.trainer.parallel.context_parallel import ContextParallelAttention, ContextParallelRunner
from packfeed.trainer.parallel.mesh import Mesh

ATTENTION = "packfeed_context_parallel"


class HFContextParallelRunner(ContextParallelRunner):
    """A `StepRunner`: a Qwen2-VL replicated on every rank, each pack of the CP plan split over its GPUs."""

    def __init__(self, model, mesh: Mesh, source, precision: str = "fp32"):
        if model.family not in CP_MODELS:
            raise ValueError(f"context parallelism runs model.hf={' or '.join(CP_MODELS[1:])} (or the reference "
                             f"model), not {model.family}")
        super().__init__(model, mesh, source, precision)
        register_attention(self.attention)
        model.text_config._attn_implementation = ATTENTION  # the decoder layers only; the vision tower keeps its own
        self.meta = {"context_parallel": mesh.cp, "hf": model.family}

    def encode_own(self, pack) -> torch.Tensor:
        from packfeed.client.model.context_parallel import share_qwen_pixels

        model, device = self.model, self.mesh.device
        patches, grids, mine = share_qwen_pixels(pack, model.family, model.conventions, device=device)
        if not mine:
            return self.no_features()
        geometry = model.builder.patch_geometry(SimpleNamespace(pixels=patches, grids=grids), patches.shape[0])
        named = {"pixels": patches, **{name: t.to(device) for name, t in geometry.items()}}
        named = {name: t[None] for name, t in named.items()}
        unused = torch.zeros(1, 0, dtype=torch.int64, device=device)  # the vision layers pass the text's on
        carrier = tuple(named.get(name, unused) for name in model.names[0])
        for layer in self.layers[:self.text_embed]:
            carrier = layer(*carrier)
        return dict(zip(model.names[self.text_embed], carrier))["features"][0]

    def no_features(self) -> torch.Tensor:
        width = self.model.text_config.hidden_size
        return torch.zeros(0, width, device=self.mesh.device, requires_grad=True)

    def language_loss(self, pack, features, vision_positions, targets) -> torch.Tensor:
        model, device = self.model, self.mesh.device
        positions = torch.cat([pack.position_ids.long()[None], self._mrope(pack)])
        named = {"features": features[None], "input_ids": pack.input_ids.long()[None].to(device),
                 "positions": positions[None].to(device), "bounds": pack.cu_seqlens.to(torch.int32)[None].to(device),
                 "labels": pack.labels.long()[None].to(device), "vision_positions": vision_positions[None]}
        carrier = tuple(named[name] for name in model.names[self.text_embed])
        for layer in self.layers[self.text_embed:-1]:
            carrier = layer(*carrier)
        head = self.layers[-1]
        hidden = dict(zip(head.inputs, carrier))["hidden"][0]
        logits = head.lm_head(head.norm(hidden)).float()
        return F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum").reshape(1)

    def _mrope(self, pack) -> torch.Tensor:
        """(3, L) M-RoPE positions of this GPU's tokens, as in the unsplit pack."""
        from packfeed.client.model.context_parallel import share_mrope_positions

        return share_mrope_positions(pack, self.model.family)

    def vision_units(self, pack) -> int:
        return int(pack.image_token_spans.view(-1, 2)[:, 1].sum())  # merged patches: Qwen's items vary in size


def register_attention(attention: ContextParallelAttention) -> None:
    """`transformers`' attention under `ATTENTION`: the runner's context-parallel attention for packs at degree
    > 1, Packfeed's varlen kernel otherwise."""
    from transformers import AttentionInterface

    from packfeed.client.model.attention import varlen_attention

    def attend(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        layout = attention.layout
        if layout is None or layout.degree == 1:
            return varlen_attention(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
        q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (L, heads, dim)
        return attention(q, k, v, None, scale=scaling).unsqueeze(0), None

    AttentionInterface.register(ATTENTION, attend)
