"""LAMB through bert_ds's real engine on real text, one DeepSpeed CPU rank (gloo) per process; spawned by
``tests.helpers.lamb_harness.launch_engine_runs``. Not a test module.

Each job is named ``z<stage>-<clip|noclip>-<trust_ratio>`` (e.g. ``z2-clip-decay_only``): ``ds_configs/tiny_cpu.json``
with dropout 0, the first ``--steps`` optimizer steps of its phase 1 (global batch 16, so the data is the same for any
number of ranks), ZeRO ``stage``, ``gradient_clipping`` 1.0 or 0 and ``optimizer.trust_ratio``. Rank 0 writes
``<out>/<job>/params.pt`` (fp64 copies of the final weights) and ``<out>/<job>/norms.json``:
``TrainEngine.grad_norm()`` after every step and, at stage 0, the norm of the averaged gradients computed here before
each step.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

import torch

MODEL_INPUTS = ("input_ids", "token_type_ids", "attention_mask", "masked_lm_positions", "masked_lm_ids",
                "next_sentence_label")
TINY_CPU = Path(__file__).resolve().parents[2] / "ds_configs" / "tiny_cpu.json"


def job_recipe(job: str):
    """The tiny_cpu recipe for ``job`` (see the module docstring)."""
    from bert_ds.recipe import Recipe

    stage, clip, trust_ratio = job.split("-")
    data = json.loads(TINY_CPU.read_text())
    data["model_overrides"] = {**data.get("model_overrides", {}), "hidden_dropout_prob": 0.0,
                               "attention_probs_dropout_prob": 0.0}
    data["optimizer"] = {**data["optimizer"], "trust_ratio": trust_ratio}
    data["deepspeed"] = {**data["deepspeed"], "zero_stage": int(stage.removeprefix("z")),
                         "gradient_clipping": {"clip": 1.0, "noclip": 0.0}[clip]}
    data["phases"] = data["phases"][:1]
    return Recipe.from_dict(data, source=f"{TINY_CPU} ({job})")


def run_job(job: str, steps: int, data_dir: Path, vocab: Path, out: Path) -> None:
    from bert_ds.data.index import vocab_sha256
    from bert_ds.data.loader import build_loader
    from bert_ds.runtime.engine import build_engine, build_model

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    recipe = job_recipe(job)
    phase = recipe.phases[0]
    vocab_size = sum(1 for line in vocab.read_text(encoding="utf-8").splitlines() if line)
    model = build_model(recipe, recipe.model_config(vocab_size))
    te = build_engine(recipe, 0, model, world)
    loader = build_loader(data_dir, global_batch_size=phase.global_batch_size, micro_batch_size=phase.micro_batch_size,
                          rank=rank, world_size=world, seed=recipe.seed, num_workers=0,
                          expected_seq_len=phase.seq_len, expected_vocab_sha256=vocab_sha256(vocab),
                          max_predictions=phase.max_predictions)
    batches = iter(loader)
    norms: dict[str, list] = {"grad_norms": [], "independent_norms": []}
    for _ in range(steps):
        for _ in range(te.accumulation):
            batch = next(batches)
            out_ = te.engine(**{k: batch[k] for k in MODEL_INPUTS})
            te.engine.backward(out_.loss)
            if recipe.deepspeed.zero_stage == 0 and te.engine.is_gradient_accumulation_boundary():
                # stage 0: backward has averaged the gradients over ranks; the norm the step must report
                grads = [p.grad.double() for p in te.engine.module.parameters() if p.grad is not None]
                norms["independent_norms"].append(math.sqrt(sum(float((g * g).sum()) for g in grads)))
            te.engine.step()
        norms["grad_norms"].append(te.grad_norm())
    if rank == 0:
        (out / job).mkdir(parents=True, exist_ok=True)
        params = {n: p.detach().double().clone() for n, p in te.engine.module.named_parameters()}
        torch.save(params, out / job / "params.pt")
        (out / job / "norms.json").write_text(json.dumps(norms))
    te.engine.destroy()


def main() -> None:
    import deepspeed

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--jobs", required=True, help="comma-separated job names, run in order")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--data", type=Path, required=True, help="a seq-128 shard set")
    ap.add_argument("--vocab", type=Path, required=True, help="the shard set's vocab.txt")
    args = ap.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    for job in args.jobs.split(","):
        run_job(job, args.steps, args.data, args.vocab, args.out)


if __name__ == "__main__":
    main()
