"""One phase of pre-training: set-up, the step loop, and its small named pieces.

A phase is: build the model (fresh, from Hugging Face, or from the previous phase's weights), wrap it in the DeepSpeed
engine, restore a checkpoint if resuming, then loop ``train_step`` -> ``NonFiniteGuard.check`` -> log -> evaluate ->
checkpoint -> stop? until the phase's steps are done. Every rank runs the same loop and takes every decision from
values all-reduced inside the step, so all ranks stop, save and exit at the same step.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from bert_ds import checkpoint as ckpt
from bert_ds.data.batch import MODEL_INPUTS
from bert_ds.data.workers import raise_if_worker_died
from bert_ds.deepspeed_internals import loss_scale
from bert_ds.errors import BertDsError
from bert_ds.exit_codes import ExitCode
from bert_ds.lifecycle import startup_gc
from bert_ds.lifecycle.hang_watchdog import NoWatchdog, StallWatchdog
from bert_ds.lifecycle.preemption import Preemption
from bert_ds.model.compile import COMPILE_BOUND_PER_PHASE, compiled_graphs
from bert_ds.model.unpad import host_counts
from bert_ds.optim.schedule import apply_elapsed, rescale_peak
from bert_ds.runtime.distributed import seed_everything
from bert_ds.runtime.preflight import RunPlan, StartPoint, loader_for_phase

if TYPE_CHECKING:
    from bert_ds.data.loader import MixedShardLoader, ShardLoader

__all__ = ["DropoutKey", "EXIT_PREEMPTED", "NonFiniteGuard", "NonFiniteLossError", "PhaseOutcome", "StepRecord",
           "run_phase", "train_step"]

EXIT_PREEMPTED = ExitCode.PREEMPTED
log = logging.getLogger(__name__)

# Per-rank quantities a step sums over its micro batches; one all-reduce sums them over ranks. The flags are summed
# too, so every rank sees whether *any* rank was signalled or holds non-finite weights, and decides the same. Only
# rank 0 adds its training-time reading (time_linear phases), so the sum is rank 0's clock on every rank.
_SUMMED = ("loss", "mlm_loss", "nsp_loss", "mlm_correct", "mlm_total", "nsp_correct", "nsp_total",
           "preempt_requested", "nonfinite_weights", "elapsed_s")


class NonFiniteLossError(BertDsError, RuntimeError):
    """The loss, gradient norm or updated weights stayed non-finite; the last good checkpoint is kept (exit 3)."""

    exit_code = ExitCode.NONFINITE


@dataclass(frozen=True)
class StepRecord:
    """One optimizer step, reduced over ranks and micro batches."""

    loss: float
    mlm_loss: float
    nsp_loss: float | None
    mlm_accuracy: float
    nsp_accuracy: float | None
    grad_norm: float | None
    lr: float
    step_time: float
    applied: bool
    """False when the fp16 loss scaler skipped the update."""
    weights_finite: bool
    preempt_requested: bool
    elapsed_s: float | None = None
    """``time_linear`` phases: rank 0's training time at the end of this step, the same on every rank."""

    @property
    def update_finite(self) -> bool:
        return math.isfinite(self.loss) and (self.grad_norm is None or math.isfinite(self.grad_norm))

    @property
    def saveable(self) -> bool:
        """Weights worth saving: finite, and made by a finite update or left alone (a skipped step)."""
        return self.weights_finite and (self.update_finite or not self.applied)


def _micro_batch(te, it: Iterator[dict], nsp: bool, totals: torch.Tensor) -> None:
    """Forward + backward (+ the optimizer step at the accumulation boundary) of one micro batch; adds to ``totals``."""
    engine = te.engine
    batch = next(it)
    # The unpadded model's sizes, read from the CPU batch before it moves: the forward then needs no device sync.
    counts = host_counts(batch["attention_mask"], batch["masked_lm_ids"])
    inputs = {k: batch[k].to(engine.device, non_blocking=True) for k in MODEL_INPUTS
              if nsp or k != "next_sentence_label"}
    out = engine(**inputs, counts=counts)
    engine.backward(out.loss)
    engine.step()
    nsp_loss = out.nsp_loss if out.nsp_loss is not None else torch.zeros_like(out.mlm_loss)
    counts = (out.mlm_correct, out.mlm_total, out.nsp_correct, out.nsp_total)
    totals[:7] += torch.stack([out.loss.detach(), out.mlm_loss.detach(), nsp_loss.detach(),
                               *(c.to(out.loss.dtype) for c in counts)]).double()


