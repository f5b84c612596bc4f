"""Where a training step's time goes: torch.profiler over :class:`~bert_ds.devtools.bench_step.BenchStep`.

Each profiled step is two marked windows, forward + backward and the optimizer, each ending in a device
synchronisation, so every kernel of a step runs inside its window. The device's kernels (on CUDA: kernel, memcpy and
memset activities; on the CPU: the leaf aten ops that would launch a kernel, :mod:`.launch_count`) are sorted into
:data:`CATEGORIES` by name (:func:`classify_kernel`; the optimizer window makes a kernel ``optimizer`` whatever its
name). A step's wall time is split exactly: where k kernels overlap, each category gets 1/k of the overlap
(:func:`category_times`), and the time no kernel covers is ``idle`` (:func:`idle_time`): a CPU-bound step (launch
overhead, host syncs) shows up there. The categories plus idle sum to the step's wall time.

The micro batch is profiled at the recipe's size and at the largest that fits (:func:`largest_batch`: doubling until
out of memory, a cap, or a step slower than a time bound).
"""

from __future__ import annotations

import gc
import re
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from bert_ds.devtools.launch_count import aten_name_launches_kernel

__all__ = ["CATEGORIES", "Kernel", "StepWindows", "category_times", "classify_kernel", "format_profile", "idle_time",
           "largest_batch", "own_pieces", "profile_steps", "profile_training", "summarise", "union_length"]

CATEGORIES = ("gemm", "attention", "norm_elementwise", "optimizer", "communication", "memory", "other")
"""Where device time goes; ``idle`` (no kernel running) is reported beside them."""

# Order matters: the first matching pattern wins (fmha_cutlass is attention, not a GEMM; nccl before anything).
_PATTERNS: tuple[tuple[str, re.Pattern], ...] = tuple((cat, re.compile(p, re.IGNORECASE)) for cat, p in (
    ("communication", r"nccl|c10d::|all_?reduce|all_?gather|reduce_?scatter|broadcast_|gloo"),
    ("optimizer", r"multi_tensor_apply|_foreach_|lamb(?!da)|adam"),  # not "lambda" (every elementwise kernel)
    ("attention", r"flash|fmha|attn|attention|_varlen_(fwd|bwd)|scaled_dot_product"),
    ("gemm", r"gemm|xmma|cutlass|nvjet|cublas|s16816|s1688|wgmma|splitkreduce|aten::(mm|addmm|bmm|baddbmm|addbmm|"
             r"matmul|linear|_addmm_activation)$"),
    ("memory", r"^memcpy|^memset|aten::(copy_|_to_copy|fill_|zero_|zeros|ones|full|clone|cat|index_copy|"
               r"_local_scalar_dense)$"),
    ("norm_elementwise", r"elementwise|vectorized|unrolled|reduce_kernel|layer_?norm|gelu|dropout|bernoulli|"
                         r"softmax|fused_|triton_|_kernel$|^aten::"),
))


def classify_kernel(name: str, in_optimizer: bool = False) -> str:
    """The category of a kernel (CUDA kernel name, memcpy/memset, Triton function, or CPU aten op name).
    ``in_optimizer``: it ran in the optimizer window, so it is ``optimizer`` unless it is communication."""
    for category, pattern in _PATTERNS:
        if category == "optimizer" and in_optimizer:
            return category
        if pattern.search(name):
            return category
    return "optimizer" if in_optimizer else "other"


