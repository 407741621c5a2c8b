"""One context-parallel GPU's work, measured on one GPU in bf16. Skips without CUDA.

Run (on a machine with a GPU): .venv/bin/python -m pytest -q -s tests/benchmarks/test_bench_cp_gpu.py -m benchmark

The model is the reference VLM's language model at its `2b` flavor (2,048 wide, 30 blocks, 16 heads, SwiGLU:
1.5 B parameters, plus a 32,000-word vocabulary), fp32 weights, bf16 autocast, every block recomputed in the
backward (what 128K-token samples need). One GPU runs exactly what CP rank 0 of a pack at degree d runs in
`packfeed train parallel.cp` (`ContextParallelRunner`'s attention hook, the contract's zigzag split), except
that the K/V all-gather is replaced by copies of its own rows: the compute and memory of one GPU of the pack,
the exchange between GPUs not included (one GPU has no peer to exchange with).

1. Correctness of the CUDA path: one flash-attention varlen call for all of a share's chunks (causal aligned
   to each chunk's last key) against the unsplit pack's attention in fp32, and against a wrong alignment.
2. One long sample (32K and 128K tokens) at degree 1, 2, 4, 8: forward + backward time of one GPU's share and
   its peak memory (`torch.cuda.max_memory_allocated`); out of memory is reported as such.
3. Equal tokens per GPU, short samples (InternVL-1.2M's real lengths): a pack of 32K tokens at degree 1 (what
   dynamic CP runs) against a share of a 4 x 32K (8 x 32K) pack at degree 4 (8) (what static CP runs), with
   the varlen kernel and with sdpa per chunk: what splitting short samples into 2d chunks costs a GPU.

`PACKFEED_BENCH_OUT=FILE` also writes the figures as JSON; `PACKFEED_BENCH_KERNELS=varlen` measures 3. with the
varlen kernel alone. `PACKFEED_BENCH_DEVICE=cpu PACKFEED_BENCH_SCALE=64`
runs the same code on a CPU with the `tiny` model and every length divided by 64 (a check of the script, not a
figure).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

DEVICE = os.environ.get("PACKFEED_BENCH_DEVICE", "cuda")
SCALE = int(os.environ.get("PACKFEED_BENCH_SCALE", 1))
pytestmark = [pytest.mark.benchmark, pytest.mark.timeout(3600),
              pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA device")]

LENGTHS = Path(__file__).resolve().parents[3] / "shared" / "data" / "lengths"
VOCAB = 32_000 // SCALE
N = 32_768 // SCALE
FIGURES: dict = {}


def model(ffn_multiple: int | None = None):
    from packfeed.trainer.models.reference import LLMBlock, LMHead, TextEmbed, VLMConfig

    config = VLMConfig(flavor="2b" if SCALE == 1 else "tiny", vocab_size=VOCAB, ffn_multiple=ffn_multiple)
    torch.manual_seed(0)
    with torch.device(DEVICE):
        return TextEmbed(config), torch.nn.ModuleList([LLMBlock(config) for _ in range(config.llm_layers)]), \
            LMHead(config)


def share_of(lengths: list[int], degree: int, rank: int = 0):
    """CP rank `rank`'s layout of a pack of samples of `lengths` at `degree`, its all-gather replaced by copies
    of its own rows (the shapes, and so the work, of the real one)."""
    from packfeed.trainer.parallel.context_parallel import ShareLayout
    from packfeed.v1.context_parallel import pack_shares, rank_chunks

    bounds = np.concatenate([[0], np.cumsum(lengths)]).tolist()
    held = [sum(b - a for a, b in rank_chunks(chunks, rank)) for chunks in pack_shares(lengths, degree)]
    layout = ShareLayout.split(bounds, degree, rank, None, np.concatenate([[0], np.cumsum(held)]).tolist())

    def gather(local, most=None):
        most = layout.most if most is None else most
        return F.pad(local, (0, 0) * (local.dim() - 1) + (0, most - local.shape[0])).repeat(
            (degree,) + (1,) * (local.dim() - 1))

    layout.gather = gather
    return layout


def share_step(parts, layout) -> None:
    """Forward + backward of one GPU's share (every block recomputed), as the CP runner runs it."""
    from torch.utils.checkpoint import checkpoint

    from packfeed.trainer.parallel.context_parallel import ContextParallelAttention

    embed, blocks, head = parts
    attention = ContextParallelAttention()
    attention.layout = layout
    for block in blocks:
        block.attention = attention
    tokens = len(layout.local_unsplit)
    ids = torch.randint(0, VOCAB, (tokens,), device=DEVICE)
    positions = (layout.local_unsplit - torch.tensor(layout.bounds)[
        torch.searchsorted(torch.tensor(layout.bounds), layout.local_unsplit, right=True) - 1]).to(DEVICE)
    bounds = torch.tensor(layout.local_bounds, device=DEVICE)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        hidden = embed.embed(ids)
        for block in blocks:
            hidden = checkpoint(block, hidden, positions, bounds, ids, use_reentrant=False)[0]
        loss = head.loss(hidden, torch.roll(ids, -1)) / tokens
    loss.backward()


