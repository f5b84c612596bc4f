"""Training recipes: one typed dataclass per concern, loaded from JSON and validated before any compute.

A recipe fixes everything that decides the numbers a run produces (model, optimizer, phases, precision). Batch sizes
live only in the phases; DeepSpeed's ``train_batch_size`` / ``gradient_accumulation_steps`` are derived from them
in :mod:`bert_ds.runtime.engine`, which refuses inconsistent values.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bert_ds.config import MODEL_PRESETS, BertConfig, model_preset
from bert_ds.errors import BadInput

__all__ = ["OptimizerConfig", "DataSource", "PhaseConfig", "DeepSpeedSection", "LoggingConfig", "HandoffConfig",
           "Recipe", "load_recipe", "check_grad_accum_stage", "gradient_accumulation_steps", "resume_blockers"]

_KERNELS = ("auto", "triton", "torch", "apex")
_TRUST_RATIO_RULES = ("all", "decay_only")
"""``optimizer.trust_ratio`` values; the same names as ``ZeroAwareLamb(trust_ratio=...)``."""
_PRECISIONS = ("auto", "bf16", "fp16", "fp32")
_GRAD_ACCUM_DTYPES = ("fp32", "bf16")
"""``deepspeed.grad_accum_dtype`` values (DeepSpeed's ``data_types.grad_accum_dtype`` names)."""
_SCHEDULES = ("warmup_poly", "nvidia_poly", "composer_linear", "time_linear")
"""``phase.schedule`` values; the formulas are in :mod:`bert_ds.optim.schedule` (its ``SCHEDULES``)."""
_DEFAULT_MASKED_LM_PROB = 0.15  # BERT paper §3.1
_HANDOFF_STEPS = ("reset", "continue")
"""``handoff.optimizer_step`` values."""


def check_grad_accum_stage(grad_accum_dtype: str, zero_stage: int) -> None:
    """Refuse fp32 gradient sums for a bf16 run where they cannot be had: without ZeRO, DeepSpeed 0.19 refuses bf16
    with fp32 accumulation (``runtime/engine.py:2323``, "unsupported mix"); under ZeRO-3 its fp32 path is not proven
    here (``tests/optim/test_grad_accum_bf16.py`` covers ZeRO 1/2). The recipe calls this for an explicit bf16, the
    engine for ``auto`` once it is resolved to bf16."""
    if grad_accum_dtype == "fp32" and zero_stage not in (1, 2):
        raise BadInput(f"deepspeed.grad_accum_dtype='fp32' (the default) sums bf16 gradients in fp32 under ZeRO "
                         f"stage 1 or 2 only, and deepspeed.zero_stage is {zero_stage}: set deepspeed.zero_stage to "
                         f"1 or 2, or deepspeed.grad_accum_dtype to 'bf16' to sum in bf16")


def _positive_int(owner: str, name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise BadInput(f"{owner}.{name} must be a positive integer, got {value!r}")


def _non_negative_int(owner: str, name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise BadInput(f"{owner}.{name} must be a non-negative integer, got {value!r}")


@dataclass
class OptimizerConfig:
    name: str = "lamb"
    """``lamb`` (You et al. 2019; NVIDIA and bing_bert recipes) or ``adamw``."""
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-6
    weight_decay: float = 0.01
    """Decoupled weight decay; never applied to biases or LayerNorm parameters (NVIDIA recipe)."""
    trust_clamp: tuple[float, float] | None = None
    """LAMB only: clamp the trust ratio to [min, max]; bing_bert uses [0.01, 0.3]. ``None``: unclamped (NVIDIA)."""
    bias_correction: bool = True
    trust_ratio: str = "all"
    """LAMB only: which tensors get the trust ratio ``||w|| / ||u||``. ``all``: every tensor ("NVLAMB"; apex
    ``FusedLAMB(use_nvlamb=True)``, timm ``Lamb(always_adapt=True)``). ``decay_only``: only tensors with weight decay;
    biases and LayerNorm take plain ``lr * u`` steps (``use_nvlamb=False``: the default of NVIDIA's
    ``FusedLAMBAMP``, ``lamb_amp_opt/fused_lamb/fused_lamb.py``, which NVIDIA's BERT ``run_pretraining.py`` steps,
    and of apex's ``FusedLAMB`` that its earlier versions used; timm's default ``always_adapt=False``). Under
    ``all`` an attention key bias, whose true gradient is 0 (softmax cancels it), still moves by ``lr * ||b||`` per
    step of rounding noise. The default stays ``all`` because recipes saved before this field existed were trained
    that way."""

    def __post_init__(self) -> None:
        if self.name not in ("lamb", "adamw"):
            raise BadInput(f"optimizer.name={self.name!r}: choose 'lamb' or 'adamw'")
        self.betas = tuple(self.betas)
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise BadInput(f"optimizer.betas={list(self.betas)!r}: need two values in [0, 1)")
        if not self.eps > 0:
            raise BadInput(f"optimizer.eps={self.eps!r} must be > 0")
        if not self.weight_decay >= 0:
            raise BadInput(f"optimizer.weight_decay={self.weight_decay!r} must be >= 0")
        if self.trust_clamp is not None:
            self.trust_clamp = tuple(self.trust_clamp)
            if len(self.trust_clamp) != 2 or not 0 <= self.trust_clamp[0] <= self.trust_clamp[1]:
                raise BadInput(f"optimizer.trust_clamp={list(self.trust_clamp)!r}: need [min, max], 0 <= min <= max")
            if self.name != "lamb":
                raise BadInput("optimizer.trust_clamp is a LAMB setting; remove it for adamw")
        if self.trust_ratio not in _TRUST_RATIO_RULES:
            raise BadInput(f"optimizer.trust_ratio={self.trust_ratio!r}: choose one of {_TRUST_RATIO_RULES}")
        if self.name != "lamb" and self.trust_ratio != "all":
            raise BadInput(f"optimizer.trust_ratio={self.trust_ratio!r} is a LAMB setting; remove it for adamw")


@dataclass
class DataSource:
    """One shard set a phase trains on, and its weight in the phase's mix (``phases[i].data``)."""

    path: str
    """A shard directory: absolute, or relative to the directory of the recipe file (:func:`load_recipe` makes it
    absolute), not to the working directory, so a recipe means the same data wherever a job starts."""
    weight: float | None = None
    """Its share of each global batch relative to the other sources' weights (any positive numbers: 3 and 1 give 75%
    and 25%). Left out only when the phase reads a single source: then the single-set loader and its sample order."""


def _data_source(value: Any, where: str) -> DataSource:
    """A ``phases[i].data`` element (a JSON object or a :class:`DataSource`) checked: a non-empty ``path``, a weight
    that is a positive finite number or absent; errors name ``where`` and the field."""
    if isinstance(value, dict):
        unknown = sorted(set(value) - {"path", "weight"})
        if unknown or "path" not in value:
            raise BadInput(f"{where} must be {{\"path\": DIR, \"weight\": W}}, got keys {sorted(value)}")
        value = DataSource(**value)
    if not isinstance(value, DataSource):
        raise BadInput(f"{where} must be {{\"path\": DIR, \"weight\": W}}, got {value!r}")
    if not isinstance(value.path, str) or not value.path:
        raise BadInput(f"{where}.path={value.path!r} must name a shard directory")
    w = value.weight
    if w is not None and (isinstance(w, bool) or not isinstance(w, int | float) or not (math.isfinite(w) and w > 0)):
        raise BadInput(f"{where}.weight={w!r} must be a positive number")
    return DataSource(value.path, None if w is None else float(w))


@dataclass
class PhaseConfig:
    seq_len: int
    steps: int
    """Optimizer steps in this phase (each consumes ``global_batch_size`` sequences); with ``schedule: time_linear``
    the most steps the phase may take (it ends at ``budget_hours`` or here, whichever comes first)."""
    global_batch_size: int
    micro_batch_size: int
    """Sequences per rank per forward pass; accumulation = global / (micro * world size)."""
    lr: float
    warmup_fraction: float
    max_predictions: int
    """Masked positions per sequence (Google/NVIDIA: 20 at seq 128, 80 at seq 512); shards must match."""
    decay_power: float = 0.5
    """Polynomial decay power (NVIDIA's PolyWarmUpScheduler uses 0.5; 1.0 is linear decay). The linear schedules
    (``composer_linear``, ``time_linear``) need 1.0."""
    schedule: str = "warmup_poly"
    """The warm-up + decay formula (:mod:`bert_ds.optim.schedule`). ``warmup_poly``: warm-up over
    ``int(warmup_fraction * S)`` steps, then decay to 0 from the warm-up's end. ``nvidia_poly``: NVIDIA's
    ``PolyWarmUpScheduler``, decay ``(1 - n / S) ** decay_power`` from the phase start. ``composer_linear``:
    Composer's ``LinearWithWarmupScheduler`` (MosaicBERT), linear decay to ``final_lr_fraction``. ``time_linear``:
    academic-budget-bert's time-based schedule over ``budget_hours`` of training time."""
    final_lr_fraction: float = 0.0
    """``composer_linear`` only: the lr at the end of the schedule, as a fraction of ``lr`` (MosaicBERT: 0.02)."""
    budget_hours: float | None = None
    """``time_linear`` only (and required there): the training-time budget in hours. Warm-up takes the first
    ``warmup_fraction`` of it, the lr reaches 0 at its end and the phase stops there; the elapsed time is saved in
    each checkpoint and continues on resume. Such a phase must be the recipe's last."""
    schedule_steps: int | None = None
    """Length of the warm-up + decay schedule when it is longer than the phase (``None``: ``steps``). Warm-up is
    ``warmup_fraction * schedule_steps`` and the lr would reach 0 at ``schedule_steps``; the phase stops at ``steps``.
    The BERT paper decays linearly over 1M steps but switches to seq 512 at step 900,000: phase 1 runs 900,000 steps
    of a 1,000,000-step schedule, and phase 2 continues the same line from the lr it had reached."""
    target_mlm_accuracy: float | None = None
    """Stop the phase early once evaluation MLM accuracy reaches this (MLPerf: 0.720); needs eval data."""
    eval_interval: int = 0
    """Evaluate every N steps (0: only at the end of the phase, when eval data is given)."""
    checkpoint_interval: int = 0
    """Checkpoint every N steps (0: only at the end of the phase and on pre-emption)."""
    dynamic_masking: bool | None = None
    """Re-mask on the fly each epoch; ``None`` keeps the shards' static masks."""
    masked_lm_prob: float = _DEFAULT_MASKED_LM_PROB
    """Dynamic masking only: fraction of tokens to predict (BERT paper §3.1: 0.15; MosaicBERT: 0.30)."""
    shuffle_window_shards: int = 8
    """Loader shuffle window in shards: samples are shuffled across this many shards at a time, which also spreads
    near-duplicate copies that the data pipeline writes into different shards."""
    data: list[DataSource] | None = None
    """The shard sets this phase trains on, each with a weight (a mix, ``[{"path": "wiki128/", "weight": 3},
    {"path": "books128/", "weight": 1}]``), or one set (``[{"path": "wiki128/"}]``). ``--data`` on the command line
    replaces it (logged); ``None``: ``--data`` must name the phase's data. Free on resume: the loader state decides
    whether the mix changed (docs/data.md)."""

    def __post_init__(self) -> None:
        for name in ("seq_len", "steps", "global_batch_size", "micro_batch_size", "max_predictions",
                     "shuffle_window_shards"):
            _positive_int("phase", name, getattr(self, name))
        for name in ("eval_interval", "checkpoint_interval"):
            _non_negative_int("phase", name, getattr(self, name))
        if self.schedule_steps is not None:
            _positive_int("phase", "schedule_steps", self.schedule_steps)
            if self.schedule_steps < self.steps:
                raise BadInput(f"phase.schedule_steps={self.schedule_steps} is shorter than phase.steps={self.steps}")
        if self.global_batch_size % self.micro_batch_size:
            raise BadInput(f"phase.global_batch_size={self.global_batch_size} is not a multiple of "
                             f"phase.micro_batch_size={self.micro_batch_size}")
        if not self.lr > 0:
            raise BadInput(f"phase.lr={self.lr!r} must be > 0")
        if not 0.0 <= self.warmup_fraction < 1.0:
            raise BadInput(f"phase.warmup_fraction={self.warmup_fraction!r} must be in [0, 1)")
        if not self.decay_power > 0:
            raise BadInput(f"phase.decay_power={self.decay_power!r} must be > 0")
        self._check_schedule()
        if self.max_predictions > self.seq_len:
            raise BadInput(f"phase.max_predictions={self.max_predictions} exceeds phase.seq_len={self.seq_len}")
        if not 0.0 < self.masked_lm_prob < 1.0:
            raise BadInput(f"phase.masked_lm_prob={self.masked_lm_prob!r} must be in (0, 1)")
        if not self.dynamic_masking and self.masked_lm_prob != _DEFAULT_MASKED_LM_PROB:
            raise BadInput(f"phase.masked_lm_prob={self.masked_lm_prob!r} needs phase.dynamic_masking=true (static "
                             f"masks come with the shards)")
        if self.target_mlm_accuracy is not None and not 0.0 < self.target_mlm_accuracy <= 1.0:
            raise BadInput(f"phase.target_mlm_accuracy={self.target_mlm_accuracy!r} must be in (0, 1]")
        self._check_data()

    def _check_data(self) -> None:
        """``data``: None, or a non-empty list of sources, each weighted when there are several, no name twice."""
        if self.data is None:
            return
        if not isinstance(self.data, list) or not self.data:
            raise BadInput(f"phase.data={self.data!r} must be a non-empty list of {{\"path\": DIR, \"weight\": W}} "
                             f"(or left out, for --data)")
        self.data = [_data_source(e, f"phase.data[{i}]") for i, e in enumerate(self.data)]
        if len(self.data) > 1:
            bare = [i for i, e in enumerate(self.data) if e.weight is None]
            if bare:
                raise BadInput(f"phase.data[{bare[0]}] ({self.data[bare[0]].path!r}) has no weight; give every "
                                 f"source of a mix one")
        names = [Path(e.path).name or e.path for e in self.data]  # what logs and the loader state call a source
        for i, name in enumerate(names):
            if names.index(name) != i:
                raise BadInput(f"phase.data[{i}].path={self.data[i].path!r}: name {name!r} is data"
                                 f"[{names.index(name)}]'s too; each source needs its own directory name")


    def _check_schedule(self) -> None:
        if self.schedule not in _SCHEDULES:
            raise BadInput(f"phase.schedule={self.schedule!r}: choose one of {_SCHEDULES}")
        linear = self.schedule in ("composer_linear", "time_linear")
        if linear and self.decay_power != 1.0:
            raise BadInput(f"phase.decay_power={self.decay_power!r}: phase.schedule={self.schedule!r} decays "
                             f"linearly; set decay_power to 1.0")
        frac = self.final_lr_fraction
        if isinstance(frac, bool) or not isinstance(frac, int | float) or not 0.0 <= frac < 1.0:
            raise BadInput(f"phase.final_lr_fraction={frac!r} must be a number in [0, 1)")
        if frac and self.schedule != "composer_linear":
            raise BadInput(f"phase.final_lr_fraction={frac!r} is a composer_linear setting; phase.schedule is "
                             f"{self.schedule!r}")
        hours = self.budget_hours
        if self.schedule == "time_linear":
            if isinstance(hours, bool) or not isinstance(hours, int | float) or not 0 < hours < float("inf"):
                raise BadInput(f"phase.budget_hours={hours!r}: phase.schedule='time_linear' needs a positive "
                                 f"number of hours")
            if self.schedule_steps is not None:
                raise BadInput(f"phase.schedule_steps={self.schedule_steps}: a time_linear schedule is measured "
                                 f"in hours (phase.budget_hours), not steps")
        elif hours is not None:
            raise BadInput(f"phase.budget_hours={hours!r} is a time_linear setting; phase.schedule is "
                             f"{self.schedule!r}")


@dataclass
class DeepSpeedSection:
    zero_stage: int = 2
    precision: str = "auto"
    """``auto``: bf16 on GPU, fp32 on CPU. ``fp16`` uses dynamic loss scaling unless ``loss_scale`` > 0.
    An explicit ``bf16`` also runs on CPU ranks (DeepSpeed's bf16 ZeRO-1/2 path); ``fp16`` on CPU is refused."""
    grad_accum_dtype: str = "fp32"
    """bf16 runs: the dtype gradients are summed in, over the micro batches of a step and over the ranks (DeepSpeed's
    ``data_types.grad_accum_dtype`` and ``communication_data_type``). ``fp32`` sums the bf16 gradients to fp32
    rounding (ZeRO 1/2 only); ``bf16``, DeepSpeed's own default, rounds the running sum to bf16 after every micro batch
    and so drops small contributions once it has grown (docs/recipes.md, "Gradient sums under bf16"). fp32 runs sum
    in fp32 whatever this says; fp16 runs keep DeepSpeed's loss-scaled fp16 path."""
    loss_scale: float = 0.0
    """fp16 only: 0 = dynamic loss scaling, > 0 = this static scale."""
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    min_loss_scale: float = 1.0
    gradient_clipping: float = 1.0
    """Global-norm clipping (NVIDIA recipe: 1.0); 0 disables."""
    activation_checkpointing: bool = False
    overlap_comm: bool = False
    """ZeRO 1/2: overlap the gradient reduce-scatter with the backward pass (a GPU speed option; the GPU recipes turn
    it on). Off keeps the reduction order independent of bucket timing."""
    contiguous_gradients: bool = True
    """ZeRO 1/2: copy gradients into one contiguous buffer as they are produced (less fragmentation)."""
    reduce_bucket_size: int = 500_000_000
    """ZeRO 1/2: elements reduced per bucket (DeepSpeed's default 5e8)."""
    allgather_bucket_size: int = 500_000_000
    """ZeRO 1/2: elements all-gathered per bucket after the step (DeepSpeed's default 5e8)."""
    process_group_timeout_s: float | None = None
    """Seconds a collective may wait for a rank before the process group fails (NCCL's watchdog then ends the job).
    ``None``: DeepSpeed's default (10 minutes, or ``$DEEPSPEED_TIMEOUT`` minutes). Raise it when one rank works alone
    for long, e.g. a slow shared file system under checkpoint writes (DeepSpeed#6705). It also bounds the rendezvous:
    rank 0 waits this long for every rank to join at start, so keep it above the start-up skew between nodes."""

    def __post_init__(self) -> None:
        for name in ("overlap_comm", "contiguous_gradients"):
            if not isinstance(getattr(self, name), bool):
                raise BadInput(f"deepspeed.{name}={getattr(self, name)!r} must be true or false")
        for name in ("reduce_bucket_size", "allgather_bucket_size"):
            _positive_int("deepspeed", name, getattr(self, name))
        timeout = self.process_group_timeout_s
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int | float)
                                    or not 0 < timeout < float("inf")):
            raise BadInput(f"deepspeed.process_group_timeout_s={timeout!r} must be a positive number of seconds "
                             f"(or null for DeepSpeed's default)")
        if self.zero_stage not in (0, 1, 2, 3):
            raise BadInput(f"deepspeed.zero_stage={self.zero_stage!r}: choose 0, 1, 2 or 3")
        if self.precision not in _PRECISIONS:
            raise BadInput(f"deepspeed.precision={self.precision!r}: choose one of {_PRECISIONS}")
        if self.grad_accum_dtype not in _GRAD_ACCUM_DTYPES:
            raise BadInput(f"deepspeed.grad_accum_dtype={self.grad_accum_dtype!r}: choose one of "
                             f"{_GRAD_ACCUM_DTYPES}")
        if self.grad_accum_dtype == "bf16" and self.precision in ("fp32", "fp16"):
            raise BadInput(f"deepspeed.grad_accum_dtype='bf16' applies to bf16 runs only; deepspeed.precision is "
                             f"{self.precision!r} (remove the field)")
        if self.precision == "bf16":
            check_grad_accum_stage(self.grad_accum_dtype, self.zero_stage)
        if not self.loss_scale >= 0:
            raise BadInput(f"deepspeed.loss_scale={self.loss_scale!r} must be >= 0 (0 = dynamic)")
        if not self.gradient_clipping >= 0:
            raise BadInput(f"deepspeed.gradient_clipping={self.gradient_clipping!r} must be >= 0")
        for name in ("initial_scale_power", "loss_scale_window", "hysteresis"):
            _positive_int("deepspeed", name, getattr(self, name))


@dataclass
class LoggingConfig:
    interval: int = 10
    """Console line / TensorBoard point every N steps."""
    keep_last_k: int = 3
    """Checkpoints kept on disk (the newest is never deleted)."""
    max_nonfinite_steps: int = 5
    """bf16/fp32: stop after this many consecutive non-finite losses (fp16's scaler skips them instead)."""
    peak_tflops: float | None = None
    """Accelerator peak for MFU; ``None`` leaves MFU out."""

    def __post_init__(self) -> None:
        for name in ("interval", "keep_last_k", "max_nonfinite_steps"):
            _positive_int("logging", name, getattr(self, name))


@dataclass
class HandoffConfig:
    """How phase 2 takes over phase 1's optimizer (``handoff``). The weights and the Adam/LAMB moments always carry
    over; the schedule is always the new phase's."""

    optimizer_step: str = "reset"
    """``reset``: the optimizer's step count restarts at 0, so bias correction starts again over the carried moments
    (NVIDIA's ``run_pretraining.py --phase2``; the default). Adam's first updates are then scaled by
    sqrt(1 - b2^t) / (1 - b1^t) against a continued count: 0.32 at t = 1, 0.15-0.32 over the first 100 updates at
    betas 0.9 / 0.999 (docs/recipes.md). ``continue``: the count goes on from phase 1's, as one optimizer over both
    phases would (Google's BERT trains both lengths with one optimizer)."""

    def __post_init__(self) -> None:
        if self.optimizer_step not in _HANDOFF_STEPS:
            raise BadInput(f"handoff.optimizer_step={self.optimizer_step!r}: choose one of {_HANDOFF_STEPS}")


@dataclass
class Recipe:
    model: str = "tiny"
    """Model preset (``tiny``, ``base``, ``large``) from :data:`bert_ds.config.MODEL_PRESETS`."""
    phases: list[PhaseConfig] = field(default_factory=list)
    model_overrides: dict = field(default_factory=dict)
    """BertConfig fields replacing the preset's (``vocab_size`` is always taken from the tokenizer)."""
    kernels: str = "auto"
    compile: bool = False
    """Compile each encoder layer with ``torch.compile`` (:mod:`bert_ds.model.compile`): same parameters and
    checkpoints; dropout masks come from the compiler's generator, so a compiled run resumes bit-exact against
    compiled runs, not against eager ones. Off in every shipped recipe until a GPU shows it faster."""
    nsp: bool = True
    """Train the next-sentence head (RoBERTa-style MLM-only when false)."""
    seed: int = 12345
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    deepspeed: DeepSpeedSection = field(default_factory=DeepSpeedSection)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    handoff: HandoffConfig = field(default_factory=HandoffConfig)
    """Phase 1 -> phase 2 (:class:`HandoffConfig`); a one-phase recipe has no hand-off and must keep the default."""
    name: str = ""

    def __post_init__(self) -> None:
        if self.model not in MODEL_PRESETS:
            raise BadInput(f"model={self.model!r}: choose one of {sorted(MODEL_PRESETS)}")
        if self.kernels not in _KERNELS:
            raise BadInput(f"kernels={self.kernels!r}: choose one of {_KERNELS}")
        if not isinstance(self.compile, bool):
            raise BadInput(f"compile={self.compile!r}: must be true or false")
        _non_negative_int("recipe", "seed", self.seed)
        if not self.phases:
            raise BadInput("phases: a recipe needs at least one phase")
        if len(self.phases) > 2:
            raise BadInput(f"phases: at most 2 phases (seq 128 then 512), got {len(self.phases)}")
        if len(self.phases) == 1 and self.handoff != HandoffConfig():
            raise BadInput(f"handoff.optimizer_step={self.handoff.optimizer_step!r}: a one-phase recipe has no "
                           f"hand-off; remove the handoff section")
        if self.optimizer.name == "lamb" and self.deepspeed.zero_stage == 3:
            raise BadInput("deepspeed.zero_stage=3: ZeroAwareLamb is exact under ZeRO stage 0/1/2 only "
                             "(per-tensor trust ratios across stage-3 sub-groups are not implemented); use 1 or 2")
        config = self.model_config(vocab_size=30522)  # raises on bad model_overrides, naming the field
        for i, phase in enumerate(self.phases):
            if phase.seq_len > config.max_position_embeddings:
                raise BadInput(f"phases[{i}].seq_len={phase.seq_len} exceeds max_position_embeddings")
            if phase.schedule == "time_linear" and i != len(self.phases) - 1:
                raise BadInput(f"phases[{i}].schedule='time_linear' must be the last phase: it ends by time, so its "
                                 f"steps are only a cap and the next phase's step numbers would count from it")

    def model_config(self, vocab_size: int) -> BertConfig:
        overrides = {**self.model_overrides, "vocab_size": vocab_size}
        try:
            return model_preset(self.model, **overrides)
        except TypeError as exc:
            raise BadInput(f"model_overrides: {exc}") from exc

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict, source: str = "recipe") -> Recipe:
        """Build from JSON data; an unknown key anywhere is an error naming the key and ``source``."""
        return _build(cls, data, source, "")

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")


