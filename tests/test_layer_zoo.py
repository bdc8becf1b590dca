"""The layer zoo: no model may make one example count for more than the clip norm C.

Each model shape in ``ZOO`` runs through both clipping engines ("fast" and
"vmap"), in float32, and is held to two checks:

* the clipped sum equals that of a plain per-example autograd loop on a
  float64 copy of the model (``reference.per_example_gradients_by_loop``) to
  1e-5 relative, with C between the two middle per-example norms, so that
  some examples are scaled down and some pass through unchanged;
* every example moves the engine's sum by at most C (1 + 1e-6): the sum with
  it minus the sum without it is that example's own clipped contribution,
  whatever the engine did to get there. Models that draw random numbers
  (dropout) cannot be rerun on a different set of examples with the same
  masks, so only deterministic models take this check.

Dropout is checked against the masks the engines draw. Under
``torch.manual_seed(seed)`` both engines draw, for each chunk of
``max_physical_batch`` examples and for each ``nn.Dropout`` call in forward
order, one Bernoulli(1 - p) tensor shaped like the batched input of that call
(``torch.empty_like(x).bernoulli_(1 - p)``): the fast engine because its
batched forward pass calls dropout on the chunk, the vmap engine because
``randomness="different"`` draws one mask for the whole chunk and gives row i
to example i. ``masks_the_engines_draw`` replays that under the same seed on a
copy of the model, and the loop applies row i of each mask to example i. The
check is strict: the masks differ between examples and dropout changes every
example's gradient (both asserted), so an engine that shared one mask between
examples, shifted masks by an example, or drew them in another order would
be off by far more than 1e-5.

Under precision "bf16" the fast engine is held to the bound for each example
on its own, and to the float32 vmap engine within bfloat16's rounding.

A hypothesis test stacks random sequence layers (kinds, width, length, batch,
clip norm) and holds both engines to the loop in the same way, to 1e-5 or,
for a stack so ill-conditioned that a float32 autograd loop is further off
than that, to 10 times that loop's error.
"""

import copy
import functools
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from reference import clipped_sum_by_loop, per_example_gradients_by_loop, relative_error
from workers.clipping import LossFunction
from workers.engines import ENGINES, clipped_sum, engine_plan
from workers.layer_rules import rule_for
from workers.models import flat_parameters

BATCH = 5
MAX_PHYSICAL_BATCH = 3  # smaller than the batch: every engine clips chunk by chunk
TOLERANCE = 1e-5  # relative error of a float32 engine against the float64 loop
FLOAT32_ERROR_FACTOR = 10  # random stacks: an engine may be this many times as far off as a float32 loop
BOUND_SLACK = 1e-6  # float32 rounding allowed on top of C for one example's contribution
# Relative error of the fast engine under bf16 against the float32 vmap engine, where bfloat16 keeps 8 significant
# bits: 0.06% to 0.92% across the zoo, measured on the CPU (the most for LlamaRMSNorm on sequences).
BF16_TOLERANCE = 0.02
VOCAB = 7
WIDTH = 4
LENGTH = 5
CLASSES = 3

# torch.func has no batching rule for CPU flash attention and says so; the result is right, only slower.
# The fast engine warns when it runs a model (a functional tie) on the vmap engine whole: allowed here.
# Under bf16 autocast torch's RMSNorm warns that a float32 weight keeps it off its fused kernel; the result is right.
pytestmark = [
    pytest.mark.filterwarnings("ignore:There is a performance drop"),
    pytest.mark.filterwarnings("ignore:fast clipping engine"),
    pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight"),
]


# ---------------------------------------------------------------------------
# Losses


def token_cross_entropy(logits: Tensor, labels: Tensor) -> Tensor:
    """Cross-entropy averaged over one example's tokens: logits [1, T, V], labels [1, T]."""
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def focal_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """A user-defined loss: focal loss (gamma 2) on class logits [n, classes], averaged over the n examples."""
    log_probabilities = F.log_softmax(logits, dim=-1).gather(1, labels[:, None]).squeeze(1)
    return (-((1 - log_probabilities.exp()) ** 2) * log_probabilities).mean()


# ---------------------------------------------------------------------------
# Inputs


def features(*shape: int) -> Tensor:
    """A batch of float inputs [BATCH, *shape]."""
    return torch.randn(BATCH, *shape)


def tokens(length: int = LENGTH) -> Tensor:
    """A batch of token ids [BATCH, length]; few ids, so rows repeat tokens."""
    return torch.randint(0, VOCAB, (BATCH, length))


def class_labels() -> Tensor:
    """One class label per example [BATCH]."""
    return torch.randint(0, CLASSES, (BATCH,))


