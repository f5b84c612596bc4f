"""The DeepSpeed boundary: every DeepSpeed-version fact bert_ds relies on, in one leaf module (it imports nothing
from bert_ds but the error base, and deepspeed only inside the functions that need it, so the run directory's owner
and the safe loader read its names without importing DeepSpeed). An upgrade means reading this file: the file names
DeepSpeed gives a checkpoint, the classes its pickles hold, its optimizer wrapper's name and the loss-scale
attribute, its CPU shared-memory extension and buffers, its launcher module, the log lines and warnings bert_ds
silences, and the private ZeRO 1/2 internals below.

Written against DeepSpeed 0.19.x (checked on 0.19.8): ``runtime/zero/stage_1_and_2.py`` (``DeepSpeedZeroOptimizer``)
for the ZeRO 1/2 partition map that :class:`bert_ds.optim.ZeroAwareLamb` binds to and for re-cutting elastic
checkpoints on resume; ``runtime/engine.py`` (``DeepSpeedEngine``) for the one choice bert_ds overrides, the wrapper
that bf16 ZeRO-1 with fp32 gradient sums gets (:func:`zero1_keeps_zero_optimizer`). DeepSpeed has no public API for
these, so an upgrade may move what is read here; the version check refuses other releases before any compute, and
``tests/test_deepspeed_internals.py`` inspects the installed classes for every name listed in the ``ZERO_*`` tables
and for the wrapper choice. This module reports facts and performs mechanics; its callers decide policy:
ZeroAwareLamb what setups it refuses (:func:`zero_setup`), :mod:`bert_ds.checkpoint` what it resumes
(:func:`recut_zero_partitions` re-cuts partitions that module has read), the engine when fp32 sums are asked for.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from bert_ds.errors import BadInput

if TYPE_CHECKING:  # torch is imported where used: bert_ds.lifecycle.supervise reads these names without it
    import torch

__all__ = ["ENGINE_WRAPPER_CHOICE", "LAUNCH_MODULE", "LOSS_SCALE_ATTRIBUTE", "MODEL_STATES_NAME", "MUON_MODULE",
           "PICKLED_CLASSES", "RUNNER_MODULE", "SHM_BUFFER_GLOB", "SHM_COMM_BUILDER", "SUPPORTED_DEEPSPEED",
           "ZERO3_OPTIMIZER_ATTRIBUTES", "ZERO_CHECKPOINT_KEYS", "ZERO_OPTIMIZER_ATTRIBUTES", "ZERO_OPTIMIZER_CLASS",
           "ZERO_OPTIMIZER_METHODS", "ZERO_PARTITION_FILE", "ZeroGroupPartition", "ZeroPartitionMap", "ZeroSetup",
           "check_deepspeed_version", "import_muon_compiling_on_first_call", "is_elastic_zero_state",
           "is_zero3_optimizer", "loss_scale", "quiet_moot_warnings", "recut_zero_partitions", "shm_comm_builder",
           "zero1_keeps_zero_optimizer", "zero_partition_map", "zero_setup"]

SUPPORTED_DEEPSPEED = ((0, 19), (0, 20))
"""Supported DeepSpeed releases: ``>= 0.19, < 0.20`` (the internals below are those of 0.19.x)."""

ZERO_OPTIMIZER_ATTRIBUTES = (
    "bit16_groups", "round_robin_bit16_groups", "round_robin_bit16_meta", "round_robin_bit16_offsets",
    "single_partition_of_fp32_groups", "partition_size", "parallel_partitioned_bit16_groups",
    "real_dp_process_group", "dp_process_group", "cpu_offload", "torch_autocast_gradscaler", "zenflow",
    "gradient_accumulation_dtype", "communication_data_type",
)
"""Instance attributes of ``DeepSpeedZeroOptimizer`` read here (set in its ``__init__``)."""

ZERO_OPTIMIZER_METHODS = {
    "_load_global_state": ("sd",),
    "_restore_from_elastic_fp32_weights": ("all_state_dict",),
    "_partition_base_optimizer_state": ("state_key", "all_partition_states", "group_id"),
    "update_lp_params": (),
}
"""Methods of ``DeepSpeedZeroOptimizer`` called on resume (the first three are private), with the leading parameters
they are called with, positionally and in this order."""

ZERO3_OPTIMIZER_ATTRIBUTES = ("fp32_partitioned_groups_flat",)
"""Instance attributes of ``DeepSpeedZeroOptimizer_Stage3`` that :func:`is_zero3_optimizer` looks for."""

ZERO_CHECKPOINT_KEYS = ("optimizer_state_dict", "base_optimizer_state")
"""Keys of DeepSpeed's ``zero_pp_rank_*_optim_states.pt`` files read on resume."""

