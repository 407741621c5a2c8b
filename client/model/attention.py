"""Packfeed's variable-length attention for `transformers` models trained on packs: each sample attends only to
itself, computed per sample with no mask (sdpa on CPU and GPU, flash-attention's varlen kernel where installed),
registered under a name for `attn_implementation` and fed by `to_hf_inputs(..., attention="varlen")`."""

from __future__ import annotations

import functools
from typing import Any

import torch

VARLEN_ATTENTION = "packfeed_varlen"


def register_varlen_attention() -> str:
    """Register Packfeed's variable-length attention with `transformers` and return its name, for
    `from_config(..., attn_implementation=name)`; feed it `to_hf_inputs(..., attention="varlen")`."""
    from transformers import AttentionInterface

    AttentionInterface.register(VARLEN_ATTENTION, varlen_attention)
    return VARLEN_ATTENTION


def varlen_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """Attention of (batch, heads, L, dim) tensors, one sample at a time when `cu_seq_lens_q` splits L: each
    sample attends only to itself (causal for the LLM, full for vision towers), with no L x L mask. On CUDA in
    bf16 / fp16 that is one flash-attention call over the whole pack (torch's `varlen_attn`); elsewhere sdpa per
    sample. Without them (or for a call they do not describe), plain sdpa with the mask given."""
    import torch.nn.functional as F

    causal = bool(kwargs.get("is_causal", getattr(module, "is_causal", True)))
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # grouped-query attention: every query head group shares a key/value head
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    dropout = dropout if module.training else 0.0
    bounds = kwargs.get("cu_seq_lens_q")
    length = query.shape[2]
    parents = kwargs.get("segment_parents")
    if parents is not None and causal and bounds is not None and int(bounds[-1]) == length and query.shape[0] == 1:
        # a shared prefix's segments (to_hf_inputs(..., shared_prefix=True)): they say all a mask would
        starts = kwargs.get("segment_starts")
        out = segment_attention(*(t[0].transpose(0, 1) for t in (query, key, value)), bounds.tolist(),
                                list(parents), scaling, None if starts is None else list(starts))
        return out.unsqueeze(0), None
    with _fixed_plan_backends(query):
        if bounds is None or int(bounds[-1]) != length or attention_mask is not None:
            out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                                 is_causal=causal and attention_mask is None and length > 1,
                                                 scale=scaling)
            return out.transpose(1, 2).contiguous(), None
        if dropout == 0.0 and (flash := _flash_varlen(query, key, value, bounds, causal, scaling)) is not None:
            return flash, None
        edges = bounds.tolist()
        out = torch.cat([F.scaled_dot_product_attention(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b],
                                                        dropout_p=dropout, is_causal=causal, scale=scaling)
                         for a, b in zip(edges[:-1], edges[1:]) if b > a], dim=2)
    return out.transpose(1, 2).contiguous(), None


def _fixed_plan_backends(query: torch.Tensor):
    """On CUDA, sdpa without its cuDNN backend: cuDNN builds an execution plan for every new sequence length,
    and in packed training nearly every call has a new one; flash and memory-efficient kernels need none."""
    from contextlib import nullcontext

    if query.device.type != "cuda":
        return nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


@functools.cache
def _torch_varlen_attn() -> tuple[Any, frozenset[str]]:
    """torch's flash-attention `varlen_attn` and the names of its parameters (their set changed between
    versions), looked up once rather than in every layer's call; (None, {}) before torch 2.10."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None, frozenset()
    import inspect

    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def _flash_varlen(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bounds: torch.Tensor, causal: bool,
                  scaling: float | None) -> torch.Tensor | None:
    """The pack's attention as one call of torch's flash-attention `varlen_attn` (a batch of one packed row), as
    (1, L, heads, dim); None where it does not apply, so the caller runs sdpa per sample."""
    if query.shape[0] != 1:
        return None
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (L, heads, dim)
    out = flash_varlen_attention(q, k, v, bounds, bounds, causal, scaling)
    return None if out is None else out.unsqueeze(0)


def flash_varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                           causal: bool, scale: float | None = None) -> torch.Tensor | None:
    """Attention of (L, heads, dim) rows cut into sequences by `cu_q` (queries) and `cu_k` (keys), as one call of
    torch's flash-attention `varlen_attn`; causal is aligned to each sequence's last key (a sequence's queries
    are its last keys' positions, flash-attention's convention). None where it does not apply (not CUDA, not
    bf16 / fp16, torch older than 2.10, a scale this torch cannot take), so the caller runs sdpa instead."""
    if q.device.type != "cuda" or q.dtype not in (torch.float16, torch.bfloat16) or len(cu_q) < 2 or not len(q):
        return None
    varlen_attn, params = _torch_varlen_attn()
    if varlen_attn is None:
        return None
    # torch 2.10-2.11 take is_causal; later versions a window, (-1, 0) being causal; the first had no scale
    options = {"window_size": (-1, 0) if causal else (-1, -1)} if "window_size" in params else {"is_causal": causal}
    if "scale" in params:
        options["scale"] = scale
    elif scale is not None and abs(scale * q.shape[-1] ** 0.5 - 1) > 1e-6:
        return None
    cu_q, cu_k = (c.to(device=q.device, dtype=torch.int32) for c in (cu_q, cu_k))
    longest_q, longest_k = (int((c[1:] - c[:-1]).max()) for c in (cu_q, cu_k))
    return varlen_attn(q.contiguous(), k.contiguous(), v.contiguous(), cu_q, cu_k, longest_q, longest_k, **options)


def segment_context(bounds: list[int], parents: list[int], starts: list[int] | None = None) -> list[torch.Tensor]:
    """Per segment of rows cut at `bounds`, the rows it sees before its own (int64): its parent's context before
    its first position and its parent's rows up to it, recursively (`packfeed.client.model.shared_prefix`).
    `starts`: each segment's first position in its sample (None: right after its parent's whole context, a
    group's responses after their prompt)."""
    return list(_context(tuple(bounds), tuple(parents), None if starts is None else tuple(starts)))