def synchronize() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def measure(parts, layout, repeats: int) -> dict:
    synchronize()
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    try:
        for _ in range(1 + repeats):  # the first a warm-up
            synchronize()
            started = time.perf_counter()
            share_step(parts, layout)
            synchronize()
            times.append(time.perf_counter() - started)
            for module in parts:
                module.zero_grad(set_to_none=True)
    except torch.cuda.OutOfMemoryError:
        for module in parts:
            module.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
        return {"tokens_per_gpu": len(layout.local_unsplit), "out_of_memory": True}
    times = times[1:]
    peak = torch.cuda.max_memory_allocated() / 2 ** 20 if DEVICE == "cuda" else float("nan")
    return {"tokens_per_gpu": len(layout.local_unsplit), "ms": 1000 * statistics.median(times),
            "ms_min": 1000 * min(times), "ms_max": 1000 * max(times), "peak_mib": peak}


def row(label: str, r: dict) -> str:
    if r.get("out_of_memory"):
        return f"[cp-gpu] {label} | {r['tokens_per_gpu']:,} tokens/GPU | out of memory"
    return (f"[cp-gpu] {label} | {r['tokens_per_gpu']:,} tokens/GPU | {r['ms']:.1f} ms ({r['ms_min']:.1f}-"
            f"{r['ms_max']:.1f}) | peak {r['peak_mib']:,.0f} MiB")


@pytest.fixture(scope="module")
def parts():
    built = model()
    yield built
    FIGURES["device"] = torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE
    FIGURES["torch"] = torch.__version__
    if os.environ.get("PACKFEED_BENCH_OUT"):
        Path(os.environ["PACKFEED_BENCH_OUT"]).write_text(json.dumps(FIGURES, indent=1))


