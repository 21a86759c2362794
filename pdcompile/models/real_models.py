"""Real models from torchvision, timm, Hugging Face transformers and torch.nn, in small sizes.

The README's "Real models" table and tests/models/test_real_models.py compile each of these. They
are the libraries' own model classes, built with small widths, depths or images so that a CPU
trains them in seconds (each factory's docstring says what was made smaller); the libraries are
the optional extra `pip install -e .[models]`. Dropout is off, so that a pipeline and one
process compute the same thing (they draw dropout masks in different orders).

`FAMILIES[name]()` returns `(model, example_inputs, target)`; example inputs are a tuple, or a
dict for the Hugging Face models (given by name). `loss_for(name)` is the loss function, a
module-level function that exported pipelines can pickle by reference.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

Example = tuple[nn.Module, Any, torch.Tensor]


def logits_of(output: Any) -> torch.Tensor:
    """The logits of a model's output: a tensor, a Hugging Face ModelOutput's, or the
    "logits" item of the dict a graph from transformers' own fx tracer returns."""
    if isinstance(output, Mapping):
        return output["logits"]  # type: ignore[no-any-return]
    return output.logits if hasattr(output, "logits") else output  # type: ignore[no-any-return]


def classification_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the logits (`logits_of`)."""
    return nn.functional.cross_entropy(logits_of(output), target)


def next_token_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over every position of (batch, length, vocab) logits (`logits_of`)."""
    logits = logits_of(output)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def _images(batch: int, size: int, classes: int = 10) -> tuple[tuple[torch.Tensor], torch.Tensor]:
    return (torch.randn(batch, 3, size, size),), torch.randint(0, classes, (batch,))


def resnet50(batch: int = 4, image: int = 32) -> Example:
    """torchvision ResNet-50 as it is (25.6 M parameters), 10 classes, 32x32 images."""
    from torchvision.models import resnet50 as build

    torch.manual_seed(0)
    inputs, target = _images(batch, image)
    return build(num_classes=10), inputs, target


def vgg16(batch: int = 4, image: int = 32) -> Example:
    """torchvision VGG-16's 13 convolutions as they are; its 3-layer classifier narrowed from
    4096 to 64 wide after a 1x1 pooling (138 M parameters would be 15 M)."""
    from torchvision.models import vgg16 as build

    torch.manual_seed(0)
    model = build(num_classes=10)
    model.avgpool = nn.AdaptiveAvgPool2d(1)
    model.classifier = nn.Sequential(nn.Linear(512, 64), nn.ReLU(True), nn.Linear(64, 64),
                                     nn.ReLU(True), nn.Linear(64, 10))
    inputs, target = _images(batch, image)
    return model, inputs, target


def inception_v3(batch: int = 4, image: int = 75) -> Example:
    """torchvision Inception-v3 without its auxiliary classifier (which needs 299x299 images),
    10 classes, 75x75 images (its smallest); dropout off."""
    from torchvision.models import inception_v3 as build

    torch.manual_seed(0)
    inputs, target = _images(batch, image)
    model = build(num_classes=10, aux_logits=False, init_weights=False, dropout=0.0)
    return model, inputs, target


def mobilenet_v3_small(batch: int = 4, image: int = 32) -> Example:
    """torchvision MobileNetV3-small as it is, 10 classes, 32x32 images; dropout off."""
    from torchvision.models import mobilenet_v3_small as build

    torch.manual_seed(0)
    inputs, target = _images(batch, image)
    return build(num_classes=10, dropout=0.0), inputs, target


def vit(batch: int = 4, image: int = 32) -> Example:
    """torchvision's VisionTransformer (ViT-B/16's class) with 2 layers of width 32 over 8x8
    patches of 32x32 images."""
    from torchvision.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    model = VisionTransformer(image_size=image, patch_size=8, num_layers=2, num_heads=2,
                              hidden_dim=32, mlp_dim=64, num_classes=10)
    inputs, target = _images(batch, image)
    return model, inputs, target


def timm_vit_tiny(batch: int = 4, image: int = 32) -> Example:
    """timm's vit_tiny_patch16_224 with 2 of its 12 blocks, 8x8 patches of 32x32 images."""
    import timm

    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=image,
                              patch_size=8, depth=2, num_classes=10)
    inputs, target = _images(batch, image)
    return model, inputs, target