@dataclass(frozen=True)
class DropoutKey:
    """Where a micro batch sits in the run: its dropout masks are drawn from a stream keyed by this, not from a
    per-rank stream, so they do not depend on the number of ranks, on which rank computes the micro batch, or on
    whether the run was resumed. The loader puts the same samples in micro batch ``k`` of a global batch for any
    world size (``bert_ds.data.loader``: micro step ``a`` of rank ``r`` is slice ``k = a * W + r``), so a run resumed
    on another rank count draws the same masks for the same samples."""

    seed: int
    phase: int
    step: int
    """Optimizer step within the phase (0-based: the step being computed)."""
    rank: int
    world_size: int

    def seed_for(self, micro_step: int) -> int:
        k = micro_step * self.world_size + self.rank  # micro batch index within the global batch
        digest = hashlib.blake2b(f"{self.seed}/{self.phase}/{self.step}/{k}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") >> 1  # torch.manual_seed takes a non-negative int64


def train_step(te, it: Iterator[dict], nsp: bool, preemption: Preemption, dropout: DropoutKey) -> StepRecord:
    """One optimizer step over ``te.accumulation`` micro batches; one host sync (the all-reduce of the totals)."""
    import deepspeed.comm as dist

    engine = te.engine
    t0 = time.perf_counter()
    lr = te.current_lr()  # the lr this step uses (the scheduler advances inside engine.step)
    totals = torch.zeros(len(_SUMMED), dtype=torch.float64, device=engine.device)
    for micro_step in range(te.accumulation):
        torch.manual_seed(dropout.seed_for(micro_step))  # CPU and every CUDA device; host-side only, no sync
        _micro_batch(te, it, nsp, totals)
    totals[_SUMMED.index("preempt_requested")] = float(preemption.requested)
    # The loss above was computed before this step's update; only the updated weights show an update that
    # overflowed. One pass over the parameters, reduced with the rest: no extra host sync.
    finite = torch.stack([q.detach().isfinite().all() for q in engine.module.parameters()]).all()
    totals[_SUMMED.index("nonfinite_weights")] = (~finite).double()
    budget = te.time_budget
    if budget is not None and dropout.rank == 0:
        totals[_SUMMED.index("elapsed_s")] = budget.read()
    dist.all_reduce(totals)
    s = dict(zip(_SUMMED, totals.tolist(), strict=True))
    n_micro = te.accumulation * dropout.world_size
    return StepRecord(loss=s["loss"] / n_micro, mlm_loss=s["mlm_loss"] / n_micro,
                      nsp_loss=s["nsp_loss"] / n_micro if nsp else None,
                      mlm_accuracy=s["mlm_correct"] / max(s["mlm_total"], 1.0),
                      nsp_accuracy=s["nsp_correct"] / max(s["nsp_total"], 1.0) if nsp else None,
                      grad_norm=te.grad_norm(), lr=lr, step_time=time.perf_counter() - t0,
                      applied=engine.was_step_applied(), weights_finite=s["nonfinite_weights"] == 0,
                      preempt_requested=s["preempt_requested"] > 0,
                      elapsed_s=s["elapsed_s"] if budget is not None else None)


class NonFiniteGuard:
    """Counts consecutive non-finite steps and raises after ``limit``; fp16 steps the loss scaler skipped (weights
    unchanged) are not counted."""

    def __init__(self, limit: int, phase: int, precision: str, rank: int) -> None:
        self.limit, self.phase, self.precision, self.rank = limit, phase, precision, rank
        self.in_a_row = 0

    def check(self, rec: StepRecord, step: int, last_good: str | None, where: str) -> None:
        if rec.update_finite and rec.weights_finite:
            self.in_a_row = 0
            return
        p = self.phase
        if self.precision == "fp16" and not rec.applied and rec.weights_finite:
            if self.rank == 0:  # the scaler halves the scale and retries; the weights are unchanged
                log.warning("non-finite loss at phase %d step %d: fp16 loss scaler skipped the step", p + 1, step)
            return
        self.in_a_row += 1
        what = "loss/grad norm" if rec.weights_finite else "weights after the update"
        if self.in_a_row >= self.limit:
            raise NonFiniteLossError(
                f"non-finite {what} (loss {rec.loss}) for {self.in_a_row} consecutive steps at phase {p + 1} step "
                f"{step} (logging.max_nonfinite_steps={self.limit}); last good checkpoint: {last_good or 'none'} in "
                f"{where}. Lower phases[{p}].lr or check the data; resume with --resume auto.")
        log.warning("non-finite %s at phase %d step %d (%d in a row)", what, p + 1, step, self.in_a_row)


