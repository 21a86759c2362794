"""Activation recomputation per stage: the plan flag, the runtime, the simulator's costs, and the
torch-free figures the planner weighs (pdcompile.cost.recompute)."""

from __future__ import annotations

from dataclasses import replace

import networkx as nx
import pytest
import torch
from torch import nn

import pdcompile
from pdcompile.backends.simulate import simulate
from pdcompile.cost.costgraph import add_block, new_cost_graph
from pdcompile.cost.recompute import recompute_costs
from pdcompile.cost.stage_costs import StageCosts
from pdcompile.errors import PlanError
from pdcompile.machine.cluster import Cluster
from pdcompile.passes.split import even_plan
from pdcompile.passes.trace import trace
from pdcompile.plan import Plan
from pdcompile.runtime.local_transport import LocalTransport, Mailboxes
from pdcompile.schedule.generators import generate
from pdcompile.schedule.lower import lower

FREE = Cluster.flat(8, 1e30)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(inplace=True),
                         nn.Dropout(0.3), nn.Linear(16, 16), nn.Tanh(), nn.Dropout(0.2),
                         nn.Linear(16, 3))


def _pipeline(schedule: str, stages: int, recompute: bool, micro: int | None = 4
              ) -> pdcompile.pipeline.Pipeline:
    model = _model()
    plan = even_plan(trace(model), stages)
    plan = replace(plan, stages=tuple(replace(s, recompute=recompute) for s in plan.stages))
    return pdcompile.compile(model, example_inputs=(torch.randn(8, 8),),
                             loss_fn=nn.functional.cross_entropy,
                             optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
                             schedule=schedule, microbatches=micro, plan=plan)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 8, generator=gen), torch.randint(0, 3, (8,), generator=gen))
            for _ in range(4)]


@pytest.mark.parametrize(("schedule", "stages", "micro"), [
    ("1f1b-flush", 2, 4), ("zb-h1", 3, 4), ("gpipe", 2, 2), ("1f1b", 3, None), ("2bw", 2, 2)])
def test_recomputation_changes_nothing_but_the_work(schedule: str, stages: int,
                                                    micro: int | None) -> None:
    """Dropout masks, BatchNorm statistics, stashed weight versions: training with recomputing
    stages gives the very same losses, weights and buffers as without."""
    runs = []
    for recompute in (False, True):
        pipe = _pipeline(schedule, stages, recompute, micro)
        torch.manual_seed(5)
        losses = pipe.train(_batches())
        runs.append((losses, pipe.state_dict()))
    (plain_losses, plain_state), (losses, state) = runs
    assert losses == plain_losses
    for name, value in plain_state.items():
        assert torch.equal(state[name], value), name


def test_a_recomputing_stage_keeps_no_graph_between_forward_and_backward() -> None:
    for recompute in (False, True):
        pipe = _pipeline("1f1b-flush", 1, recompute, 2)
        run = pipe.prepare(_batches()[:1])
        rt = pipe.runtime(0, config=pipe.run_config(run.per_minibatch),
                          transport=LocalTransport(0, Mailboxes()), data=run.data)
        for _ in rt.forward(0):
            pass
        entry = rt.stash.get(0)
        assert (entry.loss is not None and entry.loss.grad_fn is None) == recompute
        for _ in rt.backward(0):
            pass
        weight = pipe.stage_modules[0].get_parameter("0.weight")
        assert weight.grad is not None and weight.grad.abs().sum() > 0


def test_the_flag_travels_in_plan_json_and_old_plans_load() -> None:
    plan = even_plan(trace(_model()), 2)
    flagged = replace(plan, stages=(replace(plan.stages[0], recompute=True), plan.stages[1]))
    assert Plan.from_json(flagged.to_json()) == flagged
    data = flagged.to_dict()
    for stage in data["stages"]:
        del stage["recompute"]  # a plan written before the flag existed
    assert Plan.from_dict(data) == plan


