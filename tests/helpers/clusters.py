"""Clusters the tests build."""

from __future__ import annotations

import json
from pathlib import Path

from pdcompile.machine.cluster import Cluster


def reloaded(cluster: Cluster, folder: Path) -> Cluster:
    """`cluster` written as a JSON cluster file and read back."""
    file = folder / "cluster.json"
    file.write_text(json.dumps(cluster.to_dict()))
    return Cluster.load(file)
