"""BERT pre-training: the phase loop, checkpoint/resume, pre-emption, logging.

    deepspeed [--num_gpus N] bert_ds/pretrain.py --recipe ds_configs/bert_large.json --data DIR128 DIR512 \\
        --tokenizer DIR --output RUN_DIR [--resume auto] [--phase 1|2|all] [--max-steps N] [--eval-data DIR ...]
    python -m bert_ds.pretrain ...      (one process, no launcher: a 1-rank gloo/nccl group is set up here)

Phase hand-off. Phase 2 starts from phase 1's final weights *and* its optimizer moments (LAMB's ``exp_avg`` and
``exp_avg_sq``), with the step count reset to 0 and phase 2's own warm-up + decay schedule. This is what NVIDIA
DeepLearningExamples does (``run_pretraining.py --phase2`` without ``--resume_phase2`` loads phase 1's optimizer state
dict but zeroes each group's ``step`` and resets the lr, and starts a new ``PolyWarmUpScheduler``; the fp16 grad
scaler starts fresh). Carrying the moments keeps the per-parameter gradient statistics of 7,038 steps instead of
re-estimating them from noise at the start of the short phase 2; resetting the step restarts bias correction, which
rescales the carried moments but does not damp the first updates: LAMB's unclamped trust ratio makes every update's
norm lr * ||w|| per tensor, so phase 2's warm-up alone sets their size. The hand-off is the same code in
one invocation (``--phase all``) and when resuming exactly at the boundary, so both give identical results.

Exit codes: 0 done (or ``--max-steps`` reached), 2 bad input (recipe, data, resume mismatch; nothing computed),
3 non-finite loss or weights (the last good checkpoint is kept; fp16 steps the loss scaler skipped leave the weights
unchanged and are not counted), 75 pre-empted (SIGTERM/SIGUSR1: checkpointed at the next step boundary, even the last
step of a phase; resubmit with ``--resume auto``).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import os
import random
import signal
import socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from bert_ds import checkpoint as ckpt
from bert_ds.recipe import Recipe, gradient_accumulation_steps, load_recipe, resume_blockers

__all__ = ["EXIT_BAD_INPUT", "EXIT_NONFINITE", "EXIT_PREEMPTED", "NonFiniteLossError", "main", "parse_args", "train"]

EXIT_BAD_INPUT = 2
EXIT_NONFINITE = 3
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: "try again later", what a Slurm requeue wrapper checks for

log = logging.getLogger("bert_ds.pretrain")
_MODEL_INPUTS = ("input_ids", "token_type_ids", "attention_mask", "masked_lm_positions", "masked_lm_ids")


class NonFiniteLossError(RuntimeError):
    pass


class _Preemption:
    """SIGTERM/SIGUSR1 only set a flag; the loop checkpoints at the next step boundary (all ranks agree via an
    all-reduce, since a signal may reach only some ranks)."""

    def __init__(self) -> None:
        self.requested = False
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handler)

    def _handler(self, signum, frame) -> None:
        self.requested = True


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bert_ds.pretrain", description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", required=True, help="recipe JSON (ds_configs/*.json)")
    p.add_argument("--data", nargs="+", required=True,
                   help="shard directories, one per recipe phase in order (seq 128 then 512); one directory when "
                        "--phase selects a single phase")
    p.add_argument("--output", required=True, help="run directory (checkpoints/, tensorboard/, recipe.json)")
    p.add_argument("--resume", choices=("auto", "none"), default="none",
                   help="auto: continue from the newest complete checkpoint in RUN_DIR/checkpoints, if any")
    p.add_argument("--phase", choices=("1", "2", "all"), default="all")
    p.add_argument("--max-steps", type=int, default=None,
                   help="stop (with a checkpoint) once the run has done N optimizer steps in total, counting every "
                        "phase's steps from the start of the run")
    p.add_argument("--tokenizer", required=True,
                   help="tokenizer dir (vocab.txt) the shards were made with: checked against every shard set's "
                        "index.json, gives dynamic masking its [MASK] id, and is copied beside the checkpoints for the "
                        "exporter")
    p.add_argument("--eval-data", nargs="+", default=None, help="eval shard dirs, one per phase (or one for all)")
    p.add_argument("--init-from-hf", default=None,
                   help="start the first selected phase from a Hugging Face BertForPreTraining dir")
    p.add_argument("--num-workers", type=int, default=1, help="data loader worker processes per rank")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.max_steps is not None and args.max_steps < 1:
        p.error(f"--max-steps must be >= 1, got {args.max_steps}")
    return args


def init_distributed() -> None:
    """Join the launcher's process group, or create a 1-rank group when started without a launcher."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    if "RANK" not in os.environ and int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        # `srun python -m bert_ds.pretrain`: one task per rank, so Slurm's --signal reaches every rank directly (the
        # deepspeed launcher would answer SIGTERM by killing its ranks before they can checkpoint).
        if "MASTER_ADDR" not in os.environ:
            raise ValueError("under srun without a launcher, export MASTER_ADDR (the first node's hostname) "
                             "and optionally MASTER_PORT")
        os.environ.setdefault("MASTER_PORT", "29500")
        os.environ.update(RANK=os.environ["SLURM_PROCID"], WORLD_SIZE=os.environ["SLURM_NTASKS"],
                          LOCAL_RANK=os.environ.get("SLURM_LOCALID", "0"))
        if "SLURM_NTASKS_PER_NODE" in os.environ and os.environ["SLURM_NTASKS_PER_NODE"].isdigit():
            os.environ.setdefault("LOCAL_WORLD_SIZE", os.environ["SLURM_NTASKS_PER_NODE"])
    if "RANK" not in os.environ and "OMPI_COMM_WORLD_RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    accel = get_accelerator()
    cpu = accel.device_name() == "cpu"
    if cpu and "OMP_NUM_THREADS" not in os.environ:
        # Ranks on one host share its cores; more threads than cores per rank only adds contention.
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_ranks))
    backend = "gloo" if cpu else accel.communication_backend_name()
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery="OMPI_COMM_WORLD_RANK" in os.environ)


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _phase_dirs(dirs: list[str] | None, phases: list[int], n_phases: int, flag: str) -> dict[int, str]:
    if not dirs:
        return {}
    if len(dirs) == n_phases:
        return {p: dirs[p] for p in phases}
    if len(dirs) == 1 and (len(phases) == 1 or flag == "--eval-data"):
        return {p: dirs[0] for p in phases}
    raise ValueError(f"{flag}: got {len(dirs)} directories for a recipe with {n_phases} phase(s); give one per phase")


