"""The compiler passes: trace, shapes, cost, partition, split, schedule, codegen."""
