"""The memory model (bert_ds.runtime.memory): saved activations counted once per storage, what the CUDA kernels save,
the exact affine fit on the real model, the ZeRO state per rank, the docs table, and the refusal of a micro batch a
device cannot hold."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from bert_ds.config import model_preset
from bert_ds.errors import BadInput, exit_code_of
from bert_ds.recipe import load_recipe
from bert_ds.runtime import memory
from bert_ds.runtime.memory import (
    GIB,
    GradAccumLayout,
    Headroom,
    SavedTensorCounter,
    activation_fit,
    check_recipe_memory,
    saved_activation_bytes,
    static_bytes_per_rank,
)

REPO = Path(__file__).resolve().parents[2]
LARGE = model_preset("large", vocab_size=30522, pad_vocab_to_multiple_of=64)


def _naive_saved_bytes(fn) -> int:
    """Every saved tensor's own bytes, views and parameters included: what the counter must not do."""
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total


def _toy(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    h = x.exp()  # saves its result h: B x 8 fp32
    s = h.sin()  # saves its input: h again (one storage)
    c = h[:, :4].cos()  # saves a view of h: still h's storage
    return F.linear(s, weight).sum() + c.sum()  # saves s (new) and the weight (a parameter)


def test_the_counter_counts_each_storage_once_and_no_parameter():
    batch = 5
    x = torch.randn(batch, 8, requires_grad=True)
    weight = torch.nn.Parameter(torch.randn(3, 8))
    counter = SavedTensorCounter(exclude=[weight])
    with counter.counting():
        _toy(x, weight)
    assert counter.total == 2 * batch * 8 * 4  # h and s, by construction
    # The fault the counter avoids: counting views and saves of one storage again, and the parameter.
    naive = _naive_saved_bytes(lambda: _toy(x, weight))
    assert naive == (3 * batch * 8 + batch * 4 + 3 * 8) * 4 != counter.total
    with_weight = SavedTensorCounter()
    with with_weight.counting():
        _toy(x, weight)
    assert with_weight.total == counter.total + 3 * 8 * 4


def test_dropout_and_attention_count_what_the_cuda_kernels_save():
    x = torch.randn(6, 10, requires_grad=True)
    cuda, cpu = SavedTensorCounter(), SavedTensorCounter(cuda_saves=False)
    for counter in (cuda, cpu):
        with counter.counting():
            F.dropout(x, 0.1, True)
    assert cuda.total == 60  # native_dropout's bool mask: 1 byte per element
    assert cpu.total == 60 * 4  # the CPU composite keeps a mask in x's dtype
    assert F.dropout is not cuda._dropout  # the functions are restored after counting

    q = torch.randn(2, 3, 5, 16, requires_grad=True)
    k = torch.randn(2, 3, 7, 16, requires_grad=True)
    counter = SavedTensorCounter()
    with counter.counting():
        F.scaled_dot_product_attention(q, k, k, dropout_p=0.1)
    # q and k (v is k's storage), the output (q's shape) and an fp32 log-sum-exp per query row and head.
    assert counter.total == (2 * q.numel() + k.numel()) * 4 + 4 * 2 * 3 * 5
    cpu = SavedTensorCounter(cuda_saves=False)
    with cpu.counting():
        F.scaled_dot_product_attention(q, k, k, dropout_p=0.1)
    assert cpu.total > counter.total  # the CPU math path keeps the probabilities


def test_meta_counts_what_a_cpu_forward_saves():
    """The meta device (no arithmetic) saves the same storages as a CPU forward of the same model, except LayerNorm's
    mean and rstd, which the CPU kernel keeps in bf16 and the meta kernel (as CUDA) in fp32: 2 x 2 bytes more per
    normalised row, counted here row by row."""
    config = model_preset("tiny", vocab_size=30522, num_hidden_layers=2)
    seq, predictions = 64, 10
    for batch in (1, 2):
        on_meta = saved_activation_bytes(config, batch, seq, predictions, "bf16", device="meta")
        on_cpu = saved_activation_bytes(config, batch, seq, predictions, "bf16", device="cpu")
        tokens, queries = batch * seq, batch * (1 + predictions)
        # embeddings LN; two per full layer; two in the last layer on its query rows; the MLM head's transform LN
        rows = tokens + 2 * tokens * (config.num_hidden_layers - 1) + 2 * queries + batch * predictions
        assert on_meta - on_cpu == rows * 2 * (4 - 2)


def test_bert_large_saves_34_bytes_per_hidden_unit_per_token_and_layer():
    """Per encoder layer and token the CUDA path saves 34 x hidden bytes in bf16 (Korthikanti et al. 2022, Table 2,
    without the s^2 attention terms: FlashAttention keeps none), plus the attention's fp32 log-sum-exp per head and
    LayerNorm's fp32 mean and rstd twice. Counted by hand: the layer input 2h (shared by Q, K, V), q, k, v 6h, attention
    output 2h, dropout mask h, LN input 2h, FFN input 2h, GELU input 8h, GELU output 8h, dropout mask h, LN input 2h.
    The fit is exact (checked at a third batch size and layer count), and linear in layers."""
    for seq, predictions in ((128, 20), (512, 80)):
        fit = activation_fit(LARGE, seq, predictions, layer_counts=(2, 3, 4), batch_sizes=(1, 2, 3))
        per_layer_sequence = (fit.measured[3, 2] - fit.measured[3, 1]) - (fit.measured[2, 2] - fit.measured[2, 1])
        h, heads = LARGE.hidden_size, LARGE.num_attention_heads
        assert per_layer_sequence == seq * (34 * h + 4 * heads + 2 * 2 * 4)
        assert fit.bytes(3) == fit.fixed + 3 * fit.per_sequence
        assert 0 <= fit.fixed < 1024  # cu_seqlens' extra entry: nothing else is independent of the batch
        # Extrapolated to 24 layers: within the 24 layers' own count (per_layer_sequence * 24) plus the embeddings,
        # the last layer and the heads, which are less than one more layer.
        assert 24 * per_layer_sequence < fit.per_sequence < 25 * per_layer_sequence


def test_a_fit_that_is_not_affine_is_refused():
    assert memory._exact_line([(1, 10), (2, 20), (3, 30)], "x") == (10, 0)
    with pytest.raises(ArithmeticError, match="not affine in x"):
        memory._exact_line([(1, 10), (2, 20), (3, 31)], "x")


def test_static_state_per_rank_under_zero_1_and_2():
    n, world = 1000, 4
    z1 = static_bytes_per_rank(n, world, 1, "bf16", reduce_bucket_size=100, overlap_comm=True)
    assert (z1.weights, z1.gradients, z1.grad_accum, z1.master, z1.optimizer, z1.buckets) == (
        2 * n, 2 * n, 4 * n // world, 4 * n // world, 8 * n // world, 2 * 100 * 2)
    z2 = static_bytes_per_rank(n, world, 2, "bf16", reduce_bucket_size=100, overlap_comm=False)
    assert (z2.gradients, z2.buckets) == (2 * n // world, 2 * 100)  # stage 2 partitions the gradients too
    full = static_bytes_per_rank(n, world, 2, "bf16", GradAccumLayout("fp32", partitioned=False))
    assert full.grad_accum == 4 * n
    assert static_bytes_per_rank(n, world, 2, "bf16", GradAccumLayout(None)).grad_accum == 0
    fp32 = static_bytes_per_rank(n, world, 2, "fp32")
    assert (fp32.weights, fp32.grad_accum) == (4 * n, 0)  # fp32 gradients are their own fp32 buffer
    zero0 = static_bytes_per_rank(n, world, 0, "fp32")
    assert (zero0.master, zero0.optimizer, zero0.buckets) == (0, 8 * n, 0)  # no partition, no copy, no buckets
    with pytest.raises(ValueError, match="zero_stage=3"):
        static_bytes_per_rank(n, world, 3)


def test_a_recipes_gradient_sums_decide_the_gradient_buffer():
    # bf16 ZeRO-1 summing in fp32 keeps a whole-model fp32 buffer; ZeRO-2 (and bf16 sums) an fp32 partition; fp32
    # sums are reduced in fp32.
    assert memory.recipe_grad_accum(1, "fp32", "bf16") == GradAccumLayout("fp32", False, fp32_reduction=True)
    assert memory.recipe_grad_accum(2, "fp32", "bf16") == GradAccumLayout("fp32", True, fp32_reduction=True)
    assert memory.recipe_grad_accum(1, "bf16", "bf16") == memory.FP32_PARTITION
    # DeepSpeed's buckets: fp32 under ZeRO-1 fp32 sums; ZeRO-2 reducing in fp32 adds one fp32 copy of a bucket.
    n, bucket = 1000, 100
    plain = static_bytes_per_rank(n, 4, 2, "bf16", reduce_bucket_size=bucket, overlap_comm=True).buckets
    zero2 = static_bytes_per_rank(n, 4, 2, "bf16", memory.recipe_grad_accum(2, "fp32", "bf16"), bucket, True).buckets
    zero1 = static_bytes_per_rank(n, 4, 1, "bf16", memory.recipe_grad_accum(1, "fp32", "bf16"), bucket, True).buckets
    assert (plain, zero2, zero1) == (2 * bucket * 2, 2 * bucket * 2 + 4 * bucket, 4 * bucket * 2)
    recipe = load_recipe(REPO / "ds_configs" / "bert_large.json")
    zero1 = dataclasses.replace(recipe, deepspeed=dataclasses.replace(recipe.deepspeed, zero_stage=1))
    config = dataclasses.replace(recipe.model_config(30522), num_hidden_layers=2)
    small = memory.phase_estimate(zero1, 0, config, 8, "bf16")
    assert small.static.grad_accum == 4 * memory.parameter_count(config)


def test_the_largest_micro_batch_is_the_last_that_fits():
    recipe = load_recipe(REPO / "ds_configs" / "bert_large.json")
    config = recipe.model_config(30522)
    headroom = Headroom()
    card = 80 * 10**9
    base = memory.phase_estimate(recipe, 0, config, 8, "bf16")
    largest = base.largest_micro_batch(card, headroom)
    at = [dataclasses.replace(base, micro_batch=m).total for m in (largest, largest + 1)]
    assert at[0] <= headroom.usable(card) < at[1]


def test_refusal_names_the_phase_its_micro_batch_and_the_numbers():
    recipe = load_recipe(REPO / "ds_configs" / "bert_large.json")
    recipe.phases[1].micro_batch_size = 64  # phase 2 now needs more than phase 1
    config = recipe.model_config(30522)
    need = [memory.phase_estimate(recipe, p, config, 8, "bf16").total for p in (0, 1)]
    assert need[0] < need[1]
    headroom = Headroom()
    # A device that holds phase 1 but not phase 2 (bytes chosen so that usable() lands between the two).
    device = int((need[0] + need[1]) / 2 + headroom.fixed_gib * GIB) * 10 // 9 + 1
    assert need[0] <= headroom.usable(device) < need[1]
    lines = check_recipe_memory(recipe, [0], config, 8, "bf16", device)
    assert len(lines) == 1 and lines[0].startswith("phases[0]: large seq 128, micro batch 64") and "fits" in lines[0]
    with pytest.raises(BadInput) as caught:
        check_recipe_memory(recipe, [0, 1], config, 8, "bf16", device)
    message = str(caught.value)
    assert message.startswith("phases[1].micro_batch_size=64: expected ")
    assert f"{need[1] / GIB:.1f} GiB per GPU at seq 512" in message and f"{device / GIB:.1f} GiB" in message
    assert int(exit_code_of(caught.value)) == 2
    largest = int(re.search(r"the largest micro batch that fits is (\d+)", message).group(1))
    assert 16 <= largest < 64
    cpu = check_recipe_memory(recipe, [0, 1], config, 8, "bf16", None)  # CPU: stated, never refused
    assert all("not checked against a device (no CUDA)" in line for line in cpu)


def test_the_docs_hold_the_memory_table_as_printed():
    from bert_ds.devtools.memory_table import gpu_recipe_estimates, memory_table, static_table

    table = memory_table(gpu_recipe_estimates(world_size=8))
    docs = (REPO / "docs" / "recipes.md").read_text()
    assert table in docs and static_table(8) in docs
    names = {r.name for r in map(load_recipe, (REPO / "ds_configs").glob("*.json")) if r.model != "tiny"}
    assert {line.split(" | ")[0].lstrip("| ") for line in table.splitlines()[2:]} == names


def test_the_h100_measurement_against_the_estimate_as_docs_state_it():
    """docs/recipes.md compares the model with the one GPU measurement (gpu-check on an H100, BERT-large bf16, fp32
    masters + LAMB, no ZeRO, 1 GPU): its ratios, and the torch twins' extra memory, which the model predicts to the
    report's rounding (two figures rounded to 0.01 GiB: at most 0.01 apart)."""
    import json

    report = json.loads((REPO / "docs" / "measurements" / "gpu_check_h100_2026-11-27.json").read_text())
    docs = " ".join((REPO / "docs" / "recipes.md").read_text().split())  # prose: line breaks are spaces
    for item, (seq, predictions) in zip(report["items"][:2], ((128, 20), (512, 80)), strict=True):
        runs = item["details"]
        assert (runs["auto"]["seq"], runs["auto"]["batch"]) == (seq, 64 if seq == 128 else 16)
        batch, measured = runs["auto"]["batch"], runs["auto"]["max_memory_gib"]
        estimate = memory.memory_per_gpu(LARGE, seq, predictions, batch, world_size=1, zero_stage=0, dtype="bf16")
        grads = estimate.static.gradients + estimate.static.grad_accum
        assert f"{measured:.2f} GiB" in docs and f"says {estimate.total / GIB:.1f} GiB for both" in docs
        assert f"measured / estimate = {measured * GIB / estimate.total:.2f}" in docs
        assert f"gradients ({grads / GIB:.2f} GiB)" in docs
        assert f"it says {(estimate.total - grads) / GIB:.1f} GiB (measured / estimate = " \
               f"{measured * GIB / (estimate.total - grads):.2f})" in docs
        twins = memory.activation_fit(LARGE, seq, predictions, kernels="torch").per_sequence
        extra = (twins - activation_fit(LARGE, seq, predictions).per_sequence) * batch / GIB
        assert abs(extra - (runs["torch"]["max_memory_gib"] - measured)) <= 0.01 + 1e-9
    short = (memory.activation_fit(LARGE, 128, 20, kernels="torch").per_sequence
             - activation_fit(LARGE, 128, 20).per_sequence)
    assert f"keeps {short / 1e6:.1f} MB more per sequence of 128" in docs


def test_the_estimate_leaves_the_runs_fallback_warning_to_the_run():
    """Tracing the model for the estimate resolves kernels as on CUDA (fp32 attention falls back to the twin, with a
    warning once per process); that once must still be the run's."""
    import warnings

    from bert_ds.kernels import registry

    key = "test-memory-held"
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with registry.fallback_warnings_held():
            registry.warn_fallback_once(key, "held")
    assert seen == []
    with pytest.warns(RuntimeWarning, match="the run's"):
        registry.warn_fallback_once(key, "the run's")
    with warnings.catch_warnings(record=True) as again:  # the fault held back: a remembered key never warns again
        warnings.simplefilter("always")
        registry.warn_fallback_once(key, "the run's")
    assert again == []
    config = model_preset("tiny", vocab_size=1000, num_hidden_layers=2)
    before = set(registry._warned)
    with warnings.catch_warnings(record=True) as traced:
        warnings.simplefilter("always")
        saved_activation_bytes(config, 1, 32, 5, "fp32")  # fp32 attention: the twin, as on CUDA
    assert [w for w in traced if issubclass(w.category, RuntimeWarning)] == []
    assert registry._warned == before


# ---- fits kept between starts ---------------------------------------------------------------------------------------

def test_a_kept_fit_is_read_back_and_a_code_change_or_a_bad_file_measures_again(tmp_path, monkeypatch):
    tiny = model_preset("tiny", vocab_size=300)
    monkeypatch.setattr(memory, "_FITS", {})
    activation_fit(tiny, 32, 5, "fp32")
    assert not list(tmp_path.iterdir())  # off unless asked: nothing kept
    monkeypatch.setattr(memory, "_FITS", {})
    with memory.fits_kept_in(tmp_path):
        measured = activation_fit(tiny, 32, 5, "fp32")
    (kept,) = tmp_path.glob("fit-*.json")

    measures = []
    real_fit = memory._fit
    monkeypatch.setattr(memory, "_fit", lambda *a: measures.append(a) or real_fit(*a))

    def fit(predictions: int = 5):
        monkeypatch.setattr(memory, "_FITS", {})
        with memory.fits_kept_in(tmp_path):
            return activation_fit(tiny, 32, predictions, "fp32")

    assert fit() == measured and measures == []  # read, not measured
    fit(6)  # other arguments: another fit
    assert len(measures) == 1 and len(list(tmp_path.glob("fit-*.json"))) == 2
    kept.write_text('{"key": "something else", "per_sequence": 1, "fixed": 2, "measured": []}')
    assert fit() == measured and len(measures) == 2  # not its key: measured again
    assert fit() == measured and len(measures) == 2  # and kept again
    kept.write_bytes(b"\x00 not JSON")
    assert fit() == measured and len(measures) == 3 and json.loads(kept.read_text())["key"]
    monkeypatch.setattr(memory, "_code_digest", lambda: "the model's code changed")
    assert fit() == measured and len(measures) == 4
    assert memory._FIT_DIR == []  # the block ended: this process keeps nothing more


def test_pre_flight_keeps_fits_in_the_users_cache(tmp_path):
    from bert_ds.runtime.preflight import fit_cache_dir

    assert fit_cache_dir({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "bert_ds" / "memory_fits"
    assert fit_cache_dir({}) == Path.home() / ".cache" / "bert_ds" / "memory_fits"