@dataclass
class _Phase:
    """The live objects of one phase and its position."""

    index: int
    te: object
    loader: ShardLoader | MixedShardLoader
    """The phase's training loader: one surface for one shard set and a mix (iterate, ``state_dict``,
    ``load_state_dict``, ``describe``, ``mix_change``), built by :func:`~bert_ds.runtime.preflight.loader_for_phase`."""
    eval_loader: dict | None
    """Held-out set name -> its eval loader (one entry: one set), or None without ``--eval-data`` for the phase."""
    step: int
    consumed: int
    last_good: str | None
    watch: StallWatchdog | NoWatchdog = field(default_factory=NoWatchdog)
    """Where the loop marks each stretch of work (:mod:`bert_ds.lifecycle.hang_watchdog`)."""


@dataclass(frozen=True)
class PhaseOutcome:
    exit_code: int | None
    """Stop the run with this code, or None to go on to the next phase."""
    last_tag: str | None
    """The phase's last saved checkpoint: the next phase starts from it."""


def _build_model_and_engine(plan: RunPlan, p: int, start: StartPoint):
    from bert_ds.runtime.engine import build_engine, build_model

    handoff = ckpt.open_handoff(plan.ckpt_dir, start.tag, p) if start.handoff else None
    state_dict = None
    if handoff is not None:
        log.info("phase %d starts from %s: weights and optimizer moments, step count %s, new schedule", p + 1,
                 start.tag, "continued" if plan.recipe.handoff.optimizer_step == "continue" else "0")
        state_dict = handoff.weights()
    init_hf = plan.args.init_from_hf if start.tag is None else None  # a fresh start of the first phase run
    model = build_model(plan.recipe, plan.model_config, init_from_hf=init_hf, state_dict=state_dict)
    te = build_engine(plan.recipe, p, model, plan.world_size)
    if handoff is not None:
        handoff.load_moments(te.engine, plan.recipe.handoff.optimizer_step)
    return te


def _build_loaders(plan: RunPlan, p: int):
    from bert_ds.data.loader import build_eval_loader

    phase = plan.recipe.phases[p]
    loader = loader_for_phase(plan, p)
    eval_loader = None
    if p in plan.eval_data:  # several held-out sets: name -> loader, each reported on its own
        loaders = {s.name: build_eval_loader(s.path, micro_batch_size=phase.micro_batch_size, rank=plan.rank,
                                             world_size=plan.world_size, expected_seq_len=phase.seq_len,
                                             expected_vocab_sha256=plan.vocab_sha256,
                                             max_predictions=phase.max_predictions, verify=plan.loader_verify)
                   for s in plan.eval_sources[p]}
        eval_loader = loaders
    elif phase.target_mlm_accuracy is not None and plan.rank == 0:
        log.warning("phases[%d].target_mlm_accuracy=%s is ignored without --eval-data for phase %d: it runs all %d "
                    "steps", p, phase.target_mlm_accuracy, p + 1, phase.steps)
    return loader, eval_loader


def _apply_changed_lr(plan: RunPlan, ph: _Phase, saved: ckpt.RunState, tag: str) -> None:
    """A resume with a changed ``phases[p].lr`` (the non-finite guard's advice): the restored LambdaLR carries the
    saved peak in ``base_lrs``, so rescale it to the recipe's and set the next step's lr from the same point of the
    schedule (warmup/decay position kept)."""
    p = ph.index
    before = float(saved.recipe["phases"][p]["lr"])
    now = plan.recipe.phases[p].lr
    if before == now:
        return
    if plan.rank == 0:
        log.warning("resuming %s with phases[%d].lr=%g (checkpoint was made with %g): the schedule continues from "
                    "step %d at the new peak", tag, p, now, before, ph.step)
    rescale_peak(ph.te.scheduler, now)


