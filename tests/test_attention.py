"""The CPU attention equals per-document causal attention computed the slow way."""

from __future__ import annotations

import torch
from torchtitan.models.common.attention import create_varlen_metadata_for_document

from titan_async.model.attention import DenseDocumentAttention, document_causal_mask


def reference_mask(positions: torch.Tensor) -> torch.Tensor:
    batch, seq_len = positions.shape
    mask = torch.zeros(batch, 1, seq_len, seq_len, dtype=torch.bool)
    for b in range(batch):
        document = torch.cumsum((positions[b] == 0).long(), 0)
        for i in range(seq_len):
            for j in range(i + 1):
                mask[b, 0, i, j] = bool(document[i] == document[j])
    return mask


def test_mask_matches_documents_from_positions():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2], [3, 4, 5, 6, 0, 1, 2, 3]])
    metadata = create_varlen_metadata_for_document(positions)
    assert torch.equal(document_causal_mask(metadata.cu_seq_q, 2, 8), reference_mask(positions))


def test_attention_output_matches_explicit_softmax():
    torch.manual_seed(0)
    positions = torch.tensor([[0, 1, 2, 3, 0, 1], [0, 1, 0, 1, 2, 3]])
    q, k, v = (torch.randn(2, 6, 4, 8, dtype=torch.float64) for _ in range(3))
    attention = DenseDocumentAttention.Config().build()
    out = attention(q, k, v, attention_masks=create_varlen_metadata_for_document(positions))

    scores = torch.einsum("blnh,bmnh->bnlm", q, k) / 8**0.5
    scores = scores.masked_fill(~reference_mask(positions), float("-inf"))
    expected = torch.einsum("bnlm,bmnh->blnh", scores.softmax(-1), v)
    torch.testing.assert_close(out, expected)
