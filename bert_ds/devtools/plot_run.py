"""Plot a bert_ds run's curves from its TensorBoard event files into one PNG.

    bert-ds-plot-run RUN_DIR [--out PNG]        (default: RUN_DIR/curves.png; also python tools/plot_run.py)

RUN_DIR is a run directory (``RUN_DIR/tensorboard/`` holds the event files) or the TensorBoard directory itself.
Panels: losses, masked-LM accuracy (train and held-out eval), next-sentence accuracy, learning rate, throughput and
gradient norm, against the global optimizer step; phase 2 is shaded and each phase start is marked with a dashed
line and its sequence length (from ``RUN_DIR/recipe.json`` when present). Needs only matplotlib (Agg backend: no
display) and tensorboard (installed with bert_ds). Exit status 2 when there is nothing to plot.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from bert_ds.cli import alias
from bert_ds.cli_args import build_parser, defaults_of, option
from bert_ds.errors import BadInput

__all__ = ["PANELS", "PlotResult", "find_event_dir", "main", "plot_run", "read_scalars"]

# (title, y label, [(tag, legend label, style)]); style "line" for per-interval training points, "marker" for the
# sparse eval points. Tags are the ones bert_ds.runtime.metrics.MetricsLogger writes.
PANELS: list[tuple[str, str, list[tuple[str, str, str]]]] = [
    ("Loss", "loss", [("train/loss", "train total", "line"), ("train/mlm_loss", "train masked LM", "line"),
                      ("train/nsp_loss", "train NSP", "line"), ("eval/mlm_loss", "eval masked LM", "marker")]),
    ("Masked-LM accuracy", "accuracy", [("train/mlm_accuracy", "train", "line"),
                                        ("eval/mlm_accuracy", "held-out eval", "marker")]),
    ("Next-sentence accuracy", "accuracy", [("train/nsp_accuracy", "train", "line"),
                                            ("eval/nsp_accuracy", "held-out eval", "marker")]),
    ("Learning rate", "lr", [("train/lr", "lr", "line")]),
    # Tokens, not sequences: comparable across phases of different sequence lengths.
    ("Throughput", "tokens / s (all ranks, padding included)", [("perf/tokens_per_s", "tokens/s", "line")]),
    ("Gradient norm (before clipping)", "global L2 norm", [("train/grad_norm", "grad norm", "line")]),
]
_PHASE_TAG = "progress/phase"
_PHASE_COLORS = ("#ffffff", "#e8eef7")  # phase 1 unshaded, phase 2 light blue


@dataclass
class PlotResult:
    path: Path
    tags: list[str] = field(default_factory=list)
    """The scalar tags drawn, in panel order."""
    missing: list[str] = field(default_factory=list)
    """Tags a panel asks for that the run did not write (e.g. eval tags of a run without --eval-data)."""
    phases: list[tuple[float, str]] = field(default_factory=list)
    """(step where the phase's shading starts, label) per phase marked."""


def find_event_dir(run_dir: str | Path) -> Path:
    """The directory holding the event files: ``run_dir/tensorboard`` or ``run_dir`` itself."""
    run_dir = Path(run_dir)
    for candidate in (run_dir / "tensorboard", run_dir):
        if candidate.is_dir() and any(candidate.glob("events.out.tfevents.*")):
            return candidate
    raise FileNotFoundError(f"{run_dir}: no TensorBoard event files (events.out.tfevents.*) here or in "
                            f"{run_dir / 'tensorboard'}")


def read_scalars(event_dir: str | Path) -> dict[str, tuple[list[int], list[float]]]:
    """Every scalar tag as (steps, values), sorted by step. A step written twice (a run resumed from an earlier
    checkpoint logs it again) keeps the last value, which is the one the continuing run produced."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(event_dir), size_guidance={"scalars": 0})  # 0: keep every point, not a sample
    acc.Reload()
    out = {}
    for tag in acc.Tags()["scalars"]:
        by_step = {e.step: e.value for e in acc.Scalars(tag)}
        steps = sorted(by_step)
        out[tag] = (steps, [by_step[s] for s in steps])
    return out


def _phase_spans(scalars: dict, run_dir: Path) -> list[tuple[float, int, str]]:
    """(start step, phase number, label) per phase, from ``progress/phase``. A phase starts where the previous one's
    last logged step ends (the logger writes a partial interval at every phase change, so that step is the previous
    phase's last). The label names the sequence length when the run directory's ``recipe.json`` is readable."""
    if _PHASE_TAG not in scalars:
        return []
    seq_lens = {}
    try:
        recipe = json.loads((run_dir / "recipe.json").read_text())
        seq_lens = {i + 1: p["seq_len"] for i, p in enumerate(recipe["phases"])}
    except (OSError, ValueError, KeyError, TypeError):
        pass  # a bare TensorBoard directory: the phases are still marked, without their sequence length
    spans, previous_phase, previous_step = [], None, 0
    for step, phase in zip(*scalars[_PHASE_TAG], strict=True):
        if phase != previous_phase:
            number = int(phase)
            label = f"phase {number}" + (f": seq {seq_lens[number]}" if number in seq_lens else "")
            spans.append((0 if previous_phase is None else previous_step, number, label))
            previous_phase = phase
        previous_step = step
    return spans


def _mark_phases(ax, spans: list[tuple[float, int, str]], last_step: int) -> None:
    for i, (begin, number, label) in enumerate(spans):
        end = spans[i + 1][0] if i + 1 < len(spans) else last_step
        ax.axvspan(begin, end, color=_PHASE_COLORS[(number - 1) % 2], zorder=0)
        if i > 0:
            ax.axvline(begin, color="0.35", linestyle="--", linewidth=1, zorder=1)
        # A short last phase gets its label inside its own shading's left neighbour, pointing right.
        narrow_last = i + 1 == len(spans) and end - begin < 0.25 * last_step
        x, text, ha = (end, f" {label} \u2192 ", "right") if narrow_last else (begin, f" {label} ", "left")
        ax.text(x, 0.99, text, transform=ax.get_xaxis_transform(), fontsize=7, color="0.3", va="top", ha=ha, zorder=4)


def _draw_panel(ax, title: str, ylabel: str, series: list[tuple[str, str, str]], scalars: dict) -> list[str]:
    drawn = []
    for tag, label, style in series:
        if tag not in scalars:
            continue
        steps, values = scalars[tag]
        if style == "marker":
            ax.plot(steps, values, "o-", markersize=5, linewidth=1.2, label=label, zorder=3)
        else:
            ax.plot(steps, values, linewidth=1.4, label=label, zorder=2)
        drawn.append(tag)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("optimizer step (all phases)", fontsize=8)
    ax.set_ylabel(ylabel, fontsize=8)
    ax.tick_params(labelsize=8)
    ax.grid(True, alpha=0.3)
    if drawn:
        ax.legend(fontsize=7, loc="best")
    else:
        ax.text(0.5, 0.5, "not logged by this run", transform=ax.transAxes, ha="center", color="0.5")
    return drawn


def plot_run(run_dir: str | Path, out: str | Path | None = None, title: str | None = None) -> PlotResult:
    """Write the run's curves to ``out`` (default ``RUN_DIR/curves.png``); returns the path and the tags drawn.
    Raises FileNotFoundError without event files and BadInput when they hold none of the plotted tags."""
    import matplotlib

    matplotlib.use("Agg")  # files only: never needs a display
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    event_dir = find_event_dir(run_dir)
    scalars = read_scalars(event_dir)
    wanted = [tag for _, _, series in PANELS for tag, _, _ in series]
    if not any(tag in scalars for tag in wanted):
        raise BadInput(f"{event_dir}: the event files hold none of the plotted tags {wanted} "
                       f"(found {sorted(scalars) or 'no scalars'})")
    meta_dir = run_dir if event_dir != run_dir else run_dir.parent
    spans = _phase_spans(scalars, meta_dir)
    last_step = max(steps[-1] for steps, _ in scalars.values() if steps)

    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5), layout="constrained")
    result = PlotResult(path=Path(out) if out is not None else meta_dir / "curves.png")
    for ax, (panel_title, ylabel, series) in zip(axes.flat, PANELS, strict=True):
        _mark_phases(ax, spans, last_step)
        result.tags += _draw_panel(ax, panel_title, ylabel, series, scalars)
        ax.set_xlim(0, last_step)
    result.missing = [tag for tag in wanted if tag not in result.tags]
    result.phases = [(begin, label) for begin, _, label in spans]
    fig.suptitle(title or f"bert_ds run {meta_dir}", fontsize=12)
    result.path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(result.path, dpi=110)
    plt.close(fig)
    return result


_PLOT_DEFAULTS = defaults_of(plot_run)


@dataclass
class PlotArgs:
    """``bert-ds-plot-run``'s options (:mod:`bert_ds.cli_args`); defaults are :func:`plot_run`'s."""

    run_dir: str = option(positional=True, metavar="RUN_DIR", help="run directory (with tensorboard/) or a "
                          "TensorBoard dir")
    out: str | None = option(_PLOT_DEFAULTS["out"], metavar="PNG", help="output PNG (default: RUN_DIR/curves.png)")
    title: str | None = _PLOT_DEFAULTS["title"]
    """Figure title (default: the run directory's name)."""


def cli_parser() -> argparse.ArgumentParser:
    return build_parser(PlotArgs, "bert-ds-plot-run", __doc__.split("\n\n")[0])


main = alias("plot-run")


def _run(args: PlotArgs) -> int:
    """``bert-ds-plot-run`` / ``tools/plot_run.py``: exit 0 after writing the PNG, 2 when there is nothing to plot."""
    result = plot_run(args.run_dir, args.out, args.title)
    note = f" (not in this run: {', '.join(result.missing)})" if result.missing else ""
    print(f"wrote {result.path}: {len(result.tags)} curves{note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
