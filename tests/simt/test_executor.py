"""The SIMT executor itself: shared memory, barriers, warp shuffles/votes, atomics, error reporting, and the
emulated tensor-core (mma.sync, ldmatrix) and asynchronous-copy (cp.async) instructions.

Each test runs with both context-switch implementations (x86-64 assembly and the portable ucontext).
"""

import pytest
import torch

from simt_build import executor_ops


@pytest.fixture(params=[False, True], ids=["asm", "ucontext"], scope="module")
def ops(request):
    return executor_ops(use_ucontext=request.param)


@pytest.mark.parametrize("n,num_blocks", [(1, 1), (1000, 3), (12345, 8)])
def test_block_reduction_with_shared_memory(ops, n, num_blocks):
    x = torch.randn(n, dtype=torch.float64).float()
    partial = ops.block_sum(x, num_blocks)
    # Each block sums a grid-strided slice: compare per block, not only the total.
    idx = torch.arange(n)
    expected = torch.stack([x[(idx // 128) % num_blocks == b].sum() for b in range(num_blocks)])
    torch.testing.assert_close(partial, expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("threads_per_block", [32, 96])
def test_warp_shuffles_and_votes(ops, threads_per_block):
    x = torch.randn(2 * threads_per_block)
    out = ops.warp_ops(x, threads_per_block)
    w = x.view(-1, 32)
    lane = torch.arange(32)
    torch.testing.assert_close(out[:, 0].view(-1, 32), w.sum(1, keepdim=True).expand(-1, 32), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[:, 1].view(-1, 32), w.amax(1, keepdim=True).expand(-1, 32))
    torch.testing.assert_close(out[:, 2].view(-1, 32), w[:, 5:6].expand(-1, 32))
    down = torch.where(lane + 3 < 32, w[:, (lane + 3).clamp(max=31)], w)
    torch.testing.assert_close(out[:, 3].view(-1, 32), down)
    up = torch.where(lane % 8 >= 1, w[:, (lane - 1).clamp(min=0)], w)
    torch.testing.assert_close(out[:, 4].view(-1, 32), up)
    votes = (w > 0).sum(1, keepdim=True).float() + torch.where(lane == 0, 1000.0, 0.0)
    torch.testing.assert_close(out[:, 5].view(-1, 32), votes)


@pytest.mark.parametrize("bx,by", [(32, 1), (16, 4), (8, 9)])
def test_barriers_in_a_loop_2d_block_dynamic_smem(ops, bx, by):
    x = torch.randint(-100, 100, (3 * bx * by,), dtype=torch.int32)
    out = ops.block_scan_2d(x, bx, by)
    expected = x.view(3, -1).cumsum(1, dtype=torch.int32).view(-1)
    assert torch.equal(out, expected)


def test_atomics_across_concurrent_blocks(ops):
    values = torch.randint(0, 17, (20000,), dtype=torch.int32)
    counts, weights, max_value = ops.histogram(values, 17, 16)
    expected = torch.bincount(values.long(), minlength=17).int()
    assert torch.equal(counts, expected)
    torch.testing.assert_close(weights, expected.float() * 0.5)
    assert max_value.item() == values.max().item()


def test_returned_threads_leave_later_barriers(ops):
    out = ops.early_exit()
    assert torch.equal(out[:40], torch.full((40,), 40, dtype=torch.int32))
    assert torch.equal(out[40:], torch.full((24,), -1, dtype=torch.int32))


def test_divergent_syncthreads_is_reported(ops):
    with pytest.raises(RuntimeError, match="divergent barrier"):
        ops.divergent_barrier()


def test_divergent_shuffle_is_reported(ops):
    with pytest.raises(RuntimeError, match="warp operation"):
        ops.divergent_shuffle()


def test_executor_still_works_after_an_error(ops):
    with pytest.raises(RuntimeError):
        ops.divergent_barrier()
    x = torch.randn(500)
    torch.testing.assert_close(ops.block_sum(x, 1), x.sum().view(1), rtol=1e-5, atol=1e-4)


def test_cp_async_lands_only_at_its_wait_group(ops):
    src = torch.arange(32 * 3 * 4, dtype=torch.int32)
    out = ops.async_copy(src)  # [phase, thread, chunk, 4]
    want = src.view(32, 3, 4)
    stale = torch.full((32, 4), -1, dtype=torch.int32)
    assert torch.equal(out[0], torch.full((32, 3, 4), -1, dtype=torch.int32))  # nothing before a wait
    assert torch.equal(out[1, :, 0], want[:, 0]) and torch.equal(out[1, :, 1], stale)  # wait_group 2: oldest
    assert torch.equal(out[2, :, 1], want[:, 1]) and torch.equal(out[2, :, 2], stale)
    assert torch.equal(out[3, :, 2], torch.zeros(32, 4, dtype=torch.int32))  # src-size 0 zero-fills


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mma_tile_with_ldmatrix_operands(ops, dtype):
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(16, 32, generator=gen).to(dtype)
    b = torch.randn(32, 16, generator=gen).to(dtype)
    out = ops.mma_tile(a, b)
    want = a.double() @ b.double()  # 16-bit products are exact in fp32; only the fp32 sums round
    torch.testing.assert_close(out[0].double(), want, rtol=1e-5, atol=1e-5)  # B as [n][k] (the K path)
    torch.testing.assert_close(out[1].double(), want, rtol=1e-5, atol=1e-5)  # B as [k][n], .trans (the V path)
