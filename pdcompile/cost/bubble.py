"""Closed forms: the time per minibatch and the bubble of every flush schedule, uniform stages.

p ranks, m microbatches per minibatch, v chunks per rank; per microbatch one rank spends `fwd`
seconds in forwards and `bwd` in backwards (all its chunks together; a chunk is 1/v of it), of
which `wgrad` compute weight gradients (the W of a split backward; where the schedule does not
split it, the part a stage that sends input gradients computes after that send,
runtime/stage_runtime.py). Transfers are free; each rank ends with `step` seconds of optimizer
steps. Then (tests/cost/test_bubble.py checks that the simulator gives exactly these on a grid
of p, m, v and times):

- "gpipe", "1f1b-flush" (any m):           (m + p - 1) (fwd + bwd) - (p - 1) wgrad
- "interleaved-1f1b" (m a multiple of p):  m (fwd + bwd) + (p - 1) (fwd + bwd - wgrad) / v
  (Narayanan et al., SC 2021: bubble (p - 1) / (v m) of the ideal time m (fwd + bwd), where
  every backward ends before its send; each of the p - 1 fill and drain steps hands its input
  gradients on before its weight gradients, wgrad / v sooner);
- "zb-h1" (m >= p, w <= f and w <= b):     m (f + b + w) + (p - 1) (f + b - w)
  with f = fwd, b = bwd - wgrad (input gradients), w = wgrad (Qi et al., ICLR 2024, ZB-H1:
  1F1B's bubble (p - 1)(f + b + w) shrinks to (p - 1)(f + b - w); f = b = w: to a third);
- "interleaved-zb" (m a multiple of p, w <= f and w <= b): m (f + b + w) + (p - 1)(f + b - w)/v.
- "zb-v" (m >= 2p - 1, f = b, w <= f), on a V of 2 chunks per rank (`schedule.placement`):
  m (f + b + w) + (p - 1) max(f, b, f + b - 2w) / 2
  (Qi et al., 2024, ZB-V: a chunk is half a stage, so the fill costs half; at f = b = w the
  bubble is (p - 1) f / 2, the first forward's way down and back only);
- "dualpipev" (m >= 2p, f = b, w <= f): m (f + b + w) + (p - 1) max(f + b - w, f, b) / 2
  (DeepSeek's DualPipeV run without overlapping a pair's forward and backward, as one CPU
  process runs them: every rank's full backwards in the main phase leave its W's nothing to
  fill, so its bubble exceeds ZB-V's by (p - 1) w / 2 where w <= f / 2, more above).

plus `step`. Outside those conditions the forms are estimates (fewer microbatches than ranks
leave rounds half empty; a W longer than F or B no longer fits the bubbles it is meant to fill;
the V-shaped ones, where f differs from b, are lower bounds within 12% of the simulated
makespan on the grid tests/cost/test_bubble.py draws).
The planner prices flush schedules by the longest path through a minibatch's actions instead
(cost/flush_path.py: exact for stages that differ, links that take time and any microbatch
count); these forms state the uniform case in a line, and `pipeline_time` falls back on
`v_fill` where ranks share processors. Recomputing a stage's activations adds its forward to
its backward (`recompute.recompute_costs`).
"""

from __future__ import annotations

from dataclasses import dataclass

from pdcompile.errors import ScheduleError
from pdcompile.schedule.kinds import KINDS, names

FORMULAS = names("flush")  # every flush schedule has one


@dataclass(frozen=True)
class FlushTime:
    """One minibatch of a flush schedule: its makespan and each rank's idle time in it."""

    makespan: float
    idle: float

    @property
    def busy(self) -> float:
        """Seconds each rank computes (and steps)."""
        return self.makespan - self.idle

    @property
    def bubble_fraction(self) -> float:
        """Idle share of the makespan (what the simulator's `bubble` reports)."""
        return self.idle / self.makespan if self.makespan > 0 else 0.0

    @property
    def bubble_ratio(self) -> float:
        """Idle time over busy time, the papers' measure ((p - 1) / (v m) interleaved)."""
        return self.idle / self.busy if self.busy > 0 else 0.0


def flush_time(schedule: str, *, ranks: int, microbatches: int, fwd: float, bwd: float,
               chunks: int = 1, wgrad: float = 0.0, step: float = 0.0) -> FlushTime:
    """The closed form of `schedule` (module docstring) for one minibatch."""
    if schedule not in FORMULAS:
        raise ScheduleError(f"no closed form for schedule {schedule!r}; there is one for "
                            f"{', '.join(FORMULAS)}")
    if ranks < 1 or microbatches < 1 or chunks < 1:
        raise ScheduleError(f"ranks, microbatches and chunks must be positive integers (got "
                            f"{ranks}, {microbatches}, {chunks})")
    if min(fwd, bwd, wgrad, step) < 0 or wgrad > bwd:
        raise ScheduleError(f"times must be >= 0 with wgrad <= bwd (got fwd {fwd}, bwd {bwd}, "
                            f"wgrad {wgrad}, step {step})")
    p, m, v = ranks, microbatches, chunks
    row = KINDS[schedule]
    if not row.interleaved and v != 1:
        raise ScheduleError(f"{schedule!r} runs one stage per rank (chunks=1, got {v})")
    if row.v_shape and v != 2:
        raise ScheduleError(f"{schedule!r} runs a V of 2 chunks per rank (chunks=2, got {v})")
    busy = m * (fwd + bwd) + step
    if row.v_shape:
        f, b, w = fwd, bwd - wgrad, wgrad
        idle = (p - 1) * v_fill(schedule, f, b, w) / 2
    elif not row.split_backward:  # (interleaved: v chunks shrink each fill and drain step;
        # a stage's weight gradients after its send leave the step before them)
        idle = (p - 1) * (fwd + bwd - wgrad) / v
    else:  # zero bubble: B is the input-gradient part, W fills the drain
        f, b, w = fwd, bwd - wgrad, wgrad
        idle = (p - 1) * (f + b - w) / v
    return FlushTime(busy + idle, idle)


def v_fill(schedule: str, f: float, b: float, w: float) -> float:
    """A V-shaped schedule's idle time per rank over (p - 1) / 2 (module docstring), for a
    rank's forward `f`, input-gradient backward `b` and weight gradients `w` per microbatch;
    per chunk (half of them each) it is the idle time of one of the p - 1 fill steps."""
    if schedule == "zb-v":
        return max(f, b, f + b - 2 * w)
    return max(f + b - w, f, b)  # dualpipev


__all__ = ["FORMULAS", "v_fill", "FlushTime", "flush_time"]
