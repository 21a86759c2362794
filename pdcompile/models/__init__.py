"""Example models written here (no torchvision): VGG-16, ResNet-50, AlexNet, GNMT, GPT-2.

Each module has `factory(**size_options) -> (model, example_inputs)` sized to train on this CPU
by default (any size by its arguments), `loss_fn(output, target)` and
`make_target(example_inputs, ...)` to build a matching target. Name one on the command line as
`pdcompile.models.vgg16:factory`. `real_models` builds the libraries' own models (torchvision,
timm, Hugging Face transformers; the `.[models]` extra) in small sizes.
"""

from __future__ import annotations

MODELS = ("vgg16", "resnet50", "alexnet", "gnmt", "gpt2")
