"""Position-type schedules."""

import pytest
import torch

from structlm.nn import BlockSchedule, CyclicSchedule, TableSchedule, get_schedule


def test_cyclic_and_paper_block() -> None:
    p = torch.arange(2000)
    assert torch.equal(CyclicSchedule(4)(p), p % 4)
    paper = get_schedule("block", 4)
    assert paper == BlockSchedule(4, 192) and paper.period == 768
    assert torch.equal(paper(p), (p % 768) // 192)
    assert torch.equal(get_schedule("block:5", 3)(p), (p % 15) // 5)
    assert torch.equal(get_schedule("block:5:10", 3)(p), (p % 10) // 5)
    with pytest.raises(ValueError, match="at most q=2 blocks"):
        BlockSchedule(2, 5, 15)
    with pytest.raises(ValueError, match="multiple of block 5"):
        BlockSchedule(4, 5, 12)


def test_absolute_positions_chunking() -> None:
    sched = BlockSchedule(4, 7)
    full = sched(torch.arange(100))
    chunks = torch.cat([sched(torch.arange(a, min(a + 13, 100))) for a in range(0, 100, 13)])
    assert torch.equal(full, chunks)


def test_table_and_errors() -> None:
    t = get_schedule("table:0,2,1", 3)
    assert isinstance(t, TableSchedule)
    assert t(torch.arange(6)).tolist() == [0, 2, 1, 0, 2, 1]
    assert get_schedule([1, 0], 2)(torch.arange(3)).tolist() == [1, 0, 1]
    with pytest.raises(ValueError, match=r"outside \[0, 2\)"):
        get_schedule("table:0,2", 2)
    with pytest.raises(ValueError, match="unknown schedule 'zigzag'"):
        get_schedule("zigzag", 4)
    with pytest.raises(ValueError, match="positions must be >= 0"):
        CyclicSchedule(2)(torch.tensor([-1, 0]))
    with pytest.raises(TypeError, match="integers"):
        CyclicSchedule(2)(torch.tensor([0.5]))
    with pytest.raises(ValueError, match="schedule has q=2"):
        get_schedule(CyclicSchedule(2), 4)
