"""Memory per GPU of a pre-training run: activations saved for backward (measured), plus weights, gradients and the
ZeRO optimizer partition (counted); and the largest micro batch that fits a card.

Activations are measured, not guessed: :func:`saved_activation_bytes` runs the real model's training forward
(``BertForPreTraining``, unpadded, dropout on, in the run's dtype) under ``torch.autograd.graph.saved_tensors_hooks``
and counts every storage autograd keeps for backward once (views share their storage; parameters are not
activations). It runs inside :func:`bert_ds.kernels.jit.record_launches`, so the kernel registry picks what it picks on
CUDA tensors (``auto``: the Triton varlen attention in bf16, torch twins elsewhere) and Triton launches are recorded
instead of run. Where a torch op saves something else off CUDA, :class:`SavedTensorCounter` counts what the CUDA op
saves (dropout: ``native_dropout``'s bool mask; SDPA: FlashAttention's q, k, v, output and log-sum-exp). By default
the model lives on the ``meta`` device (shapes only, no arithmetic), which counts the storages a CPU run counts but
LayerNorm's statistics (fp32 there as on CUDA; tests/engine/test_memory_estimate.py). :func:`activation_fit` measures
three batch sizes and three layer counts and checks that the bytes are exactly affine in both;
:func:`memory_per_gpu` adds the static state of :func:`static_bytes_per_rank`.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import math
import os
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from bert_ds.config import BertConfig
from bert_ds.errors import BadInput
from bert_ds.recipe import Recipe

__all__ = ["ActivationFit", "CARDS_GB", "DEFAULT_HEADROOM", "FP32_PARTITION", "GradAccumLayout", "Headroom",
           "MemoryEstimate", "SavedTensorCounter", "StaticState", "activation_fit", "check_fits", "check_recipe_memory",
           "fits_kept_in", "memory_per_gpu", "parameter_count", "phase_estimate", "recipe_grad_accum",
           "saved_activation_bytes", "static_bytes_per_rank"]

log = logging.getLogger(__name__)

GIB = 2**30
CARDS_GB = (40, 80, 141)
"""Card sizes of the table, in GB as vendors print them (A100 40/80 GB, H100 80 GB, H200 141 GB); 1 GB = 1e9 bytes."""

_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
_TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


# ------------------------------------------------------------------------------------- saved tensors, counted once


def _storage_key(t: torch.Tensor) -> int:
    # The StorageImpl's address: unique among live storages on any device (meta storages all have data_ptr 0).
    return t.untyped_storage()._cdata


class SavedTensorCounter:
    """Bytes of the distinct storages autograd saves for backward while :meth:`counting` is active.

    A saved tensor is counted by its whole storage (a saved view keeps all of it alive), each storage once;
    ``exclude`` (the parameters) is never counted. Counted tensors are held until the counter dies, so no counted
    address is freed and reused by another storage during a count. ``cuda_saves`` (default on) replaces what
    ``F.dropout`` and ``F.scaled_dot_product_attention`` save off CUDA by what their CUDA kernels save."""

    def __init__(self, exclude: Iterable[torch.Tensor] = (), cuda_saves: bool = True) -> None:
        self._excluded = {_storage_key(t) for t in exclude}
        self._seen: dict[int, int] = {}
        self._held: list[torch.Tensor] = []
        self._quiet = 0
        self.cuda_saves = cuda_saves
        self.extra_bytes = 0
        """Bytes the CUDA kernels save that are no tensor here (dropout masks, attention log-sum-exp)."""

    @property
    def total(self) -> int:
        return sum(self._seen.values()) + self.extra_bytes

    def add(self, t: torch.Tensor) -> None:
        """Count ``t``'s storage unless it is excluded, empty or already counted."""
        key = _storage_key(t)
        nbytes = t.untyped_storage().nbytes()
        if nbytes and key not in self._excluded and key not in self._seen:
            self._seen[key] = nbytes
            self._held.append(t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if not self._quiet:
            self.add(t)
        return t

    @contextmanager
    def _quietly(self) -> Iterator[None]:
        self._quiet += 1
        try:
            yield
        finally:
            self._quiet -= 1

    def _dropout(self, original: Callable) -> Callable:
        def dropout(input, p=0.5, training=True, inplace=False):
            with self._quietly():
                out = original(input, p, training, inplace)
            if training and 0.0 < p < 1.0 and out.requires_grad:
                # CUDA runs native_dropout, whose backward keeps only the bool keep-mask (derivatives.yaml); the CPU
                # composite keeps a mask in the input's dtype instead.
                self.extra_bytes += input.numel()
            return out
        return dropout

    def _sdpa(self, original: Callable) -> Callable:
        def scaled_dot_product_attention(query, key, value, *args, **kwargs):
            with self._quietly():
                out = original(query, key, value, *args, **kwargs)
            if out.requires_grad:
                # FlashAttention / memory-efficient attention on CUDA keep q, k, v, the output and an fp32
                # log-sum-exp per query row and head (derivatives.yaml, _scaled_dot_product_flash_attention); the CPU
                # math path keeps fp32 copies and the S x S probabilities instead.
                for t in (query, key, value):
                    self.add(t)
                self.extra_bytes += out.numel() * out.element_size() + 4 * math.prod(query.shape[:-1])
            return out
        return scaled_dot_product_attention

    @contextmanager
    def counting(self) -> Iterator[SavedTensorCounter]:
        """Count the tensors saved inside the block (and apply the CUDA rules when ``cuda_saves``)."""
        originals = (F.dropout, F.scaled_dot_product_attention)
        if self.cuda_saves:
            F.dropout, F.scaled_dot_product_attention = self._dropout(originals[0]), self._sdpa(originals[1])
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
                yield self
        finally:
            F.dropout, F.scaled_dot_product_attention = originals


# ------------------------------------------------------------------------------------------------ the real model


def _full_batch(config: BertConfig, batch: int, seq_len: int, predictions: int, nsp: bool) -> dict:
    """``batch`` full-length sequences (every position a real token: the most memory a batch of ``seq_len`` can take),
    ``predictions`` valid masked positions each, NSP labels when ``nsp``."""
    low = min(1000, config.vocab_size // 2)  # above the special tokens of a BERT vocabulary
    ids = low + (torch.arange(batch * seq_len) * 7919) % (config.vocab_size - low)
    positions = torch.arange(1, predictions + 1).repeat(batch, 1)
    out = dict(input_ids=ids.view(batch, seq_len), token_type_ids=(torch.arange(seq_len) >= seq_len // 2).long()
               .repeat(batch, 1), attention_mask=torch.ones(batch, seq_len, dtype=torch.long),
               masked_lm_positions=positions, masked_lm_ids=torch.full((batch, predictions), low))
    if nsp:
        out["next_sentence_label"] = torch.zeros(batch, dtype=torch.long)
    return out


def saved_activation_bytes(config: BertConfig, batch: int, seq_len: int, predictions: int, dtype: str = "bf16",
                           kernels: str = "auto", nsp: bool = True, device: str = "meta",
                           cuda_saves: bool = True) -> int:
    """Bytes autograd saves for backward in one training forward of ``BertForPreTraining(config)`` on ``batch``
    full-length sequences of ``seq_len`` with ``predictions`` masked positions each, as a CUDA device would save
    them (see the module docstring). ``device``: ``meta`` (shapes only) or ``cpu`` (computes)."""
    from bert_ds.kernels.jit import record_launches
    from bert_ds.kernels.registry import fallback_warnings_held
    from bert_ds.model import BertForPreTraining
    from bert_ds.model.unpad import host_counts

    with torch.device(device):
        model = BertForPreTraining(config, kernels=kernels).to(_TORCH_DTYPES[dtype]).train()
    data = _full_batch(config, batch, seq_len, predictions, nsp)
    counts = host_counts(data["attention_mask"], data["masked_lm_ids"])
    data = {k: v.to(device) for k, v in data.items()}
    counter = SavedTensorCounter(exclude=model.parameters(), cuda_saves=cuda_saves)
    with torch.enable_grad(), record_launches(), counter.counting(), fallback_warnings_held():
        model(**data, counts=counts)
    return counter.total


@dataclass(frozen=True)
class ActivationFit:
    """Saved activation bytes of a training micro batch: ``fixed + per_sequence * micro_batch``, both affine in the
    number of encoder layers (measured at two layer counts and two batch sizes, extrapolated to ``layers``)."""

    per_sequence: int
    fixed: int
    layers: int
    measured: dict
    """{(layers, batch): bytes} the fit came from."""

    def bytes(self, micro_batch: int) -> int:
        return self.fixed + self.per_sequence * micro_batch


def activation_fit(config: BertConfig, seq_len: int, predictions: int, dtype: str = "bf16", kernels: str = "auto",
                   nsp: bool = True, device: str = "meta", layer_counts: tuple[int, ...] = (2, 3, 4),
                   batch_sizes: tuple[int, ...] = (1, 2, 3)) -> ActivationFit:
    """Measure :func:`saved_activation_bytes` at every (layers, batch) of ``layer_counts`` x ``batch_sizes`` and fit
    bytes = a + b * batch with a and b affine in layers. More than two of either are checked to lie exactly on the
    line (``ArithmeticError`` otherwise, naming the point: a bug, not bad input): the saved bytes are sums of tensor
    sizes, each linear in the batch and the same in every layer but the last, so the fit is exact, not approximate."""
    key = (tuple(sorted(dataclasses.asdict(config).items())), seq_len, predictions, dtype, kernels, nsp, device,
           tuple(layer_counts), tuple(batch_sizes))
    if key not in _FITS:  # preflight asks once per phase; the gpu-check and the table ask again in one process
        _FITS[key] = _read_fit(key, config.num_hidden_layers) or _write_fit(key, _fit(
            config, seq_len, predictions, dtype, kernels, nsp, device, layer_counts, batch_sizes))
    return _FITS[key]


_FITS: dict[tuple, ActivationFit] = {}
_FIT_DIR: list[Path] = []
_FIT_CODE = ("model", "kernels", "runtime/memory.py", "config.py")
"""What a fit is a function of besides its arguments (and torch's version): the files under ``bert_ds/``."""


@contextmanager
def fits_kept_in(directory: str | Path) -> Iterator[None]:
    """Inside the block, also keep fits as JSON files in ``directory``, keyed by their arguments, torch's version and
    the bytes of the code they measure (:data:`_FIT_CODE`): a start of the same model and phase shapes reads its fit
    instead of running 9 meta-device forwards per phase. Pre-flight keeps them in the user's cache."""
    saved = list(_FIT_DIR)
    _FIT_DIR[:] = [Path(directory)]
    try:
        yield
    finally:
        _FIT_DIR[:] = saved


@functools.cache
def _code_digest() -> str:
    root = Path(__file__).resolve().parents[1]
    files = sorted(f for part in _FIT_CODE for f in ([root / part] if part.endswith(".py")
                                                     else (root / part).rglob("*.py")))
    digest = hashlib.sha256(torch.__version__.encode())
    for f in files:
        digest.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes())
    return digest.hexdigest()


def _fit_file(key: tuple) -> Path | None:
    if not _FIT_DIR:
        return None
    return _FIT_DIR[0] / f"fit-{hashlib.sha256(repr((key, _code_digest())).encode()).hexdigest()[:40]}.json"


def _read_fit(key: tuple, layers: int) -> ActivationFit | None:
    """The kept fit of ``key``, or None (none kept, or a file that does not hold one: it is measured again)."""
    path = _fit_file(key)
    try:
        data = json.loads(path.read_text()) if path is not None else None
        fit = ActivationFit(per_sequence=int(data["per_sequence"]), fixed=int(data["fixed"]), layers=layers,
                            measured={(int(n), int(b)): int(v) for n, b, v in data["measured"]})
    except (OSError, ValueError, TypeError, KeyError):
        return None
    return fit if data.get("key") == repr(key) else None


def _write_fit(key: tuple, fit: ActivationFit) -> ActivationFit:
    path = _fit_file(key)
    if path is not None:
        data = {"key": repr(key), "per_sequence": fit.per_sequence, "fixed": fit.fixed,
                "measured": [[n, b, v] for (n, b), v in sorted(fit.measured.items())]}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(data))
            os.replace(tmp, path)  # whole or absent: ranks of a node may write the same fit at once
        except OSError as exc:  # a cache that cannot be written costs the next start the measurement, nothing else
            log.debug("activation fit not kept in %s: %s", path.parent, exc)
    return fit


def _fit(config: BertConfig, seq_len: int, predictions: int, dtype: str, kernels: str, nsp: bool, device: str,
         layer_counts: tuple[int, ...], batch_sizes: tuple[int, ...]) -> ActivationFit:
    if len(layer_counts) < 2 or len(batch_sizes) < 2 or min(layer_counts) < 2:
        raise ValueError(f"activation_fit needs two layer counts >= 2 (the last layer differs) and two batch sizes, "
                         f"got {layer_counts} and {batch_sizes}")
    measured = {(n, b): saved_activation_bytes(dataclasses.replace(config, num_hidden_layers=n), b, seq_len,
                                               predictions, dtype, kernels, nsp, device)
                for n in layer_counts for b in batch_sizes}
    lines = {n: _exact_line([(b, measured[n, b]) for b in batch_sizes], f"layers={n}") for n in layer_counts}
    slope = _exact_line([(n, lines[n][0]) for n in layer_counts], "per-sequence bytes by layer count")
    offset = _exact_line([(n, lines[n][1]) for n in layer_counts], "fixed bytes by layer count")
    layers = config.num_hidden_layers
    return ActivationFit(per_sequence=slope[1] + slope[0] * layers,
                         fixed=offset[1] + offset[0] * layers, layers=layers, measured=measured)


def _exact_line(points: list[tuple[int, int]], what: str) -> tuple[int, int]:
    """(slope, intercept) through the first two points, every other point checked to be on it exactly."""
    (x0, y0), (x1, y1) = points[:2]
    if (y1 - y0) % (x1 - x0):
        raise ArithmeticError(f"saved bytes are not affine in {what}: {points}")
    slope = (y1 - y0) // (x1 - x0)
    for x, y in points[2:]:
        if y != y0 + slope * (x - x0):
            raise ArithmeticError(f"saved bytes are not affine in {what}: {(x, y)} is off the line through "
                                  f"{points[:2]}")
    return slope, y0 - slope * x0


# ----------------------------------------------------------------------------------- weights, gradients, optimizer


def parameter_count(config: BertConfig) -> int:
    """Distinct parameters of ``BertForPreTraining(config)`` (the tied decoder counted once), built on ``meta``."""
    from bert_ds.model import BertForPreTraining

    with torch.device("meta"):
        model = BertForPreTraining(config, kernels="torch")
    return sum(p.numel() for p in model.parameters())


@dataclass(frozen=True)
class GradAccumLayout:
    """Where gradients are summed across micro batches besides the model-dtype ``param.grad``: a buffer of
    ``dtype`` per rank partition (``partitioned``) or per parameter. ``dtype=None``: no buffer (gradients summed in
    the model dtype). The default, an fp32 partition per rank, is what DeepSpeed's ZeRO 1/2 step itself allocates
    (``single_grad_partition``, the gradient partition cast to fp32); an fp32 accumulation kept across micro batches
    would hold that much from the first backward on, which this model assumes either way. A buffer in the model's own
    dtype costs nothing extra (the gradients are the buffer). ``fp32_reduction``: gradients are reduced across ranks in
    fp32 (``communication_data_type``), which widens DeepSpeed's buffers (:func:`static_bytes_per_rank`)."""

    dtype: str | None = "fp32"
    partitioned: bool = True
    fp32_reduction: bool = False

    def __post_init__(self) -> None:
        if self.dtype is not None and self.dtype not in _DTYPE_BYTES:
            raise ValueError(f"GradAccumLayout.dtype={self.dtype!r}: choose one of {sorted(_DTYPE_BYTES)} or None")


FP32_PARTITION = GradAccumLayout()
"""The default gradient layout: an fp32 buffer of each rank's partition beside the model-dtype gradients."""


def recipe_grad_accum(zero_stage: int, grad_accum_dtype: str, dtype: str) -> GradAccumLayout:
    """The gradient layout a run with ``deepspeed.grad_accum_dtype`` keeps (``runtime.engine.deepspeed_config``).
    bf16 ZeRO-1 summing in fp32 keeps a whole-model fp32 ``param.grad_accum`` (DeepSpeed 0.19
    ``runtime/zero/stage_1_and_2.py:1234-1240``); every other ZeRO 1/2 run holds at most an fp32 copy of its gradient
    partition (the fp32 sum under ZeRO-2, or the cast DeepSpeed's step makes of bf16 sums)."""
    fp32_sums = dtype == "bf16" and grad_accum_dtype == "fp32" and zero_stage in (1, 2)
    return GradAccumLayout("fp32", partitioned=zero_stage != 1 or not fp32_sums, fp32_reduction=fp32_sums)


@dataclass(frozen=True)
class StaticState:
    """Bytes per rank that do not depend on the micro batch, by what holds them."""

    weights: int
    """The model in its training dtype, on every rank (ZeRO 1/2 do not partition weights)."""
    gradients: int
    """``param.grad`` in the model dtype: every parameter under ZeRO 0/1; ZeRO 2 keeps this rank's partition."""
    grad_accum: int
    """The gradient buffer of :class:`GradAccumLayout` beyond the model-dtype gradients."""
    master: int
    """fp32 master weights of this rank's partition (ZeRO 1/2 keep them for every dtype; ZeRO 0: none in fp32)."""
    optimizer: int
    """LAMB's / AdamW's two fp32 moments of this rank's partition."""
    buckets: int
    """ZeRO 1/2 with contiguous gradients: the reduce buckets (``reduce_bucket_size`` elements each, two with
    ``overlap_comm``), allocated at full size whatever the model's size (DeepSpeed 0.19 ``setup_buckets``), in fp32
    when ZeRO-1 sums in fp32 (``_gradient_reduction_buffer_dtype``); ZeRO-2 reducing in fp32 adds an fp32 copy of
    one bucket at each reduction (``allreduce_bucket``'s cast to ``communication_data_type``)."""

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.grad_accum + self.master + self.optimizer + self.buckets


def static_bytes_per_rank(params: int, world_size: int, zero_stage: int, dtype: str = "bf16",
                          grad_accum: GradAccumLayout = FP32_PARTITION, reduce_bucket_size: int = 500_000_000,
                          overlap_comm: bool = True, contiguous_gradients: bool = True) -> StaticState:
    """Weights, gradients, the gradient-accumulation buffer, the fp32 master partition, two fp32 optimizer moments
    and the reduce buckets held by one of ``world_size`` ranks (ZeRO, Rajbhandari et al. 2020, §5: stage 1
    partitions the optimizer state, stage 2 the gradients too). ZeRO's alignment padding (a few elements per group)
    is left out."""
    if zero_stage not in (0, 1, 2):
        raise BadInput(f"zero_stage={zero_stage!r}: the memory model covers ZeRO stages 0, 1 and 2")
    if world_size < 1:
        raise BadInput(f"world_size={world_size!r} must be >= 1")
    width = _DTYPE_BYTES[dtype]
    partition = params if zero_stage == 0 else -(-params // world_size)
    accum = 0
    if grad_accum.dtype is not None and grad_accum.dtype != dtype:
        accum = _DTYPE_BYTES[grad_accum.dtype] * (partition if grad_accum.partitioned else params)
    zero = zero_stage >= 1
    return StaticState(
        weights=width * params,
        gradients=width * (partition if zero_stage == 2 else params),
        grad_accum=accum,
        master=4 * partition if zero or dtype != "fp32" else 0,
        optimizer=8 * partition,
        buckets=_bucket_bytes(zero_stage, width, grad_accum, reduce_bucket_size, overlap_comm, contiguous_gradients),
    )


def _bucket_bytes(zero_stage: int, width: int, grad_accum: GradAccumLayout, reduce_bucket_size: int,
                  overlap_comm: bool, contiguous_gradients: bool) -> int:
    """ZeRO 1/2's reduce buckets (DeepSpeed 0.19 ``runtime/zero/stage_1_and_2.py``: ``setup_buckets``, the buffer
    dtype of ``_gradient_reduction_buffer_dtype``, the cast in ``allreduce_bucket``)."""
    if zero_stage == 0 or not contiguous_gradients:
        return 0
    fp32_buffers = grad_accum.dtype == "fp32" and not grad_accum.partitioned  # ZeRO-1 summing in fp32
    buffers = (4 if fp32_buffers else width) * reduce_bucket_size * (2 if overlap_comm else 1)
    cast = 4 * reduce_bucket_size if grad_accum.fp32_reduction and width != 4 and not fp32_buffers else 0
    return buffers + cast


# ----------------------------------------------------------------------------------------- the estimate and a card


@dataclass(frozen=True)
class Headroom:
    """What a card keeps for itself and for what this model does not count: the CUDA context and cuBLAS/NCCL
    workspaces (``fixed_gib``) and the caching allocator's fragmentation (``fraction`` of the card). An estimate
    until a GPU measures it."""

    fraction: float = 0.10
    fixed_gib: float = 2.0

    def usable(self, card_bytes: int) -> int:
        return int(card_bytes * (1.0 - self.fraction) - self.fixed_gib * GIB)


DEFAULT_HEADROOM = Headroom()
"""10% of the card + 2 GiB."""


@dataclass(frozen=True)
class MemoryEstimate:
    """Expected peak bytes per GPU of one phase: static state + saved activations of one micro batch + the backward's
    working set (taken as one encoder layer's saved activations: the gradients of the layer being differentiated)."""

    model: str
    seq_len: int
    micro_batch: int
    world_size: int
    zero_stage: int
    dtype: str
    static: StaticState
    fit: ActivationFit
    per_layer_sequence: int
    """Saved bytes per sequence of one encoder layer (the fit's slope in layers)."""

    @property
    def activations(self) -> int:
        return self.fit.bytes(self.micro_batch)

    @property
    def backward_working(self) -> int:
        return self.per_layer_sequence * self.micro_batch

    @property
    def total(self) -> int:
        return self.static.total + self.activations + self.backward_working

    def largest_micro_batch(self, card_bytes: int, headroom: Headroom = DEFAULT_HEADROOM) -> int:
        """The largest micro batch whose estimate fits ``card_bytes`` after ``headroom``; 0 when none does."""
        room = headroom.usable(card_bytes) - self.static.total - self.fit.fixed
        return max(0, room // (self.fit.per_sequence + self.per_layer_sequence))

    def line(self) -> str:
        s = self.static
        parts = [("weights", s.weights), ("gradients", s.gradients + s.grad_accum),
                 ("master and moments", s.master + s.optimizer), ("reduce buckets", s.buckets),
                 ("activations", self.activations), ("backward working set", self.backward_working)]
        terms = " + ".join(f"{name} {size / GIB:.2f}" for name, size in parts)
        return (f"{self.model} seq {self.seq_len}, micro batch {self.micro_batch}, {self.dtype}, "
                f"ZeRO-{self.zero_stage} on {self.world_size} GPU(s): {self.total / GIB:.1f} GiB expected per GPU = "
                f"{terms} ({self.fit.per_sequence / 2**20:.1f} MiB of activations per sequence)")


def memory_per_gpu(config: BertConfig, seq_len: int, predictions: int, micro_batch: int, world_size: int,
                   zero_stage: int, dtype: str = "bf16", kernels: str = "auto", nsp: bool = True,
                   grad_accum: GradAccumLayout = FP32_PARTITION, reduce_bucket_size: int = 500_000_000,
                   overlap_comm: bool = True, contiguous_gradients: bool = True, model: str = "") -> MemoryEstimate:
    """The :class:`MemoryEstimate` of training ``config`` at ``seq_len`` with ``micro_batch`` sequences per GPU."""
    fit = activation_fit(config, seq_len, predictions, dtype, kernels, nsp)
    layers = sorted({n for n, _ in fit.measured})
    b0, b1 = sorted({b for _, b in fit.measured})[:2]
    per_layer = ((fit.measured[layers[1], b1] - fit.measured[layers[1], b0])
                 - (fit.measured[layers[0], b1] - fit.measured[layers[0], b0])) // ((b1 - b0) * (layers[1] - layers[0]))
    static = static_bytes_per_rank(parameter_count(config), world_size, zero_stage, dtype, grad_accum,
                                   reduce_bucket_size, overlap_comm, contiguous_gradients)
    return MemoryEstimate(model=model or f"{config.num_hidden_layers}x{config.hidden_size}", seq_len=seq_len,
                          micro_batch=micro_batch, world_size=world_size, zero_stage=zero_stage, dtype=dtype,
                          static=static, fit=fit, per_layer_sequence=per_layer)


def check_fits(estimate: MemoryEstimate, device_bytes: int, where: str, headroom: Headroom = DEFAULT_HEADROOM) -> None:
    """Raise :class:`~bert_ds.errors.BadInput` naming ``where`` (e.g. ``phases[0]``), its micro batch and the numbers
    when ``estimate`` exceeds what ``device_bytes`` leaves after ``headroom``."""
    usable = headroom.usable(device_bytes)
    if estimate.total > usable:
        fits = estimate.largest_micro_batch(device_bytes, headroom)
        raise BadInput(f"{where}.micro_batch_size={estimate.micro_batch}: expected {estimate.total / GIB:.1f} GiB per "
                       f"GPU at seq {estimate.seq_len}, but the device has {device_bytes / GIB:.1f} GiB, "
                       f"{usable / GIB:.1f} GiB after the headroom ({headroom.fraction:.0%} + {headroom.fixed_gib:g} "
                       f"GiB); the largest micro batch that fits is {fits} ({estimate.line()})")


# ------------------------------------------------------------------------------------------------------ a recipe


def phase_estimate(recipe: Recipe, phase: int, config: BertConfig, world_size: int, dtype: str,
                   grad_accum: GradAccumLayout | None = None) -> MemoryEstimate:
    """The :class:`MemoryEstimate` of ``recipe.phases[phase]`` on ``world_size`` GPUs in ``dtype`` (the resolved
    precision). Activation checkpointing is not modelled: with it on, the activations here are an upper bound."""
    p, ds = recipe.phases[phase], recipe.deepspeed
    if grad_accum is None:
        grad_accum = recipe_grad_accum(ds.zero_stage, ds.grad_accum_dtype, dtype)
    return memory_per_gpu(config, p.seq_len, p.max_predictions, p.micro_batch_size, world_size, ds.zero_stage, dtype,
                          recipe.kernels, recipe.nsp, grad_accum, ds.reduce_bucket_size, ds.overlap_comm,
                          ds.contiguous_gradients, model=recipe.model)


def check_recipe_memory(recipe: Recipe, phases: Iterable[int], config: BertConfig, world_size: int, dtype: str,
                        device_bytes: int | None, grad_accum: GradAccumLayout | None = None,
                        headroom: Headroom = DEFAULT_HEADROOM) -> list[str]:
    """One line per phase stating its expected peak memory per GPU; raises :class:`~bert_ds.errors.BadInput` (exit 2)
    naming the phase, its micro batch and the numbers when ``device_bytes`` (a CUDA device's memory) is given and
    the estimate exceeds it after ``headroom``. ``device_bytes=None`` (CPU ranks): stated, not checked."""
    lines = []
    for p in phases:
        where = f"phases[{p}]"
        if recipe.deepspeed.zero_stage == 3:
            lines.append(f"{where}: expected memory per GPU not estimated (ZeRO stage 3 is outside the memory model)")
            continue
        try:
            estimate = phase_estimate(recipe, p, config, world_size, dtype, grad_accum)
        except RuntimeError as exc:  # the kernel registry refuses this kernels/dtype on CUDA (its own error says why)
            lines.append(f"{where}: expected memory per GPU not estimated: {exc}")
            continue
        if device_bytes is not None:
            check_fits(estimate, device_bytes, where, headroom)
            fits = (f"fits the device's {device_bytes / GIB:.1f} GiB (largest micro batch that fits: "
                    f"{estimate.largest_micro_batch(device_bytes, headroom)})")
        else:
            fits = "not checked against a device (no CUDA)"
        upper = "; activation checkpointing is on, so activations are an upper bound" if (
            recipe.deepspeed.activation_checkpointing) else ""
        lines.append(f"{where}: {estimate.line()}; {fits}{upper}")
    return lines