def union_length(intervals: Sequence[tuple[float, float]]) -> float:
    """Total length covered by the (start, end) intervals (overlaps counted once)."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def idle_time(intervals: Sequence[tuple[float, float]], window: tuple[float, float]) -> float:
    """Time in ``window`` not covered by any interval (intervals clipped to the window)."""
    lo, hi = window
    clipped = [(max(s, lo), min(e, hi)) for s, e in intervals if e > lo and s < hi]
    return (hi - lo) - union_length(clipped)


@dataclass(frozen=True)
class Kernel:
    """One device activity: name, start and end (microseconds, the profiler's clock) and category; ``launches`` is
    0 for the later pieces of a CPU op split around the ops it called (counted once)."""

    name: str
    start: float
    end: float
    category: str
    launches: int = 1


def category_times(kernels: Sequence[Kernel], window: tuple[float, float]) -> dict[str, float]:
    """Time per category inside ``window`` plus ``idle``: a stretch where k kernels run gives each 1/k, so the
    values sum to the window's length exactly."""
    lo, hi = window
    edges = []
    for k in kernels:
        s, e = max(k.start, lo), min(k.end, hi)
        if e > s:
            edges += [(s, 1, k.category), (e, -1, k.category)]
    edges.sort(key=lambda x: (x[0], x[1]))
    out = dict.fromkeys(CATEGORIES, 0.0)
    active: Counter = Counter()
    last = lo
    for t, delta, category in edges:
        running = sum(active.values())
        if running and t > last:
            for c, n in active.items():
                out[c] += (t - last) * n / running
        last = t
        active[category] += delta
        if not active[category]:
            del active[category]
    out["idle"] = idle_time([(k.start, k.end) for k in kernels], window)
    return out


@dataclass(frozen=True)
class StepWindows:
    """One profiled step: its forward + backward and optimizer windows (profiler clock, microseconds)."""

    fwd_bwd: tuple[float, float]
    optimizer: tuple[float, float]


def summarise(kernels: Sequence[Kernel], steps: Sequence[StepWindows], top: int = 10) -> dict:
    """Per-step means over ``steps``: wall ms, ms per category and idle (each window's idle apart), kernels per
    step, the kernel time that fell outside every window, and the ``top`` kernels by time."""
    n = len(steps)
    ms: dict[str, float] = defaultdict(float)
    idle = {"fwd_bwd": 0.0, "optimizer": 0.0}
    counts, inside, by_name = [], 0.0, Counter()
    for step in steps:
        seen = 0
        for phase in ("fwd_bwd", "optimizer"):
            window = getattr(step, phase)
            mine = [k for k in kernels if window[0] <= k.start < window[1]]
            seen += sum(k.launches for k in mine)
            for category, t in category_times(mine, window).items():
                ms[category] += t / 1e3 / n
            idle[phase] += idle_time([(k.start, k.end) for k in mine], window) / 1e3 / n
            for k in mine:
                by_name[(k.name[:90], k.category)] += (min(k.end, window[1]) - k.start) / 1e3 / n
                inside += min(k.end, window[1]) - k.start
        counts.append(seen)
    total = sum(k.end - k.start for k in kernels)
    wall = sum((s.fwd_bwd[1] - s.fwd_bwd[0]) + (s.optimizer[1] - s.optimizer[0]) for s in steps) / 1e3 / n
    return {"steps": n, "step_ms": round(wall, 3),
            "fwd_bwd_ms": round(sum(s.fwd_bwd[1] - s.fwd_bwd[0] for s in steps) / 1e3 / n, 3),
            "optimizer_ms": round(sum(s.optimizer[1] - s.optimizer[0] for s in steps) / 1e3 / n, 3),
            "ms": {c: round(ms[c], 3) for c in (*CATEGORIES, "idle")},
            "fraction": {c: round(ms[c] / wall, 4) if wall else 0.0 for c in (*CATEGORIES, "idle")},
            "idle_ms": {k: round(v, 3) for k, v in idle.items()},
            "kernels_per_step": round(sum(counts) / n, 1) if n else 0,
            "kernels_per_step_range": [min(counts, default=0), max(counts, default=0)],
            "kernel_ms_outside_steps": round((total - inside) / 1e3, 3),
            "top_kernels": [{"name": name, "category": cat, "ms_per_step": round(t, 3)}
                            for (name, cat), t in by_name.most_common(top)]}


def own_pieces(ops: Sequence[tuple[str, float, float]], counts: Callable[[str], bool]) -> list[tuple]:
    """CPU ops of one thread, (name, start, end), nested by time: for each op that ``counts``, the pieces of its time
    not inside a counted op it called (at any depth, through ops that do not count, such as views): the time it
    computes itself. Returns (name, start, end, launches) with launches 1 on an op's first piece, 0 on the rest."""
    holes: dict[int, list] = {}
    stack: list[int] = []  # indices of open ops, outermost first
    order = sorted(range(len(ops)), key=lambda i: (ops[i][1], -ops[i][2]))
    for i in order:
        name, start, end = ops[i]
        while stack and ops[stack[-1]][2] <= start:
            stack.pop()
        if counts(name):
            parent = next((j for j in reversed(stack) if counts(ops[j][0])), None)
            if parent is not None:
                holes[parent].append((start, end))
            holes[i] = []
        stack.append(i)
    out = []
    for i in order:
        if i not in holes:
            continue
        name, at, end = ops[i]
        first = 1
        for s, t in sorted(holes[i]) + [(end, end)]:
            if s > at:
                out.append((name, at, s, first))
                first = 0
            at = max(at, t)
        if first:  # wholly inside the ops it called: still one launch, no time of its own
            out.append((name, end, end, 1))
    return out


def _device_kernels(events, device: torch.device, markers: set[str]) -> list[tuple[str, float, float, int]]:
    """(name, start, end, launches) in microseconds from torch's raw profiler events: CUDA kernels, copies and sets;
    on the CPU the aten ops that would launch a kernel, each cut around the launching ops it called
    (:func:`own_pieces`)."""
    if device.type == "cuda":
        return [(e.name(), e.start_ns() / 1e3, e.end_ns() / 1e3, 1) for e in events
                if e.device_type() == torch.autograd.DeviceType.CUDA and "annotation" not in e.activity_type()
                and e.name() not in markers]
    threads: dict[int, list] = defaultdict(list)
    for e in events:
        if e.device_type() == torch.autograd.DeviceType.CPU and e.name().startswith("aten::"):
            threads[e.start_thread_id()].append((e.name(), e.start_ns() / 1e3, e.end_ns() / 1e3))
    return [k for ops in threads.values() for k in own_pieces(ops, aten_name_launches_kernel)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_steps(forward_backward: Callable[[], object], optimizer_step: Callable[[], object], device: torch.device,
                  steps: int = 3, warmup: int = 2) -> dict:
    """Profile ``steps`` training steps after ``warmup`` unprofiled ones: :func:`summarise` of the device's work."""
    from torch.profiler import ProfilerActivity, profile, record_function

    markers = {"bert_ds.fwd_bwd", "bert_ds.optimizer"}

    def step() -> None:
        with record_function("bert_ds.fwd_bwd"):
            forward_backward()
            _sync(device)
        with record_function("bert_ds.optimizer"):
            optimizer_step()
            _sync(device)

    for _ in range(warmup):
        step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
    profiled_s = time.perf_counter() - start
    events = prof.profiler.kineto_results.events()  # raw: building torch's event tree takes seconds per 100k events
    windows = sorted((e.start_ns() / 1e3, e.end_ns() / 1e3, e.name()) for e in events
                     if e.name() in markers and e.device_type() == torch.autograd.DeviceType.CPU)
    fwd = [(s, e) for s, e, name in windows if name == "bert_ds.fwd_bwd"]
    opt = [(s, e) for s, e, name in windows if name == "bert_ds.optimizer"]
    kernels = []
    for name, s, e, launches in _device_kernels(events, device, markers):
        in_opt = any(lo <= s < hi for lo, hi in opt)
        kernels.append(Kernel(name, s, e, classify_kernel(name, in_opt), launches))
    summary = summarise(kernels, [StepWindows(f, o) for f, o in zip(fwd, opt, strict=True)])
    summary["profiled_wall_s"] = round(profiled_s, 3)
    return summary


def largest_batch(fits: Callable[[int], float], start: int, cap: int, max_step_s: float) -> tuple[int, list]:
    """The largest of start, 2 start, 4 start, ... <= ``cap`` for which ``fits(batch)`` (one forward + backward,
    its seconds) does not run out of memory; doubling also stops after a step slower than ``max_step_s`` (the next
    would take twice as long). Returns the batch and the tries [(batch, seconds or "out of memory")]."""
    best, tries, batch = None, [], start
    while batch <= cap:
        try:
            seconds = fits(batch)
        except RuntimeError as exc:  # torch.OutOfMemoryError, or a library's "out of memory" / cuBLAS ALLOC_FAILED
            if not isinstance(exc, torch.OutOfMemoryError) and not any(
                    sign in str(exc) for sign in ("out of memory", "CUBLAS_STATUS_ALLOC_FAILED")):
                raise
            tries.append((batch, "out of memory"))
            break
        tries.append((batch, round(seconds, 3)))
        best = batch
        if seconds > max_step_s:
            break
        batch *= 2
    if best is None:
        raise RuntimeError(f"the starting micro batch {start} does not fit: {tries}")
    return best, tries


def _release(bench) -> None:
    """Drop the model's and the fp32 masters' gradients (a step that ran out of memory leaves both) and hand the
    cached blocks back to the device."""
    bench.model.zero_grad(set_to_none=True)
    bench.optimizer.zero_grad(set_to_none=True)
    if bench.device.type == "cuda":
        torch.cuda.empty_cache()


def profile_training(bench, seq: int, batch: int, cap: int, max_step_s: float = 2.0) -> tuple[bool, dict]:
    """Profile ``bench`` (:class:`~bert_ds.devtools.bench_step.BenchStep`) at ``seq`` x ``batch`` and at the largest
    micro batch that fits (:func:`largest_batch`, probing with two whole steps and timing the second's forward +
    backward); both profiles judged by :func:`~bert_ds.devtools.gpu_rules.profile_rule`."""
    from bert_ds.devtools.bench_step import predictions_for, synthetic_batch
    from bert_ds.devtools.gpu_rules import profile_rule

    device = bench.device

    def data(b: int) -> dict:
        return synthetic_batch(bench.config, b, seq, predictions_for(seq), device)

    def profile_at(b: int) -> dict:
        batch_data = data(b)
        summary = profile_steps(lambda: bench.forward_backward(batch_data), bench.optimizer_step, device)
        return {"batch": b, "seq_per_s_profiled": round(1e3 * b / summary["fwd_bwd_ms"], 2), **summary}

    def fits(b: int) -> float:
        batch_data = data(b)
        try:
            for _ in range(2):
                _sync(device)
                start = time.perf_counter()
                bench.forward_backward(batch_data)
                _sync(device)
                seconds = time.perf_counter() - start
                bench.optimizer_step()
            return seconds
        finally:
            del batch_data
            _release(bench)

    profiles = {"recipe_batch": profile_at(batch)}
    largest, tries = largest_batch(fits, batch, cap, max_step_s)
    if device.type == "cuda":  # the failed try's tensors died with its exception: hand their blocks back
        gc.collect()
        torch.cuda.empty_cache()
    while largest > batch:
        try:
            profiles["largest_batch"] = profile_at(largest)
            break
        except torch.OutOfMemoryError:  # fits() ran at this size: the profiler's own buffers tipped it over
            tries.append((largest, "out of memory while profiled"))
            largest //= 2
            if device.type == "cuda":
                torch.cuda.empty_cache()
    details = {"search": {"cap": cap, "max_step_s": max_step_s, "largest": largest,
                          "tries_fwd_bwd_s": [list(t) for t in tries],
                          "seq_per_s": {b: round(b / t, 2) for b, t in tries if isinstance(t, float)}}}
    ok, reasons = True, []
    for key, summary in profiles.items():
        good, verdict = profile_rule(summary)
        details[key] = {**summary, "rule_check": verdict}
        ok = ok and good
        reasons += [f"{key}: {verdict['reason']}"] if not good else []
    if reasons:
        details["reason"] = "; ".join(reasons)
    return ok, details


def format_profile(name: str, summary: dict) -> str:
    """One table row per category (ms per step and share of the step), then idle by window and the launches."""
    lines = [f"{name}: {summary['step_ms']:.1f} ms per step (forward + backward {summary['fwd_bwd_ms']:.1f}, "
             f"optimizer {summary['optimizer_ms']:.1f}), {summary['kernels_per_step']:.0f} kernels per step"]
    for category in (*CATEGORIES, "idle"):
        share = 100 * summary["fraction"][category]
        lines.append(f"    {category:18} {summary['ms'][category]:9.2f} ms  {share:5.1f} %")
    lines.append(f"    idle in forward + backward {summary['idle_ms']['fwd_bwd']:.2f} ms, in the optimizer "
                 f"{summary['idle_ms']['optimizer']:.2f} ms")
    return "\n".join(lines)
