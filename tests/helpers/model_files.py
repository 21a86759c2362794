"""A user's model file, as text to write outside the package: a factory, a `make_target`, a
`loss_fn` beside them and a function wrapped for torch.fx (the stage code imports it), all of
which an export of `FILE.py:factory` must carry (tests/export/test_user_modules.py,
tests/cli/test_export_run_cli.py)."""

MODEL_FILE = '''"""A small model of a user\'s own, outside the package."""

import torch
from torch import nn


@torch.fx.wrap
def shift(x):
    return x + 1.0


class Gate(nn.Module):
    """Calls `shift`, a wrapped function: the stage code imports it from this file."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.full((16,), 0.5))

    def forward(self, x):
        return shift(torch.sigmoid(x) * self.scale)


def factory():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), Gate(), nn.Linear(16, 16), nn.ReLU(),
                          nn.Linear(16, 4))
    return model, (torch.randn(8, 8),)


def make_target(inputs):
    return torch.arange(inputs[0].shape[0]) % 4


def loss_fn(out, target):
    return nn.functional.cross_entropy(shift(out), target) * 0.5
'''
