"""The trainer's losses and gradient norms, pinned: `packfeed train` at pp 1, 2 and 4 and at DP 2, for the
reference VLM and a Hugging Face VLM, gives the numbers it gave before the trainer was restructured (one loop
for every model and layout). A refactor that changes the arithmetic (the loss scaling, the gradient averaging
over replicas, what a step holds) moves them; the 1e-6 tolerance absorbs only float rounding.

Each run is two steps on the same small dataset (the second step's loss follows one AdamW update, so the
gradients of the first step are in it as well as its grad_norm)."""

from __future__ import annotations

import pytest
from hf_models import family_dataset
from trainer_workers import SMALL_MODEL, packfeed_train

pytestmark = pytest.mark.slow

COMMON = ["data.microbatches=2", "data.server_workers=1", "partition.mode=layers", "recompute.mode=none",
          "optim.steps=2", "optim.warmup_steps=1", "data.epochs=2"]
REFERENCE = [f"model.{k}={v}" for k, v in SMALL_MODEL.items()]
HF = ["model.hf=qwen2_vl", "model.hf_config={text: {hidden_size: 32, num_hidden_layers: 2}}"]

# layout -> (processes, overrides, [(loss, grad_norm) per step]) measured before the restructure (commit 31aa254)
PINNED = {
    "reference pp1": (1, REFERENCE + ["parallel.pp=1"],
        [(7.1721062660217285, 0.8925811744787773), (7.132253170013428, 0.8059569116806792)]),
    "reference pp2": (2, REFERENCE + ["parallel.pp=2"],
        [(7.1721062660217285, 0.8925811779840591), (7.132253170013428, 0.8059569221546968)]),
    "reference pp4": (4, REFERENCE + ["parallel.pp=4", "data.microbatches=4"],
        [(7.17110401391983, 0.8411234966212454), (7.12540078163147, 0.841031607963823)]),
    "reference dp2": (2, REFERENCE + ["parallel.pp=1", "parallel.dp=2"],
        [(7.17110401391983, 0.8411234945386981), (7.12540078163147, 0.8410316108751351)]),
    "qwen2_vl dp2 fsdp": (2, HF + ["parallel.pp=1", "parallel.dp=2"],
        [(5.9673227071762085, 2.3447887897491455), (5.932201683521271, 2.5439295768737793)]),
    "qwen2_vl pp2": (2, HF + ["parallel.pp=2"],
        [(5.9681655168533325, 2.3874179524825045), (5.932088136672974, 2.28520015517786)]),
}


@pytest.fixture(scope="module")
def qwen_index(tmp_path_factory):
    pytest.importorskip("transformers")
    return family_dataset(tmp_path_factory.mktemp("qwen2_vl"), "qwen2_vl", samples=24).index


@pytest.mark.parametrize("layout", list(PINNED))
def test_losses_and_gradient_norms_stay_pinned(tmp_path, layout, small_tile_index, request):
    nproc, overrides, expected = PINNED[layout]
    index = request.getfixturevalue("qwen_index") if layout.startswith("qwen2_vl") else small_tile_index
    _, records = packfeed_train(nproc, COMMON + overrides + [f"data.index={index}"], tmp_path / "run")
    measured = [(r["loss"], r["grad_norm"]) for r in records]
    print(layout, measured)
    assert len(measured) == 2
    flat = [value for pair in measured for value in pair]
    assert flat == pytest.approx([value for pair in expected for value in pair], rel=1e-6, abs=1e-9)
