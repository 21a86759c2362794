"""Schedules: what each schedule kind means (`kinds`); generators and lowering live in passes/."""
