"""``torch.compile`` for the encoder: each layer compiled in place, parameter names unchanged.

:func:`compile_model` calls ``module.compile()`` on every encoder layer (torchtitan compiles per transformer block
too): the layers keep their names, so state dicts, checkpoints and the Hugging Face export are the eager model's,
where wrapping the model in ``torch.compile`` would add an ``_orig_mod.`` prefix. The layers share one code object,
so all of them reuse one graph. The packed token count T and the per-sequence lengths change every batch; with
``dynamic=True`` they are symbolic from the first compile, so a new batch reuses the graph instead of compiling per
step (the graph's guards still split it by layer kind, training/eval and micro batch size: a handful per phase,
:data:`COMPILE_BOUND_PER_PHASE`). The Triton attentions are ``torch.library`` custom ops (:mod:`bert_ds.kernels`),
so a layer is one graph. Dropout in a compiled graph comes from inductor's own generator, seeded from torch's at
each call: as reproducible as eager under the trainer's per-micro-batch ``torch.manual_seed``, but with other masks
than the eager model draws (docs/recipes.md).
"""

from __future__ import annotations

import torch
import torch.fx.experimental._config
from torch import nn

__all__ = ["COMPILE_BOUND_PER_PHASE", "compile_model", "compiled_graphs"]

COMPILE_BOUND_PER_PHASE = 6
"""Graphs a phase may compile: a layer and the last layer (its few query rows) in training, and in evaluation the
padded forward of the finite-logits probe and the unpadded forward of the eval set, each of the two also per
layer kind. ``tests/model/test_compile.py`` holds a run of varying batches to it."""

# torch.compile's cache holds 8 graphs per code object by default (``recompile_limit``), and every module compiled
# with ``module.compile()`` shares ``nn.Module._call_impl``'s: two phases of graphs must fit, with room to spare.
_RECOMPILE_LIMIT = 4 * COMPILE_BOUND_PER_PHASE


def compile_model(model: nn.Module, backend: str = "inductor") -> nn.Module:
    """Compile each encoder layer of ``model`` (a ``BertForPreTraining`` or ``BertModel``) in place; returns it.
    ``backend``: torch.compile's (``eager`` traces and guards as ``inductor`` does, without code generation)."""
    encoder = model.bert.encoder if hasattr(model, "bert") else model.encoder
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, _RECOMPILE_LIMIT)
    # Duck shaping gives dims of equal value one symbol: a batch of exactly hidden_size tokens would tie T to the
    # hidden size, which the weights fix, and compile a static graph (one more compile per layer kind).
    torch.fx.experimental._config.use_duck_shape = False
    for layer in encoder.layer:
        layer.compile(backend=backend, dynamic=True)
    return model


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process so far (its ``unique_graphs`` counter, torch 2.13)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