# ---- file names, pickled classes, names and attributes of DeepSpeed 0.19 that other bert_ds modules use -------------

MODEL_STATES_NAME = "mp_rank_00_model_states.pt"
"""The module-weights file of a tag (``DeepSpeedEngine._get_ckpt_name``, no tensor/pipeline parallelism); it also holds
the client state, merged into its top level (``_save_checkpoint``: ``state.update(client_state)``)."""

ZERO_PARTITION_FILE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")
"""One saved rank's ZeRO 1/2 optimizer partition: ``zero_pp_rank_<r>_mp_rank_00_optim_states.pt``, with a ``bf16_``
prefix when the run trained in bf16 (``DeepSpeedEngine._get_zero_ckpt_prefix``)."""

PICKLED_CLASSES = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler", "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum", "deepspeed.utils.tensor_fragment.fragment_address",
)
"""DeepSpeed's own classes inside its checkpoint files (``zero_pp_rank_*``: the loss scaler object -- static for
fp32/bf16, dynamic for fp16 --, the ZeRO stage enum and the param-slice map's addresses; found by saving real
checkpoints at ZeRO 0-3 in fp32 and bf16): what :mod:`bert_ds.safe_load` allows besides numpy's."""

ZERO_OPTIMIZER_CLASS = "DeepSpeedZeroOptimizer"
"""The class name of the ZeRO stage 1/2 wrapper around a client optimizer (``runtime/zero/stage_1_and_2.py``)."""

LOSS_SCALE_ATTRIBUTE = "cur_scale"
"""The fp16 optimizer wrappers' current loss scale (``FP16_Optimizer``, ``DeepSpeedZeroOptimizer``)."""

SHM_COMM_BUILDER = "ShareMemCommBuilder"
"""The op builder of the CPU shared-memory all-reduce extension ``deepspeed_shm_comm`` compiled on first use."""

SHM_BUFFER_GLOB = "deepspeed_allreduce_buffer_*_{addr}_{port}_{local_rank}"
"""The /dev/shm segments that extension creates per local rank (never unlinked by DeepSpeed 0.19)."""

LAUNCH_MODULE = "deepspeed.launcher.launch"
"""The per-node launcher module the ``deepspeed`` runner starts, which starts the ranks."""

RUNNER_MODULE = "deepspeed.launcher.runner"
"""The module behind the ``deepspeed`` command (its ``main``); it installs no SIGTERM handler on one node."""


def shm_comm_builder():
    """DeepSpeed's op builder of :data:`SHM_COMM_BUILDER` when this install can build it (``deepspeed.ops.
    __compatible_ops__``, filled when DeepSpeed was installed), else None."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder(SHM_COMM_BUILDER)
    return builder if builder is not None and deepspeed.ops.__compatible_ops__.get(builder.NAME, False) else None


def loss_scale(optimizer) -> float | None:
    """The current fp16 loss scale of DeepSpeed's optimizer wrapper, None when it keeps none."""
    return getattr(optimizer, LOSS_SCALE_ATTRIBUTE, None)


MOOT_LOG_MESSAGES = ("You are using ZeRO with an untested optimizer",)
"""DeepSpeed log lines bert_ds drops: 0.19's ``DeepSpeedEngine._do_optimizer_sanity_check`` warns for every client
optimizer outside its list (``zero/utils.py`` ``ZERO_SUPPORTED_OPTIMIZERS``) once ``zero_allow_untested_optimizer`` is
set, which ZeroAwareLamb needs; bert_ds tests that setup against a float64 LAMB on real ZeRO 1/2 ranks
(``tests/optim/test_lamb_engine.py``), so the line is noise around the ones that matter."""

MOOT_FUTURE_WARNINGS = (r"`torch\.distributed\.all_gather_into_tensor` is deprecated",)
"""torch FutureWarnings raised by DeepSpeed 0.19's own calls (its ZeRO 1/2 all-gather of the updated partitions), not
by bert_ds: nothing a user can act on until DeepSpeed moves to the new collective."""


class _DropMessages(logging.Filter):
    """Drops records whose message contains one of ``texts``; every other record passes."""

    def __init__(self, texts: tuple[str, ...]) -> None:
        super().__init__()
        self.texts = texts

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(text in message for text in self.texts)


