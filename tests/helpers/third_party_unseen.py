"""Third-party models the other pools (tests/helpers/third_party.py) leave out, in tiny float64
configurations: torchvision's ConvNeXt (layer scale), EfficientNet (MBConv and Fused-MBConv,
squeeze-excite), RegNet (grouped convolutions, squeeze-excite), ViT, ShuffleNetV2 (channel
shuffle, split branches) and MNASNet; Hugging Face Falcon (parallel attention and MLP), OPT,
Phi (partial rotary), Gemma 2 (logit soft-capping, sliding window), Mamba (selective scan in
PyTorch), DeBERTa-v2 (disentangled relative attention), FNet (Fourier mixing), MobileBERT
(bottlenecks, stacked feed-forwards) and XLNet (two-stream relative attention); torchvision's
Swin (shifted windows, relative position bias), MaxViT (block and grid attention over MBConv,
BatchNorm beside LayerNorm) and Inception v3 (factorised convolutions, four-branch blocks);
Hugging Face GPT-NeoX (parallel residual, partial rotary), Funnel (pooling that shortens the
sequence between blocks), ConvBERT (span-based dynamic convolution) and Whisper's encoder
(an audio classifier: convolutions over mel features, then attention); BLOOM (ALiBi, its own
GeLU autograd Function, captured by torch.export as one operator).

`UNSEEN[name](batch)` returns `(model, inputs, target, loss_fn)` as `third_party.POOL` does;
`repeated_unseen` is its example minibatch as a stream for `train_processes` (picklable)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from pdcompile.models.real_models import classification_loss, next_token_loss
from tests.helpers.third_party import Example


def _images(batch: int, size: int) -> tuple[tuple[torch.Tensor], torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return ((torch.randn(batch, 3, size, size, dtype=torch.float64, generator=generator),),
            torch.randint(0, 10, (batch,), generator=generator))


def convnext(batch: int) -> Example:
    models = pytest.importorskip("torchvision.models.convnext")
    torch.manual_seed(0)
    model = models.ConvNeXt([models.CNBlockConfig(8, 16, 1), models.CNBlockConfig(16, None, 1)],
                            stochastic_depth_prob=0.0, num_classes=10).double()
    return (model, *_images(batch, 32), classification_loss)


def efficientnet(batch: int) -> Example:
    e = pytest.importorskip("torchvision.models.efficientnet")
    torch.manual_seed(0)
    model = e.EfficientNet([e.MBConvConfig(1, 3, 1, 8, 8, 1), e.MBConvConfig(6, 3, 2, 8, 16, 2),
                            e.FusedMBConvConfig(4, 3, 2, 16, 16, 1)], dropout=0.0,
                           stochastic_depth_prob=0.0, num_classes=10, last_channel=32).double()
    return (model, *_images(batch, 32), classification_loss)


def regnet(batch: int) -> Example:
    r = pytest.importorskip("torchvision.models.regnet")
    torch.manual_seed(0)
    params = r.BlockParams.from_init_params(depth=3, w_0=8, w_a=8, w_m=2, group_width=4,
                                            se_ratio=0.25)
    model = r.RegNet(params, num_classes=10, stem_width=8).double()
    return (model, *_images(batch, 32), classification_loss)


def vit(batch: int) -> Example:
    v = pytest.importorskip("torchvision.models.vision_transformer")
    torch.manual_seed(0)
    model = v.VisionTransformer(image_size=16, patch_size=8, num_layers=2, num_heads=2,
                                hidden_dim=16, mlp_dim=32, num_classes=10).double()
    return (model, *_images(batch, 16), classification_loss)


def shufflenet(batch: int) -> Example:
    s = pytest.importorskip("torchvision.models.shufflenetv2")
    torch.manual_seed(0)
    model = s.ShuffleNetV2([1, 2, 1], [8, 16, 32, 64, 64], num_classes=10).double()
    return (model, *_images(batch, 32), classification_loss)


def mnasnet(batch: int) -> Example:
    m = pytest.importorskip("torchvision.models.mnasnet")
    torch.manual_seed(0)
    model = m.MNASNet(0.25, num_classes=10, dropout=0.0).double()
    return (model, *_images(batch, 32), classification_loss)


def swin(batch: int) -> Example:
    s = pytest.importorskip("torchvision.models.swin_transformer")
    torch.manual_seed(0)
    model = s.SwinTransformer(patch_size=[4, 4], embed_dim=8, depths=[1, 1], num_heads=[1, 2],
                              window_size=[2, 2], stochastic_depth_prob=0.0,
                              num_classes=10).double()
    return (model, *_images(batch, 16), classification_loss)


def maxvit(batch: int) -> Example:
    m = pytest.importorskip("torchvision.models.maxvit")
    torch.manual_seed(0)
    model = m.MaxVit(input_size=(32, 32), stem_channels=8, partition_size=2,
                     block_channels=[8, 16], block_layers=[1, 1], head_dim=4,
                     stochastic_depth_prob=0.0, num_classes=10).double()
    return (model, *_images(batch, 32), classification_loss)


def inception3(batch: int) -> Example:
    i = pytest.importorskip("torchvision.models.inception")
    torch.manual_seed(0)
    model = i.Inception3(num_classes=10, aux_logits=False, init_weights=False,
                         dropout=0.0).double()
    return (model, *_images(batch, 75), classification_loss)


def whisper_encoder(batch: int) -> Example:
    model = _hf_model("WhisperForAudioClassification", "WhisperConfig",
                      {"vocab_size": 40, "num_mel_bins": 8, "encoder_layers": 2,
                       "encoder_attention_heads": 2, "decoder_layers": 1,
                       "decoder_attention_heads": 2, "d_model": 16, "encoder_ffn_dim": 32,
                       "decoder_ffn_dim": 32, "max_source_positions": 8,
                       "max_target_positions": 8, "dropout": 0.0, "pad_token_id": 0,
                       "bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 1})
    features = torch.randn(batch, 8, 16, dtype=torch.float64,
                           generator=torch.Generator().manual_seed(2))
    labels = torch.randint(0, 2, (batch,), generator=torch.Generator().manual_seed(3))
    return model, {"input_features": features}, labels, _logits_loss


def _ids(batch: int) -> torch.Tensor:
    return torch.randint(0, 40, (batch, 6), generator=torch.Generator().manual_seed(2))


def _hf_model(model_class: str, config_class: str, config: dict[str, Any]) -> nn.Module:
    """transformers' `model_class` of `config_class(**config)`, seeded, in float64."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    built = getattr(transformers, config_class)(**config)
    return getattr(transformers, model_class)(built).double()


