"""Packed attention on CPU: forward + backward of a Hugging Face VLM over one pack, three ways in the same run:
each sample alone (the loop packing should beat), the pack with HF's sdpa path (a dense L x L block mask built
from the restarting positions), and the pack with Packfeed's variable-length attention (sdpa per sample, no
mask: `register_varlen_attention`, `to_hf_inputs(..., attention="varlen")`).

Run: .venv/bin/python -m pytest -q -s tests/benchmarks/test_bench_packed_attention.py -m benchmark
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from packfeed.client.model.hf import register_varlen_attention, to_hf_inputs  # noqa: E402
from packfeed.client.stream.tensors import pack_of  # noqa: E402
from packfeed.server.serve.packs import assemble_pack  # noqa: E402
from packfeed.server.serve.preprocess import SampleTensors  # noqa: E402
from packfeed.server.serve.wire import encode_pack  # noqa: E402
from packfeed.trainer.models.hf.build import build_hf_model  # noqa: E402
from packfeed.v1 import packfeed_pb2 as pb  # noqa: E402

pytestmark = pytest.mark.benchmark
SIZES = {"text": {"hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 8,
                  "num_key_value_heads": 4}}
VOCAB = 4096


def conventions(family: str) -> pb.ModelConventions:
    policy = pb.ImagePolicy(name="fixed", tile_size=56, tokens_per_tile=16, patch_size=14, parameters_json="{}") \
        if family == "llava" else pb.ImagePolicy(name="qwen2vl", patch_size=14, parameters_json='{"factor": 28}')
    return pb.ModelConventions(image_policy=policy, vocab_size=VOCAB, image_context_id=VOCAB - 1)


def text_pack(lengths: list[int], seed: int, vocab: int = VOCAB):
    """A pack of text samples of these lengths (random tokens, the first third of each a prompt), as the client
    receives it, and the samples."""
    rng = np.random.default_rng(seed)
    samples = []
    for k, n in enumerate(lengths):
        ids = rng.integers(5, vocab - 5, n).astype(np.int32)
        labels = ids.copy()
        labels[: n // 3] = -100  # the prompt
        samples.append(SampleTensors(f"s{k}", ids, labels, [], [], [], []))
    pack = assemble_pack(samples, 0, 0, 0, 0)
    pack.step_loss_tokens = pack.loss_tokens
    return pack_of(encode_pack(pack, 1, False)), samples


def seconds(model, inputs_list, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        for inputs in inputs_list:
            model(**inputs).loss.backward()
        best = min(best, time.perf_counter() - started)
        model.zero_grad(set_to_none=True)
    return best


@pytest.mark.parametrize("family", ["llava", "qwen2_vl"])
def test_packed_attention_costs(family):
    torch.manual_seed(0)
    varlen_name = register_varlen_attention()
    models = {name: build_hf_model(family, conventions(family), SIZES, attention=impl).train()
              for name, impl in (("sdpa", "sdpa"), ("varlen", varlen_name))}
    print(f"\n[attention] {family}: LLM hidden 256, 4 layers, 8 heads; torch threads {torch.get_num_threads()}")
    for lengths in ([512] * 8, [200, 1500, 300, 800, 120, 900, 600, 400], [1024] * 4):
        pack, samples = text_pack(lengths, len(lengths))
        alone = []
        for sample in samples:
            single, _ = text_pack([len(sample.input_ids)], 0)
            single.tensors["input_ids"], single.tensors["labels"] = (torch.from_numpy(sample.input_ids),
                                                                     torch.from_numpy(sample.labels))
            single.step_loss_tokens = pack.step_loss_tokens
            alone.append(to_hf_inputs(single, family))
        loop = seconds(models["sdpa"], alone)
        dense = seconds(models["sdpa"], [to_hf_inputs(pack, family)])
        varlen = seconds(models["varlen"], [to_hf_inputs(pack, family, attention="varlen")])
        print(f"[attention] {len(lengths)} samples, L = {sum(lengths)}: per-sample loop {loop * 1e3:.0f} ms, "
              f"packed sdpa (dense mask) {dense * 1e3:.0f} ms ({dense / loop:.2f}x the loop), packed varlen "
              f"{varlen * 1e3:.0f} ms ({varlen / loop:.2f}x the loop)")
        assert varlen < dense
