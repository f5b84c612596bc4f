"""gpu-check's profile: kernel names into categories, idle as the gaps between kernels, a CPU profile of a real step."""

from __future__ import annotations

import pytest
import torch

from bert_ds.devtools.gpu_profile import (
    CATEGORIES,
    Kernel,
    StepWindows,
    category_times,
    classify_kernel,
    idle_time,
    largest_batch,
    own_pieces,
    summarise,
    union_length,
)
from bert_ds.devtools.gpu_rules import profile_rule

# Kernel names as CUDA profiles of PyTorch 2.x on A100/H100 print them (cuBLAS, cuBLASLt nvjet, CUTLASS, flash and
# memory-efficient attention, ATen's elementwise/reduction/LayerNorm kernels, the foreach optimizer, NCCL) and ours.
CUDA_NAMES = {
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_"
    "cublas": "gemm",
    "ampere_bf16_s16816gemm_bf16_128x64_ldg8_f2f_stages_64x4_tn": "gemm",
    "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_32x32_128x1_tn_align8>(cutlass_80_wmma_"
    "tensorop_bf16_s161616gemm_bf16_32x32_128x1_tn_align8::Params)": "gemm",
    "nvjet_hsh_256x128_64x4_2x1_v_bz_coopA_NTT": "gemm",
    "void splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, __nv_bfloat16, true, false, false>"
    "(cublasSplitKParams<float>, float const*, __nv_bfloat16 const*, __nv_bfloat16*, float const*, float const*, "
    "__nv_bfloat16 const*, float*, void*, long, float*, int*)": "gemm",
    "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, false, false, cutlass::bfloat16_t,"
    " Flash_kernel_traits<64, 128, 128, 4, cutlass::bfloat16_t> >, true, false, false, false, true, true, false>"
    "(pytorch_flash::Flash_fwd_params)": "attention",
    "fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<cutlass::bfloat16_t, "
    "cutlass::arch::Sm80, true, 64, 64, 64, true, true>::Params)": "attention",
    "_attn_fwd_kernel": "attention",
    "_varlen_bwd_dkdv_kernel": "attention",
    "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, float>(int, float, "
    "c10::BFloat16 const*, c10::BFloat16 const*, c10::BFloat16 const*, float*, float*, c10::BFloat16*)":
        "norm_elementwise",
    "void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl(at::TensorIteratorBase&, "
    "at::native::GeluType)::{lambda()#2}::operator()() const::{lambda()#4}::operator()() const::"
    "{lambda(c10::BFloat16)#1}, at::detail::Array<char*, 2> >(int, at::native::GeluCUDAKernelImpl(at::"
    "TensorIteratorBase&, at::native::GeluType)::{lambda()#2}::operator()() const::{lambda()#4}::operator()() const::"
    "{lambda(c10::BFloat16)#1}, at::detail::Array<char*, 2>)": "norm_elementwise",
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::func_wrapper_t<float, "
    "at::native::sum_functor<float, float, float>::operator()(at::TensorIterator&)::{lambda(float, float)#1}>, "
    "unsigned int, float, 4, 4> >(at::native::ReduceOp<float, at::native::func_wrapper_t<float, at::native::"
    "sum_functor<float, float, float>::operator()(at::TensorIterator&)::{lambda(float, float)#1}>, unsigned int, "
    "float, 4, 4>)": "norm_elementwise",
    "_layer_norm_fwd_kernel": "norm_elementwise",
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
    "TensorListMetadata<3>, at::native::(anonymous namespace)::BinaryOpListAlphaFunctor<float, 3, 2, 2>, "
    "std::plus<float>, float>(at::native::(anonymous namespace)::TensorListMetadata<3>, ...)": "optimizer",
    "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevComm*, unsigned long, ncclWork*)": "communication",
    "ncclKernel_AllReduce_RING_LL_Sum_float(ncclDevComm*, unsigned long, ncclWork*)": "communication",
    "Memcpy HtoD (Pageable -> Device)": "memory",
    "Memset (Device)": "memory",
}
ATEN_NAMES = {"aten::mm": "gemm", "aten::addmm": "gemm", "aten::bmm": "gemm",
              "aten::_scaled_dot_product_flash_attention_for_cpu": "attention",
              "aten::native_layer_norm": "norm_elementwise", "aten::gelu_backward": "norm_elementwise",
              "aten::native_dropout": "norm_elementwise", "aten::_foreach_mul_": "optimizer", "aten::copy_": "memory",
              "c10d::allreduce_": "communication"}