@pytest.mark.parametrize("kv_heads, scale", [(8, None), (2, 0.05)])
def test_varlen_chunks_equal_the_unsplit_attention(kv_heads, scale):
    """The CUDA path (one varlen call over a share's chunks) gives the unsplit pack's attention on its rows, also
    with grouped K/V heads (gathered, then repeated) and a given scale (Hugging Face models pass theirs)."""
    from packfeed.trainer.parallel.context_parallel import ContextParallelAttention

    lengths, heads, dim = [max(8, n // SCALE) for n in (3000, 517, 9000, 64)], 8, 128
    total = sum(lengths)
    torch.manual_seed(1)
    q = torch.randn(total, heads, dim, device=DEVICE)
    k, v = (torch.randn(total, kv_heads, dim, device=DEVICE) for _ in range(2))
    bounds = np.concatenate([[0], np.cumsum(lengths)]).tolist()
    wide_k, wide_v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
    expected = torch.cat([F.scaled_dot_product_attention(  # fp32, sdpa per sample
        q[a:b].transpose(0, 1), wide_k[a:b].transpose(0, 1), wide_v[a:b].transpose(0, 1), is_causal=True,
        scale=scale).transpose(0, 1) for a, b in zip(bounds[:-1], bounds[1:])])
    worst = {}
    for degree in (2, 4, 8):
        errors = []
        for rank in range(degree):
            layout = share_of(lengths, degree, rank)
            kv = torch.cat([k, v], -1).bfloat16()
            held = [share_of(lengths, degree, r).local_unsplit for r in range(degree)]
            layout.gather = lambda local, most=None, held=held, kv=kv, layout=layout: torch.cat(
                [F.pad(kv[h], (0, 0, 0, 0, 0, layout.most - len(h))) for h in held])
            attention = ContextParallelAttention()
            attention.layout = layout
            rows = layout.local_unsplit.to(DEVICE)
            got = attention(q[rows].bfloat16(), k[rows].bfloat16(), v[rows].bfloat16(), None, scale=scale)
            errors.append(float((got.float() - expected[rows]).abs().max()))
        worst[degree] = max(errors)
    # control: the first sample's second half of queries, causal from its first key (top left aligned)
    half, first = lengths[0] // 2, lengths[0]
    wrong = F.scaled_dot_product_attention(*(t.transpose(0, 1) for t in (q[half:first], wide_k[:first],
                                                                        wide_v[:first])), is_causal=True, scale=scale)
    control = float((wrong - expected[half:first].transpose(0, 1)).abs().max())
    print(f"[cp-gpu] varlen chunks vs unsplit fp32 ({kv_heads} K/V heads, scale {scale}): max abs error {worst}; "
          f"top-left control {control:.3f}")
    FIGURES[f"correctness, {kv_heads} K/V heads, scale {scale}"] = {"max_abs_error": worst, "control": control}
    assert max(worst.values()) < 0.05 < control


def short_pack(tokens: int, seed: int) -> list[int]:
    """Real InternVL-1.2M sample lengths, drawn in a seeded order, up to `tokens` in all."""
    lengths = [r["token_num"] for f in sorted(LENGTHS.glob("*.json")) for r in json.loads(f.read_text())]
    if not lengths:
        pytest.skip(f"needs the length files in {LENGTHS}")
    order = np.random.default_rng(seed).permutation(len(lengths))
    pack, total = [], 0
    for k in order:
        if total + lengths[k] > tokens:
            break
        pack.append(int(lengths[k]))
        total += lengths[k]
    return pack


def test_short_samples_split_or_whole(parts, monkeypatch):
    import packfeed.trainer.models.reference as reference
    import packfeed.trainer.parallel.context_parallel as context_parallel

    results = {}
    for kernel in os.environ.get("PACKFEED_BENCH_KERNELS", "varlen,sdpa per chunk").split(","):
        if kernel != "varlen":  # the fallback every non-CUDA device runs
            monkeypatch.setattr(reference, "flash_varlen_attention", lambda *a, **k: None)
            monkeypatch.setattr(context_parallel, "flash_varlen_attention", lambda *a, **k: None)
        for degree in (1, 4, 8):
            lengths = short_pack(N * degree, seed=degree)
            r = measure(parts, share_of(lengths, degree), repeats=3)
            r["samples"] = len(lengths)
            results[f"{kernel}, degree {degree}"] = r
            print(row(f"short samples ({len(lengths)} in the pack), {kernel}, degree {degree}", r))
    FIGURES["short"] = results
    assert all(r.get("ms", 0) > 0 for r in results.values())


def test_the_swiglu_width_a_multiple_of_256(parts):
    """The `2b` flavor's SwiGLU 5,632 wide (a multiple of 256, what it is now) against 5,461 (2/3 of 4 x 2,048, what
    it was, odd: the matrix products fell to tensor-core kernels for unaligned rows): a whole pack of short
    samples, N tokens, degree 1. Per token: the wider MLP does 3% more FLOPs."""
    from packfeed.trainer.models.reference import VLMConfig

    lengths = short_pack(N, seed=1)
    widths = {}
    for name, built in (("aligned", parts), ("unaligned", None)):
        built = built or model(ffn_multiple=1)
        width = built[1][0].mlp.up.out_features
        widths[name] = r = measure(built, share_of(lengths, 1), repeats=3)
        r["swiglu_width"] = int(width)
        print(row(f"SwiGLU {width} wide ({name}), {len(lengths)} short samples, degree 1", r))
        del built
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    ratio = widths["unaligned"]["ms"] / widths["aligned"]["ms"]
    print(f"[cp-gpu] SwiGLU width: the aligned step is {ratio:.2f}x faster than the unaligned one "
          f"(widths {widths['aligned']['swiglu_width']} vs {widths['unaligned']['swiglu_width']})")
    FIGURES["swiglu_width"] = widths
    assert widths["aligned"]["swiglu_width"] % (256 if SCALE == 1 else 1) == 0
    assert VLMConfig(flavor="2b").llm_ffn == 5632 and VLMConfig(flavor="2b", ffn_multiple=1).llm_ffn == 5461


@pytest.mark.parametrize("sample", [32_768 // SCALE, 131_072 // SCALE])
def test_one_long_sample_by_degree(parts, sample):
    results = {}
    for degree in (8, 4, 2, 1):  # the cheapest first
        results[degree] = measure(parts, share_of([sample], degree), repeats=2 if sample > N else 3)
        print(row(f"one {sample:,}-token sample, degree {degree}", results[degree]))
    FIGURES[f"long_{sample}"] = results
    done = [r for r in results.values() if not r.get("out_of_memory")]
    assert done and all(r["ms"] > 0 for r in done)


def _candidate_attention(original):
    """A candidate CUDA path for `ContextParallelAttention`, measured against the code as it is: the keys each
    span sees picked with `index_select` (its backward an `index_add_`, not the sorting `index_put_` of a
    tensor index), every index and bound moved to the GPU once per share, no host sync for the longest span."""
    from packfeed.client.model.attention import _torch_varlen_attn

    varlen_attn, params = _torch_varlen_attn()
    cache: dict[int, tuple] = {}

    def call(self, q, k, v, cu_seqlens, scale=None):
        layout = self.layout
        if layout is None or layout.degree == 1 or q.device.type != "cuda" or varlen_attn is None:
            return original(self, q, k, v, cu_seqlens, scale=scale)
        if id(layout) not in cache:
            cu_q, rows, cu_k = layout.span_keys
            cache.clear()
            cache[id(layout)] = (cu_q.to(q.device), rows.to(q.device), cu_k.to(q.device),
                                 int((cu_q[1:] - cu_q[:-1]).max()), int((cu_k[1:] - cu_k[:-1]).max()))
        cu_q, rows, cu_k, longest_q, longest_k = cache[id(layout)]
        keys, values = layout.gather(torch.cat([k, v], dim=-1)).index_select(0, rows).chunk(2, dim=-1)
        options = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
        if "scale" in params:
            options["scale"] = scale
        return varlen_attn(q.contiguous(), keys.contiguous(), values.contiguous(), cu_q, cu_k, longest_q, longest_k,
                           **options)

    return call


KERNEL_KINDS = (("flash-attention forward", ("flash_fwd",)), ("flash-attention backward", ("flash_bwd",)),
                ("matrix products", ("gemm", "nvjet", "cutlass")),  # after flash: its names hold "cutlass::"
                ("index backward", ("indexing_backward", "index_put", "scatter", "index_add")),
                ("index forward", ("gather_kernel", "index_select", "indexFunc", "index_kernel")),
                ("copies, cat, pad", ("copy", "cat", "pad", "fill", "Cat")), ("reductions", ("reduce",)))


def kernel_kind(name: str) -> str:
    return next((kind for kind, marks in KERNEL_KINDS if any(m in name for m in marks)), "other elementwise")


def test_where_a_split_share_spends_its_time(parts):
    """The CUDA kernels of one share step, whole (degree 1) and split (degree 4, 8), short samples: what the
    split adds, by kind of kernel (torch.profiler, self CUDA time; launches counted)."""
    from torch.profiler import ProfilerActivity, profile

    if DEVICE != "cuda":
        pytest.skip("profiles CUDA kernels")
    table = {}
    for degree in (1, 4, 8):
        layout = share_of(short_pack(N * degree, seed=degree), degree)
        share_step(parts, layout)  # warm-up
        for module in parts:
            module.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            share_step(parts, layout)
            torch.cuda.synchronize()
        for module in parts:
            module.zero_grad(set_to_none=True)
        kinds: dict[str, list[float]] = {}
        for event in prof.key_averages():
            ms, launches = kinds.setdefault(kernel_kind(event.key), [0.0, 0])
            kinds[kernel_kind(event.key)] = [ms + event.self_device_time_total / 1000, launches + event.count]
        table[degree] = {kind: [round(ms, 1), n] for kind, (ms, n) in sorted(kinds.items(), key=lambda kv: -kv[1][0])}
        total = sum(ms for ms, _ in kinds.values())
        print(f"[cp-gpu] profile, degree {degree}: {total:,.1f} ms of CUDA kernels, by kind (ms, launches): "
              + "; ".join(f"{kind} {ms:,.1f} ({n:,})" for kind, (ms, n) in table[degree].items()))
        top = sorted(prof.key_averages(), key=lambda e: -e.self_device_time_total)[:25]
        for event in top:
            print(f"[cp-gpu]   d{degree} {event.self_device_time_total / 1000:>9,.1f} ms {event.count:>6} x {event.key[:110]}")
    FIGURES["profile"] = table
    assert all(table.values())


def test_kv_pick_as_is_or_candidate(parts, monkeypatch):
    """The share step with the code as it is and with `_candidate_attention`, split short samples and one long
    sample: the candidate replaces the code only where it is faster (and gives the same loss)."""
    import packfeed.trainer.parallel.context_parallel as context_parallel

    original = context_parallel.ContextParallelAttention.__call__
    if DEVICE == "cuda":  # the candidate's attention and its gradients are the code's
        layout, heads = share_of(short_pack(N * 8, seed=8), 8), 16
        torch.manual_seed(2)
        q, k, v = (torch.randn(len(layout.local_unsplit), heads, 128, device=DEVICE, dtype=torch.bfloat16,
                               requires_grad=True) for _ in range(3))
        outputs = []
        for call in (original, _candidate_attention(original)):
            attention = context_parallel.ContextParallelAttention()
            attention.layout = layout
            out = call(attention, q, k, v, None)
            outputs.append([out.detach(), *torch.autograd.grad(out.float().square().sum(), (q, k, v))])
        gaps = [float((a.float() - b.float()).abs().max()) for a, b in zip(*outputs)]
        print(f"[cp-gpu] candidate vs as is: max abs difference of out, dq, dk, dv {gaps}")
        assert gaps[0] == 0 and max(gaps) < 0.05
    cases = [(f"short samples, degree {d}", short_pack(N * d, seed=d), d) for d in (4, 8)]
    cases.append((f"one {4 * N:,}-token sample, degree 8", [4 * N], 8))
    results = {}
    for label, lengths, degree in cases:
        for variant in ("as is", "candidate"):
            monkeypatch.setattr(context_parallel.ContextParallelAttention, "__call__",
                                original if variant == "as is" else _candidate_attention(original))
            r = measure(parts, share_of(lengths, degree), repeats=3)
            results[f"{label}, {variant}"] = r
            print(row(f"{label}, {variant}", r))
    FIGURES["kv_pick"] = results
    assert all(r.get("ms", 0) > 0 for r in results.values())
