"""fw's block tables as FlashInfer's paged-KV description, computed on the host.

FlashInfer plans a step from three host arrays (CSR over the batch)::

    seq_lens    [12, 21, 2]            block_size 8
    pages       [ 2,  3, 1]            ceil(seq_len / block_size)
    indptr      [0, 2, 5, 6]           prefix sums of pages
    indices     [b00 b01 | b10 b11 b12 | b20]   the first ``pages[r]`` entries of each table row
    last_len    [ 4,  5, 2]            tokens in each request's last page
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class PagedKV(NamedTuple):
    """FlashInfer's ``(indptr, indices, last_page_len)``, int32 host tensors."""

    indptr: torch.Tensor
    indices: torch.Tensor
    last_page_len: torch.Tensor


def paged_kv_from_block_table(seq_lens: torch.Tensor, block_table: torch.Tensor, block_size: int) -> PagedKV:
    """Describe the pages of ``seq_lens`` tokens per request held in ``block_table`` rows (host tensors)."""
    seq_lens = seq_lens.to(torch.int32)
    pages = (seq_lens + block_size - 1) // block_size
    indptr = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    torch.cumsum(pages, 0, out=indptr[1:])
    used = torch.arange(block_table.shape[1]).unsqueeze(0) < pages.unsqueeze(1)
    indices = block_table.to(torch.int32)[used]
    last_page_len = seq_lens - (pages - 1) * block_size
    return PagedKV(indptr, indices, last_page_len)
