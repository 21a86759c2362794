"""Generated rank loops: golden sources, loop compression, and that running them replays the
schedule exactly (the generated code is the execution path).

Golden files live in tests/passes/golden/; regenerate with PDCOMPILE_REGEN_GOLDEN=1 after a
deliberate change and review the diff.
"""

from __future__ import annotations

import os
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest

from pdcompile.errors import ScheduleError
from pdcompile.passes.codegen import generate, generate_rank, load_rank
from pdcompile.schedule.generators import generate as generate_schedule
from pdcompile.schedule.ir import Action, Kind, Schedule
from pdcompile.schedule.lower import lower

GOLDEN = Path(__file__).parent / "golden"

CASES = {
    "1f1b_4stages_8mb": ("1f1b", [[0], [1], [2], [3]], 8, {}, None),
    "1f1b_rr_2-1_8mb": ("1f1b", [[0, 1], [2]], 8, {}, None),
    "1f1b-flush_3stages_skip_4mb": ("1f1b-flush", [[0], [1], [2]], 4, {}, [(0, 1), (0, 2),
                                                                            (1, 2)]),
    "gpipe_2stages_4mb": ("gpipe", [[0], [1]], 4, {}, None),
    "2bw_2stages_2x4mb": ("2bw", [[0], [1]], 8, {"microbatches_per_minibatch": 4}, None),
    "interleaved-1f1b_2ranks_2chunks_4mb": ("interleaved-1f1b", [[0], [1], [0], [1]], 4, {},
                                            None),
    "zb-h1_3stages_6mb": ("zb-h1", [[0], [1], [2]], 6, {}, None),
}


def lowered(name: str) -> Schedule:
    schedule, ranks, n, options, edges = CASES[name]
    return lower(generate_schedule(schedule, ranks, n, **options), edges)


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden_generated_code(name: str) -> None:
    sources = generate(lowered(name))
    text = "".join(f"# ===== rank {rank}\n{src}" for rank, src in sorted(sources.items()))
    path = GOLDEN / f"{name}.py.txt"
    if os.environ.get("PDCOMPILE_REGEN_GOLDEN") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.is_file(), f"{path} missing: run with PDCOMPILE_REGEN_GOLDEN=1"
    assert text == path.read_text()


class Replay:
    """A runtime that only records what the generated code asks it to do."""

    def __init__(self, stage: int, done: list[Action] | None = None) -> None:
        self.stage = stage
        self.done: list[Action] = [] if done is None else done

    def chunk(self, stage: int) -> Replay:
        return Replay(stage, self.done)

    def _op(self, kind: Kind, n: int, peer: int | None = None) -> Generator[None, None, None]:
        self.done.append(Action(self.stage, kind, n, peer))
        yield from ()

    def forward(self, n: int) -> Generator[None, None, None]:
        return self._op(Kind.F, n)

    def backward(self, n: int) -> Generator[None, None, None]:
        return self._op(Kind.B, n)

    def backward_weight(self, n: int) -> Generator[None, None, None]:
        return self._op(Kind.W, n)

    def send_f(self, n: int, peer: int) -> Generator[None, None, None]:
        return self._op(Kind.SEND_F, n, peer)

    def recv_f(self, n: int, peer: int) -> Generator[None, None, None]:
        return self._op(Kind.RECV_F, n, peer)

    def send_b(self, n: int, peer: int) -> Generator[None, None, None]:
        return self._op(Kind.SEND_B, n, peer)

    def recv_b(self, n: int, peer: int) -> Generator[None, None, None]:
        return self._op(Kind.RECV_B, n, peer)

    def all_reduce(self, n: int) -> Generator[None, None, None]:
        return self._op(Kind.ALLREDUCE, n)

    def step(self, n: int) -> Generator[None, None, None]:
        return self._op(Kind.STEP, n)


@pytest.mark.parametrize(("schedule", "ranks", "n", "options"), [
    ("1f1b", [[0], [1], [2], [3]], 64, {}),
    ("1f1b", [[0, 1, 2], [3]], 36, {}),
    ("1f1b", [[0], [1, 2], [3]], 20, {"vertical_sync": False}),
    ("1f1b-flush", [[0], [1], [2]], 16, {}),
    ("gpipe", [[0, 1], [2]], 8, {}),
    ("2bw", [[0], [1], [2]], 24, {"microbatches_per_minibatch": 4}),
    ("interleaved-1f1b", [[0], [1], [2], [0], [1], [2]], 12, {}),
    ("interleaved-zb", [[0], [1], [0], [1], [0], [1]], 8, {}),
    ("zb-h1", [[0], [1], [2], [3]], 16, {}),
    ("zb-v", [[0], [1], [2], [2], [1], [0]], 12, {}),
    ("dualpipev", [[0], [1], [1], [0]], 8, {}),
])
def test_running_the_code_replays_the_schedule(schedule: str, ranks: list[list[int]], n: int,
                                               options: dict[str, Any]) -> None:
    plan = lower(generate_schedule(schedule, ranks, n, **options))
    for rank in plan.ranks:
        source = generate_rank(plan, rank)
        replay = Replay(plan.stage_of_rank(rank))
        for _ in load_rank(source)(replay):
            pass
        assert tuple(replay.done) == plan.actions[rank]


def test_periodic_parts_become_loops() -> None:
    plan = lower(generate_schedule("1f1b", [[0], [1], [2], [3]], 1000))
    for rank in plan.ranks:
        source = generate_rank(plan, rank)
        assert len(plan.actions[rank]) > 4000
        assert len(source.splitlines()) < 60, source
        assert "for i in range(" in source
    first = generate_rank(plan, 0)
    assert "# warm-up" in first and "# steady state" in first and "# drain" in first


def test_a_rank_with_several_chunks_names_the_chunk_of_every_call() -> None:
    plan = lower(generate_schedule("interleaved-1f1b", [[0], [1], [0], [1]], 4))
    source = generate_rank(plan, 1)
    assert "rank 1 runs stages 1, 3 (chunks of an interleaved pipeline)" in source
    calls = [line.strip() for line in source.splitlines() if "yield from" in line]
    assert calls[:3] == ["yield from rt.chunk(1).recv_f(0, 0)", "yield from rt.chunk(1).forward(0)",
                         "yield from rt.chunk(1).send_f(0, 2)"]
    assert calls[-2:] == ["yield from rt.chunk(1).step(0)", "yield from rt.chunk(3).step(0)"]
    single = generate_rank(lower(generate_schedule("zb-h1", [[0], [1]], 4)), 0)
    assert "rt.chunk(" not in single and "yield from rt.backward_weight(" in single


def test_codegen_needs_a_lowered_schedule() -> None:
    with pytest.raises(ScheduleError, match="lowered"):
        generate_rank(generate_schedule("1f1b", [[0], [1]], 4), 0)


def test_generated_tracebacks_show_the_source() -> None:
    plan = lower(generate_schedule("gpipe", [[0], [1]], 2))
    source = generate_rank(plan, 1)

    class Broken(Replay):
        def backward(self, n: int) -> Generator[None, None, None]:
            raise RuntimeError("boom")

    import traceback

    with pytest.raises(RuntimeError) as info:
        for _ in load_rank(source, name="rank 1")(Broken(1)):
            pass
    text = "".join(traceback.format_exception(info.value))
    assert "<pdcompile rank 1>" in text and "rt.backward(" in text