class _Run:
    """State shared by the phases of one invocation."""

    def __init__(self, args: argparse.Namespace, recipe: Recipe) -> None:
        import deepspeed.comm as dist
        from deepspeed.accelerator import get_accelerator

        from bert_ds.data.index import ShardIndex
        from bert_ds.data.tokenizer import load_tokenizer
        from bert_ds.engine import check_optimizer_support, resolve_precision

        self.args, self.recipe = args, recipe
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.run_dir = Path(args.output)
        self.ckpt_dir = ckpt.checkpoint_dir(self.run_dir)
        n = len(recipe.phases)
        if args.phase == "2" and n < 2:
            raise ValueError(f"--phase 2: recipe {args.recipe} has only {n} phase")
        self.phases = list(range(n)) if args.phase == "all" else [int(args.phase) - 1]
        self.data = _phase_dirs(args.data, self.phases, n, "--data")
        self.eval_data = _phase_dirs(args.eval_data, self.phases, n, "--eval-data")

        # Vocabulary: the tokenizer's; every shard set (training and eval, every phase) must agree, checked below.
        self.tokenizer = load_tokenizer(args.tokenizer)
        vocab_size, vocab_sha = self.tokenizer.vocab_size, self.tokenizer.vocab_sha256
        self.vocab_sha256 = vocab_sha
        # Combinations the optimizer binding refuses fail here, before any compute, naming the recipe fields.
        check_optimizer_support(recipe, resolve_precision(recipe.deepspeed.precision, get_accelerator().device_name()))
        self.model_config = recipe.model_config(vocab_size)
        if args.init_from_hf:  # the HF model's shape replaces the recipe's preset (dropout stays the recipe's)
            from bert_ds.export.hf import bert_config_from_hf

            recipe_config = self.model_config
            self.model_config = bert_config_from_hf(
                args.init_from_hf, recipe_config.pad_vocab_to_multiple_of,
                hidden_dropout_prob=recipe_config.hidden_dropout_prob,
                attention_probs_dropout_prob=recipe_config.attention_probs_dropout_prob)
            if self.model_config.vocab_size != vocab_size:
                raise ValueError(f"--init-from-hf {args.init_from_hf}: field 'vocab_size' is "
                                 f"{self.model_config.vocab_size} but the tokenizer/shards have {vocab_size}")
        for p in self.phases:  # refuse mismatched shards before any compute, naming the field
            phase = recipe.phases[p]
            gradient_accumulation_steps(phase, self.world_size, f"phases[{p}]")
            for flag, dirs in (("--data", self.data), ("--eval-data", self.eval_data)):
                if p not in dirs:
                    continue
                index = ShardIndex.load(dirs[p])
                index.check_compatible(seq_len=phase.seq_len, vocab_sha256=vocab_sha, vocab_size=vocab_size,
                                       where=f"{flag} {dirs[p]} (phases[{p}])")
                shard_preds = index.masking.get("max_predictions")
                if not phase.dynamic_masking and shard_preds is not None and shard_preds > phase.max_predictions:
                    raise ValueError(f"{flag} {dirs[p]}/index.json: field 'masking.max_predictions' is {shard_preds} "
                                     f"but phases[{p}].max_predictions is {phase.max_predictions}")
        self.preemption = _Preemption()
        self.metrics = None

    # ------------------------------------------------------------------ resume decision
    def resume_point(self) -> tuple[int, int, str | None, bool]:
        """(phase index, step in phase, tag to load, whether that tag is a finished phase to hand off from)."""
        tag = ckpt.read_latest(self.ckpt_dir) if self.ckpt_dir.is_dir() else None
        if self.args.resume == "none":
            if tag is not None:
                raise ValueError(f"{self.ckpt_dir} already holds checkpoint {tag!r}: pass --resume auto to continue "
                                 f"it, or choose a new --output")
            first = self.phases[0]
            if first > 0 and not self.args.init_from_hf:
                raise ValueError("--phase 2 starts from phase 1's final checkpoint in --output (use --resume auto) "
                                 "or from --init-from-hf")
            return first, 0, None, False
        if tag is None:
            if self.phases[0] > 0 and not self.args.init_from_hf:
                raise ValueError(f"--phase 2: {self.ckpt_dir} holds no phase-1 checkpoint to start from; "
                                 "run phase 1 first or pass --init-from-hf")
            return self.phases[0], 0, None, False
        state = ckpt.read_run_state(self.ckpt_dir, tag)
        blockers = resume_blockers(state["recipe"], self.recipe)
        if blockers:
            raise ValueError(f"--resume auto: checkpoint {tag!r} was made with a different recipe; field(s) "
                             f"{blockers} differ from {self.args.recipe}. Use a new --output or the original recipe.")
        phase, step = state["phase"], state["step"]
        if state["phase_done"]:
            return phase + 1, 0, tag, True
        return phase, step, tag, False

    # ------------------------------------------------------------------ one phase
    def run_phase(self, p: int, start_step: int, tag: str | None, handoff: bool) -> int | None:
        """Train phase ``p``; returns an exit code to stop the run with, or None to go on to the next phase."""
        import deepspeed.comm as dist

        from bert_ds.data.loader import DynamicMasking, build_eval_loader, build_loader
        from bert_ds.engine import build_engine, build_model

        recipe, phase, args = self.recipe, self.recipe.phases[p], self.args
        state_dict = None
        if handoff:
            if not ckpt.read_run_state(self.ckpt_dir, tag)["phase_done"]:
                raise ValueError(f"phase {p + 1} cannot start from {tag!r}: its run_state.json has phase_done false "
                                 f"(phase {p} did not finish there)")
            log.info("phase %d starts from %s: weights and optimizer moments, step count 0, new schedule", p + 1, tag)
            state_dict = ckpt.consolidated_state_dict(self.ckpt_dir, tag)
        init_hf = args.init_from_hf if tag is None else None  # a fresh start of whichever phase comes first
        model = build_model(recipe, self.model_config, init_from_hf=init_hf, state_dict=state_dict)
        te = build_engine(recipe, p, model, self.world_size)
        engine = te.engine
        if handoff:
            saved_world = ckpt.read_run_state(self.ckpt_dir, tag)["world_size"]
            ckpt.load_optimizer_moments(engine, self.ckpt_dir, tag, saved_world)

        masking = None
        if phase.dynamic_masking:  # [MASK]'s id comes from the tokenizer (4 in bert_ds vocabs, 103 in Google's)
            masking = DynamicMasking.from_tokenizer(args.tokenizer, masked_lm_prob=phase.masked_lm_prob,
                                                    max_predictions=phase.max_predictions)
        # Data order depends on the recipe seed and the phase only: the same for any number of ranks.
        loader = build_loader(self.data[p], global_batch_size=phase.global_batch_size,
                              micro_batch_size=phase.micro_batch_size, rank=self.rank, world_size=self.world_size,
                              seed=recipe.seed + p, num_workers=args.num_workers, expected_seq_len=phase.seq_len,
                              expected_vocab_sha256=self.vocab_sha256, max_predictions=phase.max_predictions,
                              dynamic_masking=masking, shuffle_window_shards=phase.shuffle_window_shards)
        eval_loader = None
        if p in self.eval_data:
            eval_loader = build_eval_loader(self.eval_data[p], micro_batch_size=phase.micro_batch_size,
                                            rank=self.rank, world_size=self.world_size,
                                            expected_seq_len=phase.seq_len, expected_vocab_sha256=self.vocab_sha256,
                                            max_predictions=phase.max_predictions)
        elif phase.target_mlm_accuracy is not None and self.rank == 0:
            log.warning("phases[%d].target_mlm_accuracy=%s is ignored without --eval-data for phase %d: it runs all "
                        "%d steps", p, phase.target_mlm_accuracy, p + 1, phase.steps)

        step, consumed = start_step, 0
        if tag is not None and not handoff:
            saved_world = ckpt.read_run_state(self.ckpt_dir, tag)["world_size"]
            saved = ckpt.load_checkpoint(engine, self.ckpt_dir, tag, saved_world)["bert_ds"]
            loader.load_state_dict(saved["loader"])
            consumed = saved["consumed_samples"]
            rng_file = self.ckpt_dir / tag / f"rng_rank{self.rank:05d}.pt"
            if saved["world_size"] == self.world_size and rng_file.is_file():
                ckpt.load_rng_state(rng_file)
            else:  # other rank count: per-rank RNG streams cannot carry over (only dropout draws from them)
                _seed_everything(recipe.seed + 1000 * p + 7919 * step + self.rank)
            log.info("resumed %s: phase %d step %d, %d samples consumed (saved on %d ranks, now %d)", tag, p + 1,
                     step, consumed, saved["world_size"], self.world_size)
        else:
            _seed_everything(recipe.seed + 1000 * p + self.rank)

        offset = sum(ph.steps for ph in recipe.phases[:p])  # global step of this phase's step 0
        nonfinite = 0
        last_good = tag
        it = iter(loader)
        engine.train()

        def run_state(done: bool) -> dict:
            return {"recipe": recipe.to_dict(), "phase": p, "step": step, "phase_done": done,
                    "global_step": offset + step, "consumed_samples": consumed, "loader": loader.state_dict(),
                    "world_size": self.world_size, "zero_stage": recipe.deepspeed.zero_stage,
                    "precision": te.precision}

        def save(done: bool) -> None:
            nonlocal last_good
            self.metrics.flush()
            t = ckpt.tag_for(p, step)
            ckpt.save_checkpoint(engine, self.run_dir, t, run_state(done), recipe.logging.keep_last_k)
            last_good = t
            if self.rank == 0:
                print(f"checkpoint {self.ckpt_dir / t}", flush=True)

        def evaluate_now() -> float | None:
            from bert_ds.evaluate import evaluate

            result = evaluate(engine.module, eval_loader, engine.device)
            self.metrics.log_eval(offset + step, result)
            engine.train()
            return result.get("mlm_accuracy")

        while step < phase.steps:
            t0 = time.perf_counter()
            lr = te.current_lr()  # the lr this step uses (the scheduler advances inside engine.step)
            # Summed on the device and read once per step: one host sync per optimizer step, not per micro batch.
            sums = torch.zeros(9, dtype=torch.float64, device=engine.device)
            for _ in range(te.accumulation):
                batch = next(it)
                inputs = {k: batch[k].to(engine.device, non_blocking=True) for k in _MODEL_INPUTS}
                if recipe.nsp:
                    inputs["next_sentence_label"] = batch["next_sentence_label"].to(engine.device, non_blocking=True)
                out = engine(**inputs)
                engine.backward(out.loss)
                engine.step()
                nsp_loss = out.nsp_loss if out.nsp_loss is not None else torch.zeros_like(out.mlm_loss)
                sums[:7] += torch.stack([out.loss.detach(), out.mlm_loss.detach(), nsp_loss.detach(),
                                         *(t.to(out.loss.dtype) for t in (out.mlm_correct, out.mlm_total,
                                                                         out.nsp_correct, out.nsp_total))]).double()
            sums[7] = float(self.preemption.requested)
            # The loss above was computed before this step's update; only the updated weights show an update that
            # overflowed. One pass over the parameters, reduced with the rest: no extra host sync.
            sums[8] = (~torch.stack([q.detach().isfinite().all() for q in engine.module.parameters()]).all()).double()
            dist.all_reduce(sums)  # sums over ranks (the flags too: every rank decides the same at the same step)
            sums = sums.cpu()
            step += 1
            consumed += phase.global_batch_size
            n_micro = te.accumulation * self.world_size
            loss = sums[0].item() / n_micro
            grad_norm = engine.get_global_grad_norm()
            grad_norm = float(grad_norm) if grad_norm is not None else None
            applied = engine.was_step_applied()
            weights_finite = sums[8].item() == 0
            step_finite = math.isfinite(loss) and (grad_norm is None or math.isfinite(grad_norm))
            # Weights worth saving: finite, and either made by a finite update or left alone (a skipped step).
            saveable = weights_finite and (step_finite or not applied)
            if step_finite and weights_finite:
                nonfinite = 0
            elif te.precision == "fp16" and not applied and weights_finite:
                if self.rank == 0:  # the scaler halves the scale and retries; the weights are unchanged
                    log.warning("non-finite loss at phase %d step %d: fp16 loss scaler skipped the step", p + 1, step)
            else:
                nonfinite += 1
                what = "loss/grad norm" if weights_finite else "weights after the update"
                if nonfinite >= recipe.logging.max_nonfinite_steps:
                    raise NonFiniteLossError(
                        f"non-finite {what} (loss {loss}) for {nonfinite} consecutive steps at phase {p + 1} step "
                        f"{step} (logging.max_nonfinite_steps={recipe.logging.max_nonfinite_steps}); last good "
                        f"checkpoint: {last_good or 'none'} in {self.ckpt_dir}. Lower phases[{p}].lr or check the "
                        f"data; resume with --resume auto.")
                log.warning("non-finite %s at phase %d step %d (%d in a row)", what, p + 1, step, nonfinite)
            loss_scale = getattr(engine.optimizer, "cur_scale", None) if te.precision == "fp16" else None
            self.metrics.log_step(
                offset + step, phase=p + 1, seq_len=phase.seq_len, max_predictions=phase.max_predictions, loss=loss,
                mlm_loss=sums[1].item() / n_micro, nsp_loss=sums[2].item() / n_micro if recipe.nsp else None,
                mlm_accuracy=sums[3].item() / max(sums[4].item(), 1.0),
                nsp_accuracy=sums[5].item() / max(sums[6].item(), 1.0) if recipe.nsp else None,
                lr=lr, grad_norm=grad_norm, loss_scale=loss_scale, samples=phase.global_batch_size,
                step_time=time.perf_counter() - t0, consumed_samples=consumed)

            done = step >= phase.steps
            if eval_loader is not None and (done or (phase.eval_interval and step % phase.eval_interval == 0)):
                accuracy = evaluate_now()
                if (phase.target_mlm_accuracy is not None and accuracy is not None
                        and accuracy >= phase.target_mlm_accuracy and not done):
                    if self.rank == 0:
                        print(f"phase {p + 1}: eval mlm_accuracy {accuracy:.4f} >= target "
                              f"{phase.target_mlm_accuracy} at step {step}; ending the phase", flush=True)
                    done = True
            preempted = sums[7].item() > 0
            capped = args.max_steps is not None and offset + step >= args.max_steps
            must_save = done or preempted or capped
            if must_save and not saveable:
                # The phase end (or stop) would hand on weights no finite update produced; never save those.
                raise NonFiniteLossError(
                    f"phase {p + 1} stops at step {step} with non-finite weights or update (loss {loss}); last good "
                    f"checkpoint: {last_good or 'none'} in {self.ckpt_dir}. Lower phases[{p}].lr or check the data; "
                    f"resume with --resume auto.")
            if saveable and (must_save or (phase.checkpoint_interval and step % phase.checkpoint_interval == 0)):
                save(done)
            if preempted:
                if self.rank == 0:
                    print(f"pre-empted: checkpointed at phase {p + 1} step {step}; exit {EXIT_PREEMPTED}", flush=True)
                return EXIT_PREEMPTED
            if done:
                break
            if capped:
                return 0
        self._handoff_tag = last_good
        return 0 if args.max_steps is not None and offset + step >= args.max_steps else None

    def run(self) -> int:
        from deepspeed.accelerator import get_accelerator

        from bert_ds.engine import resolve_precision
        from bert_ds.metrics import MetricsLogger, detect_peak_tflops

        p, step, tag, handoff = self.resume_point()
        if p >= len(self.recipe.phases) or p not in self.phases and p > max(self.phases):
            if self.rank == 0:
                print(f"nothing to do: {tag} already finished the selected phase(s)", flush=True)
            return 0
        if p not in self.phases:
            raise ValueError(f"--phase {self.args.phase}: the newest checkpoint {tag!r} is in phase {p + 1}")
        max_steps = self.args.max_steps
        if max_steps is not None and sum(ph.steps for ph in self.recipe.phases[:p]) + step >= max_steps:
            if self.rank == 0:  # re-running a finished --max-steps command trains nothing and saves nothing
                print(f"nothing to do: --max-steps {max_steps} already reached at {tag}", flush=True)
            return 0
        if self.rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            ckpt.write_run_metadata(self.run_dir, self.recipe, self.model_config, self.args.tokenizer)
        self.metrics = MetricsLogger(self.run_dir / "tensorboard", rank=self.rank, model_config=self.model_config,
                                     peak_tflops=self.recipe.logging.peak_tflops or detect_peak_tflops(
                                         resolve_precision(self.recipe.deepspeed.precision,
                                                           get_accelerator().device_name())),
                                     log_interval=self.recipe.logging.interval, world_size=self.world_size)
        try:
            if self.rank == 0:
                self.metrics.log_text("recipe", "```\n" + json.dumps(self.recipe.to_dict(), indent=2) + "\n```")
            while p in self.phases:
                code = self.run_phase(p, step, tag, handoff)
                if code is not None:
                    return code
                p, step, tag, handoff = p + 1, 0, self._handoff_tag, True
                gc.collect()  # the finished phase's engine and loader workers
            return 0
        finally:
            self.metrics.close()


def train(args: argparse.Namespace) -> int:
    """Run (or resume) the phases ``args`` select; returns the exit code."""
    recipe = load_recipe(args.recipe)
    init_distributed()
    return _Run(args, recipe).run()


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = parse_args(argv)
    try:
        return train(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"bert_ds.pretrain: error: {exc}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    except NonFiniteLossError as exc:
        print(f"bert_ds.pretrain: error: {exc}", file=sys.stderr, flush=True)
        return EXIT_NONFINITE


if __name__ == "__main__":
    sys.exit(main())
