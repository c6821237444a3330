"""The engine-independent parts of data parallelism (``lora_core.train.distributed``): who a process
is, how a global batch is cut, which dropout rows a rank gets, agreement between ranks and the
merge of beam outputs. Several ranks are simulated in one process with a fake all-reduce."""

from __future__ import annotations

import threading
import types

import numpy as np
import pytest

from lora_core.data.batching import collate
from lora_core.lora.dropout import NumpyDropout
from lora_core.train.distributed import (
    Comm,
    DistributedError,
    ShardedDropout,
    World,
    check_shardable,
    discover_world,
    pack_outputs,
    pick_loss,
    run_hash,
    shard_range,
    shard_step,
    unpack_outputs,
)


def _pairs(n=11, seed=0):
    rng = np.random.default_rng(seed)
    return [
        (list(rng.integers(1, 50, rng.integers(1, 6))), list(rng.integers(1, 50, rng.integers(1, 5)))) for _ in range(n)
    ]


def test_pick_loss_maps_the_choice_to_the_backend_loss():
    def lm(model, batch, label_smooth):
        return ("lm", model, batch, label_smooth)

    def cls(model, batch):
        return ("cls", model, batch)

    assert pick_loss("lm", lm, cls) is lm
    assert pick_loss("cls", lm, cls)("m", "b", 0.1) == ("cls", "m", "b")  # no label smoothing for classifiers
    with pytest.raises(ValueError, match=r"loss must be one of \['cls', 'lm'\], got 'mse'"):
        pick_loss("mse", lm, cls)


