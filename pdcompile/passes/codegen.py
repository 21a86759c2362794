"""Codegen: readable Python source of each rank's execution loop, from the lowered schedule.

Each rank gets a generator function `run_rank(rt)` that performs its actions in order, every one
written `yield from rt.<op>(...)` (`rt` is a runtime.stage_runtime.StageRuntime, or anything with
the same handlers), so a backend can interleave ranks (local) or run one to the end
(distributed). A rank holding several chunks of an interleaved pipeline gets a runtime per
chunk, and its calls name the chunk: `yield from rt.chunk(2).forward(3)`
(runtime/chunks.ChunkRuntimes). Periodic stretches of the action list (warm-up, steady 1F1B,
drain) become `for` loops: a block of p actions repeated n times whose kinds and peers repeat
and whose microbatch numbers grow by a fixed stride per repetition. The source is compiled and
executed as is: it is the execution path of every backend, not a picture of it.
"""

from __future__ import annotations

import linecache
from dataclasses import dataclass
from typing import Any

from pdcompile.errors import ScheduleError
from pdcompile.runtime.rank_function import RankFn
from pdcompile.schedule.ir import Action, Kind, Schedule
from pdcompile.schedule.kinds import KINDS

_CALLS = {
    Kind.F: "forward({n})",
    Kind.B: "backward({n})",
    Kind.W: "backward_weight({n})",
    Kind.SEND_F: "send_f({n}, {peer})",
    Kind.RECV_F: "recv_f({n}, {peer})",
    Kind.SEND_B: "send_b({n}, {peer})",
    Kind.RECV_B: "recv_b({n}, {peer})",
    Kind.ALLREDUCE: "all_reduce({n})",
    Kind.STEP: "step({n})",
}
MAX_PERIOD = 96
MIN_REPEATS = 3


@dataclass(frozen=True)
class _Loop:
    start: int
    period: int
    repeats: int


def _find_loop(actions: tuple[Action, ...], start: int) -> _Loop | None:
    """The periodic run starting at `start` covering the most actions (ties: shortest period)."""
    best: _Loop | None = None
    for period in range(1, MAX_PERIOD + 1):
        if start + MIN_REPEATS * period > len(actions):
            break
        block = actions[start:start + period]
        second = actions[start + period:start + 2 * period]
        if any(_shape(a) != _shape(b) for a, b in zip(block, second, strict=True)):
            continue
        strides = [b.microbatch - a.microbatch for a, b in zip(block, second, strict=True)]
        repeats = 2
        while start + (repeats + 1) * period <= len(actions):
            nxt = actions[start + repeats * period:start + (repeats + 1) * period]
            if any(_shape(a) != _shape(c) or c.microbatch != a.microbatch + s * repeats
                   for a, c, s in zip(block, nxt, strides, strict=True)):
                break
            repeats += 1
        if repeats >= MIN_REPEATS and (best is None
                                       or period * repeats > best.period * best.repeats):
            best = _Loop(start, period, repeats)
    return best


def _shape(action: Action) -> tuple[int, Kind, int | None]:
    return action.stage, action.kind, action.peer


def _number(base: int, stride: int) -> str:
    if stride == 0:
        return str(base)
    term = "i" if stride == 1 else f"{stride} * i"
    return term if base == 0 else f"{base} + {term}"


def _call(action: Action, number: str, chunked: bool) -> str:
    try:
        template = _CALLS[action.kind]
    except KeyError:
        raise ScheduleError(f"codegen cannot emit {action} ({action.kind.value} actions have no "
                            "runtime handler yet); use a schedule of F/B actions") from None
    target = f"rt.chunk({action.stage})." if chunked else "rt."
    return "yield from " + target + template.format(n=number, peer=action.peer)


def _phase(block: tuple[Action, ...]) -> str:
    kinds = {a.kind for a in block}
    if Kind.F in kinds and Kind.B in kinds:
        return "steady state: one forward, one backward" + (
            " (weight gradients after)" if Kind.W in kinds else "")
    if Kind.F in kinds:
        return "warm-up: forwards"
    if Kind.B in kinds:
        return "drain: backwards" + (" and weight gradients" if Kind.W in kinds else "")
    if Kind.W in kinds:
        return "drain: weight gradients"
    return "updates"


def generate_rank(schedule: Schedule, rank: int) -> str:
    """The source of `run_rank(rt)` for `rank` of a lowered schedule."""
    if not schedule.options.get("lowered"):
        raise ScheduleError("codegen takes a lowered schedule (schedule.lower.lower(schedule, "
                            "edges)); this one has no communication or updates yet")
    actions = schedule.actions.get(rank, ())
    stages = schedule.stages_of_rank(rank)
    chunked = len(stages) > 1
    if chunked:
        row = KINDS.get(schedule.name)
        shape = "a V" if row is not None and row.v_shape else "an interleaved pipeline"
        held = f"stages {', '.join(map(str, stages))} (chunks of {shape})"
    else:
        replicas = schedule.stage_ranks[stages[0]]
        held = f"stage {stages[0]} (replica {replicas.index(rank)} of {len(replicas)})"
    header = (f'"""Generated by pdcompile.passes.codegen: rank {rank} runs {held} of schedule '
              f"'{schedule.name}', {schedule.microbatches} microbatches, {len(actions)} actions."
              '\n\nDo not edit: regenerate from the schedule.\n"""\n')
    lines = ["", "", "def run_rank(rt):"]
    if not actions:
        lines.append("    return")
        lines.append("    yield")
    index = 0
    while index < len(actions):
        loop = _find_loop(actions, index)
        if loop is None:
            lines.append("    " + _call(actions[index], str(actions[index].microbatch), chunked))
            index += 1
            continue
        block = actions[index:index + loop.period]
        second = actions[index + loop.period:index + 2 * loop.period]
        first, last = index, index + loop.period * loop.repeats - 1
        lines.append(f"    # {_phase(block)} (actions {first}..{last})")
        lines.append(f"    for i in range({loop.repeats}):")
        for a, b in zip(block, second, strict=True):
            lines.append("        " + _call(a, _number(a.microbatch, b.microbatch - a.microbatch),
                                              chunked))
        index = last + 1
    return header + "\n".join(lines) + "\n"


def generate(schedule: Schedule) -> dict[int, str]:
    """Source of every rank's loop."""
    return {rank: generate_rank(schedule, rank) for rank in schedule.ranks}


def load_rank(source: str, *, name: str = "rank") -> RankFn:
    """Compile generated source and return its `run_rank` (tracebacks show the source)."""
    filename = f"<pdcompile {name}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace: dict[str, Any] = {}
    exec(compile(source, filename, "exec"), namespace)  # noqa: S102 - our own generated code
    function = namespace.get("run_rank")
    if not callable(function):
        raise ScheduleError(f"generated source for {name} defines no run_rank(rt)")
    return function  # type: ignore[no-any-return]


__all__ = ["generate", "generate_rank", "load_rank"]
