"""Block-causal attention with a CPU backward, for machines without CUDA.

torchtitan's language models mask attention per document (positions reset to 0
at each document start). FlexAttention implements that but has no CPU backward;
this module computes the same mask densely and calls SDPA. It reuses the
varlen metadata path, so torchtitan builds its masks unchanged.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torchtitan.models.common.attention import VarlenAttention, VarlenMetadata


def document_causal_mask(cu_seqlens: torch.Tensor, batch: int, seq_len: int) -> torch.Tensor:
    """Boolean mask [batch, 1, seq_len, seq_len]: True where query i may attend key j.

    `cu_seqlens` holds the document start offsets of the batch packed into one
    sequence of batch*seq_len tokens, ending with batch*seq_len.
    """
    tokens = torch.arange(batch * seq_len, device=cu_seqlens.device)
    document = torch.searchsorted(cu_seqlens[1:-1], tokens, right=True).view(batch, seq_len)
    same_document = document.unsqueeze(2) == document.unsqueeze(1)
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=cu_seqlens.device).tril()
    return (same_document & causal).unsqueeze(1)


class DenseDocumentAttention(VarlenAttention):
    """Per-document causal attention through `scaled_dot_product_attention`."""

    @dataclass(kw_only=True, slots=True)
    class Config(VarlenAttention.Config):
        pass

    def __init__(self, config: Config) -> None:
        super(VarlenAttention, self).__init__()
        self.window_size = config.window_size

    def forward(
        self,
        q_BLNH: torch.Tensor,
        k_BLNH: torch.Tensor,
        v_BLNH: torch.Tensor,
        *,
        attention_masks: VarlenMetadata,
        scale: float | None = None,
        enable_gqa: bool = False,
        **kwargs,
    ) -> torch.Tensor:
        batch, seq_len = q_BLNH.shape[:2]
        mask = document_causal_mask(attention_masks.cu_seq_q, batch, seq_len)
        out_BNLH = F.scaled_dot_product_attention(
            q_BLNH.transpose(1, 2),
            k_BLNH.transpose(1, 2),
            v_BLNH.transpose(1, 2),
            attn_mask=mask,
            scale=scale,
            enable_gqa=enable_gqa,
        )
        return out_BNLH.transpose(1, 2)
