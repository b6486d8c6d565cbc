"""The word-level LSTM language model of the LSTM benchmarks."""

from __future__ import annotations

import torch
import torch.nn as nn

Hidden = tuple[torch.Tensor, torch.Tensor]


class LSTMLanguageModel(nn.Module):
    """Embedding, a stack of LSTM layers and a linear decoder over the vocabulary, with dropout
    on the embeddings, between LSTM layers and before the decoder. ``tied``: the decoder reuses
    the embedding matrix (which needs ``emb == hidden``). The benchmarks' model is 3 layers of
    650 units, tied, dropout 0.4 (28,949,319 parameters with their 28,869-word vocabulary).

    Input and output are time-major: tokens (T, B) -> logits (T, B, vocabulary); the state is
    the LSTM's (h, c), each (layers, B, hidden)."""

    def __init__(
        self,
        vocab_size: int,
        emb: int = 650,
        hidden: int = 650,
        layers: int = 3,
        dropout: float = 0.4,
        tied: bool = True,
    ):
        super().__init__()
        if tied and emb != hidden:
            raise ValueError(f"tied weights need --emb equal to --hidden (got {emb} and {hidden}); or pass --no-tied")
        if layers < 1:
            raise ValueError(f"--layers must be at least 1, got {layers}")
        self.vocab_size, self.hidden_size, self.num_layers = vocab_size, hidden, layers
        self.embedding = nn.Embedding(vocab_size, emb)
        self.dropout = nn.Dropout(dropout)
        self.lstm = nn.LSTM(emb, hidden, layers, dropout=dropout if layers > 1 else 0.0)
        self.decoder = nn.Linear(hidden, vocab_size)
        nn.init.uniform_(self.embedding.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)
        if tied:
            self.decoder.weight = self.embedding.weight
        else:
            nn.init.uniform_(self.decoder.weight, -0.1, 0.1)

    def initial_state(self, batch_size: int, device: torch.device | None = None) -> Hidden:
        shape = (self.num_layers, batch_size, self.hidden_size)
        return torch.zeros(shape, device=device), torch.zeros(shape, device=device)

    def forward(self, tokens: torch.Tensor, state: Hidden | None = None) -> tuple[torch.Tensor, Hidden]:
        if state is None:
            state = self.initial_state(tokens.shape[1], tokens.device)
        x = self.dropout(self.embedding(tokens))
        out, state = self.lstm(x, state)
        return self.decoder(self.dropout(out)), state