_NESTED = {"optimizer": OptimizerConfig, "deepspeed": DeepSpeedSection, "logging": LoggingConfig,
           "handoff": HandoffConfig}


def _build(cls, data: Any, source: str, where: str):
    label = where or "recipe"
    if not isinstance(data, dict):
        raise BadInput(f"{source}: {label} must be a JSON object, got {type(data).__name__}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise BadInput(f"{source}: unknown key(s) {[f'{where}.{k}' if where else k for k in unknown]} "
                         f"(known: {sorted(known)})")
    kwargs = dict(data)
    if cls is Recipe:
        for key, sub in _NESTED.items():
            if key in kwargs:
                kwargs[key] = _build(sub, kwargs[key], source, key)
        if "phases" in kwargs:
            if not isinstance(kwargs["phases"], list):
                raise BadInput(f"{source}: phases must be a list")
            kwargs["phases"] = [_build(PhaseConfig, p, source, f"phases[{i}]") for i, p in enumerate(kwargs["phases"])]
    try:
        return cls(**kwargs)
    except TypeError as exc:  # a missing required field
        raise BadInput(f"{source}: {label}: {exc}") from exc
    except ValueError as exc:
        message = str(exc)
        if cls is PhaseConfig and message.startswith("phase."):  # name the phase: phases[1].lr=...
            message = where + message[len("phase"):]
        raise BadInput(f"{source}: {message}") from exc