def with_head(body: nn.Module, inputs: Tensor) -> nn.Sequential:
    """``body``, tanh, flatten and a linear classifier sized by running ``body`` on one example."""
    with torch.no_grad():
        width = body(inputs[:1]).numel()
    return nn.Sequential(body, nn.Tanh(), nn.Flatten(), nn.Linear(width, CLASSES))


# ---------------------------------------------------------------------------
# Models


class ChannelsFirst(nn.Module):
    """Applies a channels-first layer (convolution, group or instance norm) to [B, T, W] sequences."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, sequence: Tensor) -> Tensor:
        return self.layer(sequence.transpose(1, 2)).transpose(1, 2)


class SelfAttention(nn.Module):
    """nn.MultiheadAttention over [B, T, W] sequences, optionally causal; the layer itself may be sequence-first."""

    def __init__(self, width: int, heads: int, batch_first: bool = True, causal: bool = False):
        super().__init__()
        self.attention = nn.MultiheadAttention(width, heads, batch_first=batch_first)
        self.causal = causal

    def forward(self, sequence: Tensor) -> Tensor:
        length = sequence.shape[1]
        mask = torch.ones(length, length, dtype=torch.bool).triu(1) if self.causal else None
        inputs = sequence if self.attention.batch_first else sequence.transpose(0, 1)
        attended, _ = self.attention(inputs, inputs, inputs, attn_mask=mask, need_weights=False)
        return attended if self.attention.batch_first else attended.transpose(0, 1)


class Recurrent(nn.Module):
    """A batch_first nn.RNN, nn.GRU or nn.LSTM on [B, T, W] sequences: its output at every step."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, sequence: Tensor) -> Tensor:
        outputs, _ = self.layer(sequence)
        return outputs


class TextClassifier(nn.Module):
    """Tokens, embedding, sequence layers, the last step's features, classes."""

    def __init__(self, *layers: nn.Module, width: int = WIDTH):
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, width)
        self.layers = nn.Sequential(*layers)
        self.head = nn.Linear(width, CLASSES)

    def forward(self, token_ids: Tensor) -> Tensor:
        return self.head(torch.tanh(self.layers(self.embedding(token_ids)))[:, -1])


class BagOfWords(nn.Module):
    """Tokens [B, T], one nn.EmbeddingBag bag per example, classes."""

    def __init__(self, mode: str):
        super().__init__()
        self.bag = nn.EmbeddingBag(VOCAB, WIDTH, mode=mode)
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, token_ids: Tensor) -> Tensor:
        return self.head(torch.tanh(self.bag(token_ids)))


class LanguageModel(nn.Module):
    """Per-token logits [B, T, V]: embedding, a sequence layer, a linear head over the vocabulary.

    ``tie`` makes the head's weight the embedding's own Parameter (two modules
    holding one Parameter).
    """

    def __init__(self, layer: nn.Module, tie: bool = False):
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, WIDTH)
        self.layer = layer
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        if tie:
            self.head.weight = self.embedding.weight

    def forward(self, token_ids: Tensor) -> Tensor:
        return self.head(torch.tanh(self.layer(self.embedding(token_ids))))


class FunctionallyTiedLanguageModel(nn.Module):
    """Per-token logits ``h @ embedding.weight.T``: the embedding matrix used as the head in forward, as LMs do."""

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, WIDTH)
        self.mix = nn.Linear(WIDTH, WIDTH)

    def forward(self, token_ids: Tensor) -> Tensor:
        hidden = torch.tanh(self.mix(self.embedding(token_ids)))
        return hidden @ self.embedding.weight.T


class CalledTwice(nn.Module):
    """One width-preserving layer applied twice, with tanh between, then a classifier head."""

    def __init__(self, layer: nn.Module, head: nn.Module):
        super().__init__()
        self.layer = layer
        self.head = head

    def forward(self, inputs: Tensor) -> Tensor:
        return self.head(torch.tanh(self.layer(torch.tanh(self.layer(inputs)))))


def transformers_conv1d(out_features: int, in_features: int) -> nn.Module:
    """transformers' Conv1D (GPT-2's layer: x @ weight + bias, weight [in, out]); skips the test without transformers."""
    return pytest.importorskip("transformers.pytorch_utils").Conv1D(out_features, in_features)


def llama_rms_norm(width: int) -> nn.Module:
    """transformers' LlamaRMSNorm with a weight away from its initial ones; skips the test without transformers."""
    layer = pytest.importorskip("transformers.models.llama.modeling_llama").LlamaRMSNorm(width, eps=1e-6)
    with torch.no_grad():
        layer.weight.uniform_(0.5, 1.5)
    return layer


