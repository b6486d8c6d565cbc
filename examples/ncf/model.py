"""NeuMF: generalized matrix factorization and a multi-layer perceptron side by side."""

from __future__ import annotations

import itertools

import torch
import torch.nn as nn


class NeuMF(nn.Module):
    """Scores (user, item) pairs with one logit.

    GMF branch: the element-wise product of ``factors``-wide user and item embeddings. MLP branch:
    user and item embeddings of ``layers[0] / 2`` each, concatenated and passed through linear
    layers ``layers[0] -> layers[1] -> ... -> layers[-1]``, each followed by ReLU and dropout. A
    final linear layer maps both branches' outputs, concatenated, to the logit. With 138,493 users,
    26,744 items, factors 64 and layers (256, 256, 128, 64) (MovieLens-20M) it has 31,832,577
    parameters."""

    def __init__(
        self,
        n_users: int,
        n_items: int,
        factors: int = 64,
        layers: tuple[int, ...] = (256, 256, 128, 64),
        dropout: float = 0.5,
    ):
        super().__init__()
        if len(layers) < 1 or layers[0] % 2:
            raise ValueError(f"layers {layers}: the first size is the two MLP embeddings side by side, so it is even")
        self.gmf_user = nn.Embedding(n_users, factors)
        self.gmf_item = nn.Embedding(n_items, factors)
        self.mlp_user = nn.Embedding(n_users, layers[0] // 2)
        self.mlp_item = nn.Embedding(n_items, layers[0] // 2)
        blocks: list[nn.Module] = []
        for width_in, width_out in itertools.pairwise(layers):
            blocks += [nn.Linear(width_in, width_out), nn.ReLU()]
            if dropout > 0:
                blocks.append(nn.Dropout(dropout))
        self.mlp = nn.Sequential(*blocks)
        self.output = nn.Linear(factors + layers[-1], 1)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for embedding in (self.gmf_user, self.gmf_item, self.mlp_user, self.mlp_item):
            nn.init.normal_(embedding.weight, std=0.01)
        for module in self.mlp:
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                nn.init.zeros_(module.bias)
        nn.init.kaiming_uniform_(self.output.weight, a=1.0)  # LeCun uniform: the output has no ReLU
        nn.init.zeros_(self.output.bias)

    def forward(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        gmf = self.gmf_user(users) * self.gmf_item(items)
        mlp = self.mlp(torch.cat([self.mlp_user(users), self.mlp_item(items)], dim=-1))
        return self.output(torch.cat([gmf, mlp], dim=-1)).squeeze(-1)