def test_kernel_names_fall_into_their_categories():
    for name, category in {**CUDA_NAMES, **ATEN_NAMES}.items():
        assert classify_kernel(name) == category, name
    # The optimizer window makes any kernel an optimizer kernel, except communication.
    elementwise = next(n for n, c in CUDA_NAMES.items() if "GeluCUDAKernelImpl" in n)
    assert classify_kernel(elementwise, in_optimizer=True) == "optimizer"
    assert classify_kernel("ncclDevKernel_AllGather_RING_LL(ncclDevComm*)", in_optimizer=True) == "communication"
    assert classify_kernel("someUnknownKernel(int)") == "other"


def test_idle_is_the_window_minus_the_union_of_kernels():
    assert union_length([(0, 2), (1, 3), (5, 6)]) == 4  # overlap counted once
    assert union_length([(0, 10), (2, 3)]) == 10
    assert idle_time([], (0, 10)) == 10
    assert idle_time([(1, 3), (2, 4), (6, 7)], (0, 10)) == 6
    assert idle_time([(-5, 1), (9, 20)], (0, 10)) == 8  # clipped to the window
    # Two streams: kernels overlap, idle is where neither runs.
    assert idle_time([(0, 4), (2, 6), (8, 9)], (0, 10)) == 3


def test_category_times_split_overlaps_and_sum_to_the_window():
    kernels = [Kernel("gemm", 0, 4, "gemm"), Kernel("ew", 2, 6, "norm_elementwise"), Kernel("nccl", 3, 5,
                                                                                            "communication")]
    times = category_times(kernels, (0, 10))
    assert times["gemm"] == pytest.approx(2 + 1 / 2 + 1 / 3)  # alone 0-2, with ew 2-3, three-way 3-4
    assert times["communication"] == pytest.approx(1 / 3 + 1 / 2)
    assert times["idle"] == 4
    assert sum(times.values()) == pytest.approx(10)
    assert set(times) == {*CATEGORIES, "idle"}


def test_own_pieces_cut_an_op_around_the_launching_ops_it_calls():
    # addmm (0-10) calls a view (1-2, launches nothing) that calls copy_ (1.2-1.8), and mm (4-7); a lone add (12-13).
    ops = [("aten::addmm", 0, 10), ("aten::view", 1, 2), ("aten::copy_", 1.2, 1.8), ("aten::mm", 4, 7),
           ("aten::add", 12, 13)]
    pieces = own_pieces(ops, lambda name: name != "aten::view")
    assert sorted(pieces) == sorted([("aten::addmm", 0, 1.2, 1), ("aten::addmm", 1.8, 4, 0), ("aten::addmm", 7, 10, 0),
                                     ("aten::copy_", 1.2, 1.8, 1), ("aten::mm", 4, 7, 1), ("aten::add", 12, 13, 1)])
    # An op wholly covered by what it calls still counts its launch.
    assert ("aten::linear", 5, 5, 1) in own_pieces([("aten::linear", 0, 5), ("aten::mm", 0, 5)], lambda n: True)


def _summary(kernels, steps):
    return summarise(kernels, [StepWindows(*s) for s in steps])


def test_profile_rule_passes_a_closed_profile_and_fails_planted_faults():
    step = ((0, 100), (100, 150))
    kernels = [Kernel("g", 5, 60, "gemm"), Kernel("a", 60, 80, "attention"), Kernel("o", 110, 140, "optimizer")]
    summary = _summary(kernels, [step])
    assert summary["kernels_per_step"] == 3 and summary["ms"]["idle"] == pytest.approx(0.045)  # microseconds in
    assert summary["idle_ms"] == {"fwd_bwd": 0.025, "optimizer": 0.02}
    ok, details = profile_rule(summary)
    assert ok, details
    # Categories that do not sum to the step: a category lost.
    broken = {**summary, "ms": {**summary["ms"], "gemm": 0.0}}
    ok, details = profile_rule(broken)
    assert not ok and "categories sum" in details["reason"]
    # A kernel that escaped its step window (the window did not synchronise): outside time over 1% of the step.
    late = _summary([*kernels, Kernel("late", 150.5, 160, "gemm")], [step])
    ok, details = profile_rule(late)
    assert not ok and "outside the step windows" in details["reason"]
    # No GEMM seen: the profile missed the device's work.
    ok, details = profile_rule(_summary([Kernel("o", 110, 140, "optimizer")], [step]))
    assert not ok and "no kernel" in details["reason"]