class HuggingFaceLanguageModel(nn.Module):
    """A transformers causal LM on token ids [B, T]: its logits [B, T, V], position ids counted from each example's
    own ids (so that they carry the batch, as dpfleet's pretrained models make them)."""

    def __init__(self, hf: nn.Module):
        super().__init__()
        self.hf = hf

    def forward(self, token_ids: Tensor) -> Tensor:
        positions = torch.ones_like(token_ids).cumsum(-1) - 1
        return self.hf(input_ids=token_ids, position_ids=positions).logits


def tiny_gpt2(tied: bool = False) -> nn.Module:
    """One GPT-2 block (Conv1D, LayerNorm, embeddings), no dropout, its head untied or (``tied``) the token
    embedding's table, as GPT-2 ships; skips without transformers."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_embd=WIDTH, n_layer=1, n_head=2, vocab_size=VOCAB, n_positions=LENGTH, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=tied, attn_implementation="eager")
    return HuggingFaceLanguageModel(transformers.GPT2LMHeadModel(config))


def tiny_llama() -> nn.Module:
    """One Llama block (Linear, LlamaRMSNorm, rotary positions), untied head; skips without transformers."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=WIDTH, intermediate_size=6, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        vocab_size=VOCAB, max_position_embeddings=LENGTH, bos_token_id=0, eos_token_id=0,
        tie_word_embeddings=False, attn_implementation="eager")
    return HuggingFaceLanguageModel(transformers.LlamaForCausalLM(config))


def tiny_bert_on_padded_tokens() -> tuple[nn.Module, Tensor, Tensor]:
    """One BERT block classifying padded token ids, wrapped as dpfleet's pretrained models are (``TokenModel``:
    each example's attention mask, positions and token types from its own ids); skips without transformers."""
    transformers = pytest.importorskip("transformers")
    from workers.pretrained import PAD_INPUT, TokenModel

    config = transformers.BertConfig(
        hidden_size=WIDTH, intermediate_size=6, num_hidden_layers=1, num_attention_heads=2, vocab_size=VOCAB,
        max_position_embeddings=LENGTH, num_labels=CLASSES, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, attn_implementation="eager")
    ids = tokens()
    ids[0, 3:] = PAD_INPUT
    ids[2, 1:] = PAD_INPUT
    model = TokenModel(transformers.BertForSequenceClassification(config), causal=False, pad_token_id=0,
                       token_types=True)
    return model, ids, class_labels()


def frozen(module: nn.Module, *names: str) -> nn.Module:
    """``module`` with the named parameters (all when none are named) set to requires_grad=False."""
    for name, parameter in module.named_parameters():
        if not names or name in names:
            parameter.requires_grad_(False)
    return module


@dataclass(frozen=True)
class ZooCase:
    """A model shape: ``build()`` returns (model, inputs, labels) for ``loss_fn``; ``random`` if it uses dropout."""

    build: Callable[[], tuple[nn.Module, Tensor, Tensor]]
    loss_fn: LossFunction = F.cross_entropy
    random: bool = False


def classified(body: Callable[[], nn.Module], *input_shape: int) -> Callable[[], tuple[nn.Module, Tensor, Tensor]]:
    """A builder: ``body()`` on float inputs of ``input_shape`` followed by ``with_head``, with class labels."""

    def build():
        inputs = features(*input_shape)
        return with_head(body(), inputs), inputs, class_labels()

    return build


def on_tokens(model: Callable[[], nn.Module], token_labels: bool = False) -> Callable:
    """A builder: ``model()`` on token ids, with class labels or (``token_labels``) a next-token label per position."""

    def build():
        labels = torch.randint(0, VOCAB, (BATCH, LENGTH)) if token_labels else class_labels()
        return model(), tokens(), labels

    return build


def sequence_layer_model(layer: Callable[[], nn.Module]) -> Callable:
    """A builder: ``layer()`` on float sequences [B, LENGTH, WIDTH] followed by ``with_head``."""
    return classified(layer, LENGTH, WIDTH)


def regression() -> tuple[nn.Module, Tensor, Tensor]:
    """Two float targets per example, for the mean squared error."""
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 2))
    return model, features(6), torch.randn(BATCH, 2)


def dropout_classifier() -> tuple[nn.Module, Tensor, Tensor]:
    """A classifier with two dropout layers of different rates between its linear layers."""
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Dropout(0.5), nn.Linear(8, 6), nn.Tanh(),
                          nn.Dropout(0.25), nn.Linear(6, CLASSES))
    return model, features(6), class_labels()


def dropout_on_sequences() -> tuple[nn.Module, Tensor, Tensor]:
    """Dropout on [B, T, W] embeddings before a Linear on 3-D inputs, in a text classifier."""
    model = TextClassifier(nn.Dropout(0.3), nn.Linear(WIDTH, WIDTH))
    return model, tokens(), class_labels()


