"""Gantt chart of a timeline: one row per rank, the pipeline picture of the PipeDream paper.

Forward passes are blue and backward passes green, each bar numbered with its minibatch (or
microbatch), alternating two shades so neighbouring numbers stay apart, as in the paper's
figures 4 and 8; all-reduces are orange and optimizer steps grey. Idle time (waiting for a
receive) is left blank: the bubbles. The legend says all of this, shades included. Written as
PNG or SVG (by the file's extension).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.legend_handler import HandlerTuple
from matplotlib.patches import Patch

from pdcompile.errors import PdcompileError
from pdcompile.schedule.ir import Kind, parse_action
from pdcompile.timeline import Timeline

# (light, dark) shade per drawn kind; minibatches alternate between the two
COLOURS: dict[Kind, tuple[str, str]] = {
    Kind.F: ("#8fb8e8", "#4a86c8"),
    Kind.B: ("#9fd89f", "#4caf50"),
    Kind.W: ("#d7b8e8", "#9c6ac0"),
    Kind.ALLREDUCE: ("#f5b971", "#f5b971"),
    Kind.STEP: ("#b0b0b0", "#b0b0b0"),
}
MAX_LABELS = 4000  # beyond this many bars, numbers are left out (they would not be readable)


def gantt_bars(timeline: Timeline) -> dict[int, list[tuple[float, float, Kind, int]]]:
    """What the chart draws: per rank, (start, duration, kind, number) for each drawn action."""
    bars: dict[int, list[tuple[float, float, Kind, int]]] = {rank: [] for rank in timeline.ranks}
    t0 = timeline.start
    for event in timeline.events:
        if "SEND" in event.action or "RECV" in event.action:
            continue
        action = parse_action(event.action)
        if action.kind in COLOURS:
            bars[event.rank].append((event.start - t0, event.duration, action.kind,
                                     action.microbatch))
    return bars


def draw_gantt(timeline: Timeline, paths: str | Path | Sequence[str | Path], *,
               title: str | None = None, stage_of_rank: dict[int, int] | None = None,
               width: float | None = None) -> dict[int, int]:
    """Draw `timeline` to each of `paths` (.png or .svg); returns the number of bars per rank."""
    targets = [Path(paths)] if isinstance(paths, (str, Path)) else [Path(p) for p in paths]
    for target in targets:
        if target.suffix.lower() not in (".png", ".svg"):
            raise PdcompileError(f"Gantt chart file {target} must end in .png or .svg")
    if not timeline.events:
        raise PdcompileError("the timeline is empty: nothing to draw (did the run record events?)")
    bars = gantt_bars(timeline)
    ranks = timeline.ranks
    total = sum(len(b) for b in bars.values())
    span = max(timeline.makespan, 1e-12)
    fig = Figure(figsize=(width or min(40.0, 8.0 + total / max(1, len(ranks)) * 0.25),
                          1.0 + 0.5 * len(ranks)))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    label = total <= MAX_LABELS
    for row, rank in enumerate(ranks):
        y = len(ranks) - 1 - row
        for kind in COLOURS:
            mine = [b for b in bars[rank] if b[2] == kind]
            if not mine:
                continue
            height = 0.8 if kind.is_compute else 0.4
            ax.broken_barh([(s, d) for s, d, _, _ in mine], (y - height / 2, height),
                           facecolors=[COLOURS[kind][n % 2] for _, _, _, n in mine],
                           edgecolor="black", linewidth=0.3)
            if label and kind.is_compute:
                for start, duration, _, number in mine:
                    if duration > span / 400:
                        ax.text(start + duration / 2, y, str(number), ha="center", va="center",
                                fontsize=7)
    names = [f"worker {r}" + (f" (stage {stage_of_rank[r]})" if stage_of_rank and
                              r in stage_of_rank else "") for r in ranks]
    ax.set_yticks(range(len(ranks)))
    ax.set_yticklabels(list(reversed(names)))
    ax.set_ylim(-0.6, len(ranks) - 0.4)
    ax.set_xlim(0, span)
    ax.set_xlabel("time (s)")
    # each compute kind in both its shades: light for even numbers, dark for odd ones
    handles: list[Any] = [
        (Patch(facecolor=COLOURS[k][0], edgecolor="black"),
         Patch(facecolor=COLOURS[k][1], edgecolor="black")) for k in (Kind.F, Kind.B)]
    labels = ["forward", "backward"]
    handles += [Patch(facecolor=COLOURS[k][1], edgecolor="black") for k in
                (Kind.ALLREDUCE, Kind.STEP)]
    labels += ["all-reduce", "optimizer step"]
    handles.append(Patch(facecolor="white", edgecolor="black"))
    labels.append("idle (bubble)")
    ax.legend(handles, labels, handler_map={tuple: HandlerTuple(ndivide=None, pad=0)},
              loc="lower right", bbox_to_anchor=(1.0, 1.0), fontsize=7, ncol=5, frameon=False,
              title="bar number: the minibatch; light and dark shades alternate between "
                    "consecutive minibatches", title_fontsize=7)
    ax.set_title(title or f"{timeline.meta.get('schedule', 'pipeline')} ({timeline.source})",
                 loc="left")
    fig.tight_layout()
    for target in targets:
        target.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(target, dpi=110)
    return {rank: len(b) for rank, b in bars.items()}
