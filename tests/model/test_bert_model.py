"""bert_ds BertForPreTraining against transformers' BertForPreTraining (same weights, fp32, dropout off), plus the
training contract: masked-position gathering, counts, activation checkpointing, feature extraction."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
import transformers

from bert_ds.config import model_preset
from bert_ds.export import hf_config_dict, to_hf_state_dict
from bert_ds.model import BertForPreTraining
from tests.helpers import HANG_GUARD_S


def _perturbed(config, seed: int = 0) -> BertForPreTraining:
    """A bert_ds model whose biases and LayerNorm parameters are non-trivial (init makes them 0/1)."""
    torch.manual_seed(seed)
    model = BertForPreTraining(config, kernels="torch")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model.eval()


def _hf_twin(model: BertForPreTraining) -> transformers.BertForPreTraining:
    hf = transformers.BertForPreTraining(transformers.BertConfig(**hf_config_dict(model.config)))
    hf.load_state_dict(to_hf_state_dict(model.state_dict(), model.config), strict=True)
    return hf.eval()


def _batch(config, batch=3, seq=24, predictions=5, seed=1):
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, config.vocab_size, (batch, seq), generator=gen)
    token_type_ids = (torch.arange(seq) >= seq // 2).long().repeat(batch, 1)
    attention_mask = torch.ones(batch, seq, dtype=torch.long)
    attention_mask[1, seq - 7:] = 0  # padding at the end, as the loader writes it
    attention_mask[-1, seq - 3:] = 0
    positions = torch.stack([torch.randperm(seq - 8, generator=gen)[:predictions] + 1 for _ in range(batch)])
    labels = torch.randint(0, config.vocab_size, (batch, predictions), generator=gen)
    positions[0, -2:], labels[0, -2:] = 0, -100  # padded prediction slots
    positions[-1, -1], labels[-1, -1] = 0, -100
    nsp = torch.tensor([0, 1, 1][:batch])
    return input_ids, token_type_ids, attention_mask, positions, labels, nsp


def _dense_labels(positions, labels, seq):
    dense = torch.full((positions.shape[0], seq), -100)
    for b in range(positions.shape[0]):
        keep = labels[b] != -100
        dense[b, positions[b, keep]] = labels[b, keep]
    return dense


@pytest.mark.parametrize("preset, vocab, pad_to, atol, batch, seq", [
    ("tiny", 101, 16, 1e-5, 3, 24),
    ("base", 30522, 64, 1e-4, 2, 32),
])
def test_matches_transformers(preset, vocab, pad_to, atol, batch, seq):
    config = model_preset(preset, vocab_size=vocab, pad_vocab_to_multiple_of=pad_to)
    model = _perturbed(config)
    hf = _hf_twin(model)
    ids, types, mask, positions, labels, nsp = _batch(config, batch, seq)
    with torch.no_grad():
        mlm_logits, nsp_logits = model.logits(ids, types, mask)
        out = model(ids, types, mask, positions, labels, nsp)
        dense = _dense_labels(positions, labels, seq)
        ref = hf(input_ids=ids, token_type_ids=types, attention_mask=mask, labels=dense, next_sentence_label=nsp)
    assert mlm_logits.shape == (batch, seq, vocab)  # padded vocab rows trimmed
    real = mask.bool()
    assert (mlm_logits[real] - ref.prediction_logits[real]).abs().max() <= atol
    assert (nsp_logits - ref.seq_relationship_logits).abs().max() <= atol
    ref_mlm = F.cross_entropy(ref.prediction_logits.reshape(-1, vocab), dense.reshape(-1))
    assert abs(out.mlm_loss - ref_mlm) <= atol
    assert abs(out.loss - ref.loss) <= atol


def test_loss_and_counts_on_a_hand_checked_case():
    config = model_preset("tiny", vocab_size=50, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = _perturbed(config)
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(3))
    types, mask = torch.zeros_like(ids), torch.ones_like(ids)
    with torch.no_grad():
        mlm_logits, nsp_logits = model.logits(ids, types, mask)
    best = mlm_logits.argmax(-1)
    # Three predictions: (0, 1) right, (0, 3) wrong, (1, 2) right; the rest are padding slots.
    positions = torch.tensor([[1, 3, 0], [2, 0, 0]])
    labels = torch.tensor([[best[0, 1], (best[0, 3] + 1) % 50, -100], [best[1, 2], -100, -100]])
    nsp_best = nsp_logits.argmax(-1)
    nsp_labels = torch.stack([nsp_best[0], 1 - nsp_best[1]])  # first right, second wrong
    with torch.no_grad():
        out = model(ids, types, mask, positions, labels, nsp_labels)
    assert (out.mlm_correct.item(), out.mlm_total.item()) == (2, 3)
    assert (out.nsp_correct.item(), out.nsp_total.item()) == (1, 2)
    assert out.mlm_accuracy.item() == pytest.approx(2 / 3)
    assert out.nsp_accuracy.item() == pytest.approx(1 / 2)
    logp = mlm_logits.log_softmax(-1)
    expected_mlm = -(logp[0, 1, labels[0, 0]] + logp[0, 3, labels[0, 1]] + logp[1, 2, labels[1, 0]]) / 3
    expected_nsp = -(nsp_logits.log_softmax(-1)[[0, 1], nsp_labels]).mean()
    assert out.mlm_loss.item() == pytest.approx(expected_mlm.item(), abs=1e-6)
    assert out.nsp_loss.item() == pytest.approx(expected_nsp.item(), abs=1e-6)
    assert out.loss.item() == pytest.approx((expected_mlm + expected_nsp).item(), abs=1e-6)


def test_mlm_head_runs_only_on_valid_positions():
    config = model_preset("tiny", vocab_size=60)
    model = _perturbed(config)
    ids, types, mask, positions, labels, nsp = _batch(config)
    seen = []
    model.cls.predictions.transform.register_forward_hook(lambda m, args, out: seen.append(args[0].shape))
    with torch.no_grad():
        out = model(ids, types, mask, positions, labels, nsp)
        # What sits in padded slots (position and label -100) cannot change anything.
        positions2 = positions.masked_fill(labels == -100, 5)
        out2 = model(ids, types, mask, positions2, labels, nsp)
    valid = int((labels != -100).sum())
    assert seen == [(valid, config.hidden_size)] * 2
    assert out.mlm_total.item() == valid
    assert torch.equal(out.loss, out2.loss)


def test_without_nsp_labels_and_without_predictions():
    config = model_preset("tiny", vocab_size=60)
    model = _perturbed(config).train()
    ids, types, mask, positions, labels, _ = _batch(config)
    out = model(ids, types, mask, positions, labels)
    assert out.nsp_loss is None and out.nsp_accuracy is None and out.nsp_total.item() == 0
    assert torch.equal(out.loss, out.mlm_loss)
    # A batch without a single prediction: loss 0 (not NaN) and backward still works.
    empty = model(ids, types, mask, torch.zeros_like(positions), torch.full_like(labels, -100))
    assert empty.mlm_loss.item() == 0.0 and empty.mlm_total.item() == 0
    empty.loss.backward()


def test_activation_checkpointing_gives_the_same_grads():
    config = model_preset("tiny", vocab_size=60)  # dropout stays on: the replay must reuse the RNG state
    ids, types, mask, positions, labels, nsp = _batch(config)
    grads = []
    for checkpointing in (False, True):
        model = _perturbed(config).train()
        model.activation_checkpointing = checkpointing
        torch.manual_seed(123)
        model(ids, types, mask, positions, labels, nsp).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-6, atol=1e-7, msg=name)


def test_hidden_states_match_transformers():
    config = model_preset("tiny", vocab_size=60, num_hidden_layers=4)
    model = _perturbed(config)
    hf = _hf_twin(model)
    ids, types, mask, *_ = _batch(config)
    with torch.no_grad():
        features = model.hidden_states(ids, types, mask)  # paper §5.3: concat of the last four layers
        ref = hf(input_ids=ids, token_type_ids=types, attention_mask=mask, output_hidden_states=True).hidden_states
        first = model.hidden_states(ids, types, mask, layers=(0, -1), concat=False)
    assert features.shape == (*ids.shape, 4 * config.hidden_size)
    expected = torch.cat([ref[-1], ref[-2], ref[-3], ref[-4]], dim=-1)
    real = mask.bool()
    assert (features[real] - expected[real]).abs().max() <= 1e-5
    assert (first[0] - ref[0]).abs().max() <= 1e-5
    with pytest.raises(ValueError, match="out of range"):
        model.hidden_states(ids, types, mask, layers=(5,))


def test_init_and_parameter_names():
    config = model_preset("tiny", vocab_size=100, pad_vocab_to_multiple_of=64)
    model = BertForPreTraining(config, kernels="torch")
    hf_names = set(transformers.BertForPreTraining(transformers.BertConfig(**hf_config_dict(config))).state_dict())
    ours = set(model.state_dict())
    assert ours == hf_names - {"cls.predictions.decoder.weight", "cls.predictions.decoder.bias"}
    words = model.bert.embeddings.word_embeddings.weight
    assert words.shape == (128, config.hidden_size)
    assert torch.all(words[100:] == 0)
    assert abs(words[:100].std().item() - 0.02) < 0.002
    assert torch.all(model.bert.encoder.layer[0].output.LayerNorm.weight == 1)
    assert torch.all(model.bert.encoder.layer[0].intermediate.dense.bias == 0)
    with pytest.raises(ValueError, match="kernels"):
        BertForPreTraining(config, kernels="cuda")



_TRITON_CHECK = """
import torch
from bert_ds.config import model_preset
from bert_ds.model import BertForPreTraining
config = model_preset("tiny", vocab_size=50, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
torch.manual_seed(0)
reference, fused = BertForPreTraining(config, kernels="torch"), BertForPreTraining(config, kernels="triton")
with torch.no_grad():
    for p in reference.parameters():
        p.add_(torch.randn_like(p) * 0.02)
fused.load_state_dict(reference.state_dict())
ids = torch.randint(0, 50, (2, 16))
mask = torch.ones_like(ids)
mask[1, 11:] = 0
batch = (ids, (torch.arange(16) >= 8).long().repeat(2, 1), mask, torch.tensor([[1, 4, 0], [2, 9, 0]]),
         torch.tensor([[5, 6, -100], [7, 8, -100]]), torch.tensor([0, 1]))
out_ref, out_fused = reference(*batch), fused(*batch)
out_ref.loss.backward()
out_fused.loss.backward()
assert abs(out_ref.loss.item() - out_fused.loss.item()) <= 1e-5, (out_ref.loss, out_fused.loss)
for (name, p_ref), p_fused in zip(reference.named_parameters(), fused.parameters(), strict=True):
    torch.testing.assert_close(p_fused.grad, p_ref.grad, rtol=1e-4, atol=1e-5, msg=name)
print("ok")
"""


def test_triton_kernels_match_torch_in_the_interpreter():
    """The model wired to the Triton kernels gives the torch twins' loss and grads. The interpreter must be on
    before triton's first import, so this runs in its own process."""
    pytest.importorskip("triton")
    result = subprocess.run([sys.executable, "-c", _TRITON_CHECK], capture_output=True, text=True,
                            timeout=HANG_GUARD_S,
                            env={**os.environ, "TRITON_INTERPRET": "1"})
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]