ZOO: dict[str, ZooCase] = {
    # Convolutions: stride, padding ('same' and non-zero padding modes), dilation, groups.
    "conv1d_stride_padding": ZooCase(classified(lambda: nn.Conv1d(2, 4, 3, stride=2, padding=1), 2, 6)),
    "conv1d_same_dilated_reflect": ZooCase(classified(
        lambda: nn.Conv1d(3, 4, 3, padding="same", dilation=2, padding_mode="reflect"), 3, 6)),
    "conv1d_groups_circular": ZooCase(classified(
        lambda: nn.Conv1d(4, 6, 3, padding=1, groups=2, padding_mode="circular"), 4, 5)),
    "conv2d_stride_dilation_groups": ZooCase(classified(
        lambda: nn.Conv2d(4, 6, 3, stride=2, padding=2, dilation=2, groups=2), 4, 5, 5)),
    # 4 output positions, 10 output channels: the fast engine takes the ghost norm.
    "conv2d_ghost_norm_reflect": ZooCase(classified(
        lambda: nn.Conv2d(2, 10, 3, stride=2, padding=1, padding_mode="reflect"), 2, 3, 3)),
    "conv2d_same_replicate": ZooCase(classified(
        lambda: nn.Conv2d(2, 4, (3, 2), padding="same", padding_mode="replicate"), 2, 4, 4)),
    "conv3d_stride_padding": ZooCase(classified(
        lambda: nn.Conv3d(2, 3, 3, stride=(1, 2, 2), padding=1), 2, 3, 4, 4)),
    "conv3d_same_groups_circular": ZooCase(classified(
        lambda: nn.Conv3d(2, 4, (3, 1, 2), padding="same", groups=2, padding_mode="circular"), 2, 3, 3, 3)),
    "conv_transpose1d_stride_output_padding": ZooCase(classified(
        lambda: nn.ConvTranspose1d(3, 4, 3, stride=2, padding=1, output_padding=1), 3, 4)),
    "conv_transpose2d_groups_dilation": ZooCase(classified(
        lambda: nn.ConvTranspose2d(4, 4, 3, stride=2, padding=1, dilation=2, groups=2), 4, 3, 3)),
    # Sequence models.
    # More outputs (12) than twice the positions (5): the fast engine takes the ghost norm.
    "linear_on_sequences": ZooCase(sequence_layer_model(lambda: nn.Linear(WIDTH, 12))),
    "embedding_with_padding_idx": ZooCase(on_tokens(
        lambda: nn.Sequential(nn.Embedding(VOCAB, WIDTH, padding_idx=0), nn.Flatten(),
                              nn.Linear(LENGTH * WIDTH, CLASSES)))),
    "embedding_bag_mean": ZooCase(on_tokens(lambda: BagOfWords("mean"))),
    "embedding_bag_max": ZooCase(on_tokens(lambda: BagOfWords("max"))),
    # Normalisation layers.
    "layer_norm_on_sequences": ZooCase(sequence_layer_model(
        lambda: nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.LayerNorm(WIDTH)))),
    "group_norm": ZooCase(classified(lambda: nn.Sequential(nn.Conv2d(2, 4, 3), nn.GroupNorm(2, 4)), 2, 4, 4)),
    "instance_norm1d_affine": ZooCase(classified(
        lambda: nn.Sequential(nn.Conv1d(2, 3, 2), nn.InstanceNorm1d(3, affine=True)), 2, 5)),
    "instance_norm2d_affine": ZooCase(classified(
        lambda: nn.Sequential(nn.Conv2d(2, 3, 2), nn.InstanceNorm2d(3, affine=True)), 2, 4, 4)),
    "rms_norm_on_sequences": ZooCase(sequence_layer_model(
        lambda: nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.RMSNorm(WIDTH, eps=1e-6)))),
    "rms_norm_over_two_dimensions_default_eps": ZooCase(sequence_layer_model(
        lambda: nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.RMSNorm((LENGTH, WIDTH))))),
    # Attention.
    "multihead_attention_causal_sequence_first": ZooCase(sequence_layer_model(
        lambda: SelfAttention(WIDTH, 2, batch_first=False, causal=True))),
    "transformer_encoder_layer": ZooCase(on_tokens(lambda: TextClassifier(
        nn.TransformerEncoderLayer(WIDTH, 2, dim_feedforward=6, dropout=0.0, batch_first=True)))),
    "transformer_encoder_layer_norm_first_gelu": ZooCase(sequence_layer_model(lambda: nn.TransformerEncoderLayer(
        WIDTH, 2, dim_feedforward=6, dropout=0.0, activation="gelu", batch_first=True, norm_first=True))),
    # Recurrent text classifiers (batch_first, last step).
    "rnn_text_classifier": ZooCase(on_tokens(lambda: TextClassifier(
        Recurrent(nn.RNN(WIDTH, WIDTH, batch_first=True))))),
    "gru_text_classifier": ZooCase(on_tokens(lambda: TextClassifier(
        Recurrent(nn.GRU(WIDTH, WIDTH, batch_first=True))))),
    "lstm_text_classifier": ZooCase(on_tokens(lambda: TextClassifier(
        Recurrent(nn.LSTM(WIDTH, WIDTH, num_layers=2, batch_first=True))))),
    # Hugging Face transformers' layers (skipped without transformers).
    # More outputs (12) than twice the positions (5): the ghost norm; 4 outputs on 10 positions: instantiation.
    "transformers_conv1d_on_sequences": ZooCase(sequence_layer_model(lambda: transformers_conv1d(12, WIDTH))),
    "transformers_conv1d_called_twice": ZooCase(sequence_layer_model(
        lambda: CalledTwice(transformers_conv1d(WIDTH, WIDTH), nn.Identity()))),
    "llama_rms_norm_on_sequences": ZooCase(sequence_layer_model(
        lambda: nn.Sequential(nn.Linear(WIDTH, WIDTH), llama_rms_norm(WIDTH)))),
    "tiny_gpt2_language_model": ZooCase(on_tokens(tiny_gpt2, token_labels=True), token_cross_entropy),
    "tiny_bert_on_padded_tokens": ZooCase(tiny_bert_on_padded_tokens),
    "tiny_gpt2_tied_language_model": ZooCase(on_tokens(lambda: tiny_gpt2(tied=True), token_labels=True),
                                             token_cross_entropy),
    "tiny_llama_language_model": ZooCase(on_tokens(tiny_llama, token_labels=True), token_cross_entropy),
    # Tied and reused parameters.
    "tied_through_modules": ZooCase(on_tokens(lambda: LanguageModel(nn.Linear(WIDTH, WIDTH), tie=True),
                                              token_labels=True), token_cross_entropy),
    "tied_functionally": ZooCase(on_tokens(FunctionallyTiedLanguageModel, token_labels=True), token_cross_entropy),
    "linear_called_twice_on_sequences": ZooCase(sequence_layer_model(
        lambda: CalledTwice(nn.Linear(WIDTH, WIDTH), nn.Identity()))),
    "conv2d_called_twice": ZooCase(classified(
        lambda: CalledTwice(nn.Conv2d(3, 3, 3, padding=1), nn.Identity()), 3, 4, 4)),
    "frozen_layers": ZooCase(sequence_layer_model(lambda: nn.Sequential(
        frozen(nn.Linear(WIDTH, WIDTH)), nn.Tanh(), frozen(nn.Linear(WIDTH, 5), "weight"), frozen(nn.LayerNorm(5)),
        nn.Linear(5, 3)))),
    # Losses.
    "per_token_language_model": ZooCase(on_tokens(lambda: LanguageModel(nn.TransformerEncoderLayer(
        WIDTH, 2, dim_feedforward=6, dropout=0.0, batch_first=True)), token_labels=True), token_cross_entropy),
    "mse_regression": ZooCase(regression, F.mse_loss),
    "user_defined_focal_loss": ZooCase(classified(lambda: nn.Linear(6, 5), 6), focal_loss),
    # Dropout.
    "dropout_classifier": ZooCase(dropout_classifier, random=True),
    "dropout_on_sequences": ZooCase(dropout_on_sequences, random=True),
}


