"""Helpers for the kernel tests."""

from __future__ import annotations

import torch


def leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(True)


def grads_of(fn, inputs: list[torch.Tensor], grad_out: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Output of ``fn(*inputs)`` and the gradients of ``<out, grad_out>`` w.r.t. fresh copies of ``inputs``."""
    leaves = [leaf(t) for t in inputs]
    out = fn(*leaves)
    out.backward(grad_out)
    return out.detach(), [t.grad for t in leaves]


# Low-precision (bf16/fp16) kernels against their fp32 twin on the same upcast inputs. The bound is a rule in units of
# the dtype's machine epsilon (torch.finfo: 2^-7 bf16, 2^-10 fp16), per tensor and normwise, so it neither depends on
# which elements happen to be the extremes nor on the CPU's vector width: the kernel's error is its output rounding
# plus the bf16 rounding of P and dS before the matmuls (as on the GPU), each a fraction of eps of the tensor's scale.
# Measured over every bf16/fp16 case in tests/kernels (2026-11-25, avx512 CPU, Triton interpreter): normwise at most
# 0.9 eps, largest element at most 1.35 eps of the tensor's largest; the bounds are >= 11x above both. On the
# bf16 attention case, a wrong softmax scale (1/d), an ignored padding mask or a mask one key short put the worst
# tensor at 65-120 eps normwise and 119-127 eps at its largest element, 6.5-12x beyond. Subtler errors (a 1% gain is
# 1.3 eps) are below bf16's resolution; the same tests in fp32 catch them, where a logic bug lands 1e2-1e4x beyond the
# fp32 bound.
NORM_EPS = 10.0
PEAK_EPS = 16.0


def rounding_error(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> tuple[float, float]:
    """(||got - want||_2 / ||want||_2, max|got - want| / max|want|), both in units of ``dtype``'s eps."""
    eps = torch.finfo(dtype).eps
    diff, ref = got.detach().double() - want.detach().double(), want.detach().double()
    return float(diff.norm() / ref.norm().clamp_min(1e-300)) / eps, float(
        diff.abs().max() / ref.abs().max().clamp_min(1e-300)) / eps


def assert_within_rounding(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str = "") -> None:
    """``got`` (a ``dtype`` kernel's output, any float dtype) is ``want`` up to ``dtype``'s rounding (see above)."""
    assert got.shape == want.shape, (what, got.shape, want.shape)
    assert torch.isfinite(got).all(), f"{what}: non-finite values"
    norm, peak = rounding_error(got, want, dtype)
    assert norm <= NORM_EPS and peak <= PEAK_EPS, \
        f"{what}: normwise {norm:.2f} eps (bound {NORM_EPS}), largest element {peak:.2f} eps (bound {PEAK_EPS})"


def assert_matches_twin(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, fp32_tol: dict,
                        what: str = "") -> None:
    """fp32: elementwise within ``fp32_tol`` (``atol``/``rtol``); bf16/fp16: :func:`assert_within_rounding`."""
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, **fp32_tol, msg=lambda m: f"{what}: {m}")
    else:
        assert_within_rounding(got, want, dtype, what)


def kernel_report(tmp_path_factory) -> dict:
    """One ``bert-ds-kernel-report --controls --json`` run per test session (``tests.helpers.shared.built_once``):
    its JSON report plus ``returncode`` and ``output`` (stdout, then stderr). The SASS tests and the command's own
    test read the same run: each run AOT-compiles ~50 builds and disassembles them (~40 CPU-s on 2 cores)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from tests.helpers import HANG_GUARD_S, child_env
    from tests.helpers.shared import built_once

    def build(out: Path) -> None:
        # AOT compilation needs triton imported without the interpreter, hence a process of its own.
        command = [str(Path(sys.executable).parent / "bert-ds-kernel-report"), "--controls", "--json",
                   str(out / "report.json")]
        result = subprocess.run(command, capture_output=True, text=True, timeout=HANG_GUARD_S,
                                env=child_env(TRITON_INTERPRET="0"), cwd=Path(__file__).resolve().parents[2])
        (out / "run.json").write_text(json.dumps({"returncode": result.returncode, "stdout": result.stdout,
                                                  "stderr": result.stderr}))

    out = built_once(tmp_path_factory, "kernel_report", build)
    run = json.loads((out / "run.json").read_text())
    assert (out / "report.json").exists(), run["stdout"] + run["stderr"]
    report = json.loads((out / "report.json").read_text())
    report.update(returncode=run["returncode"], stdout=run["stdout"], output=run["stdout"] + run["stderr"])
    return report
