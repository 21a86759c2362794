"""Machines: the device model (`device`), this machine measured as a cluster (`local`) and the
cluster we plan for (`cluster`: levels of links, presets, the short string form)."""
