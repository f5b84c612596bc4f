"""Exact resume with the Triton attention and attention dropout on (interpreter, tiny model).

The trainer seeds torch's RNG before every micro batch from ``DropoutKey`` (seed, phase, step, micro batch); the
attention kernels draw their Philox key from that RNG. So a step's dropout masks depend only on the key: two runs give
bit-identical losses and gradients, and a run restarted at step k from saved weights and optimizer state, with a
scrambled RNG in between (a new process), continues bit for bit as the uninterrupted one. The padded (``unpad=False``)
and the varlen (``unpad=True``) kernels are both run at model level (seconds); one slow test does the same end to end
through ``bert_ds.runtime.pretrain`` with its checkpoints.
"""

from __future__ import annotations

import copy
import importlib

import pytest
import torch

from bert_ds.config import model_preset
from bert_ds.model import BertForPreTraining
from bert_ds.runtime.trainer import DropoutKey

STEPS, RESUME_AT = 2, 1


def _batch(step: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(5, 50, (2, 24), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 17:] = 0  # one padded sequence: partial blocks in both layouts
    segments = (torch.arange(24) >= 12).long().repeat(2, 1)
    positions = torch.tensor([[1, 4, 9], [2, 7, 0]])
    labels = torch.tensor([[5, 6, 7], [8, 9, -100]])
    return ids, segments, mask, positions, labels, torch.tensor([0, 1])


def _model(unpad: bool, attention_dropout: float, init_seed: int = 0, hidden_dropout: float = 0.1):
    config = model_preset("tiny", vocab_size=50, attention_probs_dropout_prob=attention_dropout,
                          hidden_dropout_prob=hidden_dropout)
    torch.manual_seed(init_seed)
    model = BertForPreTraining(config, kernels="triton", unpad=unpad)  # explicit: no silent SDPA fallback
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _step(model, optimizer, step: int, key_seed: int = 7) -> tuple[float, list[torch.Tensor]]:
    torch.manual_seed(DropoutKey(seed=key_seed, phase=0, step=step, rank=0, world_size=1).seed_for(0))  # as train_step
    optimizer.zero_grad()
    out = model(*_batch(step))
    out.loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    optimizer.step()
    return out.loss.item(), grads


def _run(model, optimizer, steps: range, key_seed: int = 7):
    return [_step(model, optimizer, s, key_seed) for s in steps]


@pytest.mark.parametrize("unpad", [False, True], ids=["padded", "varlen"])
def test_same_key_same_steps_and_resume_is_exact(unpad):
    model, optimizer = _model(unpad, 0.1)
    full = _run(model, optimizer, range(STEPS))
    final = [p.detach().clone() for p in model.parameters()]

    # A second run, interrupted after RESUME_AT steps: the same key gives the same steps (every loss and gradient);
    # then state saved, a fresh model (other init) and optimizer restore it, the RNG is left wherever a new process
    # would find it, and the remaining steps re-seed from the key.
    model, optimizer = _model(unpad, 0.1)
    first = _run(model, optimizer, range(RESUME_AT))
    saved = copy.deepcopy((model.state_dict(), optimizer.state_dict()))
    model, optimizer = _model(unpad, 0.1, init_seed=1)
    model.load_state_dict(saved[0])
    optimizer.load_state_dict(saved[1])
    torch.manual_seed(12345)
    resumed = _run(model, optimizer, range(RESUME_AT, STEPS))
    for (loss_a, grads_a), (loss_b, grads_b) in zip(full, first + resumed, strict=True):
        assert loss_a == loss_b
        assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(final, model.parameters(), strict=True))


@pytest.mark.parametrize("unpad", [False, True], ids=["padded", "varlen"])
def test_attention_dropout_is_live_and_follows_the_key(unpad, monkeypatch):
    """The equalities above are not vacuous: the Triton attention (first layer; the last layer's few query rows run
    SDPA) draws a dropout key in each training forward, none without attention dropout, and with hidden dropout off
    attention dropout changes the loss and another key gives another loss."""
    # The package re-exports a function named `attention`, which hides the submodule from `import ... as`.
    padded_module = importlib.import_module("bert_ds.kernels.attention")
    varlen_module = importlib.import_module("bert_ds.kernels.attention_varlen")
    real, draws = padded_module.dropout_seed_tensor, []

    def counted(dropout_p):
        seed = real(dropout_p)
        if dropout_p > 0.0:
            draws.append(tuple(seed.tolist()))
        return seed

    for module in (padded_module, varlen_module):
        monkeypatch.setattr(module, "dropout_seed_tensor", counted)
    with_dropout = _run(*_model(unpad, 0.1, hidden_dropout=0.0), range(1))[0][0]
    assert len(draws) == 1  # one Triton attention call: layer 0
    without = _run(*_model(unpad, 0.0, hidden_dropout=0.0), range(1))[0][0]
    assert len(draws) == 1
    other_key = _run(*_model(unpad, 0.1, hidden_dropout=0.0), range(1), key_seed=8)[0][0]
    assert len(draws) == 2 and draws[0] != draws[1]
    assert with_dropout != without
    assert with_dropout != other_key


@pytest.mark.e2e  # three pretrain processes with every kernel interpreted: ~1 min each on 2 busy CPU cores
def test_pretrain_stop_and_resume_is_exact_with_triton_attention_dropout(tmp_path, monkeypatch):
    """End to end through ``bert_ds.runtime.pretrain`` (real DeepSpeed, ZeRO-2, one CPU rank): recipe kernels
    ``triton`` under the interpreter, hidden and attention dropout 0.1, micro batch 1 of global 2 (accumulation).
    Stopped at step 1 and resumed, the step-2 weights are bit-identical to the uninterrupted run."""
    from bert_ds.data.synthetic import write_synthetic_shards
    from bert_ds.data.tokenizer import vocab_sha256
    from tests.helpers.runs import SMALL_RECIPE, run_pretrain, weights, write_recipe

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # inherited by the pretrain process: Triton kernels on CPU tensors
    (tmp_path / "tokenizer").mkdir()
    vocab = tmp_path / "tokenizer" / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"tok{i}" for i in range(11995)]))
    write_synthetic_shards(tmp_path / "s128", num_samples=64, samples_per_shard=32, seq_len=128, max_predictions=20,
                           vocab_size=12000, seed=1, vocab_sha256=vocab_sha256(vocab), cls_id=2, sep_id=3, mask_id=4)
    recipe = write_recipe(tmp_path / "recipe.json", kernels="triton",
                          model_overrides={"hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1},
                          phases=[dict(SMALL_RECIPE["phases"][0], steps=2, global_batch_size=2)])
    common = ["--recipe", str(recipe), "--data", str(tmp_path / "s128"), "--tokenizer", str(tmp_path / "tokenizer")]
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    run_pretrain([*common, "--output", str(straight)])
    run_pretrain([*common, "--output", str(stopped), "--max-steps", "1"])
    run_pretrain([*common, "--output", str(stopped), "--resume", "auto"])
    got, want = weights(stopped, "phase1-step000002"), weights(straight, "phase1-step000002")
    assert got.keys() == want.keys()
    differ = [name for name in want if not torch.equal(got[name], want[name])]
    assert not differ, f"{len(differ)} of {len(want)} tensors differ after stop/resume, e.g. {differ[:3]}"