def load_recipe(path: str | Path) -> Recipe:
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise BadInput(f"{path}: cannot read recipe: {exc}") from exc
    recipe = Recipe.from_dict(data, source=str(path))
    if not recipe.name:
        recipe.name = path.stem
    base = path.resolve().parent
    for phase in recipe.phases:  # a relative shard directory is the recipe file's neighbour, wherever a job starts
        if phase.data is not None:
            phase.data = [DataSource(e.path if "://" in e.path else str(base / e.path), e.weight)  # URLs as given
                          for e in phase.data]
    return recipe


def gradient_accumulation_steps(phase: PhaseConfig, world_size: int, where: str = "phase") -> int:
    """global = micro * accumulation * world size, or a BadInput naming the fields (before any compute)."""
    per_step = phase.micro_batch_size * world_size
    if phase.global_batch_size % per_step:
        raise BadInput(f"{where}.global_batch_size={phase.global_batch_size} is not divisible by "
                         f"{where}.micro_batch_size={phase.micro_batch_size} x world size {world_size}")
    return phase.global_batch_size // per_step


# Fields that may change between a checkpoint and its resume without changing the numbers the run produces.
_RESUME_FREE = {"name", "kernels", "compile", "logging", "deepspeed.activation_checkpointing",
                "deepspeed.process_group_timeout_s"}
