"""The unpadded encoder (the training default) against the padded one, on real shard batches from the loader with
static and with dynamic masking: same losses, counts and gradients (dropout off), no compute on padding, one host
sync per step."""

from __future__ import annotations

import pytest
import torch

from bert_ds.config import model_preset
from bert_ds.data.batch import MODEL_INPUTS as FIELDS
from bert_ds.data.loader import DynamicMasking, build_loader
from bert_ds.data.tokenizer import read_vocab
from bert_ds.model import BertForPreTraining
from bert_ds.model import unpad as unpad_


def _twins(vocab_size: int, seed: int = 0) -> tuple[BertForPreTraining, BertForPreTraining]:
    config = model_preset("tiny", vocab_size=vocab_size, pad_vocab_to_multiple_of=8)
    torch.manual_seed(seed)
    unpadded = BertForPreTraining(config, kernels="torch")
    with torch.no_grad():  # non-trivial biases and LayerNorm parameters (init makes them 0/1)
        for p in unpadded.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    padded = BertForPreTraining(config, kernels="torch", unpad=False)
    padded.load_state_dict(unpadded.state_dict())
    assert unpadded.unpad and not padded.unpad
    return unpadded.eval(), padded.eval()


def _batches(data_dir, tokenizer_dir, dynamic: bool, count: int = 3) -> list[dict[str, torch.Tensor]]:
    masking = DynamicMasking.from_tokenizer(tokenizer_dir) if dynamic else None
    loader = build_loader(data_dir, global_batch_size=8, micro_batch_size=8, num_workers=0, seed=3,
                          dynamic_masking=masking)
    return [batch for _, batch in zip(range(count), loader, strict=False)]


