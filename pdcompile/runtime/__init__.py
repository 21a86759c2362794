"""What generated per-rank loops call at run time: transports, stash buffers, handlers."""
