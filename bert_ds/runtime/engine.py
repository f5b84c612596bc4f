"""The one place that wires model + optimizer + DeepSpeed config together.

``build_engine`` takes a recipe and a phase and returns a ready DeepSpeed engine whose client optimizer is
:class:`bert_ds.optim.ZeroAwareLamb` (or AdamW) bound to ZeRO's partition layout, with the phase's warm-up +
decay schedule. The DeepSpeed config dict is generated here from the phase's batch sizes; nothing else in
the package writes one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import deepspeed
import torch
from torch.optim.lr_scheduler import LambdaLR

from bert_ds.config import BertConfig
from bert_ds.deepspeed_internals import (
    check_deepspeed_version,
    import_muon_compiling_on_first_call,
    quiet_moot_warnings,
    zero1_keeps_zero_optimizer,
)
from bert_ds.errors import BadInput
from bert_ds.model import BertForPreTraining
from bert_ds.model.compile import compile_model
from bert_ds.optim import GlobalNormClip, TimeBudget, bind_optimizer, build_optimizer, lr_lambda
from bert_ds.recipe import PhaseConfig, Recipe, check_grad_accum_stage, gradient_accumulation_steps

__all__ = ["TrainEngine", "build_engine", "build_model", "check_kernel_support", "check_optimizer_support",
           "deepspeed_config", "fp32_grad_sums", "initialize_deepspeed", "own_stage0_clip", "phase_scheduler",
           "resolve_precision"]

log = logging.getLogger(__name__)


def resolve_precision(requested: str, device_type: str) -> str:
    """``auto`` -> bf16 on GPU, fp32 on CPU. An explicit ``bf16`` runs as asked on CPU too (DeepSpeed 0.19's bf16
    ZeRO-1/2 path runs on CPU ranks; ``tests/optim/test_lamb_bf16.py`` checks it against fp32); ``fp16`` on CPU is
    refused before any compute, as DeepSpeed would refuse it ("Type fp16 is not supported on your device")."""
    if device_type == "cpu":
        if requested == "fp16":
            raise BadInput("deepspeed.precision='fp16' is not supported on CPU (DeepSpeed refuses fp16 there); use "
                           "'bf16', 'fp32' or 'auto' (fp32 on CPU, bf16 on GPU)")
        return "fp32" if requested == "auto" else requested
    return "bf16" if requested == "auto" else requested


def check_optimizer_support(recipe: Recipe, precision: str) -> None:
    """Refuse, before any compute, the combinations :func:`bert_ds.optim.bind_optimizer` cannot bind: without ZeRO,
    DeepSpeed wraps a half-precision client optimizer in FP16_Optimizer/BF16_Optimizer, whose flat layout
    ZeroAwareLamb does not know. ``precision`` is the resolved one (see :func:`resolve_precision`)."""
    ds = recipe.deepspeed
    if recipe.optimizer.name == "lamb" and ds.zero_stage == 0 and precision in ("bf16", "fp16"):
        raise BadInput(f"optimizer.name='lamb' with deepspeed.zero_stage=0 and deepspeed.precision="
                       f"{ds.precision!r} (resolved to {precision}) is not supported: ZeroAwareLamb runs without "
                       f"ZeRO in fp32 only; set deepspeed.zero_stage to 1 or 2, or deepspeed.precision to 'fp32'")
    if precision == "bf16":
        try:
            check_grad_accum_stage(ds.grad_accum_dtype, ds.zero_stage)
        except ValueError as e:
            raise BadInput(f"{e} (deepspeed.precision={ds.precision!r} resolved to bf16)") from None


def check_kernel_support(recipe: Recipe, precision: str, device_type: str, recipe_path: str) -> None:
    """Refuse, in pre-flight (before any rank builds a model), what the kernel registry would refuse at the first
    attention call: ``kernels='triton'`` on CUDA with a resolved precision of fp32
    (:data:`bert_ds.kernels.registry.FP32_ATTENTION_REFUSED`). CPU ranks run the same kernels under
    ``TRITON_INTERPRET=1`` in fp32 (the CPU tests' twin of the GPU path), so only CUDA is refused."""
    from bert_ds.kernels.registry import FP32_ATTENTION_REFUSED

    if recipe.kernels == "triton" and precision == "fp32" and device_type == "cuda":
        raise BadInput(f"{recipe_path}: kernels='triton' with deepspeed.precision={recipe.deepspeed.precision!r} "
                       f"(resolved to fp32) on CUDA: {FP32_ATTENTION_REFUSED}; set deepspeed.precision to 'bf16' "
                       f"or 'fp16', or kernels to 'auto' or 'torch'")


def fp32_grad_sums(recipe: Recipe, precision: str) -> bool:
    """Whether this run sums bf16 gradients in fp32 (``deepspeed.grad_accum_dtype``, bf16 runs under ZeRO 1/2)."""
    return precision == "bf16" and recipe.deepspeed.grad_accum_dtype == "fp32" and recipe.deepspeed.zero_stage in (1, 2)


def own_stage0_clip(zero_stage: int, precision: str) -> bool:
    """Whether bert_ds, not DeepSpeed, clips gradients: ZeRO stage 0 in fp32, where DeepSpeed's
    ``clip_fp32_gradients`` takes fp32 per-tensor norms (off by ~3e-5 on CPU) while ZeRO 1/2 accumulate in fp64, so
    the stages would clip by different factors (``bert_ds/optim/clip.py``). Half precision at stage 0 is clipped
    inside DeepSpeed's fp16/bf16 optimizer wrapper, which is left as it is."""
    return zero_stage == 0 and precision == "fp32"


def deepspeed_config(recipe: Recipe, phase: PhaseConfig, world_size: int, precision: str,
                     where: str = "phase") -> dict:
    """DeepSpeed's config for one phase; raises ValueError before any compute if the batch sizes do not divide."""
    accumulation = gradient_accumulation_steps(phase, world_size, where)
    ds = recipe.deepspeed
    config: dict = {
        "train_batch_size": phase.global_batch_size,
        "train_micro_batch_size_per_gpu": phase.micro_batch_size,
        "gradient_accumulation_steps": accumulation,
        # Stage 0 fp32: bert_ds clips (GlobalNormClip, fp64 norm like ZeRO 1/2), DeepSpeed's fp32-norm clip is off.
        "gradient_clipping": 0.0 if own_stage0_clip(ds.zero_stage, precision) else ds.gradient_clipping,
        "steps_per_print": 1 << 30,  # bert_ds.runtime.metrics does the logging
        "wall_clock_breakdown": False,
        # LAMB is not on ZeRO's tested list; ZeroAwareLamb handles ZeRO's flat partitions itself (bert_ds.optim).
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": ds.zero_stage},
    }
    if ds.zero_stage in (1, 2):
        # elastic_checkpoint: each rank's optimizer state is saved as flat partitions that DeepSpeed merges and
        # re-partitions on load, so a checkpoint resumes onto a different number of ranks (bert_ds.checkpoint).
        config["zero_optimization"].update({"contiguous_gradients": ds.contiguous_gradients,
                                            "overlap_comm": ds.overlap_comm,
                                            "reduce_bucket_size": ds.reduce_bucket_size,
                                            "allgather_bucket_size": ds.allgather_bucket_size,
                                            "elastic_checkpoint": True})
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
        if fp32_grad_sums(recipe, precision):
            # Both halves of the sum in fp32. Over micro batches, DeepSpeed 0.19's DeepSpeedZeroOptimizer adds each
            # bf16 gradient into fp32 (deepspeed/runtime/zero/stage_1_and_2.py:397-404): ZeRO-1 into a whole-tensor
            # param.grad_accum (:1234-1240), ZeRO-2 the reduced gradient into its fp32 partition (:1259-1300,
            # :1324-1326). Over ranks, the reduction runs in communication_data_type, bf16 by default
            # (runtime/engine.py:1719-1730; the cast: stage_1_and_2.py:2376-2377).
            # Measured on 2 CPU ranks, 64 micro batches: fp32 accumulation with a bf16 reduction is still 1e-3-2e-3
            # off the exact sum, both in fp32 4e-9 (tests/optim/test_grad_accum_bf16.py). ZeRO-1 also needs
            # zero1_keeps_zero_optimizer at initialize (initialize_deepspeed).
            config["data_types"] = {"grad_accum_dtype": "fp32"}
            config["communication_data_type"] = "fp32"
    elif precision == "fp16":
        config["fp16"] = {"enabled": True, "loss_scale": ds.loss_scale, "initial_scale_power": ds.initial_scale_power,
                          "loss_scale_window": ds.loss_scale_window, "hysteresis": ds.hysteresis,
                          "min_loss_scale": ds.min_loss_scale}
    return config


def build_model(recipe: Recipe, model_config: BertConfig, init_from_hf: str | None = None,
                state_dict: dict | None = None) -> BertForPreTraining:
    """The single-device model, initialised from the recipe seed (identical on every rank), a Hugging Face
    directory, or a state dict (phase hand-off, re-partitioned resume).

    With ``recipe.nsp`` false the pooler and the NSP head are frozen: they get no gradient, and under ZeRO 1/2
    DeepSpeed would hand LAMB zero gradients for them, so weight decay alone (u = wd * w, trust ratio 1 / wd) would
    shrink them by a factor (1 - lr) every step."""
    torch.manual_seed(recipe.seed)
    act_ckpt = recipe.deepspeed.activation_checkpointing
    if init_from_hf is not None:
        from bert_ds.export.hf import load_hf_pretrained

        model = load_hf_pretrained(init_from_hf, kernels=recipe.kernels, activation_checkpointing=act_ckpt,
                                   pad_vocab_to_multiple_of=model_config.pad_vocab_to_multiple_of,
                                   hidden_dropout_prob=model_config.hidden_dropout_prob,
                                   attention_probs_dropout_prob=model_config.attention_probs_dropout_prob)
        if model.config != model_config:
            raise BadInput(f"--init-from-hf {init_from_hf}: its config {model.config} differs from the run's "
                           f"{model_config}")
    else:
        model = BertForPreTraining(model_config, kernels=recipe.kernels, activation_checkpointing=act_ckpt)
    if state_dict is not None:
        missing, unexpected = model.load_state_dict(state_dict, strict=False)
        # The decoder weight is tied to the word embeddings and may be stored under either name only.
        missing = [k for k in missing if k != "cls.predictions.decoder.weight"]
        if missing or unexpected:
            raise BadInput(f"state dict does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    if not recipe.nsp:
        model.bert.pooler.requires_grad_(False)
        model.cls.seq_relationship.requires_grad_(False)
    if recipe.compile:
        compile_model(model)  # in place: parameter names (checkpoints, export) unchanged
    return model


@dataclass
class TrainEngine:
    engine: deepspeed.DeepSpeedEngine
    scheduler: LambdaLR
    ds_config: dict
    precision: str
    accumulation: int
    clip: GlobalNormClip | None = None
    """Stage 0 fp32 only: the clip bert_ds runs instead of DeepSpeed's; it keeps the norm DeepSpeed does not."""
    time_budget: TimeBudget | None = None
    """``schedule: time_linear`` only: the phase's training time against ``budget_hours`` (the schedule reads it)."""

    @property
    def device(self) -> torch.device:
        return self.engine.device

    def current_lr(self) -> float:
        return self.engine.get_lr()[0]

    def grad_norm(self) -> float | None:
        """Global gradient norm (before clipping) of the last optimizer step at any ZeRO stage, None before the
        first step. Call it after ``engine.step()`` at the accumulation boundary."""
        if self.clip is not None:
            return self.clip.last_norm
        norm = self.engine.get_global_grad_norm()  # ZeRO 1/2, and DeepSpeed's fp16/bf16 wrappers
        return None if norm is None else float(norm)


def phase_scheduler(optimizer: torch.optim.Optimizer, phase: PhaseConfig,
                    clock: Callable[[], float] = time.monotonic) -> tuple[LambdaLR, TimeBudget | None]:
    """The phase's lr schedule on ``optimizer`` (stepped once per optimizer step), and its time budget when the
    schedule is ``time_linear`` (None otherwise)."""
    schedule_steps = phase.schedule_steps or phase.steps  # a schedule longer than the phase: the paper's recipe
    budget = TimeBudget(phase.budget_hours, clock) if phase.schedule == "time_linear" else None
    factor = lr_lambda(phase.schedule, schedule_steps, phase.warmup_fraction, phase.decay_power,
                       phase.final_lr_fraction, budget)
    return LambdaLR(optimizer, factor), budget


def initialize_deepspeed(model: torch.nn.Module, optimizer: torch.optim.Optimizer, ds_config: dict,
                         scheduler: LambdaLR | None = None) -> deepspeed.DeepSpeedEngine:
    """``deepspeed.initialize`` as bert_ds runs it, then :func:`bert_ds.optim.bind_optimizer`: bf16 ZeRO-1 with fp32
    gradient sums keeps DeepSpeedZeroOptimizer (:func:`bert_ds.deepspeed_internals.zero1_keeps_zero_optimizer`; the
    layout ZeroAwareLamb binds to and the checkpoint format bert_ds re-cuts), and the moot warnings stay quiet."""
    quiet_moot_warnings()
    import_muon_compiling_on_first_call()  # DeepSpeed imports it in deepspeed.initialize; inductor is not needed
    with zero1_keeps_zero_optimizer():
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                               config=ds_config)
    bind_optimizer(engine)
    return engine


def build_engine(recipe: Recipe, phase_index: int, model: BertForPreTraining, world_size: int,
                 clock: Callable[[], float] = time.monotonic) -> TrainEngine:
    """Wrap ``model`` in a DeepSpeed engine for ``recipe.phases[phase_index]`` with a fresh optimizer and schedule;
    ``clock`` (seconds) measures a ``time_linear`` phase's training time."""
    from deepspeed.accelerator import get_accelerator

    check_deepspeed_version()
    phase = recipe.phases[phase_index]
    where = f"phases[{phase_index}]"
    precision = resolve_precision(recipe.deepspeed.precision, get_accelerator().device_name())
    check_optimizer_support(recipe, precision)
    ds_config = deepspeed_config(recipe, phase, world_size, precision, where)
    opt = recipe.optimizer
    lamb_kw = {}
    if opt.name == "lamb":
        lamb_kw["bias_correction"] = opt.bias_correction
        lamb_kw["trust_ratio"] = opt.trust_ratio
        if opt.trust_clamp is not None:
            lamb_kw["min_trust"], lamb_kw["max_trust"] = opt.trust_clamp
    optimizer = build_optimizer(opt.name, model, phase.lr, weight_decay=opt.weight_decay, betas=opt.betas,
                                eps=opt.eps, zero_stage=recipe.deepspeed.zero_stage, **lamb_kw)
    scheduler, budget = phase_scheduler(optimizer, phase, clock)
    clip = None
    if own_stage0_clip(recipe.deepspeed.zero_stage, precision):
        clip = GlobalNormClip(recipe.deepspeed.gradient_clipping).attach(optimizer)
    engine = initialize_deepspeed(model, optimizer, ds_config, scheduler)
    return TrainEngine(engine=engine, scheduler=scheduler, ds_config=ds_config, precision=precision,
                       accumulation=ds_config["gradient_accumulation_steps"], clip=clip, time_budget=budget)
