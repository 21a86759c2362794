"""Cost pass: measured and analytic NodeCosts, the CostGraph made from them, the timers."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import time
from typing import Any

import pytest
import torch
from torch import nn

from pdcompile.cost import costgraph
from pdcompile.cost.node_costs import (
    annotate_costs,
    param_owners,
    to_cost_graph,
    total_cost,
)
from pdcompile.cost.timers import (
    CpuTimeTimer,
    CudaEventTimer,
    WallClockTimer,
    measure,
    select_timer,
)
from pdcompile.errors import PdcompileError
from pdcompile.machine.cluster import Cluster
from pdcompile.machine.device import DEVICES, Device
from pdcompile.meta import get_cost, get_shape
from pdcompile.models import gpt2
from pdcompile.passes.trace import trace
from tests.helpers.processes import PEAK_RSS_KIB


class Small(nn.Module):
    """Conv, BatchNorm, in-place ReLU, a residual add, a tied weight used twice."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.relu = nn.ReLU(inplace=True)
        self.fc = nn.Linear(8 * 4 * 4, 16)
        self.out = nn.Linear(16, 16, bias=False)
        self.out2 = nn.Linear(16, 16, bias=False)
        self.out2.weight = self.out.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scaled = x * 2  # works on the input only: nothing to differentiate
        y = self.relu(self.bn(self.conv(scaled)))
        y = y + self.conv(x)
        h = self.fc(y.flatten(1))
        return self.out2(self.out(h))


class _SleepFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.002)
        return x * 1.0

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        time.sleep(0.1)
        return grad