def _restore(plan: RunPlan, ph: _Phase, start: StartPoint) -> None:
    """Mid-phase resume: engine and (same rank count) each rank's random streams from the checkpoint, then the loader
    position."""
    p, tag = ph.index, start.tag
    restored = ckpt.restore_run(ph.te.engine, plan.ckpt_dir, tag, plan.rank)
    saved = restored.run_state
    ph.loader.load_state_dict(saved.loader, continue_with_new_mix=plan.args.continue_with_new_mix)
    if ph.loader.mix_change and plan.rank == 0:
        log.warning("resuming %s with a new data mix (--continue-with-new-mix): %s; it starts at global batch %d",
                    tag, ph.loader.mix_change, ph.loader.consumed_global_batches)
    ph.consumed = saved.consumed_samples
    budget = ph.te.time_budget
    if budget is not None:  # the training time spent before the checkpoint counts against the budget
        budget.load_state_dict(saved.time_budget)
        apply_elapsed(ph.te.scheduler, budget, budget.agreed_s)
    _apply_changed_lr(plan, ph, saved, tag)
    if not restored.rng_restored:  # another rank count: dropout does not need per-rank streams (DropoutKey)
        seed_everything(plan.recipe.seed + 1000 * p + 7919 * start.step + plan.rank)
    log.info("resumed %s: phase %d step %d, %d samples consumed (saved on %d ranks, now %d)", tag, p + 1,
             start.step, ph.consumed, saved.world_size, plan.world_size)


def _start_phase(plan: RunPlan, p: int, start: StartPoint) -> _Phase:
    te = _build_model_and_engine(plan, p, start)
    loader, eval_loader = _build_loaders(plan, p)
    ph = _Phase(index=p, te=te, loader=loader, eval_loader=eval_loader, step=start.step, consumed=0,
                last_good=start.tag)
    if start.tag is not None and not start.handoff:
        _restore(plan, ph, start)
    else:
        seed_everything(plan.recipe.seed + 1000 * p + plan.rank)
    described = loader.describe(plan.recipe.phases[p].steps)  # a mix: what each source gives over the phase
    if plan.rank == 0 and described:
        print(f"phase {p + 1} " + "\n".join(described), flush=True)
    return ph


def _save(plan: RunPlan, ph: _Phase, metrics, done: bool) -> None:
    recipe = plan.recipe
    metrics.flush()
    budget = ph.te.time_budget
    state = ckpt.RunState(recipe=recipe.to_dict(), phase=ph.index, step=ph.step, phase_done=done,
                          global_step=plan.first_step_of(ph.index) + ph.step, consumed_samples=ph.consumed,
                          loader=ph.loader.state_dict(), world_size=plan.world_size,
                          zero_stage=recipe.deepspeed.zero_stage, precision=ph.te.precision,
                          vocab_sha256=plan.vocab_sha256, lowercase=plan.lowercase,  # the converter checks tokenizer/
                          time_budget=budget.state_dict() if budget is not None else None)
    tag = ckpt.tag_for(ph.index, ph.step)
    ph.watch.begin(f"phase {ph.index + 1} step {ph.step}: checkpoint save {tag}", slow=True)
    ckpt.save_checkpoint(ph.te.engine, plan.run_dir, tag, state, recipe.logging.keep_last_k)
    ph.last_good = tag
    if plan.rank == 0:
        print(f"checkpoint {plan.ckpt_dir / tag}", flush=True)


def _loss_scale(te) -> float | None:
    """The fp16 dynamic loss scale (None in fp32/bf16, which need none)."""
    return loss_scale(te.engine.optimizer) if te.precision == "fp16" else None


def _log_step(plan: RunPlan, ph: _Phase, rec: StepRecord, metrics) -> None:
    phase = plan.recipe.phases[ph.index]
    metrics.log_step(plan.first_step_of(ph.index) + ph.step, phase=ph.index + 1, seq_len=phase.seq_len,
                     max_predictions=phase.max_predictions, loss=rec.loss, mlm_loss=rec.mlm_loss,
                     nsp_loss=rec.nsp_loss, mlm_accuracy=rec.mlm_accuracy, nsp_accuracy=rec.nsp_accuracy, lr=rec.lr,
                     grad_norm=rec.grad_norm, loss_scale=_loss_scale(ph.te), samples=phase.global_batch_size,
                     step_time=rec.step_time, consumed_samples=ph.consumed)
    metrics.log_scalars(plan.first_step_of(ph.index) + ph.step, ph.loader.data_scalars(ph.index + 1))