# ---------------------------------------------------------------------------
# Dropout masks as the engines draw them


class DrawingDropout(nn.Module):
    """nn.Dropout drawing its mask as both engines do (one Bernoulli(1 - p) tensor like the input); keeps the masks."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p
        self.drawn: list[Tensor] = []

    def forward(self, inputs: Tensor) -> Tensor:
        mask = torch.empty_like(inputs).bernoulli_(1 - self.p)
        self.drawn.append(mask.bool())
        return inputs * mask / (1 - self.p)


class ReplayedDropout(nn.Module):
    """Dropout with given masks: the k-th call multiplies its input by masks[k] / (1 - p)."""

    def __init__(self, p: float, masks: list[Tensor]):
        super().__init__()
        self.p = p
        self.masks = list(masks)

    def forward(self, inputs: Tensor) -> Tensor:
        return inputs * self.masks.pop(0).to(inputs.dtype) / (1 - self.p)


def draws_masks(module: nn.Module) -> bool:
    """Whether ``module`` is an nn.Dropout that drops anything (p > 0; p = 0 leaves its input as it is)."""
    return isinstance(module, nn.Dropout) and module.p > 0


def with_dropouts_replaced(model: nn.Module, replacement: Callable[[str, nn.Dropout], nn.Module]) -> nn.Module:
    """A copy of ``model`` in which each nn.Dropout with p > 0 (by qualified name) is ``replacement(name, dropout)``."""
    copied = copy.deepcopy(model)
    for name, module in list(copied.named_modules()):
        if draws_masks(module):
            parent_name, _, child_name = name.rpartition(".")
            setattr(copied.get_submodule(parent_name), child_name, replacement(name, module))
    return copied


def masks_the_engines_draw(model: nn.Module, inputs: Tensor, seed: int) -> dict[str, list[Tensor]]:
    """Per nn.Dropout (qualified name), example i's mask [1, ...] in a clipped sum run under ``manual_seed(seed)``.

    Each dropout module must be called once per forward pass: the masks of a
    chunk are then the rows of its one draw.
    """
    drawing = with_dropouts_replaced(model, lambda name, dropout: DrawingDropout(dropout.p))
    torch.manual_seed(seed)
    with torch.no_grad():
        for start in range(0, len(inputs), MAX_PHYSICAL_BATCH):
            drawing(inputs[start : start + MAX_PHYSICAL_BATCH])
    masks = {}
    for name, module in drawing.named_modules():
        if isinstance(module, DrawingDropout):
            assert len(module.drawn) == -(-len(inputs) // MAX_PHYSICAL_BATCH), f"{name} is not called once per pass"
            masks[name] = [row[None] for chunk in module.drawn for row in chunk]
    return masks


# ---------------------------------------------------------------------------
# The checks


@dataclass(frozen=True)
class Reference:
    """A zoo model, its data, the loop's float64 per-example gradients [n, P] and the clip norm they call for."""

    model: nn.Module
    inputs: Tensor
    labels: Tensor
    flat_weights: Tensor
    gradients: Tensor
    clip_norm: float
    seed: int