class Sleeper(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SleepFn.apply(x)


class SlowBackward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.sleep = Sleeper()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.sleep(self.lin(x))


def _costs(gm: torch.fx.GraphModule) -> dict[str, Any]:
    return {n.name: get_cost(n) for n in gm.graph.nodes if n.op != "output"}


def test_measured_costs_are_per_node_and_complete() -> None:
    model = Small().train()
    x = torch.randn(4, 3, 4, 4)
    running = model.bn.running_mean.clone()
    gm = annotate_costs(trace(model), (x,), warmup=1, repeats=3)
    costs = _costs(gm)
    assert costs["x"].fwd == 0 and costs["x"].bwd == 0 and costs["x"].act == x.numel() * 4
    assert costs["conv"].fwd > 0 and costs["conv"].bwd > 0
    assert costs["mul"].bwd == 0  # x * 2 does not need a gradient
    for name, cost in costs.items():
        assert cost.act == get_shape(gm.graph.find_nodes(op="placeholder")[0]).nbytes \
            if name == "x" else cost.act == get_shape(_node(gm, name)).nbytes
        assert cost.source == "measured"
    # BatchNorm's running statistics are as before: measuring does not train the model
    torch.testing.assert_close(model.bn.running_mean, running)
    assert all(p.grad is None for p in model.parameters())
    # the model still computes what it computed
    model.eval()
    torch.testing.assert_close(gm.eval()(x), Small.forward(model, x))


def _node(gm: torch.fx.GraphModule, name: str) -> torch.fx.Node:
    return next(n for n in gm.graph.nodes if n.name == name)


def test_params_counted_once_and_keep_excludes_weights() -> None:
    model = Small()
    gm = annotate_costs(trace(model), (torch.randn(4, 3, 4, 4),), warmup=0, repeats=1)
    costs = _costs(gm)
    total_params = sum(p.numel() * 4 for p in model.parameters())  # parameters() dedups ties
    assert sum(c.params for c in costs.values()) == total_params
    assert costs["out"].params == 16 * 16 * 4 and costs["out2"].params == 0
    assert param_owners(gm)["conv"] == (8 * 3 * 9 + 8) * 4
    # a Linear keeps its input for the weight gradient, not its weight
    assert costs["out"].keep == 4 * 16 * 4
    # the conv applied twice owns its weights at the first use only
    assert costs["conv_1"].params == 0


def test_measured_backward_is_measured_not_guessed() -> None:
    gm = annotate_costs(trace(SlowBackward(), leaf_modules=[Sleeper]), (torch.randn(2, 4),),
                        warmup=1, repeats=3)
    cost = get_cost(_node(gm, "sleep"))
    # a sleep lasts at least as long as asked and, on a loaded machine, some milliseconds
    # longer: bounds with room for that (a guess from the forward, 2 x fwd, stays far below)
    assert 0.0015 < cost.fwd < 0.05
    assert cost.bwd > 0.09
    assert cost.bwd > 2 * cost.fwd + 0.05


def test_analytic_linear_flops_and_roofline() -> None:
    model = nn.Sequential(nn.Linear(256, 512))
    x = torch.randn(64, 256)
    device = Device("test", memory=1e9, flops=1e12, mem_bandwidth=1e15)
    gm = annotate_costs(trace(model), (x,), source="analytic", device=device)
    cost = get_cost(_node(gm, "_0"))
    flops = 2 * 64 * 256 * 512
    assert cost.flops_fwd == flops
    assert cost.flops_bwd == flops  # input needs no gradient: only the weight gradient
    assert cost.fwd == pytest.approx(flops / 1e12)
    assert cost.source == "analytic"
    # a memory-bound device: time follows the bytes moved (x, W, b read, output written)
    slow_memory = Device("mem", memory=1e9, flops=1e18, mem_bandwidth=1e9)
    gm = annotate_costs(trace(model), (x,), source="analytic", device=slow_memory)
    moved = (64 * 256 + 256 * 512 + 512 + 64 * 512) * 4
    assert get_cost(_node(gm, "_0")).fwd == pytest.approx(moved / 1e9, rel=0.01)


def test_analytic_device_choice() -> None:
    model, inputs = gpt2.factory(layers=1, d=32, heads=2, vocab_size=64, seq_len=8)
    gm = trace(model)
    v100 = total_cost(annotate_costs(gm, inputs, source="analytic")).fwd
    h100 = total_cost(annotate_costs(gm, inputs, source="analytic",
                                     device=Cluster.preset("h100-node"))).fwd
    named = total_cost(annotate_costs(gm, inputs, source="analytic", device="h100")).fwd
    assert h100 == named and 0 < h100 < v100
    # bf16 uses the device's low-precision peak
    model16 = nn.Linear(1024, 1024).to(torch.bfloat16)
    x16 = torch.randn(512, 1024, dtype=torch.bfloat16)
    cost = get_cost(_node(annotate_costs(trace(model16), (x16,), source="analytic",
                                         device="h100"), "linear"))
    assert cost.fwd == pytest.approx(max(cost.flops_fwd / DEVICES["h100"].flops_lowp,
                                         cost.fwd))
    with pytest.raises(PdcompileError, match="unknown device model"):
        annotate_costs(gm, inputs, source="analytic", device="tpu9")
    with pytest.raises(PdcompileError, match="unknown cost source"):
        annotate_costs(gm, inputs, source="guess")


def test_analytic_keep_matches_measured_keep() -> None:
    model = Small()
    x = torch.randn(4, 3, 4, 4)
    gm = trace(model)
    measured = {k: v.keep for k, v in _costs(annotate_costs(gm, (x,), warmup=0,
                                                            repeats=1)).items()}
    analytic = {k: v.keep for k, v in _costs(annotate_costs(gm, (x,),
                                                            source="analytic")).items()}
    assert measured == analytic
    assert analytic["conv"] > 0


def test_to_cost_graph() -> None:
    model = Small()
    x = torch.randn(4, 3, 4, 4)
    gm = annotate_costs(trace(model), (x,), warmup=0, repeats=1)
    graph = to_cost_graph(gm, name="small")
    costgraph.validate(graph)
    names = [n.name for n in gm.graph.nodes if n.op != "output"]
    assert list(graph.nodes) == names
    assert graph.graph["name"] == "small" and graph.graph["batch_size"] == 4
    assert graph.nodes["x"]["fwd"] == 0 and graph.nodes["x"]["label"] == "input x"
    assert graph.has_edge("x", "mul") and graph.has_edge("x", "conv_1")
    assert graph.has_edge("conv", "bn") and graph.has_edge("relu", "add")
    totals = costgraph.totals(graph)
    total = total_cost(gm)
    assert totals["fwd"] == pytest.approx(total.fwd) and totals["params"] == total.params
    again = costgraph.from_dict(json.loads(json.dumps(costgraph.to_dict(graph))))
    assert costgraph.to_dict(again) == costgraph.to_dict(graph)


def test_attribute_reads_are_no_nodes_and_their_weights_go_to_their_users() -> None:
    """torch.export reads every weight with get_attr: the CostGraph leaves those reads out
    (the split puts them where they are used) and counts their bytes to their first user, so
    the model's parameter bytes are unchanged and no plan can place a weight apart."""
    from pdcompile.passes.frontend import capture

    model = Small()
    x = torch.randn(4, 3, 4, 4)
    gm = annotate_costs(capture(model, (x,), frontend="export").graph, (x,), source="analytic")
    reads = [n for n in gm.graph.nodes if n.op == "get_attr"]
    assert reads  # the weights of torch.export's graph
    graph = to_cost_graph(gm)
    costgraph.validate(graph)
    assert not set(graph.nodes) & {n.name for n in reads}
    assert costgraph.totals(graph)["params"] == total_cost(gm).params == sum(
        p.numel() * p.element_size() for p in model.parameters())
    for read in reads:
        if get_cost(read).params:
            first = min(read.users, key=list(gm.graph.nodes).index)
            assert graph.nodes[first.name]["params"] >= get_cost(read).params


@pytest.mark.parametrize("cluster", ["2@10GB/s", "3@1GB/s~1ms", "4@10GB/s"])
def test_plans_of_torch_export_graphs_give_every_stage_an_operation(cluster: str) -> None:
    """Tiny models through torch.export (weights read by get_attr): the planner placed weights
    in stages of their own, which the split refused ('stages [0, 1] of the plan have no
    operation to run')."""
    import pdcompile
    from tests.helpers.random_models import RandomNet, Step, squared_error

    for kinds in (("linear", "linear"), ("linear", "add"), ("tanh", "linear")):
        model = RandomNet([Step(k, i, 0) for i, k in enumerate(kinds)], 1, [2])
        pipe = pdcompile.compile(model, cluster, example_inputs=(torch.randn(8, 3, 4),),
                                 loss_fn=squared_error, cost="analytic", frontend="export",
                                 schedule="1f1b-flush", microbatches=2)
        assert len(pipe.stage_modules) == len(pipe.plan.stages)


@pytest.mark.slow
def test_gpt2_xl_on_meta_costs_without_memory(tmp_path: Any) -> None:
    script = tmp_path / "xl.py"
    script.write_text(
        "import json, torch\n"
        "torch.set_num_threads(1)\n"
        "from pdcompile.models import gpt2\n"
        "from pdcompile.passes.trace import trace\n"
        "from pdcompile.cost.node_costs import annotate_costs, total_cost, to_cost_graph\n"
        "model, inputs = gpt2.factory(size='xl', batch_size=1, device='meta')\n"
        "gm = annotate_costs(trace(model), inputs, source='analytic', device='h100')\n"
        "t = total_cost(gm)\n"
        "g = to_cost_graph(gm)\n"
        "print(json.dumps({'params': t.params, 'flops': t.flops_fwd, 'bwd': t.flops_bwd,\n"
        "  'nodes': g.number_of_nodes(),\n"
        f"  'rss': {PEAK_RSS_KIB} * 1024}}))\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["rss"] < 1e9, f"peak RSS {result['rss'] / 1e6:.0f} MB"
    # 1.56 billion fp32 parameters (tied head counted once), ~2 FLOPs/parameter/token forward
    assert result["params"] / 4 == pytest.approx(1.5576e9, rel=1e-3)
    assert 2 * 1.5e9 * 1024 < result["flops"] < 2 * 1.8e9 * 1024
    assert result["bwd"] == pytest.approx(2 * result["flops"], rel=0.05)
    assert result["nodes"] > 1000


# ------------------------------------------------------------------------------- timers
class _FakeEvent:
    clock = 0.0

    def __init__(self) -> None:
        self.at = 0.0

    def record(self) -> None:
        self.at = _FakeEvent.clock

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, other: _FakeEvent) -> float:
        return (other.at - self.at) * 1000.0  # milliseconds, as CUDA events report


def test_cuda_event_timer_interface_without_gpu() -> None:
    syncs: list[int] = []
    timer = CudaEventTimer(event_factory=_FakeEvent, synchronize=lambda: syncs.append(1),
                           hold=lambda seconds: None, clock=lambda: 0.0)

    def work() -> None:
        _FakeEvent.clock += 0.25  # the "GPU" spends 250 ms

    assert timer.time(work) == pytest.approx(0.25)
    assert syncs == [1]
    assert measure(timer, lambda _: work(), warmup=1, repeats=3) == pytest.approx(0.25)


def test_timer_selection_and_statistics() -> None:
    assert isinstance(select_timer("cpu"), WallClockTimer)
    assert isinstance(select_timer(torch.device("cuda", 0)), CudaEventTimer)
    assert isinstance(select_timer("meta"), WallClockTimer)
    assert isinstance(select_timer("cpu", clock="cpu"), CpuTimeTimer)
    assert isinstance(select_timer("cuda", clock="cpu"), CudaEventTimer)
    with pytest.raises(ValueError, match="unknown clock"):
        select_timer("cpu", clock="sundial")
    ticks = iter([0.0, 1.0, 1.0, 4.0, 4.0, 6.0, 6.0, 7.0])
    timer = WallClockTimer(clock=lambda: next(ticks))
    calls: list[Any] = []
    # samples 1, 3, 2, 1 -> warm-up drops the first -> median of (3, 2, 1) is 2
    assert measure(timer, calls.append, setup=lambda: "arg", warmup=1, repeats=3) == 2.0
    assert calls == ["arg"] * 4
    ticks = iter([0.0, 3.0, 3.0, 4.0])
    assert measure(WallClockTimer(clock=lambda: next(ticks)), lambda _: None, warmup=0,
                   repeats=2, statistic="min") == 1.0
    with pytest.raises(ValueError, match="statistic"):
        measure(timer, lambda _: None, statistic="max")


class Gate(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 if x.mean() > 0 else x


class Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.gate = Gate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(self.lin(x))


def test_analytic_cost_of_a_value_dependent_leaf() -> None:
    model = Gated()
    gm = trace(model, leaf_modules=["gate"])
    annotate_costs(gm, (torch.randn(4, 8),), source="analytic")
    gate = get_cost(_node(gm, "gate"))
    assert gate.flops_fwd == 0 and gate.fwd > 0  # counted on real values: bytes moved
    with torch.device("meta"):
        meta_model = Gated()
    gm = trace(meta_model, leaf_modules=["gate"])
    with pytest.raises(PdcompileError, match="'gate'.*depends on tensor values"):
        annotate_costs(gm, (torch.randn(4, 8, device="meta"),), source="analytic")


@pytest.mark.parametrize(("name", "batch"), [("vgg16", 128), ("resnet50", 128)])
def test_paper_size_costs_match_pipedream_profiles(name: str, batch: int,
                                                   profiles_dir: Any) -> None:
    """Our models at the papers' sizes, costed analytically on meta, against the activation and
    parameter bytes PipeDream's profiler recorded for the same networks (an independent
    source); the V100 roofline times land within a factor of 2.5 of its measured V100 times."""
    from pdcompile.profiles import load_pipedream

    module = importlib.import_module(f"pdcompile.models.{name}")
    model, inputs = module.factory(width=1, image_size=224, num_classes=1000, batch_size=batch,
                                   device="meta")
    ours = total_cost(annotate_costs(trace(model), inputs, source="analytic", device="v100"))
    theirs = costgraph.totals(load_pipedream(profiles_dir / name / "graph.txt"))
    assert ours.params == theirs["params"]
    assert ours.act == pytest.approx(theirs["act"], rel=0.005)
    ratio = (ours.fwd + ours.bwd) / (theirs["fwd"] + theirs["bwd"])
    assert 0.4 < ratio < 2.5


def test_progress_bar_counts_the_nodes(capsys: pytest.CaptureFixture[str]) -> None:
    """Costing shows a progress bar over the nodes when asked (it can take a while)."""
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    gm = trace(model)
    annotate_costs(gm, (torch.randn(4, 8),), progress=True, warmup=1, repeats=1)
    err = capsys.readouterr().err
    assert "measuring nodes" in err
    assert "node" in err and "/" in err  # tqdm's "k/n" counter
    annotate_costs(trace(model), (torch.randn(4, 8),), progress=False, warmup=1, repeats=1)
    assert "measuring nodes" not in capsys.readouterr().err


def test_cpu_clock_counts_the_calling_thread_only() -> None:
    """With one torch thread the CPU clock times the calling thread: another thread of the
    process burning CPU meanwhile (a progress bar's refresh, a communication library) does not
    inflate a measurement (with process-wide CPU time the wait below reads as the burner's time)."""
    import threading

    stop = threading.Event()

    def burn() -> None:
        while not stop.is_set():
            sum(range(1000))

    def wait_while_the_other_burns() -> None:
        # waits for the burner's CPU time, not for a wall-clock span: on a loaded machine the
        # burner may get little CPU in a fixed 0.1 s
        start, deadline = time.process_time(), time.monotonic() + 20
        while time.process_time() - start < 0.08 and time.monotonic() < deadline:
            time.sleep(0.002)

    other = threading.Thread(target=burn, daemon=True)
    other.start()
    try:
        torch.set_num_threads(1)
        seconds = CpuTimeTimer().time(wait_while_the_other_burns)
        whole = CpuTimeTimer(clock=time.process_time).time(wait_while_the_other_burns)
    finally:
        stop.set()
        other.join(timeout=5)
    assert seconds < 0.02 and whole > 0.05
