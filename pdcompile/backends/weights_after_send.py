"""Where the runtime computes weight gradients after a send, the simulator times them there.

Under a schedule that does not split the backward into B and W ('1f1b', '1f1b-flush', 'gpipe',
'2bw', 'interleaved-1f1b'), a stage that sends input gradients upstream defers its Linear
layers' weight gradients to the end of its last `send_b` of the microbatch
(runtime/stage_runtime.py): the previous stage waits for the message, not for them. The
simulator prices that by timing a copy of the schedule with a W action after the last SEND_B of
each such backward (`with_weights_after_send`): B is then the input-gradient part, W the rest,
split as a zero-bubble schedule's (`wgrad_share` of the backward, backends/action_costs.py),
and the rank is busy with W before its next action. The timeline shows what the runtime
records: one B per microbatch, spanning its sends and its W (`merged_backwards`).
"""

from __future__ import annotations

from dataclasses import replace

from pdcompile.schedule.ir import Action, Kind, Schedule
from pdcompile.schedule.kinds import kind


def deferring_stages(schedule: Schedule) -> frozenset[int]:
    """The stages whose backward sends input gradients upstream (a SEND_B), where the schedule
    does not split the backward: they compute weight gradients after that send."""
    if kind(schedule.name).split_backward:
        return frozenset()
    return frozenset(a.stage for actions in schedule.actions.values() for a in actions
                     if a.kind == Kind.SEND_B)


def with_weights_after_send(schedule: Schedule) -> Schedule:
    """The lowered `schedule` with a W action after the last SEND_B of every backward of a
    `deferring_stages` stage (the schedule itself where there is none)."""
    stages = deferring_stages(schedule)
    if not stages:
        return schedule
    actions: dict[int, tuple[Action, ...]] = {}
    for rank, old in schedule.actions.items():
        last: dict[tuple[int, int], int] = {}  # (stage, microbatch) -> index of its last SEND_B
        for index, action in enumerate(old):
            if action.kind == Kind.SEND_B and action.stage in stages:
                last[action.stage, action.microbatch] = index
        after = {index: Action(stage, Kind.W, m) for (stage, m), index in last.items()}
        new: list[Action] = []
        for index, action in enumerate(old):
            new.append(action)
            if index in after:
                new.append(after[index])
        actions[rank] = tuple(new)
    return replace(schedule, actions=actions)


def merged_backwards(schedule: Schedule, timed: Schedule) -> dict[int, dict[int, int]]:
    """Per rank of `timed` (`with_weights_after_send(schedule)`): index of each W it added ->
    index of the B it belongs to, whose event is to span until that W's end."""
    out: dict[int, dict[int, int]] = {}
    if timed is schedule:
        return out
    for rank, actions in timed.actions.items():
        backward: dict[tuple[int, int], int] = {}
        merged: dict[int, int] = {}
        for index, action in enumerate(actions):
            if action.kind == Kind.B:
                backward[action.stage, action.microbatch] = index
            elif action.kind == Kind.W:
                merged[index] = backward[action.stage, action.microbatch]
        out[rank] = merged
    return out


__all__ = ["deferring_stages", "merged_backwards", "with_weights_after_send"]