def quiet_moot_warnings() -> None:
    """Silence exactly :data:`MOOT_LOG_MESSAGES` (a filter on DeepSpeed's logger) and :data:`MOOT_FUTURE_WARNINGS`
    (``warnings`` filters naming each message); every other warning still shows. Idempotent."""
    from deepspeed.utils import logger

    if not any(isinstance(f, _DropMessages) for f in logger.filters):
        logger.addFilter(_DropMessages(MOOT_LOG_MESSAGES))
    for message in MOOT_FUTURE_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=FutureWarning)


MUON_MODULE = "deepspeed.runtime.zero.muon.muon_optimizer"
"""DeepSpeed's Muon optimizer module. 0.19 imports it on first use, whatever the optimizer: ZeRO's
``is_zero_supported_optimizer`` (``runtime/zero/utils.py``) during ``deepspeed.initialize``, and ZeRO 1/2's
``average_tensor`` (``runtime/zero/stage_1_and_2.py``). Its ``original_muon.py`` decorates three functions with
``torch.compile`` at import, which imports inductor's compiler (``torch._inductor.compile_fx``)."""


def import_muon_compiling_on_first_call() -> None:
    """Import :data:`MUON_MODULE` with each ``torch.compile`` its import applies deferred to the decorated function's
    first call (then compiled as the decorator would have, with the same arguments), unless it is imported already.

    Only the Muon optimizer calls those functions and bert_ds trains with LAMB or AdamW, so a rank no longer spends
    start-up importing inductor for them (1.5 s under ``python -X importtime``; a whole one-rank ``tiny`` ZeRO-2 run of
    both phases went from 8.1 to 7.3 CPU seconds on 2 cores, mean of 4). DeepSpeed defers ``torch._disable_dynamo``
    the same way and for the same reason (``runtime/compiler.py``, ``lazy_disable``). ``torch.compile`` is the original
    again when this returns, also if the import raises."""
    import importlib
    import sys

    import torch

    if MUON_MODULE in sys.modules:
        return
    eager = torch.compile

    def deferred(model=None, **options):
        if model is None:  # @torch.compile(mode=...): the decorator's arguments first
            return lambda fn: deferred(fn, **options)
        compiled = None

        @functools.wraps(model)
        def compile_on_first_call(*args, **kwargs):
            nonlocal compiled
            if compiled is None:
                compiled = eager(model, **options)
            return compiled(*args, **kwargs)

        return compile_on_first_call

    torch.compile = deferred
    try:
        importlib.import_module(MUON_MODULE)
    finally:
        torch.compile = eager


def _supported_range() -> str:
    (lo_major, lo_minor), (hi_major, hi_minor) = SUPPORTED_DEEPSPEED
    return f">={lo_major}.{lo_minor},<{hi_major}.{hi_minor}"


def check_deepspeed_version(version: str | None = None) -> str:
    """Return the installed DeepSpeed version, or raise BadInput (the user's environment) naming it and the
    supported range."""
    if version is None:
        import deepspeed

        version = deepspeed.__version__
    match = re.match(r"(\d+)\.(\d+)", str(version))
    lo, hi = SUPPORTED_DEEPSPEED
    if match is None or not lo <= (int(match[1]), int(match[2])) < hi:
        raise BadInput(f"deepspeed {version} is installed, but bert_ds relies on DeepSpeed internals of "
                       f"deepspeed{_supported_range()} (bert_ds/deepspeed_internals.py); install a "
                       f"version in that range, e.g. pip install 'deepspeed{_supported_range()}'")
    return str(version)


# ---------------------------------------------------------------------------------------------- ZeRO 1/2 layout
@dataclass
class ZeroGroupPartition:
    """One ZeRO param group as this rank sees it."""

    flat: torch.Tensor
    """This rank's flat fp32 partition (the only param ZeRO leaves in the client optimizer's group)."""
    start: int
    """Offset of the partition in the group's flat buffer (``rank * partition_size``)."""
    tensors: list[tuple[int, int, int]]
    """Every tensor of the group as (global index, offset in the flat buffer, numel), in buffer order."""
    bit16_partition: torch.Tensor | None
    """ZeRO's bit16 view of this partition, all-gathered into the model after the step."""


@dataclass
class ZeroPartitionMap:
    groups: list[ZeroGroupPartition]
    shapes: list[tuple[int, ...]]
    """Shapes of all tensors by global index (the order of ``bit16_groups``)."""
    process_group: object
    world_size: int


def is_zero3_optimizer(optimizer) -> bool:
    return type(optimizer).__name__ == "DeepSpeedZeroOptimizer_Stage3" or any(
        hasattr(optimizer, a) for a in ZERO3_OPTIMIZER_ATTRIBUTES)


