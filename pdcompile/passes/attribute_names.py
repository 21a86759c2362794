"""Submodule, parameter and buffer names torch.fx cannot write as code, refused before tracing.

torch.fx writes every attribute a graph reads into its generated Python: `self.name` where the
name is an identifier, else `getattr(self, "name")` with the name pasted between the quotes
unescaped. A name holding a quote, a backslash or a line break therefore ended the string: the
trace failed with a SyntaxError about code the user never wrote, or (a name shaped as code)
the rest of the name ran as Python when the graph ran, and was written into every export's
stage files. A keyword (`class`) became `self.class`, a SyntaxError. An identifier Python
rewrites as it reads it (NFKC: the micro sign `µ` reads as the Greek `μ`, `ﬁ` as `fi`) became
`self.µ`, which looks up another attribute: an AttributeError when the graph ran. Such names are
refused here, in one line naming the attribute and the fix, before fx writes any code.
"""

from __future__ import annotations

import keyword
import unicodedata
from collections.abc import Iterator

from torch import nn

from pdcompile.errors import PipelineInputError


def check_attribute_names(model: nn.Module) -> None:
    """Refuse `model` if one of its submodules, parameters or buffers has a name that torch.fx
    would write into generated code unescaped (see the module docstring)."""
    for kind, path in _attribute_paths(model):
        for part in path.split("."):
            if not writable(part):
                where = f" (at {path!r})" if part != path else ""
                raise PipelineInputError(
                    f"{type(model).__name__} has a {kind} named {part!r}{where}: "
                    "torch.fx writes attribute names into generated Python unquoted, so a "
                    "keyword, a name holding a quote, a backslash or a line break, or one "
                    "Python reads as another (NFKC) breaks the code or runs as code; rename it "
                    "(letters, digits and _, not a keyword)")


def writable(name: str) -> bool:
    """Whether torch.fx writes `name` as code that reads exactly that attribute: an
    identifier that is not a keyword (`self.name`), or printable text without quote or
    backslash (`getattr(self, "name")`)."""
    if name.isidentifier():
        return not keyword.iskeyword(name) and plain_identifier(name)
    return name.isprintable() and '"' not in name and "\\" not in name


def plain_identifier(name: str) -> bool:
    """Whether Python reads the identifier `name` as itself: it folds identifiers to NFKC as it
    parses them, so `self.µ` (micro sign) reads the attribute `μ` (Greek mu)."""
    return unicodedata.normalize("NFKC", name) == name


def _attribute_paths(model: nn.Module) -> Iterator[tuple[str, str]]:
    for name, _ in model.named_modules(remove_duplicate=False):
        if name:
            yield "submodule", name
    for name, _ in model.named_parameters(remove_duplicate=False):
        yield "parameter", name
    for name, _ in model.named_buffers(remove_duplicate=False):
        yield "buffer", name


__all__ = ["check_attribute_names", "plain_identifier", "writable"]
