"""Predicted against measured: the figures of two timelines of one pipeline, side by side.

`compare(predicted, measured)` takes the simulator's timeline and one recorded by a real run
(local or distributed backend) and returns a `Comparison`: time per minibatch, steady-state
bubble, and per stage the forward and backward time per microbatch, the optimizer step, the
time spent posting sends and waiting in receives, the share of the steady window spent
computing and the share spent outside any action, each predicted, measured and the error.
Per-stage compute tells whether a wrong prediction comes from the costs (forward and backward
already off) or from what the simulator models around them (transfers, waiting, per-action
overheads: compute right but time per minibatch off).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from pdcompile.timeline import Timeline, TimelineError, stage_figures

_SCHEDULE_KEYS = ("schedule", "microbatches_per_minibatch")


@dataclass(frozen=True)
class Figure:
    """One quantity, predicted and measured. `unit`: "s" (seconds) or "share" (0..1)."""

    name: str
    predicted: float
    measured: float
    unit: str = "s"

    @property
    def error(self) -> float:
        """Relative error of the prediction, (predicted - measured) / measured (nan if 0)."""
        if self.measured == 0:
            return 0.0 if self.predicted == 0 else math.nan
        return self.predicted / self.measured - 1.0

    @property
    def difference(self) -> float:
        """predicted - measured (for shares: in points of the share)."""
        return self.predicted - self.measured

    def cells(self) -> tuple[str, str, str]:
        """(predicted, measured, error) as printed."""
        if self.unit == "share":
            return (f"{self.predicted:.1%}", f"{self.measured:.1%}",
                    f"{self.difference * 100:+.1f} pts")
        error = "n/a" if math.isnan(self.error) else f"{self.error:+.1%}"
        return _ms(self.predicted), _ms(self.measured), error


@dataclass
class Comparison:
    """The figures of a predicted and a measured timeline (see module docstring)."""

    predicted: Timeline
    measured: Timeline
    figures: list[Figure] = field(default_factory=list)

    def figure(self, name: str) -> Figure:
        """The figure called `name` (e.g. "time per minibatch", "stage 1 forward")."""
        for item in self.figures:
            if item.name == name:
                return item
        raise KeyError(f"no figure {name!r}; have {[f.name for f in self.figures]}")

    @property
    def time_per_minibatch(self) -> Figure:
        """The headline figure."""
        return self.figure("time per minibatch")

    @property
    def error(self) -> float:
        """Relative error of the predicted time per minibatch."""
        return self.time_per_minibatch.error

    def table(self) -> str:
        """A fixed-width table: figure, predicted, measured, error."""
        rows = [("", "predicted", "measured", "error")]
        rows += [(f.name, *f.cells()) for f in self.figures]
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = [f"{r[0]:<{widths[0]}}  " + "  ".join(f"{c:>{w}}" for c, w in
                                                       zip(r[1:], widths[1:], strict=True))
                 for r in rows]
        lines.insert(1, "-" * len(lines[0]))
        return "\n".join(lines)

    def markdown(self) -> str:
        """The same table in Markdown."""
        lines = ["| figure | predicted | measured | error |", "|---|---|---|---|"]
        lines += [f"| {f.name} | " + " | ".join(f.cells()) + " |" for f in self.figures]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """Plain data: {name: {"predicted", "measured", "error", "unit"}}."""
        return {f.name: {"predicted": f.predicted, "measured": f.measured,
                         "error": None if math.isnan(f.error) else f.error, "unit": f.unit}
                for f in self.figures}

    def __str__(self) -> str:
        return self.table()


def compare(predicted: Timeline, measured: Timeline) -> Comparison:
    """Set the figures of `measured` beside those of `predicted` (see module docstring).

    Both must come from the same pipeline and schedule; facts about the run that the measured
    timeline lacks (schedule name, microbatches per minibatch) are taken from the predicted one.
    """
    if not predicted.events or not measured.events:
        which = "predicted" if not predicted.events else "measured"
        raise TimelineError(f"the {which} timeline is empty; record the run (record=True / "
                            "Pipeline.timed()) or simulate with timeline=True")
    measured = _with_schedule_facts(measured, predicted)
    want, got = predicted.stage_of_ranks(), measured.stage_of_ranks()
    if sorted(set(want.values())) != sorted(set(got.values())):
        raise TimelineError(f"the timelines cover different stages (predicted "
                            f"{sorted(set(want.values()))}, measured {sorted(set(got.values()))});"
                            " compare a run with the simulation of the same plan")
    figures = [
        Figure("time per minibatch", predicted.time_per_minibatch(),
               measured.time_per_minibatch()),
        Figure("makespan", predicted.makespan, measured.makespan),
        Figure("steady-state bubble", predicted.steady_bubble_fraction(),
               measured.steady_bubble_fraction(), "share"),
    ]
    pred_stages, meas_stages = stage_figures(predicted), stage_figures(measured)
    for stage in sorted(pred_stages):
        p, m = pred_stages[stage], meas_stages.get(stage, {})
        figures += [
            Figure(f"stage {stage} forward", p["fwd"], m.get("fwd", 0.0)),
            Figure(f"stage {stage} backward", p["bwd"], m.get("bwd", 0.0)),
            Figure(f"stage {stage} optimizer step", p["step"], m.get("step", 0.0)),
            Figure(f"stage {stage} sending", p["send"], m.get("send", 0.0)),
            Figure(f"stage {stage} receive wait", p["wait"], m.get("wait", 0.0)),
            Figure(f"stage {stage} busy", p["busy"], m.get("busy", 0.0), "share"),
            Figure(f"stage {stage} between actions", p["unrecorded"], m.get("unrecorded", 0.0),
                   "share"),
        ]
    return Comparison(predicted, measured, figures)


def _with_schedule_facts(measured: Timeline, predicted: Timeline) -> Timeline:
    missing = {k: predicted.meta[k] for k in _SCHEDULE_KEYS
               if k in predicted.meta and k not in measured.meta}
    if not missing:
        return measured
    return Timeline(measured.events, measured.source, {**measured.meta, **missing})


def _ms(seconds: float) -> str:
    if abs(seconds) >= 1.0:
        return f"{seconds:.3f} s"
    return f"{seconds * 1e3:.2f} ms"


__all__ = ["Comparison", "Figure", "compare"]
