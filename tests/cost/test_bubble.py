"""The simulator's time per minibatch and bubble equal the closed forms of cost/bubble.py.

Every schedule runs on p ranks with free transfers and free optimizer steps, on uniform stages:
one rank spends `fwd` and `bwd` per microbatch (its v chunks together), `wgrad` of the backward
computing weight gradients (where the backward is not split: after the input-gradient send, on
every stage but the first). The formulas tested (module docstring of cost/bubble.py):

    gpipe, 1f1b-flush:   (m + p - 1)(f + b) - (p - 1) w      (w = 0: (m + p - 1)(f + b))
    interleaved-1f1b:    m (f + b) + (p - 1)(f + b - w) / v  (w = 0: bubble ratio (p - 1) / (v m))
    zb-h1:               m (f + b + w) + (p - 1)(f + b - w)  with b the input-gradient part
    interleaved-zb:      m (f + b + w) + (p - 1)(f + b - w) / v
    zb-v (f = b):        m (f + b + w) + (p - 1) max(f, f + b - 2w) / 2     on a V, v = 2
    dualpipev (f = b):   m (f + b + w) + (p - 1)(f + b - w) / 2
"""

from __future__ import annotations

import itertools

import pytest

from pdcompile.backends.simulate import simulate
from pdcompile.cost.bubble import flush_time
from pdcompile.cost.stage_costs import StageCosts
from pdcompile.errors import ScheduleError
from pdcompile.machine.cluster import Cluster
from pdcompile.schedule.generators import generate
from pdcompile.schedule.kinds import kind
from pdcompile.schedule.lower import lower
from pdcompile.schedule.placement import v_position

TIMES = [(1.0, 1.0, 0.5), (1.0, 2.0, 1.0), (2.0, 1.0, 0.5), (1.0, 3.0, 1.0), (3.0, 4.0, 2.0),
         (1.5, 2.5, 0.25)]  # (fwd, bwd, wgrad) per microbatch and rank, wgrad <= fwd, bwd - wgrad


def simulated(name: str, p: int, v: int, m: int, fwd: float, bwd: float, wgrad: float,
              step: float = 0.0) -> tuple[float, float]:
    """(makespan, bubble fraction) the simulator gives."""
    stages = p * v
    place = v_position if kind(name).v_shape else lambda c, ranks: c % ranks
    schedule = lower(generate(name, [[place(c, p)] for c in range(stages)], m))
    costs = StageCosts.uniform(stages, fwd=fwd / v, bwd=bwd / v, optimizer=step / v)
    result = simulate(schedule, costs, Cluster.flat(p, 1e30), wgrad_share=wgrad / bwd)
    return result.makespan, result.bubble


@pytest.mark.parametrize(("p", "m"), itertools.product([2, 3, 4, 5], [1, 2, 3, 4, 7, 8, 16]))
@pytest.mark.parametrize("name", ["gpipe", "1f1b-flush"])
def test_gpipe_and_1f1b_flush(name: str, p: int, m: int) -> None:
    for fwd, bwd, wgrad in TIMES + [(f, b, 0.0) for f, b, _ in TIMES]:
        makespan, bubble = simulated(name, p, 1, m, fwd, bwd, wgrad)
        closed = flush_time(name, ranks=p, microbatches=m, fwd=fwd, bwd=bwd, wgrad=wgrad)
        # each of the p - 1 stages that send gradients back sends them before its W
        assert makespan == pytest.approx((m + p - 1) * (fwd + bwd) - (p - 1) * wgrad, rel=1e-12)
        assert makespan == pytest.approx(closed.makespan, rel=1e-12)
        assert bubble == pytest.approx(closed.bubble_fraction, rel=1e-9)


@pytest.mark.parametrize(("p", "v", "m"), [(p, v, m) for p, v, m in itertools.product(
    [2, 3, 4], [2, 3, 4], [2, 3, 4, 6, 8, 9, 12, 16]) if m % p == 0])
def test_interleaved_1f1b_bubble_is_p_minus_1_over_v_m(p: int, v: int, m: int) -> None:
    for fwd, bwd, wgrad in TIMES + [(f, b, 0.0) for f, b, _ in TIMES]:
        makespan, bubble = simulated("interleaved-1f1b", p, v, m, fwd, bwd, wgrad)
        closed = flush_time("interleaved-1f1b", ranks=p, microbatches=m, chunks=v, fwd=fwd,
                            bwd=bwd, wgrad=wgrad)
        assert makespan == pytest.approx(closed.makespan, rel=1e-12)
        assert bubble == pytest.approx(closed.bubble_fraction, rel=1e-9)
        # the paper's (p - 1) / (v m), less the weight gradients each step leaves after its send
        ratio = (p - 1) / (v * m) * (fwd + bwd - wgrad) / (fwd + bwd)
        assert closed.bubble_ratio == pytest.approx(ratio, rel=1e-12)
        idle = makespan - m * (fwd + bwd)  # per rank, measured against the ideal time
        assert idle / (m * (fwd + bwd)) == pytest.approx(ratio, rel=1e-9)


@pytest.mark.parametrize(("p", "m"), [(p, m) for p, m in itertools.product(
    [2, 3, 4, 5, 6], [2, 3, 4, 5, 6, 8, 12, 16]) if m >= p])
