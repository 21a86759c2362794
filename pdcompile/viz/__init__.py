"""Pictures of timelines: Gantt charts per rank (viz.gantt) and Chrome traces (viz.chrome_trace).

Both read a `pdcompile.timeline.Timeline`, so simulated and measured runs are drawn by the same
code. Matplotlib is used through `matplotlib.figure.Figure` with the Agg canvas (no pyplot, no
global backend switch).
"""