# ``lr`` is resume-free so that the non-finite guard's advice (lower the phase's lr, resume) works: a resumed phase
# scales its restored schedule to the new peak and logs a warning (bert_ds.runtime.trainer._restore).
# ``data`` is resume-free because the loader state, not the recipe, holds what a resume must match: shard-set hashes
# and weights (a moved directory resumes; another mix is refused unless --continue-with-new-mix).
_PHASE_RESUME_FREE = {"micro_batch_size", "eval_interval", "checkpoint_interval", "target_mlm_accuracy", "lr", "data"}
# Phase fields added after checkpoints were first written: a saved recipe without them used these values.
_PHASE_ADDED_DEFAULTS = {"masked_lm_prob": _DEFAULT_MASKED_LM_PROB, "shuffle_window_shards": 8, "schedule_steps": None,
                         "schedule": "warmup_poly", "final_lr_fraction": 0.0, "budget_hours": None}
# Optimizer fields added later: recipes saved before ``trust_ratio`` existed applied the trust ratio to every tensor.
_OPTIMIZER_ADDED_DEFAULTS = {"trust_ratio": "all"}
# Recipes saved before ``handoff`` existed restarted the optimizer's step count at the hand-off.
_HANDOFF_ADDED_DEFAULTS = {"optimizer_step": "reset"}