def timm_convnext_atto(batch: int = 4, image: int = 32) -> Example:
    """timm's convnext_atto as it is (3.4 M parameters), 10 classes, 32x32 images."""
    import timm

    torch.manual_seed(0)
    model = timm.create_model("convnext_atto", pretrained=False, num_classes=10)
    inputs, target = _images(batch, image)
    return model, inputs, target


def _tokens(batch: int, length: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length))


def bert(batch: int = 4, length: int = 16, layers: int = 4) -> Example:
    """Hugging Face BertForSequenceClassification, 4 layers of width 32, vocabulary 100, 3
    labels; inputs by name (input_ids, attention_mask with padding)."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=layers,
                        num_attention_heads=2, intermediate_size=64,
                        max_position_embeddings=64, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    config.num_labels = 3
    model = BertForSequenceClassification(config)
    ids = _tokens(batch, length, 100)
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[:, length * 3 // 4:] = 0
    return model, {"input_ids": ids, "attention_mask": mask}, torch.randint(0, 3, (batch,))


def gpt2(batch: int = 4, length: int = 16, layers: int = 4) -> Example:
    """Hugging Face GPT2LMHeadModel, 4 layers of width 32, vocabulary 100, no KV cache; input
    by name (input_ids); the target is the next token."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=100, n_positions=64, n_embd=32, n_layer=layers, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                        bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    ids = _tokens(batch, length, 100)
    return model, {"input_ids": ids}, torch.roll(ids, -1, dims=1)


class EncoderLM(nn.Module):
    """Token embedding, `nn.TransformerEncoder`, a linear head over the vocabulary."""

    def __init__(self, vocab: int = 100, width: int = 32, layers: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        layer = nn.TransformerEncoderLayer(width, 2, 2 * width, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(ids)))


def transformer_encoder(batch: int = 4, length: int = 16) -> Example:
    """EncoderLM: `nn.TransformerEncoder` of 4 layers of width 32; next-token target."""
    torch.manual_seed(0)
    ids = _tokens(batch, length, 100)
    return EncoderLM(), (ids,), torch.roll(ids, -1, dims=1)


class LSTMLanguageModel(nn.Module):
    """Token embedding, two stacked `nn.LSTM`s, a linear head over the vocabulary."""

    def __init__(self, vocab: int = 100, width: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.lstm1 = nn.LSTM(width, width, batch_first=True)
        self.lstm2 = nn.LSTM(width, width, batch_first=True)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x, _ = self.lstm1(self.embed(ids))
        x, _ = self.lstm2(x)
        return self.head(x)


def lstm_lm(batch: int = 4, length: int = 16) -> Example:
    """LSTMLanguageModel of width 32; next-token target."""
    torch.manual_seed(0)
    ids = _tokens(batch, length, 100)
    return LSTMLanguageModel(), (ids,), torch.roll(ids, -1, dims=1)


FAMILIES: dict[str, Callable[[], Example]] = {
    "torchvision-resnet50": resnet50,
    "torchvision-vgg16": vgg16,
    "torchvision-inception_v3": inception_v3,
    "torchvision-mobilenet_v3_small": mobilenet_v3_small,
    "torchvision-vit": vit,
    "timm-vit_tiny": timm_vit_tiny,
    "timm-convnext_atto": timm_convnext_atto,
    "hf-bert": bert,
    "hf-gpt2": gpt2,
    "torch-transformer_encoder": transformer_encoder,
    "torch-lstm_lm": lstm_lm,
}

# the pip package each family needs (none: torch alone)
LIBRARY = {name: {"torchvision": "torchvision", "timm": "timm", "hf": "transformers"}.get(
    name.split("-")[0]) for name in FAMILIES}


def loss_for(name: str) -> Callable[[Any, torch.Tensor], torch.Tensor]:
    """The loss function of a family: next-token for the language models, else classes."""
    return next_token_loss if name in ("hf-gpt2", "torch-transformer_encoder",
                                       "torch-lstm_lm") else classification_loss


__all__ = ["FAMILIES", "LIBRARY", "classification_loss", "loss_for", "next_token_loss"]
