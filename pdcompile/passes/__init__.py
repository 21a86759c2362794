"""The compiler passes on the traced graph: capture (trace, torch.export, a given graph), shapes,
split into stage modules, fuse (the Linear rewrite) and codegen (each rank's generated loop).
The cost pass lives in cost/, the partitioner in planner/, schedules in schedule/."""
