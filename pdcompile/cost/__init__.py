"""Cost formulas shared by the planners, the stage tables and the simulator (torch-free).

`links`: transfer and ring all-reduce times on a cluster level; `crossing`: what crosses between
stages (a tensor once per destination stage) and where every node sits; `memory`: bytes per
worker; `pipeline_time`: a plan's time per minibatch under a schedule, in closed form.
Nothing here imports torch, so a plan is priced from a CostGraph alone.
"""
