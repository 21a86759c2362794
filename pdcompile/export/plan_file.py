"""An export's plan.json: read from the export's checked files and fitted to the others.

The plan says how many processes a launcher starts and which rank runs which stage. It was
read unchecked by the launcher (`plan_workers`: a worker count from a file nobody verified,
where a damaged one silently gave none), and at load trusted to fit the stages, schedule and
rank code beside it: a plan.json edited under a manifest written again (an export loaded with
trust=True) loaded with its stages on other ranks than the rank code runs them on, or one more
replica than the code has, which deadlocked its first step. Here plan.json is taken from the
files read once against the manifest (export/verified_files.py), parsed by `Plan.from_json`
(every field's type), and fitted: as many stages as pipeline.json, only nodes the exported graph
has, and each stage on the ranks schedule.txt (the order the rank files were generated from)
gives it. Each node it lists is in the stage the export's records put it
(`recorded_stages`: the stage whose code computes it), or, where the split ran it elsewhere than
the plan said (a tuple's items read where the tuple is made, constants where they are used), in
the stage pipeline.json's `plan_moved` records for it: a plan.json with a node moved to another
stage loaded, and reported and priced a partition other than the one its stage code runs. And
every node of the graph is in the plan, but those pipeline.json's `plan_unnamed` records as made
after planning (constants, detached values): a node deleted from plan.json (not moved) loaded,
and the pipeline reported and priced a stage without it. A node of the plan the exported graph no
longer has (a view changed in place in a later stage than its base's is made again there under
a new name) is in pipeline.json's `plan_gone`, with its stage: without it such an export was
refused at load as naming a node the graph does not have.
Last, plan.json is the file pipeline.json was written with (`plan_sha256`): its predictions
(compute, times, status) fit nothing else, and a number in them changed (a stage's compute 0.0
to 4) under a manifest written again loaded as a plan priced otherwise.
Anything else is one DamagedFileError naming plan.json, what does not fit, and the fix.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

from pdcompile.errors import DamagedFileError
from pdcompile.export.files import folder_path, read_file, read_meta
from pdcompile.export.integrity import FIX
from pdcompile.export.verified_files import ExportFiles, read_export
from pdcompile.plan import Plan
from pdcompile.schedule.ir import Schedule

# the files that say what the plan must fit (all a launcher reads to count its workers)
PLAN_FILES = ("pipeline.json", "plan.json", "schedule.txt")


def export_plan(files: ExportFiles, meta: dict[str, Any]) -> Plan:
    """The Plan of the export whose checked files are `files` (pipeline.json's content
    `meta`), fitted to them (module docstring)."""
    path = files.folder / "plan.json"
    plan = read_file(path, lambda _: Plan.from_json(files.text("plan.json")))
    schedule = read_file(files.folder / "schedule.txt",
                         lambda _: Schedule.from_text(files.text("schedule.txt")))
    misfit = plan_misfit(plan, meta, schedule) or _digest_misfit(files.data("plan.json"), meta)
    if misfit is not None:
        raise DamagedFileError(f"{path} does not fit the export's other files: {misfit} (altered, "
                               f"or another export's); {FIX}")
    return plan


def plan_misfit(plan: Plan, meta: dict[str, Any], schedule: Schedule) -> str | None:
    """How `plan` does not fit an export's pipeline.json (`meta`) and schedule.txt
    (`schedule`), in words; None where it fits."""
    stages = len(meta["stages"])
    if len(plan.stages) != stages:
        return f"it has {len(plan.stages)} stages where pipeline.json has {stages}"
    placed = [list(stage.ranks) for stage in plan.stages]
    scheduled = [list(ranks) for ranks in schedule.stage_ranks]
    if placed != scheduled:
        return (f"its stages run on ranks {_short(placed)} where schedule.txt (the order the "
                f"rank files run) has {_short(scheduled)}")
    graph = meta.get("graph_stages", {})
    if not isinstance(graph, dict) or any(
            type(s) is not int or not 0 <= s < stages for s in graph.values()):
        return "pipeline.json's graph_stages is not a table of the stages of the graph's nodes"
    gone = meta.get("plan_gone", {})
    if not isinstance(gone, dict) or any(type(s) is not int for s in gone.values()):
        return "pipeline.json's plan_gone is not a table of node stages"
    if graph:  # the traced graph's nodes (none without a graph)
        known = set(graph) | set(gone)
        stranger = next((n for s in plan.stages for n in s.nodes if n not in known), None)
        if stranger is not None:
            return f"it names the node {stranger!r}, which the exported graph does not have"
    return _moved_misfit(plan, meta) or _lost_misfit(plan, meta)


def plan_digest(text: str) -> str:
    """The SHA-256 of plan.json's text as written (pipeline.json's `plan_sha256`)."""
    return hashlib.sha256(text.encode()).hexdigest()


def _digest_misfit(data: bytes, meta: dict[str, Any]) -> str | None:
    """How plan.json's bytes (`data`) are not those pipeline.json records, in words; None where
    they are (or, in an export written before the digest was recorded, unchecked)."""
    recorded = meta.get("plan_sha256")
    if recorded is None or recorded == hashlib.sha256(data).hexdigest():
        return None
    return ("it is not the plan.json pipeline.json was written with (its SHA-256 is not "
            "pipeline.json's plan_sha256)")


def recorded_stages(meta: dict[str, Any]) -> dict[str, int]:
    """The stage whose code computes each node, as an export's pipeline.json (`meta`) records
    it (the traced graph's stages; none where the pipeline had no graph). A stage's recorded
    outputs do not say it: a value is also output by the stages it passes through."""
    graph = meta.get("graph_stages")
    if not isinstance(graph, dict):
        return {}
    return {str(name): stage for name, stage in graph.items() if name != "output"}


def moved_nodes(plan: Plan, recorded: dict[str, int]) -> dict[str, int]:
    """The nodes `plan` puts in another stage than the one that runs them (`recorded`), with the
    plan's stage: what the split moved (a tuple's items, constants), which the writer records
    as pipeline.json's `plan_moved`."""
    return {node: stage for node, stage in plan.stage_of().items()
            if node in recorded and recorded[node] != stage}


