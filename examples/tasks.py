"""Datasets and models for the example configs that bring their own task (``package.module:function`` specs).

Run from the repository root, where ``examples`` is importable:

- ``examples/gru_text.toml``: a GRU text classifier on synthetic token sequences;
- ``examples/tied_language_model.toml``: a next-token model whose output layer
  is its embedding matrix (weight tying, as language models do);
- ``examples/breast_cancer.toml``: binary classification of scikit-learn's
  breast-cancer records (install the ``examples`` extra), reported with AUROC.

Every dataset function returns (train, test) map-style datasets of
(input, label) pairs. Preprocessing uses no statistic of the data (a
statistic of the training set would itself leak): the tabular features go
through log1p, a fixed function.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

VOCABULARY = 32
SEQUENCE_LENGTH = 12
WIDTH = 32
# Tokens whose counts decide the synthetic sentiment: the "positive" and the "negative" half of 0..15.
_POSITIVE, _NEGATIVE = range(0, 8), range(8, 16)


def _split(inputs: torch.Tensor, labels: torch.Tensor, test_fraction: float, seed: int) -> tuple:
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    test_count = int(len(labels) * test_fraction)
    test, train = order[:test_count], order[test_count:]
    return TensorDataset(inputs[train], labels[train]), TensorDataset(inputs[test], labels[test])


def token_sentiment(examples: int = 12_000, seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """Token sequences [SEQUENCE_LENGTH] (int64 ids < VOCABULARY) labelled 1 when "positive" tokens outnumber "negative" ones.

    Ties are broken by the last such token, so order matters and a bag of
    words cannot reach 100%.
    """
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCABULARY, (examples, SEQUENCE_LENGTH), generator=generator)
    positive = (tokens < _POSITIVE.stop).sum(1)
    negative = ((tokens >= _NEGATIVE.start) & (tokens < _NEGATIVE.stop)).sum(1)
    polar = tokens < _NEGATIVE.stop
    last_polar = torch.where(polar, torch.arange(SEQUENCE_LENGTH), -1).argmax(1)
    last_is_positive = tokens[torch.arange(examples), last_polar] < _POSITIVE.stop
    labels = torch.where(positive == negative, last_is_positive.long(), (positive > negative).long())
    return _split(tokens, labels, 1 / 6, seed)


def next_token(examples: int = 12_000, seed: int = 1) -> tuple[TensorDataset, TensorDataset]:
    """Sequences [SEQUENCE_LENGTH] from a fixed random Markov chain over VOCABULARY tokens; the label is the next token.

    Each token has four likely successors, so the best possible accuracy is
    well below 100% and a model must read the last token to beat chance.
    """
    generator = torch.Generator().manual_seed(seed)
    successors = torch.randint(0, VOCABULARY, (VOCABULARY, 4), generator=generator)
    walk = torch.empty(examples, SEQUENCE_LENGTH + 1, dtype=torch.int64)
    walk[:, 0] = torch.randint(0, VOCABULARY, (examples,), generator=generator)
    for position in range(1, SEQUENCE_LENGTH + 1):
        choice = torch.randint(0, 4, (examples,), generator=generator)
        walk[:, position] = successors[walk[:, position - 1], choice]
    return _split(walk[:, :-1], walk[:, -1], 1 / 6, seed)


def breast_cancer(seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """scikit-learn's breast-cancer records (569 x 30 features), log1p-scaled; label 1 = benign (float, for BCE)."""
    from sklearn.datasets import load_breast_cancer

    records = load_breast_cancer()
    inputs = torch.log1p(torch.as_tensor(records.data, dtype=torch.float32))
    labels = torch.as_tensor(records.target, dtype=torch.float32)
    return _split(inputs, labels, 0.2, seed)


class GRUTextClassifier(nn.Module):
    """Embedding, a one-layer GRU (batch_first) and a linear head on the last hidden state."""

    def __init__(self, classes: int = 2) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCABULARY, WIDTH)
        self.gru = nn.GRU(WIDTH, WIDTH, batch_first=True)
        self.head = nn.Linear(WIDTH, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        _, last_hidden = self.gru(self.embedding(tokens))
        return self.head(last_hidden[-1])


class TiedLanguageModel(nn.Module):
    """A next-token model: embedding, a GRU, and logits from the embedding matrix itself (``h @ E^T``)."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCABULARY, WIDTH)
        self.gru = nn.GRU(WIDTH, WIDTH, batch_first=True)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        _, last_hidden = self.gru(self.embedding(tokens))
        return last_hidden[-1] @ self.embedding.weight.T


def gru_text_classifier() -> nn.Module:
    """The model of ``examples/gru_text.toml``."""
    return GRUTextClassifier()


def tied_language_model() -> nn.Module:
    """The model of ``examples/tied_language_model.toml``."""
    return TiedLanguageModel()


def tabular_mlp() -> nn.Module:
    """The model of ``examples/breast_cancer.toml``: 30 features, one hidden layer, one logit."""
    return nn.Sequential(nn.Linear(30, 32), nn.Tanh(), nn.Linear(32, 1))
