"""Measure what exact sharded LAMB costs: launches and CPU time of one step, the per-tensor norm reduction, and ZeRO-2
state bytes per rank.

    python tools/bench_lamb.py state-bytes                 # arithmetic from ZeRO's partition layout, 1/2/4 ranks
    python tools/bench_lamb.py overhead --preset tiny      # 2 CPU ranks (gloo), real DeepSpeed ZeRO-2
    python tools/bench_lamb.py overhead --preset base --steps 5
    python tools/bench_lamb.py launches --preset large     # one process: launches and CPU ms of one step vs AdamW

``overhead`` times ``ZeroAwareLamb.step`` as called by ZeRO (summed over its per-group calls) against the same
step with one trust ratio per rank slice (the naive flat LAMB: same elementwise work, no segment norms, no
all-reduce), and times the two pieces the exact version adds in isolation: the segment sums of w^2 and u^2 over
the rank's partition and the all-reduce of the (2, n_tensors + 1) norm buffer. The model has BERT's parameter
shapes (Hugging Face names, decoder tied); its loss is a cheap function of the params since only the optimizer
step is timed.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from bert_ds.config import BertConfig, model_preset
from bert_ds.optim import ZeroAwareLamb, bind_optimizer, param_groups
from bert_ds.optim.lamb import segment_sq_norms


def bert_param_shapes(cfg: BertConfig) -> list[tuple[str, tuple[int, ...]]]:
    """Trainable parameters of BertForPreTraining (decoder weight tied to the word embeddings, so listed once)."""
    h, i, v = cfg.hidden_size, cfg.intermediate_size, cfg.padded_vocab_size
    shapes = [("bert.embeddings.word_embeddings.weight", (v, h)),
              ("bert.embeddings.position_embeddings.weight", (cfg.max_position_embeddings, h)),
              ("bert.embeddings.token_type_embeddings.weight", (cfg.type_vocab_size, h)),
              ("bert.embeddings.LayerNorm.weight", (h,)), ("bert.embeddings.LayerNorm.bias", (h,))]
    for n in range(cfg.num_hidden_layers):
        p = f"bert.encoder.layer.{n}"
        for name in ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense"):
            shapes += [(f"{p}.{name}.weight", (h, h)), (f"{p}.{name}.bias", (h,))]
        shapes += [(f"{p}.attention.output.LayerNorm.weight", (h,)), (f"{p}.attention.output.LayerNorm.bias", (h,)),
                   (f"{p}.intermediate.dense.weight", (i, h)), (f"{p}.intermediate.dense.bias", (i,)),
                   (f"{p}.output.dense.weight", (h, i)), (f"{p}.output.dense.bias", (h,)),
                   (f"{p}.output.LayerNorm.weight", (h,)), (f"{p}.output.LayerNorm.bias", (h,))]
    shapes += [("bert.pooler.dense.weight", (h, h)), ("bert.pooler.dense.bias", (h,)),
               ("cls.predictions.transform.dense.weight", (h, h)), ("cls.predictions.transform.dense.bias", (h,)),
               ("cls.predictions.transform.LayerNorm.weight", (h,)), ("cls.predictions.transform.LayerNorm.bias", (h,)),
               ("cls.predictions.bias", (v,)), ("cls.seq_relationship.weight", (2, h)),
               ("cls.seq_relationship.bias", (2,))]
    return shapes


def _is_no_decay(name: str, shape: tuple[int, ...]) -> bool:
    return name.endswith("bias") or "LayerNorm.weight" in name or len(shape) <= 1


def zero2_partition_numels(shapes: list[tuple[str, tuple[int, ...]]], world_size: int) -> list[int]:
    """This rank's flat fp32 partition size per param group, as ``stage_1_and_2.py`` lays it out (fp32 params,
    ``parameter_alignment`` off, the default): each group padded to a multiple of 2 * world_size, cut in equal parts."""
    groups = [[s for n, s in shapes if not _is_no_decay(n, s)], [s for n, s in shapes if _is_no_decay(n, s)]]
    sizes = []
    for group in groups:
        numel = sum(math.prod(s) for s in group)
        alignment = 2 * world_size  # nccl_start_alignment_factor * world size
        sizes.append(math.ceil(numel / alignment) * alignment // world_size)
    return sizes


def state_bytes(presets: list[str], world_sizes: list[int]) -> None:
    print("ZeRO-2, fp32 master weights, ZeroAwareLamb state (exp_avg + exp_avg_sq; step is a scalar per group)")
    print(f"{'preset':>6} {'params':>12} {'ranks':>5} {'partition elems':>16} {'moments MiB':>12} "
          f"{'fp32 master MiB':>16} {'opt total MiB':>14}")
    for preset in presets:
        shapes = bert_param_shapes(model_preset(preset))
        n_params = sum(math.prod(s) for _, s in shapes)
        for ws in world_sizes:
            elems = sum(zero2_partition_numels(shapes, ws))
            moments, master = 8 * elems, 4 * elems
            print(f"{preset:>6} {n_params:>12,} {ws:>5} {elems:>16,} {moments / 2**20:>12.1f} {master / 2**20:>16.1f} "
                  f"{(moments + master) / 2**20:>14.1f}")


class ShapesModel(nn.Module):
    def __init__(self, shapes: list[tuple[str, tuple[int, ...]]]) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        for name, shape in shapes:  # module-free names: "." is not allowed in attribute names
            self.register_parameter(name.replace(".", "__"), nn.Parameter(0.02 * torch.randn(shape, generator=gen)))

    def forward(self) -> torch.Tensor:
        return sum((p * p).sum() for p in self.parameters()) * 1e-4


class FlatSliceLamb(ZeroAwareLamb):
    """Baseline: the same update with one trust ratio per rank slice (no segment norms, no all-reduce)."""

    @torch.no_grad()
    def _zero_step(self) -> None:
        for group in self.param_groups:
            p = group["params"][0]
            state = self.state[p]
            self._begin_step([p], [state], group)
            u = self._moments_and_updates([p], [p.grad], [state], group)[0]
            ratio = self._trust_ratios(np.array([float(p.norm())]), np.array([float(u.norm())]), group)[0]
            p.add_(u.mul_(float(ratio)), alpha=-group["lr"])


def _median_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def _timed_steps(engine, opt, steps: int, dist) -> tuple[float, float]:
    """Median ms of ``engine.step`` and of the optimizer's ``step`` calls inside it, over ``steps`` steps after one
    that allocates the moments."""
    step_times: list[float] = []
    inner = opt.step

    def timed_step(*a, **k):
        t = time.perf_counter()
        out = inner(*a, **k)
        step_times.append(time.perf_counter() - t)
        return out

    opt.step = timed_step  # ZeRO calls self.optimizer.step() once per group
    per_step, engine_step = [], []
    for s in range(steps + 1):
        engine.backward(engine())
        step_times.clear()
        dist.barrier()
        t = time.perf_counter()
        engine.step()
        if s:  # the first step allocates the moments
            engine_step.append(time.perf_counter() - t)
            per_step.append(sum(step_times))
    return 1e3 * statistics.median(engine_step), 1e3 * statistics.median(per_step)


def _isolated_pieces(opt: ZeroAwareLamb, shapes, world: int, dist) -> dict:
    """The two pieces exact LAMB adds, timed alone on the rank's partition; checks the partition arithmetic."""
    layout = opt.zero_layout
    expected = zero2_partition_numels(shapes, world)
    actual = [lay.flat.numel() for lay in layout.groups]
    assert actual == expected, f"partition layout arithmetic {expected} != DeepSpeed {actual}"
    buf = torch.zeros(2, layout.n_tensors + 1)

    def norms():  # w and u: two passes per group
        for lay in layout.groups:
            segment_sq_norms(lay.flat, lay.lengths)
            segment_sq_norms(lay.flat, lay.lengths)

    dist.barrier()
    pieces = {"segment_norms": _median_ms(norms, 20)}
    dist.barrier()
    pieces["all_reduce"] = _median_ms(lambda: dist.all_reduce(buf), 50)
    return pieces | {"n_tensors": layout.n_tensors, "partition_elems": sum(actual)}


