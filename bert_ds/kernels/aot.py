"""Ahead-of-time compilation of every shipped kernel configuration, with register/spill usage.

No GPU is needed: ``triton.compile`` lowers each kernel for a ``GPUTarget`` and triton's bundled
``cuobjdump --dump-resource-usage`` reads REG / STACK / SHARED / LOCAL from the cubin. STACK or
LOCAL above zero means register spills, which the report treats as a failure. Kernels are compiled
for bf16 tensors (the training dtype) with the launch settings from the ``*_CONFIGS`` tables the
runtime uses, and pointer/stride arguments hinted 16-divisible as the JIT would specialize them.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import dataclass

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget

from .attention import ATTENTION_CONFIGS, _attn_bwd_dkdv_kernel, _attn_bwd_dq_kernel, _attn_fwd_kernel
from .bias_gelu import BIAS_GELU_CONFIGS, _bias_gelu_bwd_kernel, _bias_gelu_fwd_kernel
from .jit import LateJIT
from .layer_norm import LAYER_NORM_CONFIGS, _layer_norm_bwd_kernel, _layer_norm_fwd_kernel

__all__ = ["TARGETS", "KernelBuild", "ResourceUsage", "compile_kernel", "cuobjdump_path", "format_report",
           "kernel_builds", "report"]

TARGETS = (GPUTarget("cuda", 80, 32), GPUTarget("cuda", 90, 32))
_LAUNCH_KEYS = ("num_warps", "num_stages")


@dataclass(frozen=True)
class KernelBuild:
    """One kernel at one shipped configuration: argument types and constexpr values."""

    kernel: LateJIT
    config: dict  # constexprs plus launch options (num_warps, num_stages)
    pointers: dict  # pointer argument name -> element type ("bf16", "fp32", "i8")
    floats: tuple = ()  # scalar fp32 arguments; every other non-constexpr argument is i32

    @property
    def label(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self.config.items() if k not in ("INPUT_PRECISION", "DOT_DTYPE"))


@dataclass(frozen=True)
class ResourceUsage:
    kernel: str
    config: str
    arch: int
    reg: int
    stack: int
    shared: int
    local: int

    @property
    def spills(self) -> bool:
        return self.stack > 0 or self.local > 0


def kernel_builds() -> list[KernelBuild]:
    """Every kernel at every configuration the runtime ships (bf16, hidden <= 1024, head_dim 64)."""
    bf16, fp32 = "bf16", "fp32"
    ln_ptrs = {"X": bf16, "R": bf16, "Y": bf16, "W": bf16, "B": bf16, "Mean": fp32, "Rstd": fp32}
    ln_bwd_ptrs = {"X": bf16, "R": bf16, "DY": bf16, "DX": bf16, "W": bf16, "Mean": fp32, "Rstd": fp32,
                   "DW_partial": fp32, "DB_partial": fp32}
    builds = [
        KernelBuild(_layer_norm_fwd_kernel, {"HAS_RESIDUAL": True, "BLOCK_N": 1024, **LAYER_NORM_CONFIGS["fwd"]},
                    ln_ptrs, ("eps",)),
        KernelBuild(_layer_norm_bwd_kernel, {"HAS_RESIDUAL": True, "BLOCK_N": 1024, **LAYER_NORM_CONFIGS["bwd"]},
                    ln_bwd_ptrs),
        KernelBuild(_bias_gelu_fwd_kernel, dict(BIAS_GELU_CONFIGS["fwd"]), {"X": bf16, "B": bf16, "Y": bf16}),
        KernelBuild(_bias_gelu_bwd_kernel, dict(BIAS_GELU_CONFIGS["bwd"]),
                    {"X": bf16, "B": bf16, "DY": bf16, "DX": bf16, "DB_partial": fp32}),
    ]
    attn = {"HAS_MASK": True, "HEAD_DIM": 64, "INPUT_PRECISION": "tf32", "DOT_DTYPE": tl.bfloat16}
    qkv = {"Q": bf16, "K": bf16, "V": bf16, "Mask": "i8"}
    builds += [
        KernelBuild(_attn_fwd_kernel, {**attn, **ATTENTION_CONFIGS["fwd"]}, {**qkv, "Out": bf16, "LSE": fp32},
                    ("qk_scale",)),
        KernelBuild(_attn_bwd_dkdv_kernel, {**attn, **ATTENTION_CONFIGS["bwd_dkdv"]},
                    {**qkv, "DO": bf16, "LSE": fp32, "Delta": fp32, "DK": bf16, "DV": bf16}, ("qk_scale", "sm_scale")),
        KernelBuild(_attn_bwd_dq_kernel, {**attn, **ATTENTION_CONFIGS["bwd_dq"]},
                    {**qkv, "DO": bf16, "LSE": fp32, "Delta": fp32, "DQ": bf16}, ("qk_scale", "sm_scale")),
    ]
    return builds


def compile_kernel(build: KernelBuild, target: GPUTarget):
    """``triton.compile`` one build for ``target``; returns the CompiledKernel (``asm["cubin"]`` etc.)."""
    fn = build.kernel.compiled()
    constexprs = {k: v for k, v in build.config.items() if k not in _LAUNCH_KEYS}
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in build.pointers:
            signature[name] = "*" + build.pointers[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in build.floats:
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            if name.startswith("stride_"):  # row strides are multiples of hidden/head_dim, as the JIT sees them
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    backend = triton.compiler.make_backend(target)
    options = backend.parse_options({k: build.config[k] for k in _LAUNCH_KEYS if k in build.config})
    return triton.compile(src, target=target, options=options.__dict__)


def cuobjdump_path() -> str:
    """triton's bundled cuobjdump (``triton/backends/nvidia/bin/cuobjdump``)."""
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.access(path, os.X_OK):
        raise FileNotFoundError(f"cuobjdump not found at {path}; this triton build does not bundle it")
    return path


_USAGE = re.compile(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)")


def _resource_usage(cubin: bytes) -> tuple[int, int, int, int]:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([cuobjdump_path(), "--dump-resource-usage", f.name], check=True,
                             capture_output=True, text=True).stdout
    match = _USAGE.search(out)
    if match is None:
        raise RuntimeError(f"could not parse cuobjdump resource usage:\n{out}")
    reg, stack, shared, local = (int(g) for g in match.groups())
    return reg, stack, shared, local


def report(targets=TARGETS) -> list[ResourceUsage]:
    """Compile every shipped build for every target and read its resource usage."""
    rows = []
    for build in kernel_builds():
        for target in targets:
            compiled = compile_kernel(build, target)
            reg, stack, shared, local = _resource_usage(compiled.asm["cubin"])
            # cuobjdump's SHARED is static shared memory only; triton allocates dynamically.
            shared = max(shared, compiled.metadata.shared)
            rows.append(ResourceUsage(build.kernel.__name__, build.label, target.arch, reg, stack, shared, local))
    return rows


def format_report(rows: list[ResourceUsage]) -> str:
    header = ("kernel", "config", "arch", "REG", "STACK", "LOCAL", "SHARED")
    cells = [header] + [(r.kernel, r.config, f"sm_{r.arch}", str(r.reg), str(r.stack), str(r.local), str(r.shared))
                        for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells)
