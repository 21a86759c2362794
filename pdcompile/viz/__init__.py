"""Tables and pictures: the stage table of a pipeline (stage_table), the partitioned graph
(plan_graph), Gantt charts per rank (gantt), Chrome traces (chrome_trace) and predicted against
measured timelines side by side (compare).

The timeline pictures read a `pdcompile.timeline.Timeline`, so simulated and measured runs are
drawn by the same code. Matplotlib is used through `matplotlib.figure.Figure` with the Agg
canvas (no pyplot, no global backend switch).
"""
