"""The ``adamw`` recipe optimizer trained through bert_ds's engine on 2 real DeepSpeed CPU ranks (ZeRO-2, overlap_comm
on, real text) lands where a plain one-process ``torch.optim.AdamW`` loop lands.

The bound comes from the comparison's own noise: the same plain loop run in float64 is the truth; the engine's weights
(all tensors as one vector, relative norm of the difference) must be no further from it than 10 times the plain fp32
loop's own rounding distance from it (each is fp32 with its own summation order). Per tensor, Adam turns rounding
noise in near-zero gradients into full lr-sized steps (attention key biases: true gradient 0, see
tests/optim/test_lamb_engine.py), so the whole vector is
the measure. A wrong optimizer (weight decay on biases and LayerNorm too, or Adam's L2 penalty instead of
decoupled decay) lands orders of magnitude outside the bound, which the test also checks, so the bound can fail.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.optim.lr_scheduler import LambdaLR

from bert_ds.data.index import vocab_sha256
from bert_ds.data.loader import build_loader
from bert_ds.optim import param_groups, warmup_poly_decay
from bert_ds.recipe import Recipe
from bert_ds.runtime.engine import build_model
from tests.helpers.ranks import run_module_ranks as run_ranks
from tests.helpers.recipe_engine_worker import MODEL_INPUTS
from tests.helpers.runs import param_diffs

pytestmark = pytest.mark.e2e

STEPS = 6
NOISE_FACTOR = 10.0
RECIPE = {
    "name": "adamw_engine_test", "model": "tiny", "kernels": "torch", "seed": 11, "nsp": True,
    "model_overrides": {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0},
    # The paper's optimizer settings (bert_base_paper.json) at a tiny model's learning rate.
    "optimizer": {"name": "adamw", "betas": [0.9, 0.999], "eps": 1e-6, "weight_decay": 0.01},
    # Clipping off: ZeRO 1/2 and a plain loop clip with norms summed in different orders (tests/optim/
    # test_lamb_engine.py measures that clip error), which would
    # add its own noise to what this test measures.
    "deepspeed": {"zero_stage": 2, "precision": "fp32", "gradient_clipping": 0.0, "overlap_comm": True},
    "phases": [{"seq_len": 128, "steps": STEPS, "schedule_steps": 1000, "global_batch_size": 4, "micro_batch_size": 1,
                "lr": 2e-3, "warmup_fraction": 0.0, "decay_power": 1.0, "max_predictions": 20}],
}


def plain_loop(recipe: Recipe, data: Path, vocab: Path, dtype: torch.dtype, variant: str = "adamw") -> dict:
    """One process, no DeepSpeed: each global batch's 4 samples one at a time (loss / 4 each), then the step."""
    phase = recipe.phases[0]
    vocab_size = sum(1 for line in vocab.read_text(encoding="utf-8").splitlines() if line)
    model = build_model(recipe, recipe.model_config(vocab_size)).to(dtype)
    opt = recipe.optimizer
    if variant == "adamw":
        groups = param_groups(model, opt.weight_decay)
        optimizer = torch.optim.AdamW(groups, lr=phase.lr, betas=opt.betas, eps=opt.eps)
    elif variant == "decay_everything":  # one group: biases and LayerNorm decay too
        optimizer = torch.optim.AdamW(model.parameters(), lr=phase.lr, betas=opt.betas, eps=opt.eps,
                                      weight_decay=opt.weight_decay)
    elif variant == "l2_adam":  # Adam with the decay added to the gradient (not decoupled)
        optimizer = torch.optim.Adam(param_groups(model, opt.weight_decay), lr=phase.lr, betas=opt.betas,
                                     eps=opt.eps)
    else:
        raise ValueError(variant)
    scheduler = LambdaLR(optimizer, warmup_poly_decay(phase.schedule_steps, phase.warmup_fraction, phase.decay_power))
    loader = build_loader(data, global_batch_size=phase.global_batch_size, micro_batch_size=1, rank=0, world_size=1,
                          seed=recipe.seed, num_workers=0, expected_seq_len=phase.seq_len,
                          expected_vocab_sha256=vocab_sha256(vocab), max_predictions=phase.max_predictions)
    batches = iter(loader)
    for _ in range(STEPS):
        optimizer.zero_grad()
        for _ in range(phase.global_batch_size):
            batch = next(batches)
            loss = model(**{k: batch[k] for k in MODEL_INPUTS}).loss
            (loss / phase.global_batch_size).backward()
        optimizer.step()
        scheduler.step()
    return {n: p.detach().double() for n, p in model.named_parameters()}


def test_adamw_zero2_two_ranks_matches_plain_adamw(shards_128, tokenizer_dir, tmp_path):
    recipe_path = tmp_path / "recipe.json"
    recipe_path.write_text(json.dumps(RECIPE))
    recipe = Recipe.from_dict(RECIPE)
    vocab = tokenizer_dir / "vocab.txt"
    out = tmp_path / "engine"
    run_ranks(2, out, "tests.helpers.recipe_engine_worker",
              [f"--recipe={recipe_path}", f"--steps={STEPS}", f"--data={shards_128}", f"--vocab={vocab}",
               f"--out={out}"])
    engine = torch.load(out / "params.pt")
    losses = json.loads((out / "losses.json").read_text())
    assert losses[-1] < losses[0], losses

    truth = plain_loop(recipe, shards_128, vocab, torch.float64)
    fp32 = plain_loop(recipe, shards_128, vocab, torch.float32)
    floor = param_diffs(fp32, truth)["global_rel"]
    got = param_diffs(engine, truth)["global_rel"]
    print(f"AdamW, {STEPS} steps: engine (2 ranks, ZeRO-2) vs float64 loop {got:.2e}; fp32 loop vs float64 loop "
          f"{floor:.2e}; losses {losses}")
    assert 0 < floor and got <= NOISE_FACTOR * floor, (got, floor)
    # The bound separates a right optimizer from wrong ones.
    for variant in ("decay_everything", "l2_adam"):
        wrong = param_diffs(plain_loop(recipe, shards_128, vocab, torch.float32, variant), truth)["global_rel"]
        print(f"  {variant}: {wrong:.2e}")
        assert wrong > NOISE_FACTOR * floor, (variant, wrong, floor)