def _check_zero_attributes(zo) -> None:
    missing = [a for a in ZERO_OPTIMIZER_ATTRIBUTES if not hasattr(zo, a)]
    if missing:
        raise TypeError(f"{type(zo).__name__} has no {missing}: only DeepSpeed's ZeRO stage 1/2 optimizer "
                        f"(DeepSpeedZeroOptimizer of deepspeed{_supported_range()}) is supported")


@dataclass(frozen=True)
class ZeroSetup:
    """How a ZeRO optimizer is set up, as far as a client optimizer's view of its flat partitions depends on it."""

    stage3: bool
    cpu_offload: bool
    """``offload_optimizer``: the fp32 partitions live on the CPU and are stepped there."""
    torch_autocast: bool
    zenflow: bool
    mixed_dp_groups: tuple[int, ...]
    """Param groups whose data-parallel group differs in size from the first (MoE expert groups)."""
    grad_accum_dtype: torch.dtype | None = None
    """The dtype micro-batch gradients are summed in (``gradient_accumulation_dtype``; None under stage 3)."""
    comm_dtype: torch.dtype | None = None
    """The dtype gradients are reduced across ranks in (``communication_data_type``; None under stage 3)."""


def zero_setup(zero_optimizer) -> ZeroSetup:
    """The facts of :class:`ZeroSetup` for ``engine.optimizer``; TypeError when it is no ZeRO optimizer of the
    supported DeepSpeed release (its attributes are missing)."""
    zo = zero_optimizer
    if is_zero3_optimizer(zo):
        return ZeroSetup(stage3=True, cpu_offload=False, torch_autocast=False, zenflow=False, mixed_dp_groups=())
    _check_zero_attributes(zo)
    import deepspeed.comm as dist

    world_size = dist.get_world_size(group=zo.dp_process_group)
    mixed = tuple(i for i, pg in enumerate(zo.real_dp_process_group) if dist.get_world_size(group=pg) != world_size)
    return ZeroSetup(stage3=False, cpu_offload=bool(zo.cpu_offload),
                     torch_autocast=zo.torch_autocast_gradscaler is not None, zenflow=bool(zo.zenflow),
                     mixed_dp_groups=mixed, grad_accum_dtype=zo.gradient_accumulation_dtype,
                     comm_dtype=zo.communication_data_type)


def zero_partition_map(zero_optimizer) -> ZeroPartitionMap:
    """Where each tensor of a ``DeepSpeedZeroOptimizer`` (stage 1/2) lies in this rank's flat partitions.

    ``stage_1_and_2.py`` lays tensors out in ``round_robin_bit16_groups`` order at ``round_robin_bit16_offsets``
    (alignment padding after each tensor), pads the flat group to a multiple of ``2 * world_size`` and cuts it into
    equal partitions of ``partition_size[i]``. The map describes the plain layout: a caller whose use depends on the
    setup (offload, autocast, ZenFlow, MoE expert groups) asks :func:`zero_setup` first.
    """
    import deepspeed.comm as dist

    zo = zero_optimizer
    _check_zero_attributes(zo)
    world_size = dist.get_world_size(group=zo.dp_process_group)
    index_of, shapes = {}, []
    for group in zo.bit16_groups:
        for p in group:
            index_of[id(p)] = len(shapes)
            shapes.append(tuple(p.shape))
    groups = []
    for i, rr_tensors in enumerate(zo.round_robin_bit16_groups):
        rank = dist.get_rank(group=zo.real_dp_process_group[i])
        psize = int(zo.partition_size[i])
        flat = zo.single_partition_of_fp32_groups[i]
        if flat.numel() != psize:
            raise RuntimeError(f"ZeRO group {i}: fp32 partition has {flat.numel()} elements, expected {psize}")
        # shape metadata, not the params: it survives ZeRO releasing the params' storage
        numels = [int(m.numel()) for m in zo.round_robin_bit16_meta[i]]
        offsets = [int(o) for o in zo.round_robin_bit16_offsets[i]]
        tensors = sorted(((index_of[id(p)], off, n) for p, off, n in zip(rr_tensors, offsets, numels, strict=True)),
                         key=lambda t: t[1])
        groups.append(ZeroGroupPartition(flat=flat, start=rank * psize, tensors=tensors,
                                         bit16_partition=zo.parallel_partitioned_bit16_groups[i][rank]))
    return ZeroPartitionMap(groups=groups, shapes=shapes, process_group=zo.dp_process_group, world_size=world_size)


# ---------------------------------------------------------------------------------------------- wrapper choice
ENGINE_WRAPPER_CHOICE = "_do_optimizer_sanity_check"
"""The ``DeepSpeedEngine`` method that picks the wrapper around a client optimizer (returns ``"bf16"`` for
BF16_Optimizer, ``"zero_optimization"`` for DeepSpeedZeroOptimizer); :func:`zero1_keeps_zero_optimizer` wraps it."""


