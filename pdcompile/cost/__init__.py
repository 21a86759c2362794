"""Cost: what the planner reads, the formulas that price a plan, and the pass that measures.

Torch-free, imported by the planner without torch: `costgraph` (the planner's only input),
`links` (transfer and ring all-reduce times on a cluster level), `crossing` (what crosses
between stages and where every node sits), `memory` (bytes per worker), `updates` (optimizer
steps and weight copies when not measured), `recompute` (a stage's time and memory when it
recomputes its activations), `stage_costs` (per-stage figures the simulator runs on),
`pipeline_time` (a plan's time per minibatch under a schedule, in closed form; '1f1b' by
`steady_cycle`, its steady state's event graph, and `cycle_ratio`) and `bubble` (the flush
schedules' closed forms for uniform stages).

With torch, the cost pass: `node_costs` (a measured or analytic cost on every node of a traced
model, and its CostGraph), `timers`, `cache_flush`, `neighbours` (busy helper processes while
timing) and `optimizer_timing` (optimizer steps and weight snapshots timed on clones).
"""
