"""Kernel tests run the Triton kernels on CPU tensors under the Triton interpreter.

triton reads ``TRITON_INTERPRET`` when it is first imported (its own ``tl.sum`` etc. are bound then),
so it is set here, before any test module imports triton. In a whole-suite run another directory
may import triton first; the suite must then set ``TRITON_INTERPRET=1`` in the environment (or in
the root conftest), otherwise the kernels raise a RuntimeError that says exactly this.
"""

from __future__ import annotations

import os
import sys

import pytest

if "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from bert_ds.kernels import registry  # noqa: E402  (after the environment is set)


@pytest.fixture
def fresh_warnings(monkeypatch):
    """Forget which fallback warnings were already emitted in this process."""
    monkeypatch.setattr(registry, "_warned", set())
