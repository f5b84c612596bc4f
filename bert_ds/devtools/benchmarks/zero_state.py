"""Optimizer-state bytes per rank under ZeRO-1 and ZeRO-2, measured on real DeepSpeed ranks (gloo, CPU).

Each configuration starts ``world_size`` processes through bert_ds's own engine path (``engine.build_engine``: the
ZeRO-aware LAMB bound to DeepSpeed's partitions), takes one optimizer step (LAMB creates its moments lazily), and
every rank reports the bytes it holds: the fp32 master partition (``single_partition_of_fp32_groups``) and LAMB's
``exp_avg`` / ``exp_avg_sq`` for it. The expectation is total / N per rank, plus at most the alignment padding ZeRO
adds to each flat group (to a multiple of 2 * world_size elements).

    python -m bert_ds.devtools.benchmarks.zero_state --preset base --world-sizes 1 2 4 --stages 1 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

__all__ = ["zero_state_bytes"]

REPO = Path(__file__).resolve().parents[3]
_MARK = "ZERO_STATE_BYTES "


def _rank_main(preset: str, stage: int) -> None:
    from bert_ds.recipe import Recipe
    from bert_ds.runtime.distributed import init_distributed
    from bert_ds.runtime.engine import build_engine, build_model

    rank, world = init_distributed()
    recipe = Recipe.from_dict({
        "model": preset, "kernels": "torch", "seed": 1,
        "optimizer": {"name": "lamb", "weight_decay": 0.01, "trust_ratio": "decay_only"},
        "deepspeed": {"zero_stage": stage, "precision": "fp32", "gradient_clipping": 1.0},
        "phases": [{"seq_len": 32, "steps": 10, "global_batch_size": world, "micro_batch_size": 1, "lr": 1e-3,
                    "warmup_fraction": 0.1, "decay_power": 0.5,
                    "max_predictions": 4}]})
    config = recipe.model_config(vocab_size=30522)
    train = build_engine(recipe, 0, build_model(recipe, config), world)
    engine = train.engine
    gen = torch.Generator().manual_seed(rank)
    ids = torch.randint(1000, config.vocab_size, (1, 32), generator=gen)
    out = engine(ids, torch.zeros_like(ids), torch.ones_like(ids), torch.tensor([[1, 2, 3, 4]]),
                 torch.randint(1000, config.vocab_size, (1, 4), generator=gen), torch.tensor([0]))
    engine.backward(out.loss)
    engine.step()
    zero = engine.optimizer
    master = sum(t.numel() * t.element_size() for t in zero.single_partition_of_fp32_groups)
    moments = sum(t.numel() * t.element_size() for state in zero.optimizer.state.values()
                  for t in state.values() if isinstance(t, torch.Tensor) and t.dim() > 0)
    params = sum(p.numel() for p in engine.module.parameters())
    print(_MARK + json.dumps({"rank": rank, "world_size": world, "stage": stage, "params": params,
                              "master_bytes": master, "moment_bytes": moments}), flush=True)
    # Leave the process group together: a rank exiting while gloo threads still run aborts ("terminate called
    # without an active exception").
    torch.distributed.barrier()
    engine.destroy()
    torch.distributed.destroy_process_group()


def _launch(preset: str, stage: int, world_size: int, timeout_s: float) -> list[dict]:
    from bert_ds.runtime.distributed import free_port

    port = free_port()
    procs = []
    with tempfile.TemporaryDirectory(prefix="bert_ds_zero_state_") as tmp:
        for rank in range(world_size):
            env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_", "PMIX_"))}
            env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                       LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                       OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(REPO))
            log = open(Path(tmp) / f"rank{rank}.log", "w+")  # noqa: SIM115 - closed below
            cmd = [sys.executable, "-m", "bert_ds.devtools.benchmarks.zero_state", "--rank-of", preset, str(stage)]
            procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO), log))
        rows, failed = [], []
        for rank, (proc, log) in enumerate(procs):
            try:
                code = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                for p, _ in procs:
                    p.kill()
                code = "timeout"
            log.seek(0)
            text = log.read()
            log.close()
            found = [json.loads(line[len(_MARK):]) for line in text.splitlines() if line.startswith(_MARK)]
            if code != 0 or not found:
                failed.append(f"rank {rank} (exit {code}):\n{text[-2000:]}")
            rows += found
    if failed:
        raise RuntimeError(f"ZeRO-{stage} x{world_size} state measurement failed: " + "\n".join(failed))
    return sorted(rows, key=lambda r: r["rank"])


def zero_state_bytes(preset: str = "base", world_sizes=(1, 2, 4), stages=(1, 2), timeout_s: float = 1800) -> list[dict]:
    """One row per (stage, world size): bytes per rank (max over ranks) and the ratio to the 1-rank total / N."""
    results = []
    for stage in stages:
        single = None
        for world in world_sizes:
            rows = _launch(preset, stage, world, timeout_s)
            per_rank = [r["master_bytes"] + r["moment_bytes"] for r in rows]
            total = sum(per_rank)
            if single is None:
                single = total if world == 1 else None
            results.append({"preset": preset, "stage": stage, "world_size": world, "params": rows[0]["params"],
                            "per_rank_bytes": per_rank, "total_bytes": total,
                            "max_rank_vs_ideal": (max(per_rank) / (single / world)) if single else None})
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="base")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rank-of", nargs=2, metavar=("PRESET", "STAGE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank_of:
        _rank_main(args.rank_of[0], int(args.rank_of[1]))
        return 0
    for row in zero_state_bytes(args.preset, args.world_sizes, args.stages):
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    code = main()
    if "--rank-of" in sys.argv:
        from bert_ds.lifecycle.rank_exit import end_process

        end_process(code)  # a rank: no C++ teardown of gloo's threads (see rank_exit)
    sys.exit(code)