def clip_norm_between_middle_norms(gradients: Tensor) -> float:
    """A C halfway between the two middle per-example norms: the lower half passes unclipped, the upper is clipped."""
    norms = gradients.norm(dim=1).sort().values
    middle = len(norms) // 2
    clip_norm = ((norms[middle - 1] + norms[middle]) / 2).item()
    assert (norms > clip_norm).any() and (norms <= clip_norm).any(), "C must clip some examples and not others"
    return clip_norm


def reference_for(model: nn.Module, inputs: Tensor, labels: Tensor, loss_fn: LossFunction, seed: int) -> Reference:
    """The loop's per-example gradients, with dropout masks replayed as the engines draw them under ``seed``."""
    flat_weights = flat_parameters(model)
    looped = model
    if any(draws_masks(module) for module in model.modules()):
        masks = masks_the_engines_draw(model, inputs, seed)
        for name, per_example in masks.items():
            assert any(not torch.equal(mask, per_example[0]) for mask in per_example), f"{name}: one mask for all"
        looped = with_dropouts_replaced(model, lambda name, dropout: ReplayedDropout(dropout.p, masks[name]))
        without_dropout = per_example_gradients_by_loop(
            with_dropouts_replaced(model, lambda name, dropout: nn.Identity()), flat_weights, inputs, labels,
            loss_fn=loss_fn,
        )
    gradients = per_example_gradients_by_loop(looped, flat_weights, inputs, labels, loss_fn=loss_fn)
    if looped is not model:
        changed = (gradients - without_dropout).norm(dim=1) > 1e-3 * gradients.norm(dim=1)
        assert changed.all(), "dropout must change every example's gradient, or the masks go unchecked"
    return Reference(model, inputs, labels, flat_weights, gradients, clip_norm_between_middle_norms(gradients), seed)


@functools.cache
def zoo_reference(name: str) -> Reference:
    """The reference of a zoo model, built under a seed of its own (shared by both engines' tests)."""
    seed = zlib.crc32(name.encode())
    torch.manual_seed(seed)
    model, inputs, labels = ZOO[name].build()
    assert ZOO[name].random == any(draws_masks(module) for module in model.modules()), "random: uses dropout"
    return reference_for(model.train(), inputs, labels, ZOO[name].loss_fn, seed)


def engine_sum(engine: str, reference: Reference, loss_fn: LossFunction, keep: Tensor | None = None) -> Tensor:
    """The engine's clipped sum at the reference's C over all examples, or those where ``keep`` is True."""
    inputs, labels = reference.inputs, reference.labels
    if keep is not None:
        inputs, labels = inputs[keep], labels[keep]
    torch.manual_seed(reference.seed)
    return clipped_sum(engine, reference.model, reference.flat_weights, inputs, labels, reference.clip_norm,
                       MAX_PHYSICAL_BATCH, loss_fn)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("name", ZOO)