def test_discover_world():
    assert discover_world({}) == World()
    w = discover_world({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1"})
    assert (w.rank, w.size, w.local_rank, w.launcher, w.is_main, w.parallel) == (1, 4, 1, "torchrun", False, True)
    w = discover_world({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0"})
    assert (w.rank, w.size, w.launcher) == (0, 2, "mpirun")
    with pytest.raises(ValueError, match="RANK=2, WORLD_SIZE=2"):
        discover_world({"RANK": "2", "WORLD_SIZE": "2"})
    with pytest.raises(ValueError, match="WORLD_SIZE='two'"):
        discover_world({"RANK": "0", "WORLD_SIZE": "two"})


@pytest.mark.parametrize("n,size", [(10, 3), (7, 7), (5, 2), (0, 3), (8, 4)])
def test_shard_range_matches_array_split(n, size):
    parts = np.array_split(np.arange(n), size)
    for r in range(size):
        a, b = shard_range(n, size, r)
        assert list(range(a, b)) == list(parts[r])


@pytest.mark.parametrize("size,grad_accum", [(1, 1), (2, 1), (2, 2), (3, 2)])
def test_shards_cover_the_global_batch_and_weights_sum_to_one(size, grad_accum):
    pairs, idx = _pairs(), np.array([9, 2, 5, 0, 7, 3, 10])
    shards = [shard_step(idx, pairs, grad_accum, World(r, size)) for r in range(size)]
    micro = np.array_split(idx, grad_accum)
    for k, chunk in enumerate(micro):  # each micro-batch is the ranks' shards, in order
        assert np.concatenate([s.chunks[k] for s in shards]).tolist() == chunk.tolist()
        positions = sum(len(pairs[i][1]) for i in chunk)
        for s in shards:
            assert s.weights[k] == pytest.approx(sum(len(pairs[i][1]) for i in s.chunks[k]) / positions / len(micro))
    assert sum(sum(s.weights) for s in shards) == pytest.approx(1.0)
    tokens = sum(int(collate([pairs[i] for i in idx])["n_tokens"]) for _ in [0])
    assert all(s.tokens == tokens and s.examples == len(idx) for s in shards)


def test_empty_shard_is_refused():
    with pytest.raises(ValueError, match="cannot give each of 3 processes one"):
        shard_step(np.arange(4), _pairs(), 2, World(2, 3))
    check_shardable(48, 10, 2, "keep", 2)  # micro-batches of 5 and (last batch 8) 4
    with pytest.raises(ValueError, match="3 processes cannot share a batch of 10 examples in 4 micro-batch"):
        check_shardable(48, 10, 4, "drop", 3)
    with pytest.raises(ValueError, match="last batch of an epoch has 1"):
        check_shardable(41, 10, 1, "keep", 2)
    check_shardable(41, 10, 1, "drop", 2)


def test_sharded_dropout_gives_each_rank_its_rows_of_the_one_process_masks():
    """Two LoRA layers (widths 3 and 5) per forward, two micro-batches: the masks a rank gets
    are the rows of its examples' packed tokens in the one-process masks."""
    pairs, idx, p = _pairs(), np.array([4, 1, 8, 6, 2]), 0.5
    micro = np.array_split(idx, 2)
    ref = NumpyDropout(3)
    ref.reseed(7)
    full = [[ref.mask((int(collate([pairs[i] for i in c])["n_tokens"]), w), p) for w in (3, 5)] for c in micro]
    for size in (2, 3):
        got = [[[], []] for _ in micro]
        for r in range(size):
            shard = shard_step(idx, pairs, 2, World(r, size)) if all(len(c) >= size for c in micro) else None
            if shard is None:
                continue
            d = ShardedDropout(3)
            d.reseed(7)
            d.plan(shard.dropout_rows, calls=2)
            for k, c in enumerate(shard.chunks):
                n = int(collate([pairs[i] for i in c])["n_tokens"])
                for j, w in enumerate((3, 5)):
                    got[k][j].append(d.mask((n, w), p))
            with pytest.raises(RuntimeError, match="past the plan"):
                d.mask((1, 3), p)
        if got[0][0]:
            for k in range(len(micro)):
                for j in range(2):
                    np.testing.assert_array_equal(np.concatenate(got[k][j]), full[k][j])


class _FakeJob:
    """``size`` ranks as threads of this process; their all-reduce adds the values every
    rank passed (a barrier before and after), as the engines do."""

    def __init__(self, size):
        self.size = size

    def run(self, fn):
        """``fn(comm)`` on every rank; returns each rank's result or exception."""
        slots, barrier, results = [None] * self.size, threading.Barrier(self.size, timeout=10), [None] * self.size

        def all_reduce_sum(rank, x):
            slots[rank] = np.array(x)
            barrier.wait()
            total = np.sum(slots, axis=0)
            barrier.wait()
            return total

        def rank_main(rank):
            ops = types.SimpleNamespace(all_reduce_sum=lambda x: all_reduce_sum(rank, x))
            try:
                results[rank] = fn(Comm(World(rank, self.size), ops))
            except Exception as e:  # noqa: BLE001 - the test looks at it
                results[rank] = e

        threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return results


def test_comm_agreement_and_errors():
    job = _FakeJob(3)
    assert [r.tolist() for r in job.run(lambda c: c.all_gather([c.world.rank, 7]))] == [[[0, 7], [1, 7], [2, 7]]] * 3
    assert job.run(lambda c: c.broadcast_text(f"from rank {c.world.rank}")) == ["from rank 0"] * 3
    assert job.run(lambda c: c.on_main(lambda: 5)) == [5, None, None]

    def fail():
        raise ValueError("bad folder")

    out = job.run(lambda c: c.on_main(fail))
    assert isinstance(out[0], ValueError) and str(out[0]) == "bad folder"
    assert all(isinstance(e, DistributedError) and "rank 0 failed: ValueError: bad folder" in str(e) for e in out[1:])
    same = run_hash({"a": 1}, "torch")
    assert job.run(lambda c: c.check_same("config", same)) == [None] * 3
    other = run_hash({"a": 2}, "torch")
    out = job.run(lambda c: c.check_same("config", other if c.world.rank == 2 else same))
    assert all(isinstance(e, DistributedError) and "rank(s) [2]" in str(e) for e in out)


def test_beam_outputs_merge_in_input_order():
    outputs = [[5, 6, 7], [], [1], [9, 9, 9, 9], [2, 3]]
    total, size = len(outputs), 2
    bufs = []
    for r in range(size):
        a, b = shard_range(total, size, r)
        bufs.append(pack_outputs(outputs[a:b], a, total, 4))
    assert unpack_outputs(np.sum(bufs, axis=0)) == outputs
    assert Comm().all_reduce_sum([1.5]).tolist() == [1.5]
    with pytest.raises(ValueError, match="needs the backend"):
        Comm(World(0, 2))
