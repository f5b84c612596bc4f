"""BERT pre-training: the phase loop, checkpoint/resume, pre-emption, logging.

    deepspeed [--num_gpus N] bert_ds/runtime/pretrain.py --recipe ds_configs/bert_large.json --data DIR128 DIR512 \\
        --tokenizer DIR --output RUN_DIR [--resume auto] [--phase 1|2|all] [--max-steps N] [--eval-data DIR ...]
    python -m bert_ds.runtime.pretrain ...      (one process, no launcher: a 1-rank gloo/nccl group is set up here)

Phase hand-off. Phase 2 starts from phase 1's final weights *and* its optimizer moments (LAMB's ``exp_avg`` and
``exp_avg_sq``), with the step count reset to 0 (by default) and phase 2's own warm-up + decay schedule. This is
what NVIDIA DeepLearningExamples does (``run_pretraining.py --phase2`` without ``--resume_phase2`` loads phase 1's
optimizer state dict but zeroes each group's ``step`` and resets the lr, and starts a new ``PolyWarmUpScheduler``;
the fp16 grad scaler starts fresh). Carrying the moments keeps the per-parameter gradient statistics of 7,038 steps
instead of re-estimating them from noise at the start of the short phase 2; resetting the step restarts bias
correction, which rescales the carried moments but does not damp the first updates: LAMB's unclamped trust ratio makes
every update's norm lr * ||w|| per tensor, so phase 2's warm-up alone sets their size. Adam has no trust ratio:
there the restart scales phase 2's first updates by sqrt(1 - b2^t) / (1 - b1^t) (0.15-0.32 over the first 100), so
the paper recipe, one optimizer over both phases as in Google's BERT, continues the count instead (the recipe's
``handoff.optimizer_step``, :class:`bert_ds.recipe.HandoffConfig`). The hand-off is the same code in one invocation
(``--phase all``) and when resuming exactly at the boundary, so both give identical results.

Resume and the run directory. Every check runs in pre-flight (:mod:`bert_ds.runtime.preflight`) before this module
takes the run's lock or writes anything under ``--output``: the recipe, the tokenizer's vocabulary (sha256, size) and
casing against every shard set and against what the checkpoint was trained with, the model config, the loader's
sample stream and the checkpoint's checksums. A refused run leaves the run directory byte for byte as it was. A
checkpoint whose files fail the sha256 recorded at save is skipped by ``--resume auto`` with a loud warning naming the
damaged file, and the run resumes from the newest intact tag before it (the later steps are trained again, exactly);
with no intact tag the run is refused (exit 2). Default rather than opt-in so a requeued pre-empted job recovers
without a person; the warning says which steps are redone.

Exit codes (:class:`bert_ds.exit_codes.ExitCode`, one error line each through :func:`bert_ds.errors.run_main`): 0
done (or ``--max-steps`` reached), 1 a loader worker process died (the message names the shard it was reading), 2 bad
input or an environment that cannot work (recipe, data, a corrupt shard or token id, resume mismatch, another run
holding ``--output``, too little disk for a checkpoint at pre-flight, a checkpoint that holds a non-allow-listed
pickle or has no intact tag left: one line naming the culprit; the last complete checkpoint is kept), 3 non-finite
loss or weights (the last good checkpoint is kept; fp16 steps the loss scaler skipped leave the weights unchanged and
are not counted), 74 a checkpoint save the storage failed (disk full, quota, I/O error; ``latest`` still names the
previous tag), 75 pre-empted (SIGTERM/SIGUSR1: checkpointed at the next step boundary, even the last step of a phase,
or stopped before the first step; resubmit with ``--resume auto``), 124 a rank made no progress for
``--step-timeout`` (:mod:`bert_ds.lifecycle.hang_watchdog`: one line names the stalled ranks; resubmit with
``--resume auto``). What happens to a rank on SIGTERM is :mod:`bert_ds.lifecycle`'s (its docstring follows the path).
"""

from __future__ import annotations

if __name__ == "__main__":  # a rank: a pre-emption signal during the imports below is recorded, not fatal
    from bert_ds.lifecycle import early_signals, startup_gc

    early_signals.catch()
    startup_gc.pause()  # until the first training step (startup_gc)