def _print_overhead(results: dict, preset: str, world: int, steps: int) -> None:
    exact, flat = results["ZeroAwareLamb"], results["FlatSliceLamb"]
    print(f"preset={preset} ranks={world} tensors={results['n_tensors']} "
          f"partition elems/rank={results['partition_elems']:,} steps={steps} (median ms per engine step)")
    exact_e, flat_e = results["ZeroAwareLamb_engine"], results["FlatSliceLamb_engine"]
    print(f"  engine.step, exact per-tensor LAMB    : {exact_e:9.2f} ms")
    print(f"  engine.step, flat-slice LAMB          : {flat_e:9.2f} ms   (difference {exact_e - flat_e:+.2f} ms)")
    print(f"  optimizer.step calls, exact           : {exact:9.2f} ms   (includes waiting for the other rank)")
    print(f"  optimizer.step calls, flat-slice      : {flat:9.2f} ms   (difference {exact - flat:+.2f} ms)")
    print(f"  isolated: segment sums of w^2, u^2    : {results['segment_norms']:9.2f} ms")
    print(f"  isolated: all-reduce of norm buffer   : {results['all_reduce']:9.3f} ms "
          f"({2 * (results['n_tensors'] + 1) * 4} bytes)")


def overhead_rank(preset: str, steps: int) -> None:
    import deepspeed
    import deepspeed.comm as dist

    from bert_ds.runtime.distributed import join_gloo_group

    join_gloo_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    shapes = bert_param_shapes(model_preset(preset))
    results = {}
    for cls in (ZeroAwareLamb, FlatSliceLamb):
        model = ShapesModel(shapes)
        opt = cls(param_groups(model, 0.01), lr=1e-3)
        config = {"train_batch_size": world, "train_micro_batch_size_per_gpu": 1, "gradient_clipping": 1.0,
                  "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
        bind_optimizer(engine)
        results[cls.__name__ + "_engine"], results[cls.__name__] = _timed_steps(engine, opt, steps, dist)
        if cls is ZeroAwareLamb:
            results.update(_isolated_pieces(opt, shapes, world, dist))
        del engine, opt, model
    if rank == 0:
        _print_overhead(results, preset, world, steps)


def launches(preset: str, scale: int, trust_ratio: str, repeats: int) -> None:
    """One optimizer step over BERT's tensors in this process: launches counted on the CPU and CPU time, for
    ZeroAwareLamb and torch's foreach AdamW, at stage 0 and on the one-rank ZeRO flat-partition path (with ZeRO's
    two bit16 copies)."""
    import gc

    from bert_ds.devtools.benchmarks.optimizer_step import (
        bert_groups,
        flat_groups,
        measure_step,
        one_rank_zero_map,
        zero_lamb,
        zero_step,
    )

    def lamb_stage0():
        return ZeroAwareLamb(bert_groups(preset, scale), lr=1e-3, trust_ratio=trust_ratio), lambda o: o.step()

    def lamb_zero():
        opt, zmap = zero_lamb(bert_groups(preset, scale), trust_ratio=trust_ratio)
        return opt, lambda o: zero_step(o, zmap)

    def adamw():
        return torch.optim.AdamW(bert_groups(preset, scale), lr=1e-3, foreach=True), lambda o: o.step()

    def adamw_zero():
        groups = bert_groups(preset, scale)
        zmap = one_rank_zero_map(groups)
        return torch.optim.AdamW(flat_groups(zmap, groups), lr=1e-3, foreach=True), lambda o: zero_step(o, zmap)

    n = sum(len(g["params"]) for g in bert_groups(preset, max(scale, 64)))
    print(f"preset={preset} scale=1/{scale} tensors={n} trust_ratio={trust_ratio} threads={torch.get_num_threads()} "
          f"(one steady-state step; ms: median of {repeats})")
    print(f"{'optimizer':<38} {'launches':>8} {'ops':>6} {'reads':>6} {'ms':>9}")
    for name, build in (("ZeroAwareLamb, stage 0", lamb_stage0), ("torch AdamW(foreach=True), stage 0", adamw),
                        ("ZeroAwareLamb, ZeRO 1/2 path, 1 rank", lamb_zero),
                        ("torch AdamW(foreach=True), ZeRO path", adamw_zero)):
        opt, step = build()
        r = measure_step(opt, step, repeats)
        print(f"{name:<38} {r['launches']:>8} {r['ops']:>6} {r['reads']:>6} {r['ms']:>9.1f}")
        del opt, step
        gc.collect()


MODULE = "bert_ds.devtools.benchmarks.lamb"
REPO = Path(__file__).resolve().parents[3]
RANK_ENV = "BERT_DS_BENCH_LAMB_RANK"
"""Set in the environment of the ranks ``overhead`` starts (this module again): they time, the parent only waits."""


def overhead(preset: str, steps: int, world_size: int) -> None:
    from bert_ds.runtime.distributed import free_port

    port = free_port()
    procs = []
    for rank in range(world_size):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
                   PYTHONPATH=str(REPO), **{RANK_ENV: "1"})
        procs.append(subprocess.Popen([sys.executable, "-m", MODULE, "overhead", f"--preset={preset}",
                                       f"--steps={steps}"], env=env, stdout=None if rank == 0 else subprocess.DEVNULL))
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"ranks exited with {codes}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sb = sub.add_parser("state-bytes", help="ZeRO-2 optimizer state bytes per rank")
    sb.add_argument("--presets", default="tiny,base")
    sb.add_argument("--world-sizes", default="1,2,4")
    p = sub.add_parser("overhead", help="time the per-tensor norm reduction on CPU ranks")
    p.add_argument("--preset", default="tiny", choices=["tiny", "base", "large"])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--world-size", type=int, default=2)
    lc = sub.add_parser("launches", help="launches (counted on the CPU) and CPU time of one optimizer step")
    lc.add_argument("--preset", default="large", choices=["tiny", "base", "large"])
    lc.add_argument("--scale", type=int, default=1, help="divide every dimension by this (the launches do not change)")
    lc.add_argument("--trust-ratio", default="decay_only", choices=["all", "decay_only"])
    lc.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    if args.cmd == "launches":
        launches(args.preset, args.scale, args.trust_ratio, args.repeats)
    elif args.cmd == "state-bytes":
        state_bytes(args.presets.split(","), [int(w) for w in args.world_sizes.split(",")])
    elif os.environ.get(RANK_ENV):  # one of the ranks `overhead` starts
        overhead_rank(args.preset, args.steps)
    else:
        overhead(args.preset, args.steps, args.world_size)


if __name__ == "__main__":
    main()
    if os.environ.get(RANK_ENV):
        from bert_ds.lifecycle.rank_exit import end_process

        end_process(0)  # a rank: no C++ teardown of gloo's threads (see rank_exit)
