"""Ahead-of-time builds of the Triton kernels the runtime launches, and what their machine code shows.

No GPU is needed. Each entry of :data:`ENTRIES` runs an op's real launch code (the autograd wrappers in
``layer_norm.py``, ``bias_gelu.py``, ``attention.py``, forward and backward; attention with and without dropout) on
CPU tensors laid out as the model passes them, at BERT-base and BERT-large shapes, inside
:func:`~.jit.record_launches`: the launches are recorded, not run. :func:`~.jit.specialize` then gives each launch
the JIT's own specialisation for a target (argument types, integers divisible by 16 marked ``tt.divisibility`` 16,
integers equal to 1 folded to constants, pointer alignment), so the binary built here is the one the runtime compiles.
Launches with one specialisation share one build.

For every build and target the report reads, with triton's bundled ``cuobjdump``:

- ``--dump-resource-usage``: REG / STACK / SHARED / LOCAL. STACK or LOCAL above zero means register spills.
- ``-sass``: global loads and stores by width in bits (``LDG.E.128`` is 128, ``LDG.E.U16`` 16, ``LDG.E`` 32;
  ``LDGSTS``, the asynchronous global-to-shared copy, counts as a load), tensor-core instructions (``HMMA`` on
  sm_80; ``HGMMA`` or ``HMMA`` on sm_90) and local-memory traffic (``LDL`` / ``STL``).

Each entry names the checks its kernels must pass (:class:`TensorCores`, :class:`WideAccess`); every kernel must not
spill. :func:`controls` builds known-bad variants that the checks must reject, the evidence that each check can fail.
One more kernel is one more entry: a function that calls the op's Triton wrapper at a :class:`ModelShape`, and its
checks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import subprocess
import tempfile
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
import triton
from triton.backends.compiler import GPUTarget

from bert_ds.config import model_preset

from .attention import attention_triton
from .attention_varlen import VARLEN_ATTENTION_CONFIGS, varlen_attention_triton
from .bias_gelu import bias_gelu_triton
from .jit import Specialization, compiler_mode_problem, record_launches, specialize
from .layer_norm import layer_norm_triton

__all__ = ["ATTENTION_DROPOUT", "ENTRIES", "TARGETS", "Build", "KernelEntry", "KernelReport", "ModelShape",
           "TensorCores", "WideAccess", "analyse", "bert_shapes", "compile_build", "controls", "cuobjdump_path",
           "format_report", "kernel_builds", "report", "report_json", "sass", "sass_ops"]

TARGETS = (GPUTarget("cuda", 80, 32), GPUTarget("cuda", 90, 32))


@dataclass(frozen=True)
class ModelShape:
    """The activation sizes one BERT configuration hands the kernels at one sequence length."""

    name: str
    hidden: int
    heads: int
    intermediate: int
    seq: int
    batch: int
    predictions: int  # masked positions per sequence (max_predictions_per_seq)

    @property
    def row_counts(self) -> tuple[int, ...]:
        """Rows of the (rows, hidden) activations: every token; the last layer's [CLS] + masked positions; the MLM
        head's masked positions (fewer than the cap: rarely a multiple of 16)."""
        return self.batch * self.seq, self.batch * (1 + self.predictions), self.batch * self.predictions - 3


def bert_shapes(batch: int = 4) -> tuple[ModelShape, ...]:
    """BERT-base and BERT-large at both pre-training phases: seq 128 with 20 predictions, seq 512 with 80 (NVIDIA's
    recipe). The batch size changes no build: row counts are not specialised (``do_not_specialize``) and the
    attention kernels take no batch argument; it only sets the memory the recording takes."""
    shapes = []
    for preset in ("base", "large"):
        config = model_preset(preset)
        for seq, predictions in ((128, 20), (512, 80)):
            shapes.append(ModelShape(f"{preset}-s{seq}", config.hidden_size, config.num_attention_heads,
                                     config.intermediate_size, seq, batch, predictions))
    return tuple(shapes)


@dataclass(frozen=True)
class TensorCores:
    """The kernel's matrix products must run on tensor cores: HMMA (sm_80), HGMMA or HMMA (sm_90)."""

    def problems(self, row: KernelReport) -> list[str]:
        return [] if row.tensor_core_ops > 0 else ["no tensor-core instruction (HMMA/HGMMA): products run on FMA"]