def test_largest_batch_doubles_until_out_of_memory_cap_or_time():
    def fits_below(limit, seconds_per_seq=0.001):
        def fits(batch):
            if batch > limit:
                raise torch.OutOfMemoryError("planted")
            return batch * seconds_per_seq
        return fits

    best, tries = largest_batch(fits_below(300), 64, cap=4096, max_step_s=10)
    assert best == 256 and tries[-1] == (512, "out of memory")
    assert largest_batch(fits_below(10**6), 64, cap=1024, max_step_s=10)[0] == 1024  # the cap
    best, tries = largest_batch(fits_below(10**6, seconds_per_seq=0.01), 64, cap=4096, max_step_s=2.0)
    assert best == 256 and len(tries) == 3  # 2.56 s at 256: no doubling past a slow step
    with pytest.raises(RuntimeError, match="does not fit"):
        largest_batch(fits_below(10), 64, cap=4096, max_step_s=10)

    def cublas_out_of_memory(batch):  # what a library allocation failing inside a GEMM raises
        if batch > 100:
            raise RuntimeError("CUDA error: out of memory (cublasCreate)")
        return 0.1

    assert largest_batch(cublas_out_of_memory, 64, cap=4096, max_step_s=10)[0] == 64
    with pytest.raises(RuntimeError, match="planted bug"):  # any other error is not a batch that does not fit
        largest_batch(lambda b: (_ for _ in ()).throw(RuntimeError("planted bug")), 64, cap=4096, max_step_s=10)


def test_a_real_cpu_profile_of_the_tiny_step_accounts_for_its_time():
    from bert_ds.devtools.gpu_check import _tiny_profile

    ok, details = _tiny_profile()
    assert ok, details
    assert sum(details["ms"].values()) == pytest.approx(details["step_ms"], rel=1e-3)
    # The aten ops were classified: GEMMs, LayerNorm/GELU/dropout, SDPA on the CPU, the LAMB step's ops.
    for category in ("gemm", "attention", "norm_elementwise", "optimizer"):
        assert details["ms"][category] > 0, category
    assert details["ms"]["communication"] == 0
    assert details["kernels_per_step_range"][0] == details["kernels_per_step_range"][1] > 0  # same launches each step
    names = {k["name"]: k["category"] for k in details["top_kernels"]}
    assert names.get("aten::mm", "gemm") == "gemm" and any(c == "gemm" for c in names.values())


def test_profile_training_profiles_the_recipe_batch_and_the_largest_that_fits(capsys):
    # The GPU item's code on the CPU: the tiny preset, a cap of 4x the starting batch (no out-of-memory here).
    from bert_ds.config import model_preset
    from bert_ds.devtools.bench_step import BenchStep
    from bert_ds.devtools.gpu_profile import profile_training

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        bench = BenchStep(model_preset("tiny", vocab_size=4000), torch.device("cpu"), torch.float32, "torch")
        ok, details = profile_training(bench, 32, 2, cap=8, max_step_s=60)
    finally:
        torch.set_num_threads(threads)
    assert ok, details
    assert details["search"]["largest"] == 8 and [t[0] for t in details["search"]["tries_fwd_bwd_s"]] == [2, 4, 8]
    assert details["recipe_batch"]["batch"] == 2 and details["largest_batch"]["batch"] == 8
    for key in ("recipe_batch", "largest_batch"):
        assert details[key]["rule_check"]["categories_sum_ms"] == pytest.approx(details[key]["step_ms"], rel=1e-3)
    # gpu-check prints both profiles as tables under the item's line.
    from bert_ds.devtools.gpu_check import PASSED, Item, _print_item

    _print_item(Item("profile.large.s128", PASSED, 1.0, details))
    printed = capsys.readouterr().out
    assert "recipe_batch 2:" in printed and "largest_batch 8:" in printed
    assert printed.count("idle in forward + backward") == 2
