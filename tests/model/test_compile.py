"""``compile: true`` at model level (:mod:`bert_ds.model.compile`): a training layer is one graph, batches of
changing lengths do not recompile per step, parameter names survive, and (slow tier, inductor) a compiled step is
reproducible under the trainer's seeding while drawing other dropout masks than the eager model."""

from __future__ import annotations

import random

import pytest
import torch

from bert_ds.config import model_preset
from bert_ds.kernels import jit, registry
from bert_ds.model import BertForPreTraining
from bert_ds.model.compile import COMPILE_BOUND_PER_PHASE, compile_model, compiled_graphs
from bert_ds.model.unpad import plan

SEQ, PREDICTIONS = 64, 8


@pytest.fixture(autouse=True)
def _restore_compiler_settings():
    """compile_model sets two process-wide compiler settings; other tests in this worker get them back."""
    import torch.fx.experimental._config as fx_config

    saved = torch._dynamo.config.recompile_limit, fx_config.use_duck_shape
    yield
    torch._dynamo.config.recompile_limit, fx_config.use_duck_shape = saved


def _model(seed: int = 0, dropout: float = 0.1) -> BertForPreTraining:
    config = model_preset("tiny", vocab_size=300, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    torch.manual_seed(seed)
    return BertForPreTraining(config, kernels="torch").train()


def _batch(rng: random.Random, size: int = 3) -> tuple[torch.Tensor, ...]:
    """A padded batch whose rows have random real lengths (>= 2 + PREDICTIONS), masked positions among them."""
    lengths = [rng.randint(PREDICTIONS + 2, SEQ) for _ in range(size)]
    mask = (torch.arange(SEQ)[None, :] < torch.tensor(lengths)[:, None]).long()
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    ids = torch.randint(5, 300, (size, SEQ), generator=gen) * mask
    positions = torch.stack([torch.randperm(n - 2, generator=gen)[:PREDICTIONS] + 1 for n in lengths])
    labels = torch.randint(5, 300, (size, PREDICTIONS), generator=gen)
    labels[:, -1] = -100  # a padding slot in every row
    return ids, (torch.arange(SEQ) >= SEQ // 2).long().expand(size, -1) * mask, mask, positions, labels, \
        torch.randint(0, 2, (size,), generator=gen)


def _layer_inputs(model: BertForPreTraining, rng: random.Random):
    ids, segments, mask, positions, *_ = _batch(rng)
    unpadding = plan(mask, tuple(mask.sum(1).tolist()))
    x = model.bert.embeddings(ids, segments, unpadding).detach().requires_grad_()
    return x, mask.bool(), unpadding, unpadding.rows_at(positions)


@pytest.mark.parametrize("last", [False, True], ids=["layer", "last_layer"])
def test_a_training_layer_is_one_graph(last):
    """torch._dynamo.explain over an encoder layer's training forward (dropout 0.1, unpadded, as the trainer runs it;
    the last layer with the heads' query rows): one graph, no break."""
    model = _model()
    x, key_mask, unpadding, rows = _layer_inputs(model, random.Random(0))
    layer = model.bert.encoder.layer[-1 if last else 0]
    explained = torch._dynamo.explain(layer)(x, key_mask, rows if last else None, unpadding)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


def test_the_graph_break_check_catches_a_break(monkeypatch):
    """Planted: the backend registry's recording flag read from its ContextVar without
    ``torch.compiler.assume_constant_result`` (how it was before) breaks the layer's graph, and the check sees it."""
    monkeypatch.setattr(registry, "recording", lambda: jit._RECORDING.get() is not None)
    model = _model()
    x, key_mask, unpadding, _ = _layer_inputs(model, random.Random(0))
    explained = torch._dynamo.explain(model.bert.encoder.layer[0])(x, key_mask, None, unpadding)
    assert explained.graph_break_count > 0


def _train_and_evaluate(model: BertForPreTraining, batches: int, seed: int = 1) -> None:
    """What a phase does to the model: training steps on batches of changing lengths, then an evaluation forward and
    the trainer's finite-logits probe (a padded forward)."""
    rng = random.Random(seed)
    for step in range(batches):
        torch.manual_seed(step)
        model(*_batch(rng)).loss.backward()
    model.eval()
    with torch.no_grad():
        model(*_batch(rng))
        ids = torch.arange(32)[None, :] % 300
        model.logits(ids, torch.zeros_like(ids), torch.ones_like(ids))
    model.train()


@pytest.mark.slow  # dynamo traces every graph kind (the eager backend generates no code): ~30 s
def test_batches_of_changing_lengths_compile_a_bounded_number_of_graphs():
    """12 training batches, each with other row lengths (so another packed-token count T), then evaluation: the
    layers compile at most COMPILE_BOUND_PER_PHASE graphs, not one per batch (dynamo's guards and recompiles are the
    same under the ``eager`` backend as under inductor, which only generates the code)."""
    torch._dynamo.reset()
    model = compile_model(_model(), backend="eager")
    before = compiled_graphs()
    _train_and_evaluate(model, batches=12)
    graphs = compiled_graphs() - before
    assert 0 < graphs <= COMPILE_BOUND_PER_PHASE


@pytest.mark.slow  # a dozen graphs traced: ~50 s
def test_the_compile_bound_catches_a_recompile_per_batch():
    """Planted: layers compiled with static shapes recompile for every new T, past the bound."""
    torch._dynamo.reset()
    model = _model()
    compile_model(model, backend="eager")
    for layer in model.bert.encoder.layer:
        layer.compile(backend="eager", dynamic=False)
    before = compiled_graphs()
    _train_and_evaluate(model, batches=12)
    assert compiled_graphs() - before > COMPILE_BOUND_PER_PHASE


def test_compiled_model_keeps_parameter_names():
    """Checkpoints and the Hugging Face export read the state dict: a compiled model's keys are the eager model's
    (``torch.compile(model)`` would prefix ``_orig_mod.``)."""
    eager, compiled = _model(), compile_model(_model(), backend="eager")
    assert list(compiled.state_dict()) == list(eager.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(compiled.state_dict().values(), eager.state_dict().values(),
                                                  strict=True))


def _loss_and_grads(model: BertForPreTraining, batch, seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad()
    torch.manual_seed(seed)  # as the trainer's DropoutKey before each micro batch
    out = model(*batch)
    out.loss.backward()
    return out.loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.slow  # inductor generates and compiles C++ for the layer's forward and backward: minutes on 2 cores
def test_inductor_step_is_reproducible_and_draws_its_own_masks(compile_cache_env, monkeypatch):
    """Compiled with inductor: the same seed gives the same loss and gradients bit for bit (so a resumed run
    reproduces the masks); dropout off, the compiled step equals the eager one to fp32 rounding; dropout on, it draws
    other masks than eager (the documented difference: compiled runs resume against compiled runs)."""
    for name, value in compile_cache_env.items():
        monkeypatch.setenv(name, value)
    torch._dynamo.reset()
    batch = _batch(random.Random(3))
    for dropout in (0.1, 0.0):
        eager, compiled = _model(dropout=dropout), compile_model(_model(dropout=dropout))
        first, again = _loss_and_grads(compiled, batch, seed=5), _loss_and_grads(compiled, batch, seed=5)
        assert torch.equal(first[0], again[0])
        assert all(torch.equal(a, b) for a, b in zip(first[1], again[1], strict=True))
        reference = _loss_and_grads(eager, batch, seed=5)
        if dropout:
            assert not torch.equal(first[0], reference[0])
        else:
            torch.testing.assert_close(first[0], reference[0], rtol=1e-5, atol=1e-6)
            for a, b in zip(first[1], reference[1], strict=True):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