@contextlib.contextmanager
def zero1_keeps_zero_optimizer() -> Iterator[None]:
    """While active, a DeepSpeed engine built for bf16 ZeRO-1 with ``data_types.grad_accum_dtype`` fp32 wraps its
    client optimizer in ``DeepSpeedZeroOptimizer``, as ZeRO-2 and ZeRO-1 with offload do, instead of BF16_Optimizer.

    DeepSpeed 0.19 sends exactly that one case to BF16_Optimizer (``runtime/engine.py:2305-2310``,
    ``_do_optimizer_sanity_check``), although ``DeepSpeedZeroOptimizer`` implements stage-1 fp32 accumulation itself:
    each micro batch's bf16 gradient is added into an fp32 ``param.grad_accum`` by its gradient hook
    (``runtime/zero/stage_1_and_2.py:397-404`` and ``:1234-1240``), reduced once per step into an fp32 partition
    (``:1259-1300``, ``:1328-1346``). Keeping one wrapper keeps one flat layout (what ZeroAwareLamb binds to) and one
    elastic checkpoint format (what :func:`recut_zero_partitions` re-cuts). Every other choice is DeepSpeed's own.
    """
    from deepspeed.runtime.constants import BFLOAT16
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero.config import ZERO_OPTIMIZATION

    original = getattr(DeepSpeedEngine, ENGINE_WRAPPER_CHOICE)

    def choose(engine, basic_optimizer):
        choice = original(engine, basic_optimizer)
        if choice == BFLOAT16 and engine.zero_optimization() and engine.zero_optimization_stage() == 1:
            return ZERO_OPTIMIZATION
        return choice

    setattr(DeepSpeedEngine, ENGINE_WRAPPER_CHOICE, choose)
    try:
        yield
    finally:
        setattr(DeepSpeedEngine, ENGINE_WRAPPER_CHOICE, original)


# ---------------------------------------------------------------------------------------------- resume
def is_elastic_zero_state(saved_file: dict) -> bool:
    """Whether one loaded ``zero_pp_rank_*_optim_states.pt`` was saved with ``elastic_checkpoint`` (per-group flat
    partitions with the padding stripped: re-cuttable for any rank count)."""
    state_key, base_key = ZERO_CHECKPOINT_KEYS
    return isinstance(saved_file[state_key][base_key], list)


def recut_zero_partitions(zero_optimizer, saved_files: list[dict], weights: bool):
    """Re-cut the ZeRO 1/2 state that N ranks saved (one loaded ``zero_pp_rank_*`` file per saved rank, in rank
    order, elastic) into this rank's partition; returns the client optimizer (``zero_optimizer.optimizer``).

    With ``weights`` the fp32 master weights, loss scaler and clip setting are restored too and the bit16 model copies
    refreshed from them (a resume); without, only the client optimizer's state tensors (a phase hand-off, whose
    weights come with the model). Uses the ZeRO optimizer's own merge-and-cut helpers, so on the same rank count each
    partition is reproduced bit for bit.
    """
    zero = zero_optimizer
    saved = [f[ZERO_CHECKPOINT_KEYS[0]] for f in saved_files]
    if weights:
        zero._load_global_state(saved[0])  # loss scaler, clip setting
        zero._restore_from_elastic_fp32_weights(saved)
    _restore_zero_optimizer_state(zero, saved)
    if weights:
        zero.update_lp_params()  # bf16/fp16 model copies from the restored fp32 master (a plain copy in fp32)
    return zero.optimizer


def _restore_zero_optimizer_state(zero, saved: list[dict]) -> None:
    """Merge each state tensor of the client optimizer (LAMB's ``exp_avg``/``exp_avg_sq``) from all saved partitions
    and cut this rank's partition out of it."""
    import torch

    for i, group in enumerate(zero.optimizer.param_groups):
        flat = group["params"][0]
        parts = [sd[ZERO_CHECKPOINT_KEYS[1]][i] for sd in saved]
        for key, first in parts[0].items():
            if torch.is_tensor(first) and first.dim() > 0:
                merged = zero._partition_base_optimizer_state(key, [part[key] for part in parts], i)
                zero.optimizer.state[flat][key] = merged.to(device=flat.device, dtype=torch.float32).clone()
            else:  # scalars such as LAMB's step count are the same on every rank
                zero.optimizer.state[flat][key] = first.clone() if torch.is_tensor(first) else first