import argparse
import gc
import json
import logging
import os
import signal
from collections.abc import Sequence
from pathlib import Path

from bert_ds import checkpoint as ckpt
from bert_ds.cli import alias
from bert_ds.cli_args import build_parser, parse
from bert_ds.data.loader import LoaderWorkerError
from bert_ds.errors import BadInput, exit_code_of
from bert_ds.exit_codes import ExitCode
from bert_ds.lifecycle import supervise
from bert_ds.lifecycle.hang_watchdog import start_watchdog
from bert_ds.lifecycle.preemption import Preemption
from bert_ds.recipe import load_recipe
from bert_ds.runtime.preflight import RunArgs, RunPlan, StartPoint, plan_run
from bert_ds.runtime.trainer import EXIT_PREEMPTED, NonFiniteLossError, run_phase

__all__ = ["EXIT_BAD_INPUT", "EXIT_FAILED", "EXIT_NONFINITE", "EXIT_PREEMPTED", "NonFiniteLossError", "main",
           "parse_args", "preflight", "train"]

EXIT_FAILED = ExitCode.FAILED
EXIT_BAD_INPUT = ExitCode.BAD_INPUT
EXIT_NONFINITE = ExitCode.NONFINITE
log = logging.getLogger(__name__)


def cli_parser() -> argparse.ArgumentParser:
    """The parser generated from :class:`RunArgs` (``--local_rank``, which the ``deepspeed`` launcher appends, is
    accepted and dropped: ranks read ``LOCAL_RANK``)."""
    parser = build_parser(RunArgs, PROG, __doc__.split("\n\n")[0])
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return parser


def parse_args(argv: Sequence[str] | None = None) -> RunArgs:
    """The command line as :class:`RunArgs`, as ``bert-ds pretrain`` parses it."""
    return parse(RunArgs, cli_parser(), argv)


def _metrics_logger(plan: RunPlan):
    from bert_ds.runtime.metrics import MetricsLogger, detect_peak_tflops

    recipe = plan.recipe
    return MetricsLogger(plan.run_dir / "tensorboard", rank=plan.rank, model_config=plan.model_config,
                         peak_tflops=recipe.logging.peak_tflops or detect_peak_tflops(plan.precision),
                         log_interval=recipe.logging.interval, world_size=plan.world_size)


def run(plan: RunPlan, preemption: Preemption | None = None) -> int:
    """Run the planned phases in order; returns the exit code."""
    from bert_ds.runtime.distributed import release_shm_buffers

    if plan.nothing_to_do:
        if plan.rank == 0:
            print(plan.nothing_to_do, flush=True)
        return 0
    # The first writes under --output, after every pre-flight and resume check passed (plan_run): the lock, then the
    # metadata: this run's recipe, model config and tokenizer. On a resume pre-flight has checked them against the
    # checkpoint; the fields a resume may change (lr, name, data, ...) are written as this run has them.
    run_lock = ckpt.hold_run_dir(plan.run_dir, plan.rank)  # one run per --output (exit 2 naming the holder)
    if plan.rank == 0:
        ckpt.write_run_metadata(plan.run_dir, plan.recipe, plan.model_config, plan.args.tokenizer)
        ckpt.set_aside_damaged(plan.ckpt_dir, plan.start.damaged, plan.start.tag)
        if plan.start.tag is not None and (last_save := ckpt.read_last_save(plan.ckpt_dir)) is not None:
            log.info("the previous run's last %s", ckpt.save_time_line(last_save))
    preemption = preemption or Preemption().arm()
    metrics = _metrics_logger(plan)
    # A stalled rank ends the job from a thread (os._exit): flush what the run has logged, free this rank's buffers.
    watch = start_watchdog(plan.run_dir, plan.rank, plan.world_size, plan.args.step_timeout,
                           before_exit=(metrics.flush, release_shm_buffers))
    try:
        if plan.rank == 0:
            metrics.log_text("recipe", "```\n" + json.dumps(plan.recipe.to_dict(), indent=2) + "\n```")
        start = plan.start
        while start.phase in plan.phases:
            outcome = run_phase(plan, start.phase, start, metrics, preemption, watch)
            if outcome.exit_code is not None:
                return outcome.exit_code
            start = StartPoint(phase=start.phase + 1, step=0, tag=outcome.last_tag, handoff=True)
            gc.collect()  # the finished phase's engine and loader workers
        return 0
    finally:
        watch.stop()
        metrics.close()
        if run_lock is not None:
            run_lock.release()


