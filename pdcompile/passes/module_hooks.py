"""Hooks a module's call runs (`register_forward_pre_hook`, `register_forward_hook`,
`register_full_backward_hook`, ...): they live on the module object and run only when the module
is called, so a graph that runs the module's forward, or its operations, in place of that call
skips them. torch.fx traces the model's own forward (its root hooks never run), and the fuse pass
rewrites Linear calls into `linear_accumulate` (a hooked layer's hooks were dropped); both used to
train without the hooks, silently.
"""

from __future__ import annotations

from torch import nn

_CALL_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


def module_hooks(module: nn.Module) -> list[str]:
    """The kinds of hook registered on `module` itself that its call runs, e.g.
    ["forward_pre_hooks", "backward_hooks"]; empty where it has none."""
    return [name.strip("_") for name in _CALL_HOOKS if getattr(module, name, None)]


__all__ = ["module_hooks"]
