"""Triton paged decode attention and K/V write against torch on random paged caches (Triton's
interpreter on a CPU, natively on a GPU with ``-m triton``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.kernel_env import kernel_device, triton_runs

pytestmark = [
    pytest.mark.triton,
    pytest.mark.skipif(not triton_runs(), reason="Triton cannot run here"),
]
DEV = kernel_device()


@pytest.mark.parametrize(("heads", "kv_heads", "dim", "bs"), [(4, 2, 16, 4), (6, 6, 24, 8)])
def test_paged_decode_attention_matches_sdpa(heads, kv_heads, dim, bs) -> None:
    from engramrt.kernels.paged_attention import paged_decode_attention

    g = torch.Generator().manual_seed(heads * dim)
    num_blocks, batch = 40, 5
    k_cache = torch.randn(num_blocks * bs, kv_heads, dim, generator=g)
    v_cache = torch.randn(num_blocks * bs, kv_heads, dim, generator=g)
    lens = torch.tensor([1, bs, bs + 1, 3 * bs - 1, 17])
    perm = torch.randperm(num_blocks, generator=g)
    max_blocks = int(-(-lens.max() // bs))
    tables = perm[: batch * max_blocks].view(batch, max_blocks)
    q = torch.randn(batch, heads, dim, generator=g)
    got = paged_decode_attention(q.to(DEV), k_cache.to(DEV), v_cache.to(DEV), tables.to(DEV),
                                 lens.to(DEV), bs).cpu()  # fmt: skip
    for b in range(batch):
        pos = torch.arange(int(lens[b]))
        rows = tables[b][pos // bs] * bs + pos % bs
        want = F.scaled_dot_product_attention(
            q[b][:, None], k_cache[rows].transpose(0, 1), v_cache[rows].transpose(0, 1),
            enable_gqa=True,
        )[:, 0]  # fmt: skip
        torch.testing.assert_close(got[b], want, rtol=1e-5, atol=1e-5)


def test_write_kv_scatters_rows() -> None:
    from engramrt.kernels.paged_attention import write_kv

    g = torch.Generator().manual_seed(0)
    kc, vc = torch.zeros(32, 2, 8), torch.zeros(32, 2, 8)
    k, v = torch.randn(5, 2, 8, generator=g), torch.randn(5, 2, 8, generator=g)
    slots = torch.tensor([3, 17, 0, 31, 8])
    kd, vd = kc.to(DEV), vc.to(DEV)
    write_kv(k.to(DEV), v.to(DEV), kd, vd, slots.to(DEV))
    kc[slots], vc[slots] = k, v
    assert torch.equal(kd.cpu(), kc) and torch.equal(vd.cpu(), vc)
