"""What generated per-rank loops call at run time: the stage runtime and its transports, weight
stashes, checkpoints, the fused Linear's autograd function and one-line errors for failures of
the model's own code; and the type of a generated loop itself (rank_function)."""