@dataclass(frozen=True)
class WideAccess:
    """A memory-bound kernel: its bf16 rows must move 128 bits per instruction. At least one 128-bit global load
    and store, no 16-bit store, and at most ``narrow_loads`` 16-bit loads: one per 1-D vector (weight, bias) whose
    block gives each thread a single element. A row read element by element shows as 8 16-bit loads per thread per
    128-bit vector it should have been."""

    narrow_loads: int = 0

    def problems(self, row: KernelReport) -> list[str]:
        out = []
        if row.loads.get(128, 0) == 0:
            out.append(f"no 128-bit global load (loads by width {row.loads})")
        if row.loads.get(16, 0) > self.narrow_loads:
            out.append(f"{row.loads[16]} 16-bit global loads (at most {self.narrow_loads} expected)")
        if row.stores.get(128, 0) == 0 or row.stores.get(16, 0) > 0:
            out.append(f"bf16 stores not 128-bit (stores by width {row.stores})")
        return out


def _leaf(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    # Never read: recorded launches do not run. torch.empty keeps recording cheap at BERT-large sizes.
    return torch.empty(shape, dtype=dtype, requires_grad=True)


def _backward(out: torch.Tensor) -> None:
    out.backward(torch.empty_like(out))


def _launch_layer_norm(shape: ModelShape, dtype: torch.dtype) -> None:
    weight, bias = _leaf(shape.hidden, dtype=dtype), _leaf(shape.hidden, dtype=dtype)
    for rows in shape.row_counts:
        x = _leaf(rows, shape.hidden, dtype=dtype)
        # Sublayer outputs: LN(dense(x) + residual); embeddings and the MLM head transform: LN(x).
        _backward(layer_norm_triton(x, weight, bias, 1e-12, residual=_leaf(rows, shape.hidden, dtype=dtype)))
        _backward(layer_norm_triton(x, weight, bias, 1e-12))


def _launch_bias_gelu(shape: ModelShape, dtype: torch.dtype) -> None:
    # The FFN's intermediate (rows, 4H) and the MLM head transform's (rows, H).
    for width in (shape.intermediate, shape.hidden):
        for rows in shape.row_counts:
            _backward(bias_gelu_triton(_leaf(rows, width, dtype=dtype), _leaf(width, dtype=dtype)))


# Attention is built without dropout (evaluation, recipes with attention dropout 0) and with the paper's 0.1 (every
# other recipe in training): DROPOUT is a constexpr, so each is its own binary.
ATTENTION_DROPOUT = (0.0, 0.1)


def _launch_attention(shape: ModelShape, dtype: torch.dtype) -> None:
    b, s, h, nh = shape.batch, shape.seq, shape.hidden, shape.heads
    # As BertSelfAttention: each of q, k, v is a (B, nh, S, hd) view of its projection's (B, S, H) output.
    q, k, v = (_leaf(b, s, h, dtype=dtype).view(b, s, nh, h // nh).transpose(1, 2) for _ in range(3))
    mask = torch.ones(b, s, dtype=torch.bool)
    for dropout_p in ATTENTION_DROPOUT:
        _backward(attention_triton(q, k, v, mask, dropout_p).transpose(1, 2).reshape(b, s, h))


def _launch_varlen_attention(shape: ModelShape, dtype: torch.dtype) -> None:
    b, s, h, nh = shape.batch, shape.seq, shape.hidden, shape.heads
    # As the unpadded BertSelfAttention: q, k, v are (T, nh, hd) views of (T, H) projections, one sequence per row
    # of the batch; every length bucket's block sizes (VARLEN_ATTENTION_CONFIGS) is built.
    for bucket in sorted(VARLEN_ATTENTION_CONFIGS):
        longest = min(s, bucket)
        total = b * longest
        q, k, v = (_leaf(total, h, dtype=dtype).view(total, nh, h // nh) for _ in range(3))
        cu_seqlens = torch.arange(0, total + 1, longest, dtype=torch.int32)
        for dropout_p in ATTENTION_DROPOUT:
            _backward(varlen_attention_triton(q, k, v, cu_seqlens, longest, dropout_p).reshape(total, h))


@dataclass(frozen=True)
class KernelEntry:
    """One fused op: ``launch(shape, dtype)`` runs its Triton wrapper forward and backward as the model does, and
    ``checks`` maps each of its kernels to what its machine code must show besides no spills."""

    op: str
    launch: Callable[[ModelShape, torch.dtype], None]
    checks: dict = field(default_factory=dict)


ENTRIES: tuple[KernelEntry, ...] = (
    KernelEntry("layer_norm", _launch_layer_norm, {"_layer_norm_fwd_kernel": WideAccess(narrow_loads=2),  # W, B
                                                   "_layer_norm_bwd_kernel": WideAccess(narrow_loads=1)}),  # W
    KernelEntry("bias_gelu", _launch_bias_gelu, {"_bias_gelu_fwd_kernel": WideAccess(narrow_loads=1),  # bias
                                                 "_bias_gelu_bwd_kernel": WideAccess(narrow_loads=1)}),
    KernelEntry("attention", _launch_attention, {name: TensorCores() for name in
                                                 ("_attn_fwd_kernel", "_attn_bwd_dkdv_kernel", "_attn_bwd_dq_kernel")}),
    KernelEntry("varlen_attention", _launch_varlen_attention,
                {name: TensorCores() for name in ("_varlen_fwd_kernel", "_varlen_bwd_dkdv_kernel",
                                                  "_varlen_bwd_dq_kernel")}),
)

_HIDDEN_CONSTEXPRS = ("INPUT_PRECISION", "DOT_DTYPE")  # implied by the pointer dtypes; kept out of labels


@dataclass(frozen=True)
class Build:
    """One binary: a kernel specialised as the JIT would for ``target``, and the recorded launches it serves."""

    entry: KernelEntry
    spec: Specialization
    target: GPUTarget
    shapes: tuple[str, ...]  # "large-s512" etc.: the shapes whose launches compile to this binary
    sites: tuple[str, ...] = ()  # which recipe launches it, and how (bert_ds.devtools.recipe_launches.Site.label)

    @property
    def kernel(self) -> str:
        return self.spec.kernel.__name__

    @property
    def label(self) -> str:
        """Every build parameter: the element type of the first tensor, the constexprs (including integers the JIT
        folded because they equal 1), the integer arguments the JIT marks 16-divisible (``div16``: e.g. BERT-large's
        16 heads, not BERT-base's 12), num_warps and num_stages. Two builds of one kernel and target have two labels
        exactly when their specialisations differ in anything but pointer alignment (which the JIT fixes at 16)."""
        dtype = next((t[1:] for t in self.spec.signature.values() if str(t).startswith("*")), "-")
        values = {self.spec.arg_name(path): v for path, v in self.spec.constexprs.items()}
        values = {k: v for k, v in values.items() if k not in _HIDDEN_CONSTEXPRS}
        pointers = {n for n, t in self.spec.signature.items() if str(t).startswith("*")}
        ints = [n for n in self.divisible if n not in pointers]
        return ",".join([f"dtype={dtype}"] + [f"{k}={v}" for k, v in values.items()]
                        + [f"div16={'+'.join(ints) or '-'}", f"num_warps={self.spec.options['num_warps']}",
                           f"num_stages={self.spec.options['num_stages']}"])

    @property
    def divisible(self) -> tuple[str, ...]:
        """Arguments the JIT marks 16-divisible (pointers: 16-byte aligned)."""
        return tuple(self.spec.arg_name(p) for p, attrs in self.spec.attrs.items()
                     if ["tt.divisibility", 16] in attrs)

    def with_changes(self, constexprs: dict | None = None, not_divisible: Iterable[str] = ()) -> Build:
        """A variant: constexprs replaced by name, and the 16-divisibility of the named arguments dropped."""
        names = self.spec.kernel.compiled().arg_names
        new_constexprs = dict(self.spec.constexprs)
        for name, value in (constexprs or {}).items():
            new_constexprs[(names.index(name),)] = value
        dropped = {(names.index(n),) for n in not_divisible}
        attrs = {p: a for p, a in self.spec.attrs.items() if p not in dropped}
        spec = dataclasses.replace(self.spec, constexprs=new_constexprs, attrs=attrs)
        return dataclasses.replace(self, spec=spec)


def kernel_builds(targets: Sequence[GPUTarget] = TARGETS, shapes: Sequence[ModelShape] | None = None,
                  dtype: torch.dtype = torch.bfloat16, entries: Sequence[KernelEntry] = ENTRIES) -> list[Build]:
    """Every distinct binary the runtime compiles for ``entries`` at ``shapes`` (default :func:`bert_shapes`), in
    ``dtype`` (bf16: the training dtype), per target."""
    shapes = bert_shapes() if shapes is None else shapes
    builds: dict[tuple, Build] = {}
    for entry in entries:
        for shape in shapes:
            with torch.enable_grad(), record_launches() as launches:
                entry.launch(shape, dtype)
            for launch in launches:
                for target in targets:
                    spec = specialize(launch, target)
                    key = (target.arch, spec.key)
                    seen = builds.get(key)
                    if seen is None:
                        builds[key] = Build(entry, spec, target, (shape.name,))
                    elif shape.name not in seen.shapes:
                        builds[key] = dataclasses.replace(seen, shapes=seen.shapes + (shape.name,))
    return sorted(builds.values(), key=lambda b: b.target.arch)  # stable: launch order within a target


def entry_of(kernel: str) -> KernelEntry:
    """The :data:`ENTRIES` row whose checks name ``kernel``."""
    for entry in ENTRIES:
        if kernel in entry.checks:
            return entry
    raise KeyError(f"{kernel}: no AOT entry checks this kernel")


def builds_from_launches(launches: Sequence[tuple], targets: Sequence[GPUTarget] = TARGETS) -> list[Build]:
    """Every distinct binary for ``launches`` ((Launch, site) pairs, site with ``.shape`` and ``.label``, as
    :func:`bert_ds.devtools.recipe_launches.shipped_launches` gives them), per target, with the sites it serves."""
    builds: dict[tuple, Build] = {}
    for launch, site in launches:
        for target in targets:
            spec = specialize(launch, target)
            key = (target.arch, spec.key)
            seen = builds.get(key) or Build(entry_of(spec.kernel.__name__), spec, target, ())
            shapes = seen.shapes if site.shape in seen.shapes else seen.shapes + (site.shape,)
            sites = seen.sites if site.label in seen.sites else seen.sites + (site.label,)
            builds[key] = dataclasses.replace(seen, shapes=shapes, sites=sites)
    return sorted(builds.values(), key=lambda b: (b.target.arch, b.kernel, b.label))


def compile_build(build: Build):
    """``triton.compile`` one build; returns the CompiledKernel (``asm["cubin"]``, ``asm["ptx"]``, ...)."""
    problem = compiler_mode_problem()
    if problem is not None:
        raise RuntimeError(problem)
    return triton.compile(build.spec.source(), target=build.target, options=build.spec.options)


def cuobjdump_path() -> str:
    """triton's bundled cuobjdump (``triton/backends/nvidia/bin/cuobjdump``)."""
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.access(path, os.X_OK):
        raise FileNotFoundError(f"cuobjdump not found at {path}; this triton build does not bundle it")
    return path


def _cuobjdump(cubin: bytes, *flags: str) -> str:
    """``cuobjdump FLAGS`` of ``cubin``, kept beside Triton's kernel cache (``bert_ds-cuobjdump/`` in
    ``triton.knobs.cache.dir``) under a hash of the cubin, the flags and the cuobjdump binary: the kernel report and
    gpu-check read the same builds, and a listing costs a cuobjdump and an nvdisasm process (0.3 CPU s a build)."""
    tool = cuobjdump_path()
    stat = os.stat(tool)
    key = hashlib.sha256(b"\0".join([cubin, " ".join(flags).encode(), f"{tool} {stat.st_size} {stat.st_mtime_ns}"
                                      .encode()])).hexdigest()
    cached = os.path.join(triton.knobs.cache.dir, "bert_ds-cuobjdump", key)
    try:
        with open(cached, encoding="utf-8") as f:
            return f.read()
    except OSError:
        pass
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        listing = subprocess.run([tool, *flags, f.name], check=True, capture_output=True, text=True).stdout
    with contextlib.suppress(OSError):  # a cache that cannot be written costs the next call a cuobjdump, no more
        os.makedirs(os.path.dirname(cached), exist_ok=True)
        with tempfile.NamedTemporaryFile("w", encoding="utf-8", dir=os.path.dirname(cached), delete=False) as out:
            out.write(listing)
        os.replace(out.name, cached)
    return listing


def sass(cubin: bytes) -> str:
    """The SASS listing of a cubin (``cuobjdump -sass``)."""
    return _cuobjdump(cubin, "-sass")


# "        /*0090*/                   @!P0 LDG.E.128 R4, desc[UR4][R2.64] ;" -> "LDG.E.128"
_INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)*)")
_WIDTH = {"U8": 8, "S8": 8, "U16": 16, "S16": 16, "64": 64, "128": 128}


def sass_ops(listing: str) -> Counter:
    """Opcode (with its modifiers, e.g. ``LDG.E.U16``) -> count in a SASS listing."""
    return Counter(_INSTRUCTION.findall(listing))


def _width(op: str) -> int:
    widths = [_WIDTH[m] for m in op.split(".")[1:] if m in _WIDTH]
    return widths[0] if widths else 32


def _by_width(ops: Counter, bases: tuple[str, ...]) -> dict[int, int]:
    out: Counter = Counter()
    for op, n in ops.items():
        if op.split(".")[0] in bases:
            out[_width(op)] += n
    return dict(sorted(out.items(), reverse=True))


_USAGE = re.compile(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)")


@dataclass(frozen=True)
class KernelReport:
    """Resource usage and machine-code figures of one build."""

    op: str
    kernel: str
    config: str
    arch: int
    shapes: tuple[str, ...]
    sites: tuple[str, ...]
    divisible: tuple[str, ...]
    reg: int
    stack: int
    shared: int
    local: int
    loads: dict  # width in bits -> global load instructions (LDG, LDGSTS)
    stores: dict  # width in bits -> global store instructions (STG)
    tensor_core_ops: int  # HMMA + HGMMA
    local_ops: int  # LDL + STL: spill traffic
    ops: dict  # every opcode -> count
    problems: tuple[str, ...] = ()

    @property
    def spills(self) -> bool:
        return self.stack > 0 or self.local > 0 or self.local_ops > 0


def analyse(build: Build) -> KernelReport:
    """Compile ``build`` and read its resource usage and SASS; ``problems`` lists every failed check."""
    compiled = compile_build(build)
    cubin = compiled.asm["cubin"]
    match = _USAGE.search(_cuobjdump(cubin, "--dump-resource-usage"))
    if match is None:
        raise RuntimeError(f"could not parse cuobjdump resource usage of {build.kernel}")
    reg, stack, shared, local = (int(g) for g in match.groups())
    shared = max(shared, compiled.metadata.shared)  # cuobjdump's SHARED is static only; triton allocates dynamically
    ops = sass_ops(sass(cubin))
    row = KernelReport(
        op=build.entry.op, kernel=build.kernel, config=build.label, arch=build.target.arch, shapes=build.shapes,
        sites=build.sites,
        divisible=build.divisible, reg=reg, stack=stack, shared=shared, local=local,
        loads=_by_width(ops, ("LDG", "LDGSTS")), stores=_by_width(ops, ("STG",)),
        tensor_core_ops=sum(n for op, n in ops.items() if op.split(".")[0] in ("HMMA", "HGMMA")),
        local_ops=sum(n for op, n in ops.items() if op.split(".")[0] in ("LDL", "STL")), ops=dict(sorted(ops.items())))
    problems = [f"spills: STACK={stack} LOCAL={local}, {row.local_ops} LDL/STL"] if row.spills else []
    check = build.entry.checks.get(build.kernel)
    if check is not None:
        problems += check.problems(row)
    return dataclasses.replace(row, problems=tuple(problems))


def report(targets: Sequence[GPUTarget] = TARGETS) -> list[KernelReport]:
    """Compile every shipped build for every target and analyse it."""
    return [analyse(b) for b in kernel_builds(targets)]


# Block sizes that spill, per architecture (measured with triton 3.9): sm_90 has room where sm_80 spills.
_SPILLING_BLOCKS = {
    80: {"_attn_fwd_kernel": {"BLOCK_M": 128, "BLOCK_N": 64}, "_attn_bwd_dkdv_kernel": {"BLOCK_M": 32, "BLOCK_N": 64}},
    90: {"_attn_fwd_kernel": {"BLOCK_M": 128, "BLOCK_N": 128}, "_attn_bwd_dkdv_kernel": {"BLOCK_M": 64, "BLOCK_N": 64}},
}


def controls(target: GPUTarget = TARGETS[0]) -> list[tuple[str, KernelReport]]:
    """Builds each check must reject on ``target``, with what they show: (what the variant is, its report).

    - the memory-bound kernels as the AOT report built them before issue 10: ``N`` a plain i32, not marked
      16-divisible as the JIT marks 768/1024/3072/4096, so the row masks cannot be proven 8-aligned;
    - the attention forward on fp32 inputs (IEEE products: no tensor cores, and it spills);
    - the attention forward and the dK/dV kernel with dropout at block sizes that spill on this architecture
      (:data:`_SPILLING_BLOCKS`).
    """
    shape = bert_shapes()[:1]
    out = []
    for build in kernel_builds([target], shape, entries=ENTRIES[:2]):
        if "HAS_RESIDUAL=False" not in build.label:
            out.append((f"{build.kernel}, N not 16-divisible (AOT before issue 10)",
                        analyse(build.with_changes(not_divisible=["N"]))))
    attn = [e for e in ENTRIES if e.op == "attention"]
    fp32 = [b for b in kernel_builds([target], shape, torch.float32, attn) if b.kernel == "_attn_fwd_kernel"]
    out.append(("_attn_fwd_kernel, fp32 inputs (IEEE products)", analyse(fp32[0])))
    bf16 = kernel_builds([target], shape, entries=attn)
    for kernel, blocks in _SPILLING_BLOCKS[target.arch].items():
        build = next(b for b in bf16 if b.kernel == kernel and ("DROPOUT=True" in b.label or "dkdv" not in kernel))
        dropout = " DROPOUT=True" if "dkdv" in kernel else ""
        out.append((f"{kernel},{dropout} BLOCK_M={blocks['BLOCK_M']} BLOCK_N={blocks['BLOCK_N']}",
                    analyse(build.with_changes(constexprs=blocks))))
    return out


def _widths(counts: dict) -> str:
    return ",".join(f"{w}x{n}" for w, n in counts.items()) or "-"


def _shapes(names: Sequence[str]) -> str:
    # "base-s128,base-s512,large-s128" -> "base,large-s128": a preset alone means all of its sequence lengths.
    presets = {n.split("-")[0] for n in names}
    seqs = {n.split("-", 1)[1] for n in names if "-" in n}
    out = [p for p in sorted(presets) if all(f"{p}-{s}" in names for s in seqs)]
    return ",".join(out + [n for n in names if n.split("-")[0] not in out])


def format_report(rows: Sequence[KernelReport]) -> str:
    """A table: resource usage, global loads/stores as width-in-bits x count, tensor-core instructions (MMA), and the
    shapes each build serves."""
    header = ("kernel", "config", "arch", "REG", "STACK", "LOCAL", "SHARED", "LOADS", "STORES", "MMA", "shapes")
    cells = [header] + [(r.kernel, r.config, f"sm_{r.arch}", str(r.reg), str(r.stack), str(r.local), str(r.shared),
                         _widths(r.loads), _widths(r.stores), str(r.tensor_core_ops), _shapes(r.shapes)) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells)


def _hgmma(row: KernelReport) -> int:
    return sum(n for op, n in row.ops.items() if op.split(".")[0] == "HGMMA")


def format_summary(rows: Sequence[KernelReport]) -> str:
    """Per architecture: builds, builds that spill, attention builds and how many of them use tensor cores."""
    lines = []
    for arch in sorted({r.arch for r in rows}):
        mine = [r for r in rows if r.arch == arch]
        attn = [r for r in mine if "attention" in r.op]
        lines.append(f"sm_{arch}: {len(mine)} builds, {sum(r.spills for r in mine)} spill, "
                     f"{sum(r.stack + r.local for r in mine)} spill bytes; {len(attn)} attention builds, "
                     f"{sum(r.tensor_core_ops > 0 for r in attn)} with MMA "
                     f"({sum(_hgmma(r) > 0 for r in attn)} with Hopper's wgmma, HGMMA)")
    return "\n".join(lines)


def report_json(rows: Sequence[KernelReport]) -> list[dict]:
    """Rows as JSON-ready dicts (widths as string keys)."""
    return json.loads(json.dumps([dataclasses.asdict(r) for r in rows]))
