"""HF -> bert_ds -> HF is exact; importing refuses directories bert_ds cannot represent."""

from __future__ import annotations

import pytest
import torch
import transformers

from bert_ds.config import model_preset
from bert_ds.export import ExportError, hf_config_dict, load_hf_pretrained, to_hf_state_dict


def _hf_model(vocab_size: int = 77) -> transformers.BertForPreTraining:
    torch.manual_seed(0)
    config = model_preset("tiny", vocab_size=vocab_size)
    hf = transformers.BertForPreTraining(transformers.BertConfig(**hf_config_dict(config)))
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return hf.eval()


@pytest.mark.parametrize("pad_to", [1, 64])
def test_hf_to_bert_ds_to_hf_is_exact(tmp_path, pad_to):
    hf = _hf_model()
    hf.save_pretrained(tmp_path)
    model = load_hf_pretrained(tmp_path, kernels="torch", pad_vocab_to_multiple_of=pad_to)
    assert model.bert.embeddings.word_embeddings.weight.shape[0] == model.config.padded_vocab_size
    back = to_hf_state_dict(model.state_dict(), model.config)
    reference = hf.state_dict()
    assert set(back) == set(reference)
    for name, tensor in reference.items():
        assert torch.equal(back[name], tensor), name
    ids = torch.randint(0, 77, (2, 10))
    with torch.no_grad():
        mlm, nsp = model.eval().logits(ids, torch.zeros_like(ids), torch.ones_like(ids))
        ref = hf(input_ids=ids)
    assert (mlm - ref.prediction_logits).abs().max() <= 1e-5
    assert (nsp - ref.seq_relationship_logits).abs().max() <= 1e-5


def test_config_overrides_on_import(tmp_path):
    _hf_model().save_pretrained(tmp_path)
    model = load_hf_pretrained(tmp_path, hidden_dropout_prob=0.0)
    assert model.config.hidden_dropout_prob == 0.0


def test_refuses_other_architectures(tmp_path):
    gpt2 = tmp_path / "gpt2"
    transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(gpt2)
    with pytest.raises(ExportError, match="model_type='gpt2'"):
        load_hf_pretrained(gpt2)

    # BertForMaskedLM / BertModel layouts load (their absent heads initialised): tests/export/test_init_from_hub.py

    with pytest.raises(ExportError, match="config.json"):
        load_hf_pretrained(tmp_path / "missing")


def test_refuses_an_untied_decoder(tmp_path):
    hf = _hf_model()
    state = hf.state_dict()
    state["cls.predictions.decoder.bias"] = state["cls.predictions.decoder.bias"] + 1.0
    from bert_ds.export import from_hf_state_dict

    with pytest.raises(ExportError, match="decoder.bias differs"):
        from_hf_state_dict({k: v.clone() for k, v in state.items()}, model_preset("tiny", vocab_size=77))
