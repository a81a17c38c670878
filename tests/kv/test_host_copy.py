"""Host-to-device copies of block runs (kv/host_copy.py) and the runs LayerStream copies (kv/layer_stream.py)."""
import pytest
import torch

from kvboost.kv.host_copy import RowCopier, row_copier
from kvboost.kv.layer_stream import consecutive_runs


def test_consecutive_runs_split_where_ids_jump():
    assert consecutive_runs([]) == []
    assert consecutive_runs([5, 6, 7, 2]) == [(0, 5, 3), (3, 2, 1)]
    assert consecutive_runs([3, 2, 1]) == [(0, 3, 1), (1, 2, 1), (2, 1, 1)]
    assert consecutive_runs([0, 1, 3, 4, 5]) == [(0, 0, 2), (2, 3, 3)]


def _block_major(blocks: int = 7, layers: int = 3) -> torch.Tensor:
    """[blocks, layers, 2, heads, tokens, dim] like a host BlockPool's storage, distinct values everywhere."""
    n = blocks * layers * 2 * 2 * 4 * 8
    return torch.arange(n, dtype=torch.float32).reshape(blocks, layers, 2, 2, 4, 8).to(torch.bfloat16)


def test_per_row_copier_copies_every_row_of_a_strided_run():
    storage = _block_major()
    copier = RowCopier.per_row()
    dst = torch.empty(3, *storage.shape[2:], dtype=storage.dtype)
    copier.copy_rows(dst, storage[2:5, 1])
    assert torch.equal(dst, storage[2:5, 1]) and copier.status == "one copy per block"


def test_strided_copies_to_cuda_equal_per_block_copies(device):
    if device.type != "cuda":
        pytest.skip("cudaMemcpy2DAsync copies pinned host memory to a CUDA device")
    storage = _block_major(blocks=40, layers=5).pin_memory()
    copier = row_copier()
    for start, k, layer in ((0, 40, 0), (3, 17, 4), (39, 1, 2)):
        dst = torch.empty(k, *storage.shape[2:], dtype=storage.dtype, device=device)
        copier.copy_rows(dst, storage[start:start + k, layer])
        torch.cuda.synchronize(device)
        assert torch.equal(dst.cpu(), storage[start:start + k, layer])
    assert copier.status == "one cudaMemcpy2DAsync per run of blocks", copier.status