def _evaluate_and_maybe_stop(plan: RunPlan, ph: _Phase, metrics, done: bool) -> bool:
    """Evaluate at the eval interval and at the phase end; returns whether the phase is done (the eval accuracy
    reached ``target_mlm_accuracy`` ends it early)."""
    from bert_ds.evaluate import evaluate, evaluate_sources

    phase = plan.recipe.phases[ph.index]
    if ph.eval_loader is None or not (done or (phase.eval_interval and ph.step % phase.eval_interval == 0)):
        return done
    engine = ph.te.engine
    ph.watch.begin(f"phase {ph.index + 1} step {ph.step}: evaluation", slow=True)
    if len(ph.eval_loader) > 1:
        result = evaluate_sources(engine.module, ph.eval_loader, engine.device)
    else:
        result = evaluate(engine.module, next(iter(ph.eval_loader.values())), engine.device)
    metrics.log_eval(plan.first_step_of(ph.index) + ph.step, result)
    engine.train()
    accuracy = result.get("mlm_accuracy")
    target = phase.target_mlm_accuracy
    if done or target is None or accuracy is None or accuracy < target:
        return done
    if plan.rank == 0:
        print(f"phase {ph.index + 1}: eval mlm_accuracy {accuracy:.4f} >= target {target} at step {ph.step}; "
              f"ending the phase", flush=True)
    return True


def _budget_spent(plan: RunPlan, ph: _Phase, rec: StepRecord) -> bool:
    """``time_linear`` phases: the next step's lr from the agreed training time; whether the budget is spent."""
    budget = ph.te.time_budget
    if budget is None:
        return False
    apply_elapsed(ph.te.scheduler, budget, rec.elapsed_s)
    if budget.exhausted and plan.rank == 0:
        print(f"phase {ph.index + 1}: training time {budget.agreed_s / 3600:.3f} h reached "
              f"phases[{ph.index}].budget_hours={budget.budget_hours} at step {ph.step}; ending the phase", flush=True)
    return budget.exhausted


def _max_steps_reached(plan: RunPlan, ph: _Phase) -> bool:
    max_steps = plan.args.max_steps
    return max_steps is not None and plan.first_step_of(ph.index) + ph.step >= max_steps


def _logits_finite(te) -> bool:
    """Whether the current weights give finite MLM and NSP logits on a fixed probe sequence, agreed by all ranks (one
    all-reduce). Evaluation mode under no_grad: no dropout draw, so the random streams (and exact resume) are
    untouched."""
    import deepspeed.comm as dist

    module = te.engine.module
    config = module.config
    n = min(32, config.max_position_embeddings)
    ids = (torch.arange(n, device=te.engine.device) * 7919 % config.vocab_size).unsqueeze(0)
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            mlm, nsp = module.logits(ids, torch.zeros_like(ids), torch.ones_like(ids))
            bad = (~(mlm.isfinite().all() & nsp.isfinite().all())).double().reshape(1)
    finally:
        module.train(was_training)
    dist.all_reduce(bad)
    return bad.item() == 0


def _checkpoint_and_stop(plan: RunPlan, ph: _Phase, rec: StepRecord, metrics, done: bool) -> int | None:
    """Save when the phase ends, on pre-emption, at ``--max-steps`` and at the checkpoint interval; returns the
    exit code to stop with (0 or 75), or None to go on."""
    phase = plan.recipe.phases[ph.index]
    capped = _max_steps_reached(plan, ph)
    must_save = done or rec.preempt_requested or capped
    due = must_save or bool(phase.checkpoint_interval and ph.step % phase.checkpoint_interval == 0)
    # Finite weights are not enough: an lr far too high leaves huge finite weights whose logits overflow to NaN (the
    # next step's loss shows it, after they were saved and older tags pruned). Probe the forward before any save.
    saveable = rec.saveable and (not due or _logits_finite(ph.te))
    if must_save and not saveable:
        # The phase end (or stop) would hand on weights no finite update produced; never save those.
        raise NonFiniteLossError(
            f"phase {ph.index + 1} stops at step {ph.step} with non-finite weights, update or logits (loss "
            f"{rec.loss}); last good checkpoint: {ph.last_good or 'none'} in {plan.ckpt_dir}. Lower "
            f"phases[{ph.index}].lr or check the data; resume with --resume auto.")
    if saveable and due:
        _save(plan, ph, metrics, done)
    if rec.preempt_requested:
        if plan.rank == 0:
            print(f"pre-empted: checkpointed at phase {ph.index + 1} step {ph.step}; exit {EXIT_PREEMPTED}",
                  flush=True)
        return EXIT_PREEMPTED
    if capped and not done:
        return 0
    return None