@functools.lru_cache(maxsize=16)
def _context(bounds: tuple[int, ...], parents: tuple[int, ...], starts: tuple[int, ...] | None
             ) -> tuple[torch.Tensor, ...]:
    """`segment_context`, computed once per layout rather than once per layer."""
    spans = list(zip(bounds[:-1], bounds[1:]))
    if starts is None:
        first: list[int] = []
        for p, (a, b) in zip(parents, spans):
            first.append(first[p] + spans[p][1] - spans[p][0] if p >= 0 else 0)
        starts = tuple(first)
    out = []
    for s, p in enumerate(parents):
        pieces, seen = [], starts[s]
        while p >= 0 and seen > 0:
            own = min(seen, starts[p] + spans[p][1] - spans[p][0]) - starts[p]
            if own > 0:
                pieces.append(torch.arange(spans[p][0], spans[p][0] + own))
            seen, p = min(seen, starts[p]), parents[p]
        out.append(torch.cat(pieces[::-1]) if pieces else torch.zeros(0, dtype=torch.long))
    return tuple(out)


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: list[int], parents: list[int],
                      scale: float | None = None, starts: list[int] | None = None) -> torch.Tensor:
    """Causal attention of (L, heads, dim) rows cut into segments at `bounds`, where a segment with a parent
    (`parents[s]` >= 0, an earlier segment: a shared prefix or a tree's turns, `packfeed.client.model.
    shared_prefix`) also sees its ancestors' rows before its first position (`segment_context`; `starts`: each
    segment's first position in its sample), as if it followed them. One flash-attention varlen call on CUDA in
    bf16 / fp16, each segment's keys its context's rows then its own; else sdpa per segment. Rows past the last
    bound attend among themselves."""
    import torch.nn.functional as F

    if bounds[-1] < q.shape[0]:
        bounds, parents = [*bounds, q.shape[0]], [*parents, -1]
        starts = None if starts is None else [*starts, 0]
    spans = list(zip(bounds[:-1], bounds[1:]))
    keys = [torch.cat([context, torch.arange(a, b)])
            for context, (a, b) in zip(segment_context(bounds, parents, starts), spans)]
    cu_k = torch.tensor([0] + [len(x) for x in keys]).cumsum(0)
    gathered = torch.cat(keys).to(q.device)
    flash = flash_varlen_attention(q, k[gathered], v[gathered], torch.tensor(bounds), cu_k, True, scale)
    if flash is not None:
        return flash
    out = torch.empty_like(q)
    for (a, b), key in zip(spans, keys):
        if b <= a:
            continue
        parent, key = len(key) - (b - a), key.to(q.device)
        if parent and parent <= b - a:
            # a context no longer than the segment: causal attention of the context's rows and the segment's,
            # the context's outputs thrown away (no gradient reaches them). Causal kernels skip what the mask
            # hides; a masked call would compute the segment's whole rectangle, twice the attention of a long
            # response.
            out[a:b] = F.scaled_dot_product_attention(q[key].transpose(0, 1), k[key].transpose(0, 1),
                                                      v[key].transpose(0, 1), is_causal=True,
                                                      scale=scale).transpose(0, 1)[parent:]
            continue
        mask = None
        if parent:  # every context row, then causal within the segment
            mask = torch.ones(b - a, len(key), dtype=torch.bool, device=q.device).tril(parent)
        out[a:b] = F.scaled_dot_product_attention(q[a:b].transpose(0, 1), k[key].transpose(0, 1),
                                                  v[key].transpose(0, 1), attn_mask=mask, is_causal=mask is None,
                                                  scale=scale).transpose(0, 1)
    return out
