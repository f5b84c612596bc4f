"""The memory table of docs/recipes.md: each GPU recipe's expected peak memory per GPU, and the largest micro batch
that fits 40, 80 and 141 GB cards.

    python -m bert_ds.devtools.memory_table --world-size 8

Every phase of every shipped recipe with a BERT-base or BERT-large model (``ds_configs/*.json``, globbed when
called), in the precision it resolves to on a GPU, estimated by :func:`bert_ds.runtime.memory.phase_estimate`:
measured saved activations plus weights, gradients, the fp32 gradient partition, the ZeRO optimizer partition and
the reduce buckets, then :class:`~bert_ds.runtime.memory.Headroom` for what a card keeps. An estimate until a GPU
measures it; ``tests/engine/test_memory_estimate.py`` checks that docs/recipes.md holds this table as printed.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bert_ds.cli_args import build_parser, parse
from bert_ds.errors import run_main
from bert_ds.recipe import load_recipe
from bert_ds.runtime import memory
from bert_ds.runtime.memory import GIB, GradAccumLayout, Headroom, MemoryEstimate

__all__ = ["MemoryTableArgs", "Row", "gpu_recipe_estimates", "main", "memory_table", "static_table"]

RECIPE_DIR = Path(__file__).resolve().parents[2] / "ds_configs"
BERT_VOCAB = 30522  # BERT's uncased WordPiece vocabulary (google-research/bert vocab.txt); the shards set the real size


@dataclass(frozen=True)
class MemoryTableArgs:
    world_size: int = 8
    """data-parallel GPUs the ZeRO partitions are split over"""
    vocab_size: int = BERT_VOCAB
    """tokenizer vocabulary size (the recipes' models pad it to a multiple of 64)"""


RAISE_CARD_GB = 80
"""The card the "raise to" column is for (H100/A100 80 GB, the card BENCHMARKS.md measured)."""


@dataclass(frozen=True)
class Row:
    recipe: str
    phase: int
    """Counted from 1, as docs/recipes.md names phases."""
    global_batch_size: int
    estimate: MemoryEstimate

    def raise_to(self, card_bytes: int, headroom: Headroom = memory.DEFAULT_HEADROOM) -> int | None:
        """The largest micro batch that fits ``card_bytes`` and keeps the global batch (it divides global batch /
        world size, so the accumulation steps stay whole); None when no micro batch fits."""
        per_rank = self.global_batch_size // self.estimate.world_size
        room = self.estimate.largest_micro_batch(card_bytes, headroom)
        fits = [m for m in range(1, min(room, per_rank) + 1) if per_rank % m == 0]
        return fits[-1] if fits else None


def gpu_recipe_estimates(world_size: int, vocab_size: int = BERT_VOCAB, root: Path = RECIPE_DIR,
                         grad_accum: GradAccumLayout | None = None) -> list[Row]:
    """One :class:`Row` for every phase of every non-tiny recipe under ``root`` (``grad_accum`` None: each recipe's
    own layout, :func:`bert_ds.runtime.memory.recipe_grad_accum`)."""
    from bert_ds.runtime.engine import resolve_precision  # imports deepspeed: only when called

    out = []
    for path in sorted(root.glob("*.json")):
        recipe = load_recipe(path)
        if recipe.model == "tiny":
            continue
        config = recipe.model_config(vocab_size)
        dtype = resolve_precision(recipe.deepspeed.precision, "cuda")
        out += [Row(recipe.name, p + 1, phase.global_batch_size,
                    memory.phase_estimate(recipe, p, config, world_size, dtype, grad_accum))
                for p, phase in enumerate(recipe.phases)]
    return out


def memory_table(rows: list[Row], headroom: Headroom = memory.DEFAULT_HEADROOM) -> str:
    """A markdown table: per phase, the estimate at the recipe's micro batch, the largest micro batch per card, and
    the micro batch (with its accumulation steps) the phase could raise to on an 80 GB card."""
    cards = " | ".join(f"Largest micro batch, {gb} GB" for gb in memory.CARDS_GB)
    lines = [f"| Recipe | Phase | Seq | Precision | ZeRO | Micro batch | Activations MiB / sequence | Static GiB | "
             f"Expected GiB per GPU | {cards} | Could raise to on {RAISE_CARD_GB} GB (accum.) |",
             "|---" * (10 + len(memory.CARDS_GB)) + "|"]
    for row in rows:
        e = row.estimate
        fits = " | ".join(str(e.largest_micro_batch(gb * 10**9, headroom)) for gb in memory.CARDS_GB)
        raised = row.raise_to(RAISE_CARD_GB * 10**9, headroom)
        accum = row.global_batch_size // (e.world_size * raised) if raised else None
        lines.append(f"| {row.recipe} | {row.phase} | {e.seq_len} | {e.dtype} | {e.zero_stage} | {e.micro_batch} | "
                     f"{e.fit.per_sequence / 2**20:.1f} | {e.static.total / GIB:.2f} | {e.total / GIB:.1f} | {fits} | "
                     f"{f'{raised} ({accum})' if raised else 'none'} |")
    return "\n".join(lines) + "\n"


def static_table(world_size: int, vocab_size: int = BERT_VOCAB, grad_accum_dtype: str = "fp32") -> str:
    """A markdown table of the static state per rank of BERT-base and BERT-large in bf16 under ZeRO 1 and 2, with
    gradients summed in ``grad_accum_dtype`` (the recipes' default: fp32) and the recipes' reduce buckets (DeepSpeed's
    default 5e8 elements, two with ``overlap_comm``)."""
    from bert_ds.config import model_preset

    lines = ["| Model | Parameters | ZeRO | Weights GiB | Gradients GiB | fp32 gradient buffer GiB | "
             "Master + moments GiB | Reduce buckets GiB | Static GiB per GPU |", "|---" * 9 + "|"]
    for name in ("base", "large"):
        params = memory.parameter_count(model_preset(name, vocab_size=vocab_size, pad_vocab_to_multiple_of=64))
        for stage in (1, 2):
            grad_accum = memory.recipe_grad_accum(stage, grad_accum_dtype, "bf16")
            s = memory.static_bytes_per_rank(params, world_size, stage, "bf16", grad_accum)
            cells = [s.weights, s.gradients, s.grad_accum, s.master + s.optimizer, s.buckets, s.total]
            lines.append(f"| {name} | {params:,} | {stage} | " + " | ".join(f"{c / GIB:.2f}" for c in cells) + " |")
    return "\n".join(lines) + "\n"


def _run(args: MemoryTableArgs) -> int:
    rows = gpu_recipe_estimates(args.world_size, args.vocab_size)
    headroom = memory.DEFAULT_HEADROOM
    sys.stdout.write(f"World size {args.world_size}; headroom {headroom.fraction:.0%} of the card + "
                     f"{headroom.fixed_gib:g} GiB; 1 GB = 1e9 bytes, 1 GiB = 2^30 bytes\n\n")
    sys.stdout.write(memory_table(rows, headroom))
    sys.stdout.write("\n" + static_table(args.world_size, args.vocab_size))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser(MemoryTableArgs, "python -m bert_ds.devtools.memory_table",
                          description="expected memory per GPU of the GPU recipes, and the micro batch that fits")
    args = parse(MemoryTableArgs, parser, argv)
    if args.world_size < 1:
        parser.error(f"--world-size must be >= 1, got {args.world_size}")
    return run_main("memory_table", _run, args)


if __name__ == "__main__":
    sys.exit(main())
