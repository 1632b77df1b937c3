"""FreeKVCacheBlockQueue against a plain-list model under random operations."""

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvoffload.blocks import FreeKVCacheBlockQueue, KVCacheBlock

N = 12


class FreeQueueMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = [KVCacheBlock(i) for i in range(N)]
        self.queue = FreeKVCacheBlockQueue(self.blocks)
        self.model: list[int] = list(range(N))

    def _out(self) -> list[int]:
        return [i for i in range(N) if i not in self.model]

    @rule()
    def popleft(self) -> None:
        if not self.model:
            with pytest.raises(ValueError):
                self.queue.popleft()
            return
        assert self.queue.popleft().block_id == self.model.pop(0)

    @rule(n=st.integers(0, N + 2))
    def popleft_n(self, n: int) -> None:
        if n > len(self.model):
            with pytest.raises(ValueError):
                self.queue.popleft_n(n)
            return
        got = [b.block_id for b in self.queue.popleft_n(n)]
        assert got == self.model[:n]
        del self.model[:n]

    @rule(i=st.integers(0, N - 1))
    def remove(self, i: int) -> None:
        if i in self.model:
            self.queue.remove(self.blocks[i])
            self.model.remove(i)
        else:
            with pytest.raises(ValueError):
                self.queue.remove(self.blocks[i])

    @rule(i=st.integers(0, N - 1))
    def append(self, i: int) -> None:
        if i in self.model:
            with pytest.raises(ValueError):
                self.queue.append(self.blocks[i])
        else:
            self.queue.append(self.blocks[i])
            self.model.append(i)

    @precondition(lambda self: len(self.model) < N)
    @rule(data=st.data())
    def append_n(self, data: st.DataObject) -> None:
        out = self._out()
        chosen = data.draw(st.permutations(out)).copy()
        k = data.draw(st.integers(0, len(chosen)))
        chosen = chosen[:k]
        self.queue.append_n([self.blocks[i] for i in chosen])
        self.model.extend(chosen)

    @rule(i=st.one_of(st.none(), st.integers(0, N - 1)))
    def iter_after(self, i: int | None) -> None:
        if i is None:
            expected = self.model
            got = [b.block_id for b in self.queue.iter_blocks_after(None)]
        elif i in self.model:
            expected = self.model[self.model.index(i) + 1 :]
            got = [b.block_id for b in self.queue.iter_blocks_after(self.blocks[i])]
        else:
            with pytest.raises(ValueError):
                self.queue.iter_blocks_after(self.blocks[i])
            return
        assert got == expected

    @invariant()
    def same_as_model(self) -> None:
        assert self.queue.num_free_blocks == len(self.model)
        assert [b.block_id for b in self.queue.get_all_free_blocks()] == self.model
        for i in range(N):
            assert (self.blocks[i] in self.queue) == (i in self.model)


TestFreeQueueStateful = FreeQueueMachine.TestCase
TestFreeQueueStateful.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