def test_clipped_sum_matches_the_per_example_loop(name, engine):
    reference = zoo_reference(name)
    actual = engine_sum(engine, reference, ZOO[name].loss_fn)
    expected = clipped_sum_by_loop(reference.gradients, reference.clip_norm)
    assert actual.dtype == torch.float32 and actual.shape == reference.flat_weights.shape
    error = relative_error(actual, expected)
    assert error <= TOLERANCE, f"{engine} engine: relative error {error:.3g} against the per-example loop"


DETERMINISTIC = [name for name, case in ZOO.items() if not case.random]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("name", DETERMINISTIC)
def test_no_example_moves_the_sum_by_more_than_the_clip_norm(name, engine):
    reference = zoo_reference(name)
    everyone = engine_sum(engine, reference, ZOO[name].loss_fn).double()
    contributions = []
    for example in range(len(reference.labels)):
        keep = torch.arange(len(reference.labels)) != example
        contributions.append((everyone - engine_sum(engine, reference, ZOO[name].loss_fn, keep).double()).norm())
    largest = max(contributions).item() / reference.clip_norm
    assert largest <= 1 + BOUND_SLACK, f"{engine} engine: one example moves the sum by {largest:.6f} C"


@pytest.mark.parametrize("name", ZOO)
def test_the_fast_engine_in_bf16_keeps_every_example_within_the_clip_norm_and_stays_near_float32(name):
    """Under bf16 each example's clipped contribution, computed on its own, has norm <= C to float32 rounding: its
    norm and its contribution come from the same float32 casts of what the bfloat16 pass recorded."""
    reference = zoo_reference(name)
    loss_fn = ZOO[name].loss_fn
    in_float32 = engine_sum("vmap", reference, loss_fn)
    engine_sum("fast", reference, loss_fn)
    plan = engine_plan(reference.model)
    for example in range(len(reference.labels)):
        alone = clipped_sum("fast", reference.model, reference.flat_weights, reference.inputs[example : example + 1],
                            reference.labels[example : example + 1], reference.clip_norm, MAX_PHYSICAL_BATCH, loss_fn,
                            precision="bf16")
        assert alone.dtype == torch.float32
        assert alone.double().norm().item() <= reference.clip_norm * (1 + BOUND_SLACK), f"example {example}"
    torch.manual_seed(reference.seed)
    in_bf16 = clipped_sum("fast", reference.model, reference.flat_weights, reference.inputs, reference.labels,
                          reference.clip_norm, MAX_PHYSICAL_BATCH, loss_fn, precision="bf16")
    assert engine_plan(reference.model) is plan, "a bf16 call handed the model to the vmap engine"
    error = relative_error(in_bf16, in_float32.double())
    assert 0 < error <= BF16_TOLERANCE, f"bf16 fast engine: relative error {error:.3g} against the fp32 vmap engine"


# Every layer of these models has a book-keeping rule: none may take the vmap fallback.
BOOK_KEEPING_ONLY = [
    "rms_norm_on_sequences", "rms_norm_over_two_dimensions_default_eps", "transformers_conv1d_on_sequences",
    "transformers_conv1d_called_twice", "llama_rms_norm_on_sequences", "tiny_gpt2_language_model",
    "tiny_llama_language_model", "tied_through_modules", "tiny_gpt2_tied_language_model", "tiny_bert_on_padded_tokens",
]


@pytest.mark.parametrize("name", BOOK_KEEPING_ONLY)
def test_rms_norm_and_transformers_layers_run_on_book_keeping_rules(name):
    reference = zoo_reference(name)
    engine_sum("fast", reference, ZOO[name].loss_fn)
    plan = engine_plan(reference.model)
    assert plan.fallback is None
    assert all(how.startswith("fast") for _, how in plan.layers), plan.describe()


TEXT_LAYERS = {
    "LSTM": lambda: nn.LSTM(WIDTH, WIDTH, batch_first=True),
    "EmbeddingBag": lambda: nn.EmbeddingBag(VOCAB, WIDTH),
}


@pytest.mark.parametrize("layer_type", TEXT_LAYERS)
def test_text_layers_have_a_fast_rule_of_their_own(layer_type):
    """The per-module vmap fallback takes each example's gradient separately: too slow for text models' workhorses."""
    assert rule_for(TEXT_LAYERS[layer_type]()) is not None, (
        f"the fast engine runs nn.{layer_type} on the per-module vmap fallback"
    )


