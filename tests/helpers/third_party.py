"""A small pool of third-party models (torchvision, timm, Hugging Face transformers) in tiny
float64 configurations, with what they train on: skips, in-place ReLUs and additions, BatchNorm,
layer norms, attention with masks, tied embeddings, RWKV's in-place state updates, depthwise
convolutions and squeeze-excite, layer scale, shifted windows (torch.roll), dense concatenations,
auxiliary heads (a namedtuple output), grouped-query attention, encoder-decoders (BART; T5 with
masks on both sides), one layer's weights shared by several (ALBERT), random masking by a noise
input with the model's own loss (ViT-MAE).

`POOL[name](batch)` returns `(model, inputs, target, loss_fn)`; inputs are a tuple, or a dict for
the Hugging Face models. float64 so that a pipeline that sums microbatch gradients in another
order than one process differs from it by rounding far below the comparison's tolerance.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from pdcompile.models.real_models import classification_loss, next_token_loss

Example = tuple[nn.Module, Any, torch.Tensor, Callable[[Any, torch.Tensor], torch.Tensor]]


def _images(batch: int, size: int) -> tuple[tuple[torch.Tensor], torch.Tensor]:
    return (torch.randn(batch, 3, size, size, dtype=torch.float64),), \
        torch.randint(0, 10, (batch,))


def torchvision_resnet(batch: int) -> Example:
    """torchvision's ResNet class with one BasicBlock per layer (in-place ReLU, `out +=
    identity`, BatchNorm, downsampling skips), 32x32 images."""
    resnet = pytest.importorskip("torchvision.models.resnet")
    torch.manual_seed(0)
    model = resnet.ResNet(resnet.BasicBlock, [1, 1, 1, 1], num_classes=10).double()
    return (model, *_images(batch, 32), classification_loss)


def torchvision_squeezenet(batch: int) -> Example:
    """torchvision's SqueezeNet 1.1 (in-place ReLUs, fire modules concatenating two branches,
    no BatchNorm), 32x32 images; dropout off."""
    models = pytest.importorskip("torchvision.models")
    torch.manual_seed(0)
    model = models.squeezenet1_1(num_classes=10, dropout=0.0).double()
    return (model, *_images(batch, 32), classification_loss)


def timm_vit(batch: int) -> Example:
    """timm's vit_tiny with 2 blocks (attention, layer norms, class token) over 8x8 patches."""
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=16,
                              patch_size=8, depth=2, num_classes=10).double()
    return (model, *_images(batch, 16), classification_loss)


def hf_gpt2(batch: int) -> Example:
    """Hugging Face GPT2LMHeadModel, 2 layers of width 16, its head tied to its embedding."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=40, n_positions=16, n_embd=16, n_layer=2,
                                     n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     use_cache=False, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config).double()
    ids = torch.randint(0, 40, (batch, 6))
    return model, {"input_ids": ids}, torch.roll(ids, -1, dims=1), next_token_loss


def hf_llama(batch: int) -> Example:
    """Hugging Face LlamaForCausalLM, 2 layers of width 16 (RMSNorm, rotary positions, gated
    MLP), its head tied to its embedding."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32,
                                      num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=1, max_position_embeddings=16,
                                      tie_word_embeddings=True, use_cache=False)
    model = transformers.LlamaForCausalLM(config).double()
    ids = torch.randint(0, 40, (batch, 6))
    return model, {"input_ids": ids}, torch.roll(ids, -1, dims=1), next_token_loss


def hf_bert(batch: int) -> Example:
    """Hugging Face BertForSequenceClassification, 2 layers of width 16, padded attention
    mask."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=32,
                                     max_position_embeddings=16, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0, num_labels=3)
    model = transformers.BertForSequenceClassification(config).double()
    ids = torch.randint(0, 40, (batch, 6))
    mask = torch.ones(batch, 6, dtype=torch.long)
    mask[:, 4:] = 0
    return model, {"input_ids": ids, "attention_mask": mask}, torch.randint(0, 3, (batch,)), \
        classification_loss


def hf_rwkv(batch: int) -> Example:
    """Hugging Face RwkvForCausalLM, 2 layers of width 16: states filled row by row in place
    (`out[:, t] = v`), time-mix parameters read in several places (a cut spreads them over
    stages, which then share them as tied parameters)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.RwkvConfig(vocab_size=40, context_length=16, hidden_size=16,
                                     num_hidden_layers=2, attention_hidden_size=16,
                                     intermediate_size=32, use_cache=False)
    model = transformers.RwkvForCausalLM(config).double()
    ids = torch.randint(0, 40, (batch, 6))
    return model, {"input_ids": ids}, torch.roll(ids, -1, dims=1), next_token_loss


def timm_convnext(batch: int) -> Example:
    """timm's ConvNeXt (atto) with one block per stage of width 8-16: depthwise 7x7
    convolutions, channels-last layer norms, layer scale (gamma) at 0.5, GELU."""
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("convnext_atto", pretrained=False, num_classes=10,
                              depths=(1, 1, 1, 1), dims=(8, 8, 16, 16),
                              ls_init_value=0.5).double()
    return (model, *_images(batch, 32), classification_loss)


def timm_mobilenetv3(batch: int) -> Example:
    """timm's MobileNetV3-small at width 0.5: depthwise convolutions, hardswish, squeeze-excite
    (a pooled gate multiplied back), BatchNorm, 32x32 images."""
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("mobilenetv3_small_050", pretrained=False,
                              num_classes=10).double()
    return (model, *_images(batch, 32), classification_loss)


def timm_swin(batch: int) -> Example:
    """timm's Swin with two stages of one block, width 8, 4x4 windows: torch.roll shifts,
    window partition reshapes, relative position bias tables, an attention mask buffer."""
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False,
                              num_classes=10, img_size=32, window_size=4, embed_dim=8,
                              depths=(1, 1), num_heads=(1, 2), drop_path_rate=0.0).double()
    return (model, *_images(batch, 32), classification_loss)


def torchvision_densenet(batch: int) -> Example:
    """torchvision's DenseNet class with two dense blocks of two layers (growth 4): every layer
    concatenates all earlier features, BatchNorm and in-place ReLUs."""
    densenet = pytest.importorskip("torchvision.models.densenet")
    torch.manual_seed(0)
    model = densenet.DenseNet(growth_rate=4, block_config=(2, 2), num_init_features=8,
                              bn_size=2, num_classes=10).double()
    return (model, *_images(batch, 32), classification_loss)


def torchvision_mobilenet_v2(batch: int) -> Example:
    """torchvision's MobileNetV2 at width 0.25 (inverted residuals, depthwise convolutions,
    ReLU6), dropout off; 64x64 images (at 32x32 its last BatchNorms see 1x1 maps of two samples
per microbatch, and two updates grow weights to 1e3, where rounding differs by 1e-5)."""
    models = pytest.importorskip("torchvision.models")
    torch.manual_seed(0)
    model = models.mobilenet_v2(num_classes=10, width_mult=0.25, dropout=0.0).double()
    return (model, *_images(batch, 64), classification_loss)


def _with_aux_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    """GoogLeNet's training loss: its logits' and both auxiliary heads' (a namedtuple)."""
    return sum((classification_loss(o, target) for o in output), torch.zeros(()))


def torchvision_googlenet(batch: int) -> Example:
    """torchvision's GoogLeNet in training mode with its auxiliary heads: a namedtuple output
    of three logits, inception branches concatenated, 64x64 images, dropout off."""
    models = pytest.importorskip("torchvision.models")
    torch.manual_seed(0)
    model = models.googlenet(num_classes=10, aux_logits=True, transform_input=False,
                             init_weights=True, dropout=0.0, dropout_aux=0.0).double()
    return (model, *_images(batch, 64), _with_aux_loss)


def _padded(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(2, 40, (batch, 6))
    mask = torch.ones(batch, 6, dtype=torch.long)
    mask[:, 4:] = 0
    return ids, mask


def hf_qwen2(batch: int) -> Example:
    """Hugging Face Qwen2ForCausalLM, 2 layers of width 16, grouped-query attention (2 heads
    over 1 key-value head), rotary positions, a padded attention mask."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.Qwen2Config(vocab_size=40, hidden_size=16, intermediate_size=32,
                                      num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=1, max_position_embeddings=16,
                                      use_cache=False)
    model = transformers.Qwen2ForCausalLM(config).double()
    ids, mask = _padded(batch)
    return model, {"input_ids": ids, "attention_mask": mask}, torch.roll(ids, -1, dims=1), \
        next_token_loss


def hf_distilbert(batch: int) -> Example:
    """Hugging Face DistilBertForSequenceClassification, 2 layers of width 16, padded
    attention mask."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.DistilBertConfig(vocab_size=40, dim=16, n_layers=2, n_heads=2,
                                           hidden_dim=32, max_position_embeddings=16,
                                           dropout=0.0, attention_dropout=0.0,
                                           seq_classif_dropout=0.0, num_labels=3)
    model = transformers.DistilBertForSequenceClassification(config).double()
    ids, mask = _padded(batch)
    return model, {"input_ids": ids, "attention_mask": mask}, torch.randint(0, 3, (batch,)), \
        classification_loss


def hf_bart(batch: int) -> Example:
    """Hugging Face BartForConditionalGeneration, 2+2 layers of width 16: an encoder-decoder
    given input_ids, a padded attention mask and decoder_input_ids, its head tied to the shared
    embedding."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BartConfig(vocab_size=40, d_model=16, encoder_layers=2,
                                     decoder_layers=2, encoder_attention_heads=2,
                                     decoder_attention_heads=2, encoder_ffn_dim=32,
                                     decoder_ffn_dim=32, max_position_embeddings=16,
                                     dropout=0.0, attention_dropout=0.0,
                                     activation_dropout=0.0, use_cache=False)
    model = transformers.BartForConditionalGeneration(config).double()
    ids, mask = _padded(batch)
    decoder = torch.randint(2, 40, (batch, 5))
    return model, {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": decoder}, \
        torch.roll(decoder, -1, dims=1), next_token_loss


class _TiedEncoder(nn.Module):
    """torch.nn's TransformerEncoder over an Embedding with padding_idx, key padding mask,
    the output head tied to the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(20, 8, padding_idx=0)
        layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(8, 20)
        self.head.weight = self.embedding.weight

    def forward(self, tokens: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embedding(tokens), src_key_padding_mask=padding))


def torch_transformer(batch: int) -> Example:
    """torch.nn's TransformerEncoder with a key padding mask and a tied head (_TiedEncoder)."""
    torch.manual_seed(0)
    model = _TiedEncoder().double()
    tokens = torch.randint(1, 20, (batch, 6))
    tokens[:, 5] = 0
    return model, (tokens, tokens == 0), torch.roll(tokens, -1, dims=1), next_token_loss


def _padded_mask(batch: int, length: int, pad: int) -> torch.Tensor:
    """An attention mask whose rows after the first end in `pad` padding positions."""
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[1:, length - pad:] = 0
    return mask


def _sequence_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    logits = output.logits
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def hf_t5(batch: int) -> Example:
    """Hugging Face T5ForConditionalGeneration, 2 + 2 layers of width 16: an encoder and a
    decoder (relative position biases, cross-attention), inputs and padded masks for both by
    name."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=40, d_model=16, d_kv=8, d_ff=32, num_layers=2,
                                   num_decoder_layers=2, num_heads=2, dropout_rate=0.0,
                                   decoder_start_token_id=0, pad_token_id=0)
    model = transformers.T5ForConditionalGeneration(config).double()
    ids, decoder_ids = torch.randint(0, 40, (batch, 6)), torch.randint(0, 40, (batch, 5))
    inputs = {"input_ids": ids, "attention_mask": _padded_mask(batch, 6, 2),
              "decoder_input_ids": decoder_ids,
              "decoder_attention_mask": _padded_mask(batch, 5, 1)}
    return model, inputs, torch.roll(decoder_ids, -1, dims=1), _sequence_loss


def hf_albert(batch: int) -> Example:
    """Hugging Face AlbertForSequenceClassification: one layer's weights shared by 3 layers
    (a cut ties them across stages), a factorised embedding (8 -> 16), padded attention mask."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.AlbertConfig(vocab_size=40, embedding_size=8, hidden_size=16,
                                       num_hidden_layers=3, num_attention_heads=2,
                                       intermediate_size=32, max_position_embeddings=16,
                                       hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                       classifier_dropout_prob=0.0, num_labels=3)
    model = transformers.AlbertForSequenceClassification(config).double()
    ids, mask = _padded(batch)
    return model, {"input_ids": ids, "attention_mask": mask}, torch.randint(0, 3, (batch,)), \
        classification_loss


def _mae_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    return output.loss


def hf_vit_mae(batch: int) -> Example:
    """Hugging Face ViTMAEForPreTraining, 2 + 1 layers of width 16: random masking of half the
    patches by a `noise` input (argsort, gather, a restored order), an encoder and a decoder,
    its own reconstruction loss (`output.loss`)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.ViTMAEConfig(image_size=16, patch_size=4, hidden_size=16,
                                       num_hidden_layers=2, num_attention_heads=2,
                                       intermediate_size=32, decoder_hidden_size=16,
                                       decoder_num_hidden_layers=1,
                                       decoder_num_attention_heads=2,
                                       decoder_intermediate_size=32, mask_ratio=0.5,
                                       hidden_dropout_prob=0.0,
                                       attention_probs_dropout_prob=0.0)
    model = transformers.ViTMAEForPreTraining(config).double()
    pixels = torch.randn(batch, 3, 16, 16, dtype=torch.float64)
    noise = torch.rand(batch, 16, dtype=torch.float64)
    return model, {"pixel_values": pixels, "noise": noise}, torch.zeros(batch), _mae_loss


POOL: dict[str, Callable[[int], Example]] = {
    "torchvision-resnet": torchvision_resnet,
    "torchvision-squeezenet": torchvision_squeezenet,
    "timm-vit_tiny": timm_vit,
    "hf-gpt2": hf_gpt2,
    "hf-llama": hf_llama,
    "hf-bert": hf_bert,
    "hf-rwkv": hf_rwkv,
    "timm-convnext": timm_convnext,
    "timm-mobilenetv3": timm_mobilenetv3,
    "timm-swin": timm_swin,
    "torchvision-densenet": torchvision_densenet,
    "torchvision-mobilenet_v2": torchvision_mobilenet_v2,
    "torchvision-googlenet": torchvision_googlenet,
    "hf-qwen2": hf_qwen2,
    "hf-distilbert": hf_distilbert,
    "hf-bart": hf_bart,
    "torch-transformer": torch_transformer,
    "hf-t5": hf_t5,
    "hf-albert": hf_albert,
    "hf-vit_mae": hf_vit_mae,
}


class _Tempered(nn.Module):
    """A causal LM whose logits are divided by a temperature given as a 0-d tensor input."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=input_ids).logits / temperature


def _own_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    return output.loss


def _logits_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))


def gpt2_positions(batch: int) -> Example:
    """GPT-2 given `position_ids` of shape (1, seq) by name, as Hugging Face's own examples do:
    an input of no samples, broadcast over the batch."""
    model, inputs, target, loss_fn = hf_gpt2(batch)
    seq = inputs["input_ids"].shape[1]
    return model, {**inputs, "position_ids": torch.arange(seq)[None]}, target, loss_fn


def bert_own_loss(batch: int) -> Example:
    """BERT given its labels by name, computing its own loss (`output.loss`)."""
    model, inputs, target, _ = hf_bert(batch)
    return model, {**inputs, "labels": target}, target, _own_loss


def llama_tempered(batch: int) -> Example:
    """Llama's logits divided by a 0-d temperature given by name."""
    model, inputs, target, _ = hf_llama(batch)
    temperature = torch.tensor(1.5, dtype=torch.float64)
    return _Tempered(model), {**inputs, "temperature": temperature}, target, _logits_loss


def resnet_eval(batch: int) -> Example:
    """torchvision's ResNet trained in eval mode (BatchNorm on its running statistics, which
    stay as they are): fine-tuning's frozen statistics."""
    model, inputs, target, loss_fn = torchvision_resnet(batch)
    return model.eval(), inputs, target, loss_fn


# user paths of the README in odd combinations: inputs of no samples by name, a model that
# computes its own loss, a model trained in eval mode
USER_PATHS: dict[str, Callable[[int], Example]] = {
    "hf-gpt2-positions": gpt2_positions,
    "hf-bert-own-loss": bert_own_loss,
    "hf-llama-tempered": llama_tempered,
    "torchvision-resnet-eval": resnet_eval,
}


def repeated(name: str, batch: int, steps: int) -> list[tuple[Any, torch.Tensor]]:
    """POOL[name]'s example minibatch `steps` times, as `train` and `train_processes` take a
    stream (picklable as a functools.partial: the processes call it)."""
    _, inputs, target, _ = POOL[name](batch)
    given = (inputs,) if isinstance(inputs, dict) else tuple(inputs)
    return [(given, target)] * steps
