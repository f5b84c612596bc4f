"""The Triton kernels as ``torch.library`` custom ops (interpreter): ``torch.compile`` holds each as one graph node
(``fullgraph=True`` fails on any break), the compiled forward and backward equal the eager ones bit for bit (for the
attentions with dropout on: the Philox key is drawn from torch's generator as an op input, and ``aot_eager`` runs
that draw as eager does), and the ops' fake and autograd registrations pass ``torch.library.opcheck``."""

from __future__ import annotations

import importlib

import pytest
import torch

from bert_ds import kernels

# The package re-exports functions named like the submodules.
attention_mod = importlib.import_module("bert_ds.kernels.attention")
bias_gelu_mod = importlib.import_module("bert_ds.kernels.bias_gelu")
layer_norm_mod = importlib.import_module("bert_ds.kernels.layer_norm")
varlen_mod = importlib.import_module("bert_ds.kernels.attention_varlen")

LENGTHS, HEADS, HEAD_DIM = [37, 64, 5, 20], 2, 32


def _varlen_inputs(dtype: torch.dtype):
    gen = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(sum(LENGTHS), HEADS, HEAD_DIM, generator=gen).to(dtype) for _ in range(4))
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    return (q, k, v), do, cu


def _padded_inputs(dtype: torch.dtype):
    gen = torch.Generator().manual_seed(1)
    q, k, v, do = (torch.randn(3, HEADS, 48, HEAD_DIM, generator=gen).to(dtype) for _ in range(4))
    mask = torch.arange(48)[None, :] < torch.tensor([48, 30, 7])[:, None]
    return (q, k, v), do, mask


def _step(fn, inputs, do, seed: int) -> list[torch.Tensor]:
    leaves = [t.clone().requires_grad_() for t in inputs]
    torch.manual_seed(seed)  # the trainer's DropoutKey seeding before a micro batch
    out = fn(*leaves)
    out.backward(do)
    return [out.detach(), *(t.grad for t in leaves)]


@pytest.mark.parametrize("kind", ["varlen", "padded"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_compiled_attention_is_one_graph_and_equals_eager(kind, dtype):
    if kind == "varlen":
        inputs, do, cu = _varlen_inputs(dtype)

        def fn(q, k, v):
            return kernels.varlen_attention(q, k, v, cu, max(LENGTHS), 0.2, backend="triton")
    else:
        inputs, do, mask = _padded_inputs(dtype)

        def fn(q, k, v):
            return kernels.attention(q, k, v, mask, 0.2, backend="triton")

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True, dynamic=True)
    eager, graph = _step(fn, inputs, do, seed=5), _step(compiled, inputs, do, seed=5)
    assert all(torch.equal(a, b) for a, b in zip(eager, graph, strict=True))
    other_key = _step(compiled, inputs, do, seed=6)  # not vacuous: the key reaches the kernels
    assert not torch.equal(other_key[0], eager[0])


def test_custom_ops_pass_opcheck():
    """Schema, fake tensors (shapes without running a kernel) and the autograd registration, by torch's own checker,
    with and without dropout and key-padding mask."""
    gen = torch.Generator().manual_seed(4)
    seed = torch.tensor([123, 456])
    cu = torch.tensor([0, 5, 14], dtype=torch.int32)  # small shapes: opcheck runs each op many times, interpreted
    for p in (0.0, 0.2):
        q, k, v = (torch.randn(14, 1, 16, generator=gen, requires_grad=True) for _ in range(3))
        torch.library.opcheck(varlen_mod._varlen_fwd, (q, k, v, cu, 9, p, seed))
    mask = (torch.arange(12)[None, :] < torch.tensor([12, 7])[:, None]).to(torch.int8)
    for m in (mask, None):
        q, k, v = (torch.randn(2, 1, 12, 16, generator=gen, requires_grad=True) for _ in range(3))
        torch.library.opcheck(attention_mod._attention_fwd, (q, k, v, m, 0.2, seed))


@pytest.mark.parametrize("op", ["layer_norm", "bias_gelu"])
def test_compiled_layer_norm_and_bias_gelu_are_graph_nodes_equal_to_eager(op):
    gen = torch.Generator().manual_seed(2)
    x, residual, do = (torch.randn(37, 64, generator=gen) for _ in range(3))
    weight, bias = 1 + 0.1 * torch.randn(64, generator=gen), 0.1 * torch.randn(64, generator=gen)
    if op == "layer_norm":
        def fn(x, residual, weight, bias):
            return kernels.layer_norm(x, weight, bias, 1e-12, residual, backend="triton")
        inputs = (x, residual, weight, bias)
    else:
        def fn(x, bias):
            return kernels.bias_gelu(x, bias, backend="triton")
        inputs = (x, bias)
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True, dynamic=True)
    eager, graph = _step(fn, inputs, do, seed=0), _step(compiled, inputs, do, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(eager, graph, strict=True))


def test_layer_norm_and_bias_gelu_ops_pass_opcheck():
    gen = torch.Generator().manual_seed(3)
    x, residual = (torch.randn(9, 32, generator=gen, requires_grad=True) for _ in range(2))
    weight, bias = (torch.randn(32, generator=gen, requires_grad=True) for _ in range(2))
    for res in (residual, None):
        torch.library.opcheck(layer_norm_mod._layer_norm_fwd, (x, weight, bias, res, 1e-5))
    torch.library.opcheck(bias_gelu_mod._bias_gelu_fwd, (x, bias))


@pytest.mark.parametrize("last", [False, True], ids=["layer", "last_layer"])
def test_a_training_layer_with_every_triton_kernel_is_one_graph(last):
    """kernels 'triton' (LayerNorm, bias-GELU and varlen attention in Triton; the last layer's query rows run SDPA):
    torch._dynamo.explain over a training layer, dropout 0.1, unpadded: one graph, no break."""
    from bert_ds.config import model_preset
    from bert_ds.model import BertForPreTraining
    from bert_ds.model.unpad import plan

    config = model_preset("tiny", vocab_size=300, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    torch.manual_seed(0)
    model = BertForPreTraining(config, kernels="triton").train()
    mask = (torch.arange(40)[None, :] < torch.tensor([40, 17, 29])[:, None]).long()
    unpadding = plan(mask, (40, 17, 29))
    x = torch.randn(unpadding.total, config.hidden_size, requires_grad=True)
    rows = unpadding.rows_at(torch.tensor([[0, 3, 9], [0, 1, 16], [0, 28, 5]])) if last else None
    layer = model.bert.encoder.layer[-1 if last else 0]
    explained = torch._dynamo.explain(layer)(x, mask.bool(), rows, unpadding)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


def test_the_constant_mark_is_the_one_torch_sets():
    """``jit.constant_for_dynamo`` stands in for ``torch.compiler.assume_constant_result`` (which would import dynamo
    with the model): on this torch both mark a function the same way, and dynamo folds the marked knob reads of a
    compiled kernel call (the test above compiles with ``fullgraph=True``)."""
    from bert_ds.kernels import jit

    def ours():
        return True

    def theirs():
        return True

    assert jit.constant_for_dynamo(ours) is ours and torch.compiler.assume_constant_result(theirs) is theirs
    assert vars(ours) == vars(theirs) == {"_dynamo_marked_constant": True}
    assert vars(jit.interpreter_enabled).get("_dynamo_marked_constant") is True
    assert vars(jit.recording).get("_dynamo_marked_constant") is True