def _check_output(output: str) -> None:
    """Refuse an ``--output`` that can never hold a run before any rank starts: a file, or a directory (or its nearest
    existing ancestor) on a read-only file system or not writable (else a traceback from the lock's mkdir, exit 1)."""
    run_dir = Path(output)
    existing = run_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise BadInput(f"--output {output}: {existing} is a file, not a directory; name a run directory")
    if os.statvfs(existing).f_flag & os.ST_RDONLY:
        raise BadInput(f"--output {output}: {existing} is on a read-only file system; name a writable run directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise BadInput(f"--output {output}: {existing} is not writable by this user; name a writable run directory")


def preflight(argv: Sequence[str], rank: int = 0, world_size: int = 1) -> RunPlan:
    """What ``main`` decides before any rank joins a process group or writes anything, as rank ``rank`` of
    ``world_size``: the command line, ``--output``, the recipe and :func:`~bert_ds.runtime.preflight.plan_run`.
    Raises what ``main`` turns into exit 2 (ValueError, FileNotFoundError; argparse's SystemExit(2) for the command
    line), so a refusal can be tested in-process, without ranks."""
    args = parse_args(argv)
    _check_output(args.output)
    return plan_run(args, load_recipe(args.recipe), rank, world_size)


def train(args: RunArgs, preemption: Preemption | None = None) -> int:
    """Run (or resume) the phases ``args`` select; returns the exit code. A pre-emption signal during start-up
    (``preemption`` armed by ``main`` first thing) stops the rank before it joins the process group, or, once it
    joined, before the first step (:func:`~bert_ds.runtime.trainer.run_phase`), having written nothing."""
    from bert_ds.runtime.distributed import init_distributed, release_shm_buffers

    preemption = preemption or Preemption().arm()
    _check_output(args.output)
    recipe = load_recipe(args.recipe)
    if preemption.requested:
        return preemption.stopped_during_startup("before joining the process group", None)
    rank, world_size = init_distributed(recipe.deepspeed.process_group_timeout_s)
    try:  # however the rank ends, init_distributed has it leave the process group at exit
        return run(plan_run(args, recipe, rank, world_size), preemption)
    finally:
        release_shm_buffers()


PROG = "bert_ds.runtime.pretrain"
"""How every rank's error line starts (``bert_ds.runtime.pretrain: error: ...``), whichever name started it."""


main = alias("pretrain")


def _run(args: RunArgs) -> int:
    """Once the command line is parsed (:func:`bert_ds.cli.run`): arms the pre-emption handler before anything else
    (SIGTERM/SIGUSR1 from here on end in exit 75, never 143), trains, and reports the exit code to ``bert-ds
    deepspeed`` when it started this rank (:mod:`bert_ds.lifecycle.supervise`): what :func:`bert_ds.errors.exit_code_of`
    makes of an error, 1 for a bug (an exception that escapes is Python's exit 1)."""
    preemption = Preemption().arm()
    supervise.arm()
    code = ExitCode.FAILED
    try:
        code = _train(args, preemption)
        return code
    except Exception as exc:
        code = exit_code_of(exc) or ExitCode.FAILED
        raise
    finally:
        supervise.report_exit(code)
        preemption.disarm()  # the exit code is decided: a pre-emption signal from here on is moot


def _train(args: RunArgs, preemption: Preemption) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return train(args, preemption)
    except LoaderWorkerError as exc:  # a worker process died (e.g. killed for memory): not bad input, but one line
        if Preemption.last_signal is None:
            raise
        # e.g. the deepspeed launcher ending every rank after one failed
        raise LoaderWorkerError(f"stopped by {signal.Signals(Preemption.last_signal).name} (the launcher ends all "
                                f"ranks when one fails; look for the first failing rank above) while loader workers "
                                f"were ending: {exc}") from exc


if __name__ == "__main__":
    from bert_ds.lifecycle.rank_exit import end_process

    end_process(main())  # without the interpreter's teardown: seconds of garbage collection (see rank_exit)
