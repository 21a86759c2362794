"""Where a compiled pipeline runs: local (one process), distributed, simulate (costs only)."""