def gone_nodes(plan: Plan, graph: dict[str, int]) -> dict[str, int]:
    """The nodes `plan` names that the exported graph (`graph`, pipeline.json's `graph_stages`)
    no longer has: replaced by the split (a view changed in place in a later stage than the one
    that made it is made again there, under a new name), which the writer records as
    pipeline.json's `plan_gone`, with the plan's stage."""
    return {node: stage for node, stage in plan.stage_of().items()
            if graph and node not in graph}


def unnamed_nodes(plan: Plan, recorded: dict[str, int]) -> list[str]:
    """The graph's nodes (`recorded`) that `plan` does not name: made after planning (the
    split's constants, values detached for a no_grad region), which the writer records as
    pipeline.json's `plan_unnamed`."""
    named = plan.stage_of()
    return sorted(node for node in recorded if node not in named)


def _lost_misfit(plan: Plan, meta: dict[str, Any]) -> str | None:
    """The first node of the graph that `plan` leaves out (and pipeline.json's `plan_unnamed`
    does not record as made after planning), in words; None where the plan names them all.
    Exports written before `plan_unnamed` was recorded are not checked."""
    unnamed = meta.get("plan_unnamed")
    if unnamed is None:
        return None
    if not isinstance(unnamed, list) or not all(isinstance(n, str) for n in unnamed):
        return "pipeline.json's plan_unnamed is not a list of node names"
    named, skipped = plan.stage_of(), set(unnamed)
    for node, stage in recorded_stages(meta).items():
        if node not in named and node not in skipped:
            return (f"it leaves out the node {node!r}, which stage {stage}'s code computes "
                    "(every node of the exported graph is in the plan)")
    return None


def _moved_misfit(plan: Plan, meta: dict[str, Any]) -> str | None:
    """How `plan` puts a node in another stage than pipeline.json's records (`meta`) give it,
    in words; None where every node is where they say. Exports written before `plan_moved`
    was recorded are not checked (their plans' moves cannot be told from a damaged one's)."""
    moved = meta.get("plan_moved")
    if moved is None:
        return None
    if not isinstance(moved, dict) or any(type(s) is not int for s in moved.values()):
        return "pipeline.json's plan_moved is not a table of node stages"
    recorded, gone = recorded_stages(meta), meta.get("plan_gone", {})
    for index, stage in enumerate(plan.stages):
        for node in stage.nodes:
            want = moved.get(node, recorded.get(node, gone.get(node, index)))
            if want != index:
                return (f"it puts the node {node!r} in stage {index} where the exported plan "
                        f"had it in stage {want!r}")
    given = plan.stage_of()
    held = {**gone, **moved}
    lost = next((node for node in held if node not in given), None)
    if lost is not None:
        return (f"it leaves out the node {lost!r}, which the exported plan had in stage "
                f"{held[lost]}")
    return None


def schedule_misfit(stored: Schedule, meta: dict[str, Any], microbatches: int,
                    per_minibatch: int) -> str | None:
    """How schedule.txt (`stored`) does not fit the run shape the loaded pipeline runs
    (`microbatches`, `per_minibatch`) and pipeline.json (`meta`) records, in words, before any
    schedule of that shape is built (a header claiming 10**9 microbatches over a few actions
    would build one that large); None where it fits."""
    recorded = (meta.get("schedule_length"), meta.get("per_minibatch"))
    if recorded != (microbatches, per_minibatch):
        return (f"pipeline.json records runs of {recorded[0]!r} microbatches ({recorded[1]!r} "
                f"per minibatch) where its own settings give {microbatches} ({per_minibatch})")
    if stored.microbatches != microbatches or stored.options.get(
            "microbatches_per_minibatch", 1) != per_minibatch:
        return (f"schedule.txt is a run of {stored.microbatches} microbatches "
                f"({stored.options.get('microbatches_per_minibatch', 1)!r} per minibatch) where "
                f"pipeline.json records {microbatches} ({per_minibatch})")
    actions = sum(len(ranks) for ranks in stored.actions.values())
    if actions < microbatches * stored.stages:  # every microbatch runs forward on each stage
        return (f"schedule.txt holds {actions} actions, fewer than its {microbatches} "
                f"microbatches on {stored.stages} stages need")
    return None


def plan_workers(folder: str | os.PathLike[str]) -> int:
    """The workers the export's plan uses (plan.json's `workers`: the processes a launcher
    starts, fewer than asked where the planner left workers idle), read from plan.json checked
    against the manifest and fitted to the export (`export_plan`); one line naming the file
    otherwise. Only the files the plan must fit are read (`PLAN_FILES`)."""
    path = folder_path(folder, "plan_workers")
    read_meta(path)  # the format named first, as the loader names it
    files = read_export(path, names=PLAN_FILES)
    return export_plan(files, read_meta(path, files.text("pipeline.json"))).workers


def _short(ranks: list[list[int]]) -> str:
    """Ranks per stage for a message, cut short."""
    text = str(ranks)
    return text if len(text) <= 80 else text[:77] + "..."


__all__ = ["PLAN_FILES", "export_plan", "gone_nodes", "moved_nodes", "plan_digest",
           "plan_misfit", "plan_workers", "recorded_stages", "schedule_misfit", "unnamed_nodes"]