def resume_blockers(saved: dict, current: Recipe, saved_precision: str | None = None) -> list[str]:
    """Dotted names of the fields where ``current`` differs from a checkpoint's recipe in a way that matters;
    ``saved_precision`` is the precision the checkpoint's run resolved (its run state), when known."""
    now = current.to_dict()
    diffs: list[str] = []

    def walk(a: Any, b: Any, path: str) -> None:
        if path in _RESUME_FREE or (path.startswith("phases[") and path.rsplit(".", 1)[-1] in _PHASE_RESUME_FREE):
            return
        if isinstance(a, dict) and isinstance(b, dict):
            for key in sorted(set(a) | set(b)):
                walk(a.get(key), b.get(key), f"{path}.{key}" if path else key)
        elif isinstance(a, list | tuple) and isinstance(b, list | tuple) and path == "phases":
            if len(a) != len(b):
                diffs.append("phases (count)")
            for i, (x, y) in enumerate(zip(a, b, strict=False)):
                walk(x, y, f"phases[{i}]")
        elif (list(a) if isinstance(a, tuple) else a) != (list(b) if isinstance(b, tuple) else b):
            diffs.append(path)

    if isinstance(saved.get("phases"), list):
        saved = {**saved, "phases": [{**_PHASE_ADDED_DEFAULTS, **ph} if isinstance(ph, dict) else ph
                                     for ph in saved["phases"]]}
    if isinstance(saved.get("optimizer"), dict):
        saved = {**saved, "optimizer": {**_OPTIMIZER_ADDED_DEFAULTS, **saved["optimizer"]}}
    if isinstance(saved.get("handoff", {}), dict):
        saved = {**saved, "handoff": {**_HANDOFF_ADDED_DEFAULTS, **saved.get("handoff", {})}}
    ds = saved.get("deepspeed")
    if isinstance(ds, dict) and "grad_accum_dtype" not in ds:
        # Written before the field existed: a bf16 run summed in bf16 then; under fp32 and fp16 the field changes
        # nothing, so the current value stands. Without the resolved precision, ``auto`` counts as bf16 (a GPU run).
        bf16 = saved_precision == "bf16" if saved_precision else ds.get("precision", "auto") in ("auto", "bf16")
        old = "bf16" if bf16 else now["deepspeed"]["grad_accum_dtype"]
        saved = {**saved, "deepspeed": {**ds, "grad_accum_dtype": old}}
    walk(saved, now, "")
    return diffs