# ------------------------------------------------------------------ costs
def test_closed_figures() -> None:
    figures = recompute_costs(fwd=1.0, bwd=2.0, activations=100.0, inputs=10.0, in_flight=4)
    assert figures[False].compute == 3.0 and figures[False].activations == 400.0
    assert figures[True].backward == 3.0 and figures[True].compute == 4.0
    assert figures[True].activations == 4 * 10.0 + 100.0
    with pytest.raises(PlanError, match="in_flight >= 1"):
        recompute_costs(fwd=1.0, bwd=2.0, activations=1.0, inputs=1.0, in_flight=0)


@pytest.mark.parametrize("name", ["1f1b-flush", "zb-h1"])
def test_the_simulator_charges_what_recompute_costs_says(name: str) -> None:
    """Stage 1 of a 3-stage pipeline recomputes: its backward takes its forward longer; under
    1F1B-flush its activation memory is the inputs of its 2 microbatches in flight plus one
    microbatch's activations (zero bubble keeps what W needs until W: 3 in flight, and the
    recomputed activations of those between B and W); the other stages are unchanged."""
    p, m = 3, 6
    costs = StageCosts((1.0, 1.0, 1.0), (2.0, 2.0, 2.0), (0.0,) * 3, (100.0, 100.0, 100.0),
                       {(0, 1): 10.0, (1, 2): 10.0}, (0.0,) * 3)
    stage_ranks = [[0], [1], [2]]
    plain = simulate(lower(generate(name, stage_ranks, m)), costs, FREE)
    recomputing = simulate(lower(generate(name, stage_ranks, m, recompute=[1])), costs, FREE)
    in_flight = plain.memory[1].in_flight
    assert in_flight == {"1f1b-flush": p - 1, "zb-h1": p}[name]
    figures = recompute_costs(fwd=1.0, bwd=2.0, activations=100.0, inputs=10.0,
                              in_flight=in_flight)
    assert plain.memory[1].activations == figures[False].activations
    if name == "1f1b-flush":
        assert recomputing.memory[1].activations == figures[True].activations
    else:  # 1F0 1F1 1B0 1F2 1B1 1W0: inputs of 3, activations of 0 (B done) and 1 (rebuilt)
        assert recomputing.memory[1].activations == 3 * 10.0 + 2 * 100.0
    assert recomputing.memory[0] == plain.memory[0] and recomputing.memory[2] == plain.memory[2]
    durations = {(kind, run): [e.duration for e, a in result.timeline.compute_events()
                               if a.stage == 1 and a.kind.value == kind]
                 for kind in ("F", "B") for run, result in (("plain", plain),
                                                            ("again", recomputing))}
    assert durations["B", "again"] == pytest.approx([b + 1.0 for b in durations["B", "plain"]])
    assert durations["F", "again"] == durations["F", "plain"]
    assert recomputing.makespan > plain.makespan


def test_the_simulated_schedule_reads_the_flag_of_the_plan() -> None:
    from pdcompile.planner.simulation import simulate_plan

    plan = even_plan(trace(_model()), 2)
    flagged = replace(plan, stages=(plan.stages[0], replace(plan.stages[1], recompute=True)))
    costs = StageCosts.uniform(2, fwd=1.0, bwd=2.0)
    graph = _cost_graph_of(plan)
    cluster = Cluster.parse("2@1e9")
    for name in ("1f1b-flush", "zb-h1"):
        lowered, _ = simulate_plan(graph, plan, cluster, schedule=name, microbatches=4,
                                   costs=costs)
        assert "recompute" not in lowered.options
        lowered, recomputing = simulate_plan(graph, flagged, cluster, schedule=name,
                                             microbatches=4, costs=costs)
        assert lowered.options["recompute"] == [1]
        # the recomputing stage runs its forward again in its backward
        assert recomputing.makespan > simulate_plan(graph, plan, cluster, schedule=name,
                                                    microbatches=4, costs=costs)[1].makespan


def _cost_graph_of(plan: Plan) -> nx.DiGraph:
    """A CostGraph with the plan's nodes in a chain (simulate_plan maps the plan onto it)."""
    graph = new_cost_graph("chain")
    names = [n for s in plan.stages for n in s.nodes]
    for i, name in enumerate(names):
        add_block(graph, name, fwd=0.0 if i == 0 else 1e-3, bwd=0.0 if i == 0 else 2e-3,
                  act=1e3, params=1e3 * (i > 0))
        if i:
            graph.add_edge(names[i - 1], name)
    return graph