def run_phase(plan: RunPlan, p: int, start: StartPoint, metrics, preemption: Preemption,
              watch: StallWatchdog | NoWatchdog | None = None) -> PhaseOutcome:
    """Train phase ``p`` from ``start`` to its end (or a stop: pre-emption, ``--max-steps``, early stop at the
    target eval accuracy), marking each stretch of work on ``watch``."""
    recipe = plan.recipe
    watch = watch or NoWatchdog()
    watch.begin(f"phase {p + 1}: set-up (model, engine, checkpoint, loaders)", slow=True)
    ph = _start_phase(plan, p, start)
    if preemption.agreed(ph.te.engine.device):  # a signal during start-up (or the hand-off): stop, nothing to save
        code = preemption.stopped_during_startup(f"before phase {p + 1} step {ph.step + 1}", start.tag, plan.rank)
        return PhaseOutcome(exit_code=code, last_tag=start.tag)
    ph.watch = watch
    guard = NonFiniteGuard(recipe.logging.max_nonfinite_steps, p, ph.te.precision, plan.rank)
    # Start-up is over: the collector back on before the loader forks its workers, so they share the frozen heap.
    if (frozen := startup_gc.resume()) and plan.rank == 0:
        log.info("start-up ran without the garbage collector; %d objects frozen at the first step", frozen)
    it = iter(ph.loader)
    ph.te.engine.train()
    graphs_before = compiled_graphs()
    outcome = _train_loop(plan, ph, it, metrics, preemption, watch, guard)
    if recipe.compile:
        _log_compiles(plan, p, compiled_graphs() - graphs_before, metrics)
    return outcome


def _log_compiles(plan: RunPlan, p: int, graphs: int, metrics) -> None:
    """Once per phase: how many graphs ``torch.compile`` built (a number that grows with the steps is a recompile
    per batch; :data:`~bert_ds.model.compile.COMPILE_BOUND_PER_PHASE` is what the layers need)."""
    text = f"phase {p + 1}: torch.compile built {graphs} graph(s) (bound {COMPILE_BOUND_PER_PHASE})"
    if graphs > COMPILE_BOUND_PER_PHASE:
        log.warning("%s: more than the bound, a batch property is recompiling the layers", text)
    elif plan.rank == 0:
        log.info("%s", text)
    metrics.log_text(f"compile/phase{p + 1}", text)


def _train_loop(plan: RunPlan, ph: _Phase, it: Iterator[dict], metrics, preemption: Preemption, watch,
                guard: NonFiniteGuard) -> PhaseOutcome:
    p, recipe, phase = ph.index, plan.recipe, plan.recipe.phases[ph.index]
    first = True  # compilation, loader start-up and the first collective: a slow stretch
    while ph.step < phase.steps:
        # A loader worker that died is reported at a step boundary, never inside an evaluation or a save (its SIGCHLD
        # handler only records the death): here, one that died during the last step's eval or checkpoint ...
        raise_if_worker_died()
        dropout = DropoutKey(seed=recipe.seed, phase=p, step=ph.step, rank=plan.rank, world_size=plan.world_size)
        watch.begin(f"phase {p + 1} step {ph.step + 1}: training step", slow=first)
        first = False
        rec = train_step(ph.te, it, recipe.nsp, preemption, dropout)
        ph.step += 1
        ph.consumed += phase.global_batch_size
        guard.check(rec, ph.step, ph.last_good, str(plan.ckpt_dir))
        raise_if_worker_died()  # ... and here, one that died during this step's compute (the step is not saved)
        _log_step(plan, ph, rec, metrics)
        done = _evaluate_and_maybe_stop(plan, ph, metrics, ph.step >= phase.steps or _budget_spent(plan, ph, rec))
        code = _checkpoint_and_stop(plan, ph, rec, metrics, done)
        if code is not None:
            return PhaseOutcome(exit_code=code, last_tag=ph.last_good)
        if done:
            break
    return PhaseOutcome(exit_code=0 if _max_steps_reached(plan, ph) else None, last_tag=ph.last_good)