def test_zb_h1_bubble_is_p_minus_1_times_f_plus_b_minus_w(p: int, m: int) -> None:
    for fwd, bwd, wgrad in TIMES:
        f, b, w = fwd, bwd - wgrad, wgrad
        makespan, bubble = simulated("zb-h1", p, 1, m, fwd, bwd, wgrad)
        assert makespan == pytest.approx(m * (f + b + w) + (p - 1) * (f + b - w), rel=1e-12)
        closed = flush_time("zb-h1", ranks=p, microbatches=m, fwd=fwd, bwd=bwd, wgrad=wgrad)
        assert makespan == pytest.approx(closed.makespan, rel=1e-12)
        assert bubble == pytest.approx(closed.bubble_fraction, rel=1e-9)
        # 1F1B-flush on the same work idles (p - 1)(f + b): its stages send their input
        # gradients before their W too, but leave it where it is; zero bubble saves (p - 1) w
        # more by moving it into the drain (without that, 2 (p - 1) w)
        flush, _ = simulated("1f1b-flush", p, 1, m, fwd, bwd, wgrad)
        assert flush - makespan == pytest.approx((p - 1) * w, rel=1e-9)
        blocked, _ = simulated("1f1b-flush", p, 1, m, fwd, bwd, 0.0)
        assert blocked - makespan == pytest.approx(2 * (p - 1) * w, rel=1e-9)


@pytest.mark.parametrize(("p", "v", "m"), [(p, v, m) for p, v, m in itertools.product(
    [2, 3, 4], [2, 3], [2, 3, 4, 6, 8, 12]) if m % p == 0])
def test_interleaved_zb(p: int, v: int, m: int) -> None:
    for fwd, bwd, wgrad in TIMES:
        makespan, bubble = simulated("interleaved-zb", p, v, m, fwd, bwd, wgrad)
        closed = flush_time("interleaved-zb", ranks=p, microbatches=m, chunks=v, fwd=fwd,
                            bwd=bwd, wgrad=wgrad)
        assert makespan == pytest.approx(closed.makespan, rel=1e-12)
        assert bubble == pytest.approx(closed.bubble_fraction, rel=1e-9)


# forward and input-gradient backward alike (the V-shaped forms are exact there), w <= f
EQUAL_FB = [(1.0, 2.0, 1.0), (1.0, 1.5, 0.5), (1.0, 1.25, 0.25), (2.0, 2.5, 0.5), (1.0, 1.0, 0.0),
            (3.0, 4.0, 1.0), (1.5, 2.25, 0.75)]  # (fwd, bwd, wgrad): fwd = bwd - wgrad


# zb-v fills its pipeline at 2p - 1 microbatches, dualpipev needs 2p
@pytest.mark.parametrize(("name", "p", "m"), [(name, p, m) for name, p, m in itertools.product(
    ["zb-v", "dualpipev"], [2, 3, 4, 5], [3, 4, 5, 6, 8, 9, 10, 16])
    if m >= 2 * p - (name == "zb-v")])
def test_v_shaped_bubbles(name: str, p: int, m: int) -> None:
    for fwd, bwd, wgrad in EQUAL_FB:
        f, w = fwd, wgrad
        makespan, bubble = simulated(name, p, 2, m, fwd, bwd, wgrad)
        fill = max(f, 2 * f - 2 * w) if name == "zb-v" else 2 * f - w
        assert makespan == pytest.approx(m * (2 * f + w) + (p - 1) * fill / 2, rel=1e-12)
        closed = flush_time(name, ranks=p, microbatches=m, chunks=2, fwd=fwd, bwd=bwd,
                            wgrad=wgrad)
        assert makespan == pytest.approx(closed.makespan, rel=1e-12)
        assert bubble == pytest.approx(closed.bubble_fraction, rel=1e-9)
    # a forward unlike the input-gradient backward: the form is a lower bound, within 12%
    for fwd, bwd, wgrad in TIMES:
        makespan, _ = simulated(name, p, 2, m, fwd, bwd, wgrad)
        closed = flush_time(name, ranks=p, microbatches=m, chunks=2, fwd=fwd, bwd=bwd,
                            wgrad=wgrad)
        assert makespan * 0.88 <= closed.makespan <= makespan * (1 + 1e-12)


def test_zb_v_idles_no_more_than_dualpipev_without_overlap() -> None:
    for fwd, bwd, wgrad in EQUAL_FB:
        zbv = flush_time("zb-v", ranks=4, microbatches=8, chunks=2, fwd=fwd, bwd=bwd, wgrad=wgrad)
        dual = flush_time("dualpipev", ranks=4, microbatches=8, chunks=2, fwd=fwd, bwd=bwd,
                          wgrad=wgrad)
        assert zbv.idle <= dual.idle
        # and than 1F1B-flush on the same work: (p - 1)(f + b + w) of idle
        assert zbv.idle < flush_time("1f1b-flush", ranks=4, microbatches=8, fwd=fwd,
                                     bwd=bwd).idle


def test_optimizer_steps_add_to_the_makespan() -> None:
    makespan, _ = simulated("zb-h1", 3, 1, 6, 1.0, 2.0, 1.0, step=0.5)
    assert makespan == pytest.approx(flush_time("zb-h1", ranks=3, microbatches=6, fwd=1.0,
                                                bwd=2.0, wgrad=1.0, step=0.5).makespan)


def test_closed_forms_refuse_what_they_do_not_describe() -> None:
    with pytest.raises(ScheduleError, match="no closed form for schedule '1f1b'"):
        flush_time("1f1b", ranks=2, microbatches=4, fwd=1, bwd=1)
    with pytest.raises(ScheduleError, match="chunks=1"):
        flush_time("zb-h1", ranks=2, microbatches=4, chunks=2, fwd=1, bwd=1)
    with pytest.raises(ScheduleError, match="wgrad <= bwd"):
        flush_time("zb-h1", ranks=2, microbatches=4, fwd=1, bwd=1, wgrad=2)
    with pytest.raises(ScheduleError, match="chunks=2"):
        flush_time("zb-v", ranks=2, microbatches=4, chunks=3, fwd=1, bwd=1)
