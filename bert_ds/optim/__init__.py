"""Optimizers and schedules: exact ZeRO-aware LAMB, AdamW, warm-up + decay schedules (by steps or by time).

Engine call sequence::

    opt = build_optimizer("lamb", model, lr, weight_decay=0.01, betas=(0.9, 0.999), eps=1e-6, zero_stage=stage)
    sched = LambdaLR(opt, lr_lambda("nvidia_poly", phase_steps, warmup_fraction, power=0.5))
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=sched, config=ds_config)
    bind_optimizer(engine)  # required for ZeroAwareLamb under ZeRO 1/2; no-op otherwise

DeepSpeed config: ``"zero_allow_untested_optimizer": true`` (LAMB is not on ZeRO's list), ``"gradient_clipping"``
for the global-norm clip under ZeRO 1/2 (at stage 0 fp32, ``GlobalNormClip(max_norm).attach(opt)`` with DeepSpeed's
clip at 0: see ``bert_ds/optim/clip.py``), no ``"optimizer"`` / ``"scheduler"`` sections (the client objects above
are used).
"""

from bert_ds.optim.clip import GlobalNormClip
from bert_ds.optim.factory import OPTIMIZER_NAMES, bind_optimizer, build_optimizer, no_decay, param_groups
from bert_ds.optim.lamb import TRUST_RATIO_RULES, UnsupportedZeroSetup, ZeroAwareLamb, ZeroLayout, zero_layout
from bert_ds.optim.schedule import NVIDIA_BERT_POWER, SCHEDULES, TimeBudget, lr_lambda, warmup_poly_decay

__all__ = [
    "GlobalNormClip",
    "TRUST_RATIO_RULES",
    "UnsupportedZeroSetup",
    "NVIDIA_BERT_POWER",
    "OPTIMIZER_NAMES",
    "SCHEDULES",
    "TimeBudget",
    "ZeroAwareLamb",
    "ZeroLayout",
    "bind_optimizer",
    "build_optimizer",
    "lr_lambda",
    "no_decay",
    "param_groups",
    "warmup_poly_decay",
    "zero_layout",
]