def _causal_lm(model_class: str, config_class: str, **config: Any) -> Callable[[int], Example]:
    """A Hugging Face causal (or masked) LM of `config`, trained on next tokens."""
    def build(batch: int) -> Example:
        model = _hf_model(model_class, config_class, config)
        ids = _ids(batch)
        return model, {"input_ids": ids}, torch.roll(ids, -1, dims=1), next_token_loss
    return build


def _logits_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output.logits, target)


def _classifier(model_class: str, config_class: str, **config: Any) -> Callable[[int], Example]:
    """A Hugging Face sequence classifier of `config` over padded rows (the last two
    positions of every row after the first masked)."""
    def build(batch: int) -> Example:
        model = _hf_model(model_class, config_class, config)
        ids = _ids(batch)
        mask = torch.ones_like(ids)
        mask[1:, -2:] = 0
        labels = torch.randint(0, 3, (batch,), generator=torch.Generator().manual_seed(3))
        return model, {"input_ids": ids, "attention_mask": mask}, labels, _logits_loss
    return build


_SMALL = {"vocab_size": 40, "hidden_size": 16, "num_attention_heads": 2}
_NO_DROPOUT = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}

UNSEEN: dict[str, Callable[[int], Example]] = {
    "torchvision-convnext": convnext,
    "torchvision-efficientnet": efficientnet,
    "torchvision-regnet": regnet,
    "torchvision-vit": vit,
    "torchvision-shufflenet": shufflenet,
    "torchvision-mnasnet": mnasnet,
    "torchvision-swin": swin,
    "torchvision-maxvit": maxvit,
    "torchvision-inception3": inception3,
    "hf-whisper-encoder": whisper_encoder,
    "hf-gpt-neox": _causal_lm("GPTNeoXForCausalLM", "GPTNeoXConfig", num_hidden_layers=2,
                              intermediate_size=32, max_position_embeddings=16, rotary_pct=0.5,
                              hidden_dropout=0.0, attention_dropout=0.0, use_cache=False,
                              **_SMALL),
    "hf-funnel": _classifier("FunnelForSequenceClassification", "FunnelConfig", num_labels=3,
                             vocab_size=40, block_sizes=[1, 1], d_model=16, n_head=2, d_head=8,
                             d_inner=32, hidden_dropout=0.0, attention_dropout=0.0,
                             activation_dropout=0.0),
    "hf-convbert": _classifier("ConvBertForSequenceClassification", "ConvBertConfig",
                               num_labels=3, num_hidden_layers=2, intermediate_size=32,
                               max_position_embeddings=16, embedding_size=16, **_NO_DROPOUT,
                               **_SMALL),
    "hf-falcon": _causal_lm("FalconForCausalLM", "FalconConfig", num_hidden_layers=2,
                            hidden_dropout=0.0, attention_dropout=0.0, use_cache=False, **_SMALL),
    "hf-opt": _causal_lm("OPTForCausalLM", "OPTConfig", num_hidden_layers=2, ffn_dim=32,
                         max_position_embeddings=16, dropout=0.0, word_embed_proj_dim=16,
                         use_cache=False, **_SMALL),
    "hf-phi": _causal_lm("PhiForCausalLM", "PhiConfig", intermediate_size=32, num_hidden_layers=2,
                         max_position_embeddings=16, resid_pdrop=0.0, embd_pdrop=0.0,
                         attention_dropout=0.0, use_cache=False, **_SMALL),
    "hf-gemma2": _causal_lm("Gemma2ForCausalLM", "Gemma2Config", intermediate_size=32,
                            num_hidden_layers=2, num_key_value_heads=1, head_dim=8,
                            max_position_embeddings=16, sliding_window=4, use_cache=False,
                            **_SMALL),
    "hf-mamba": _causal_lm("MambaForCausalLM", "MambaConfig", vocab_size=40, hidden_size=16,
                           state_size=4, num_hidden_layers=2, use_cache=False),
    "hf-fnet": _causal_lm("FNetForMaskedLM", "FNetConfig", vocab_size=40, hidden_size=16,
                          num_hidden_layers=2, intermediate_size=32, max_position_embeddings=16,
                          hidden_dropout_prob=0.0),
    "hf-xlnet": _causal_lm("XLNetLMHeadModel", "XLNetConfig", vocab_size=40, d_model=16,
                           n_layer=2, n_head=2, d_inner=32, dropout=0.0, use_mems_train=False),
    "hf-deberta-v2": _classifier("DebertaV2ForSequenceClassification", "DebertaV2Config",
                                 num_labels=3, num_hidden_layers=2, intermediate_size=32,
                                 max_position_embeddings=16, relative_attention=True,
                                 position_buckets=4, pos_att_type=["p2c", "c2p"],
                                 **_NO_DROPOUT, **_SMALL),
    "hf-mobilebert": _classifier("MobileBertForSequenceClassification", "MobileBertConfig",
                                 num_labels=3, num_hidden_layers=2, intermediate_size=32,
                                 embedding_size=8, intra_bottleneck_size=8, true_hidden_size=8,
                                 num_feedforward_networks=2, max_position_embeddings=16,
                                 classifier_dropout=0.0, **_NO_DROPOUT, **_SMALL),
    "hf-bloom": _causal_lm("BloomForCausalLM", "BloomConfig", vocab_size=40, hidden_size=16,
                           n_layer=2, n_head=2, hidden_dropout=0.0, attention_dropout=0.0,
                           use_cache=False),
}


def repeated_unseen(name: str, batch: int, steps: int) -> list[tuple[Any, torch.Tensor]]:
    """UNSEEN[name]'s example minibatch `steps` times (a stream `train_processes` takes)."""
    _, inputs, target, _ = UNSEEN[name](batch)
    given = (inputs,) if isinstance(inputs, dict) else tuple(inputs)
    return [(given, target)] * steps