def _step(model: BertForPreTraining, batch: dict[str, torch.Tensor]) -> tuple[dict, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = model(*(batch[k] for k in FIELDS))
    out.loss.backward()
    values = {k: out[k].detach() for k in ("loss", "mlm_loss", "nsp_loss", "mlm_correct", "mlm_total",
                                           "nsp_correct", "nsp_total")}
    return values, {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("shards, dynamic", [("shards_128", False), ("shards_128", True), ("shards_512", False)],
                         ids=["seq128-static", "seq128-dynamic", "seq512-static"])
def test_unpadded_equals_padded_on_real_batches(request, tokenizer_dir, shards, dynamic):
    data_dir = request.getfixturevalue(shards)
    vocab_size = len(read_vocab(tokenizer_dir / "vocab.txt"))
    unpadded, padded = _twins(vocab_size)
    batches = _batches(data_dir, tokenizer_dir, dynamic)
    fill = sum(int(b["attention_mask"].sum()) for b in batches) / sum(b["attention_mask"].numel() for b in batches)
    assert fill < 0.99, f"these batches hold no padding (fill {fill:.3f}): the test would prove nothing"
    for batch in batches:
        got, got_grads = _step(unpadded, batch)
        want, want_grads = _step(padded, batch)
        for key in ("mlm_correct", "mlm_total", "nsp_correct", "nsp_total"):
            assert int(got[key]) == int(want[key]), key
        for key in ("loss", "mlm_loss", "nsp_loss"):
            torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6, msg=key)
        assert got_grads.keys() == want_grads.keys()
        for name in want_grads:
            torch.testing.assert_close(got_grads[name], want_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_training_mode_with_dropout_runs_and_learns_the_same_function_in_eval(shards_128, tokenizer_dir):
    """Dropout on (the shipped recipes): the unpadded step is finite and back-propagates; switching to eval, both
    layouts again agree on the same weights."""
    vocab_size = len(read_vocab(tokenizer_dir / "vocab.txt"))
    unpadded, padded = _twins(vocab_size, seed=1)
    batch = _batches(shards_128, tokenizer_dir, dynamic=False, count=1)[0]
    unpadded.train()
    out = unpadded(*(batch[k] for k in FIELDS))
    out.loss.backward()
    assert torch.isfinite(out.loss) and all(torch.isfinite(p.grad).all() for p in unpadded.parameters()
                                            if p.grad is not None)
    unpadded.eval()
    with torch.no_grad():
        torch.testing.assert_close(unpadded(*(batch[k] for k in FIELDS)).loss, padded(*(batch[k] for k in FIELDS)).loss,
                                   rtol=1e-5, atol=1e-6)


def test_encoder_computes_only_real_tokens():
    """Every per-token op sees T rows, not B * S: count the rows the first feed-forward layer receives."""
    config = model_preset("tiny", vocab_size=101, pad_vocab_to_multiple_of=8)
    model = BertForPreTraining(config, kernels="torch").eval()
    ids = torch.randint(5, 101, (3, 32))
    mask = torch.zeros(3, 32, dtype=torch.long)
    mask[0, :32], mask[1, :10], mask[2, :5] = 1, 1, 1
    seen = []
    # The feed-forward output projection (intermediate.dense is consumed by the fused bias+GELU, not called).
    model.bert.encoder.layer[0].output.dense.register_forward_hook(lambda m, i, o: seen.append(tuple(i[0].shape)))
    with torch.no_grad():
        model(ids, torch.zeros_like(ids), mask, torch.tensor([[1], [2], [3]]), torch.tensor([[7], [8], [9]]),
              torch.tensor([0, 1, 0]))
    assert seen == [(32 + 10 + 5, config.intermediate_size)]


def test_plan_maps_positions_to_packed_rows_with_holes_in_the_mask():
    """A mask need not be a prefix (e.g. left padding): tokens keep their position ids and their own sequence."""
    mask = torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    counts = unpad_.host_counts(mask, torch.tensor([[5, -100, 6], [-100, -100, -100], [-100, 7, -100]]))
    assert counts == unpad_.HostCounts(seqlens=(2, 4, 0), num_valid=3, width=3)
    assert unpad_.host_counts(mask, torch.tensor([[5, -100, -100]] * 3)).width == 1
    plan = unpad_.plan(mask, counts.seqlens)
    assert (plan.total, plan.max_seqlen, plan.seqlens) == (6, 4, (2, 4, 0))
    assert plan.indices.tolist() == [1, 2, 4, 5, 6, 7]
    assert plan.cu_seqlens.tolist() == [0, 2, 6, 6]
    assert plan.positions().tolist() == [1, 2, 0, 1, 2, 3]
    assert plan.rows_at(torch.tensor([[2, 1], [0, 3], [0, 0]]))[:2].tolist() == [[1, 0], [2, 5]]
    assert plan.gather(torch.arange(12.0).view(3, 4)).tolist() == [1.0, 2.0, 4.0, 5.0, 6.0, 7.0]


def test_one_host_copy_per_forward_and_none_with_counts_from_the_cpu_batch(monkeypatch):
    """The unpadded forward reads the device once (host_counts' tolist), and not at all when the trainer hands it the
    counts it read from the loader's CPU batch; both give the same result."""
    config = model_preset("tiny", vocab_size=101, pad_vocab_to_multiple_of=8)
    model = BertForPreTraining(config, kernels="torch").eval()
    calls = []
    real = unpad_.host_counts
    monkeypatch.setattr(unpad_, "host_counts", lambda *a: calls.append(1) or real(*a))
    ids = torch.randint(5, 101, (2, 16))
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    args = (ids, torch.zeros_like(ids), mask, torch.tensor([[1, 0], [2, 3]]), torch.tensor([[7, -100], [8, 9]]),
            torch.tensor([0, 1]))
    with torch.no_grad():
        first = model(*args)
        assert calls == [1]
        second = model(*args, counts=real(mask, args[4]))
    assert calls == [1]  # the second forward read nothing from the device
    torch.testing.assert_close(second.loss, first.loss, rtol=0, atol=0)