# ---------------------------------------------------------------------------
# Random stacks


SEQUENCE_LAYERS: dict[str, Callable[[int, int, str], nn.Module]] = {
    # (width, convolution kernel size, padding mode) -> a width-preserving layer on [B, T, W] sequences
    "linear": lambda width, kernel, mode: nn.Linear(width, width),
    "layer_norm": lambda width, kernel, mode: nn.LayerNorm(width),
    "conv1d": lambda width, kernel, mode: ChannelsFirst(
        nn.Conv1d(width, width, kernel, padding="same", groups=2, padding_mode=mode)),
    "group_norm": lambda width, kernel, mode: ChannelsFirst(nn.GroupNorm(2, width)),
    "instance_norm": lambda width, kernel, mode: ChannelsFirst(nn.InstanceNorm1d(width, affine=True)),
    "attention": lambda width, kernel, mode: SelfAttention(width, 2),
    "transformer": lambda width, kernel, mode: nn.TransformerEncoderLayer(
        width, 2, dim_feedforward=width + 2, dropout=0.0, batch_first=True),
    "rnn": lambda width, kernel, mode: Recurrent(nn.RNN(width, width, batch_first=True)),
    "gru": lambda width, kernel, mode: Recurrent(nn.GRU(width, width, batch_first=True)),
    "lstm": lambda width, kernel, mode: Recurrent(nn.LSTM(width, width, batch_first=True)),
}


class SequenceStack(nn.Module):
    """Tokens (embedding) or features (linear) into width W, sequence layers with tanh, last step or mean, classes."""

    def __init__(self, front: nn.Module, layers: list[nn.Module], width: int, pooling: str):
        super().__init__()
        self.front = front
        self.layers = nn.ModuleList(layers)
        self.pooling = pooling
        self.head = nn.Linear(width, CLASSES)

    def forward(self, inputs: Tensor) -> Tensor:
        sequence = self.front(inputs)
        for layer in self.layers:
            sequence = torch.tanh(layer(sequence))
        return self.head(sequence[:, -1] if self.pooling == "last" else sequence.mean(1))


# No shrinking: a failure already names its layers, and shrinking one took minutes.
@settings(max_examples=12, deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate],
          report_multiple_bugs=False)
@given(
    kinds=st.lists(st.sampled_from(sorted(SEQUENCE_LAYERS)), min_size=1, max_size=3),
    token_inputs=st.booleans(),
    width=st.sampled_from([4, 6]),
    length=st.integers(min_value=2, max_value=6),
    batch=st.integers(min_value=4, max_value=6),
    kernel=st.integers(min_value=1, max_value=3),
    padding_mode=st.sampled_from(["zeros", "reflect", "replicate", "circular"]),
    pooling=st.sampled_from(["last", "mean"]),
    clip_quantile=st.floats(min_value=0.1, max_value=0.9),
    seed=st.integers(min_value=0, max_value=2**16),
)
def test_random_stacks_match_the_per_example_loop(
    kinds, token_inputs, width, length, batch, kernel, padding_mode, pooling, clip_quantile, seed
):
    torch.manual_seed(seed)
    front = nn.Embedding(VOCAB, width) if token_inputs else nn.Linear(3, width)
    model = SequenceStack(front, [SEQUENCE_LAYERS[kind](width, kernel, padding_mode) for kind in kinds], width,
                          pooling)
    inputs = torch.randint(0, VOCAB, (batch, length)) if token_inputs else torch.randn(batch, length, 3)
    labels = torch.randint(0, CLASSES, (batch,))
    flat_weights = flat_parameters(model)
    gradients = per_example_gradients_by_loop(model, flat_weights, inputs, labels)
    clip_norm = torch.quantile(gradients.norm(dim=1), clip_quantile).item()
    expected = clipped_sum_by_loop(gradients, clip_norm)
    # Some random stacks are ill-conditioned (attention averages a short sequence to nearly one value, which
    # instance norm then divides by its tiny spread): there plain float32 autograd itself misses 1e-5.
    float32_loop = per_example_gradients_by_loop(model, flat_weights, inputs, labels, dtype=torch.float32)
    float32_error = relative_error(clipped_sum_by_loop(float32_loop.double(), clip_norm), expected)
    tolerance = max(TOLERANCE, FLOAT32_ERROR_FACTOR * float32_error)
    for engine in ENGINES:
        actual = clipped_sum(engine, model, flat_weights, inputs, labels, clip_norm, MAX_PHYSICAL_BATCH)
        error = relative_error(actual, expected)
        assert error <= tolerance, (
            f"{engine} engine on {kinds}: relative error {error:.3g} against the loop "
            f"(a float32 loop: {float32_error:.3g})"
        )
