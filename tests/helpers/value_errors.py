"""The count of the issue-32 must-show: every ``raise`` in ``bert_ds`` by what it raises, found by the AST (strings
and comments that mention a raise are not counted). A bare ``ValueError`` is a bug when it fires (exit 1 with its
traceback, :func:`bert_ds.errors.exit_code_of`), so each one left must be an internal contract no user value reaches:
:data:`INTERNAL` names them by module and function, with why.

    python -m tests.helpers.value_errors            # the counts, then every bare ValueError raise left
"""

from __future__ import annotations

import ast
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

__all__ = ["INTERNAL", "PENDING", "Raise", "counts", "raises"]

PACKAGE = Path(__file__).resolve().parents[2] / "bert_ds"

INTERNAL: dict[tuple[str, str], str] = {
    # kernel entry points: the model calls them with tensors it built; shapes and masks are the caller's contract
    ("kernels/attention.py", "attention_torch"): "the dropout mask's shape, drawn by the caller for these q, k",
    ("kernels/attention.py", "attention_triton"): "q/k/v and key-padding-mask shapes, as the model built them",
    ("kernels/attention_varlen.py", "_check"): "packed q/k/v and cu_seqlens, as the unpadding step builds them",
    ("kernels/attention_varlen.py", "varlen_attention_torch"): "seqlens vs cu_seqlens, both from the unpadding",
    ("kernels/layer_norm.py", "layer_norm_triton"): "weight/bias/residual shapes of the module's own parameters",
    ("kernels/bias_gelu.py", "bias_gelu_triton"): "the bias shape of the module's own parameter",
    ("kernels/dropout.py", "check_dropout_p"): "dropout p, refused outside [0, 1) before by BertConfig",
    ("kernels/registry.py", "resolve_backend"): "the op name, a constant of the calling module (the backend a user "
                                                "names is BadInput)",
    ("optim/lamb.py", "bind_zero"): "the ZeRO optimizer the engine built around this one",
    ("model/layers.py", "forward"): "output_hidden_states with last_layer_positions: two arguments of the caller",
    ("runtime/memory.py", "_fit"): "layer counts and batch sizes, constants of the memory model's callers",
    ("runtime/memory.py", "__post_init__"): "GradAccumLayout.dtype, set from the resolved precision",
    ("data/batch.py", "check_batch"): "a batch as the collator built it (fields, dtypes, shapes)",
    ("data/index.py", "write"): "tar member names, built from sample keys by the shard writer",
    ("checkpoint/restore.py", "load_moments"): "optimizer_step, the recipe's handoff field already validated by it",
}
"""(module under bert_ds/, enclosing function) -> why no user value reaches that bare ValueError."""

PENDING: frozenset[str] = frozenset()
"""Modules whose refusals are still being typed: none (a module listed here may keep bare ValueErrors a while)."""


@dataclass(frozen=True)
class Raise:
    module: str
    """Path under bert_ds/."""
    line: int
    function: str
    """The enclosing function ('' at module level)."""
    raised: str
    """What is raised: the called or named exception ('ValueError', 'BadInput', ...), '<re-raise>' for ``raise``."""


def _name(node: ast.expr | None) -> str:
    if node is None:
        return "<re-raise>"
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else "<expression>"


def _visit(node: ast.AST, module: str, function: str, found: list[Raise]) -> None:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
            _visit(child, module, child.name, found)
            continue
        if isinstance(child, ast.Raise):
            found.append(Raise(module, child.lineno, function, _name(child.exc)))
        _visit(child, module, function, found)


def raises(root: Path = PACKAGE) -> list[Raise]:
    """Every ``raise`` statement under ``root``, in file and line order."""
    found: list[Raise] = []
    for path in sorted(root.rglob("*.py")):
        _visit(ast.parse(path.read_text(encoding="utf-8")), str(path.relative_to(root)), "", found)
    return found


def counts(found: list[Raise]) -> dict[str, int]:
    """Bare ValueError raises (internal, pending, other: a user refusal still untyped), BadInput, other raises."""
    bare = [r for r in found if r.raised == "ValueError"]
    internal = sum((r.module, r.function) in INTERNAL for r in bare)
    pending = sum(r.module in PENDING and (r.module, r.function) not in INTERNAL for r in bare)
    return {"ValueError": len(bare), "ValueError internal": internal, "ValueError pending": pending,
            "ValueError untyped": len(bare) - internal - pending,
            "BadInput": sum(r.raised == "BadInput" for r in found),
            "other": sum(r.raised not in ("ValueError", "BadInput") for r in found)}


def main() -> None:
    found = raises(Path(sys.argv[1]) if len(sys.argv) > 1 else PACKAGE)
    for name, number in counts(found).items():
        print(f"{name:>20}: {number}")
    by_module = Counter(r.module for r in found if r.raised == "ValueError")
    for module, number in sorted(by_module.items(), key=lambda kv: -kv[1]):
        tag = "pending" if module in PENDING else ""
        print(f"{number:5d}  {module} {tag}")


if __name__ == "__main__":
    main()
