"""ElasticSampler: exactly-once data across resizes and restores."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic_train.errors import ConfigError
from elastic_train.training.sampler import ElasticSampler


def _restore(state: dict, *, dataset_len: int, global_batch_size: int) -> ElasticSampler:
    """A fresh sampler from a state that went through JSON, as a new process would see it."""
    sampler = ElasticSampler(dataset_len, global_batch_size=global_batch_size, seed=12345)
    sampler.load_state_dict(json.loads(json.dumps(state)))
    return sampler


def _run_step(sampler: ElasticSampler, world_size: int) -> list[int]:
    batch = sampler.next_global_batch()
    shards = [ElasticSampler.shard(batch, rank, world_size) for rank in range(world_size)]
    sizes = [len(s) for s in shards]
    assert max(sizes) - min(sizes) <= 1
    assert [i for s in shards for i in s] == batch
    return [i for s in shards for i in s]


segments = st.lists(
    st.tuples(
        st.sampled_from([1, 2, 3, 4, 5, 8]),  # world size
        st.integers(min_value=0, max_value=6),  # steps before the next restore
        st.integers(min_value=1, max_value=17),  # global batch size after the restore
    ),
    min_size=1,
    max_size=6,
)


@settings(max_examples=150, deadline=None)
@given(
    dataset_len=st.integers(min_value=1, max_value=120),
    seed=st.integers(min_value=0, max_value=2**31),
    plan=segments,
)
def test_resizes_and_restores_consume_each_sample_exactly_once(
    dataset_len: int, seed: int, plan: list[tuple[int, int, int]]
) -> None:
    # Changing the global batch size across restores puts the restore points at
    # arbitrary sample positions, not only at multiples of one batch size.
    state = {"seed": seed, "epoch": 3, "samples_consumed": 0}
    consumed: list[int] = []
    world_size = 1
    for world_size, steps, batch in plan:
        sampler = _restore(state, dataset_len=dataset_len, global_batch_size=batch)
        for _ in range(steps):
            if sampler.epoch_finished():
                break
            consumed += _run_step(sampler, world_size)
        state = sampler.state_dict()
    sampler = _restore(state, dataset_len=dataset_len, global_batch_size=plan[-1][2])
    while not sampler.epoch_finished():
        consumed += _run_step(sampler, world_size)
    assert sorted(consumed) == list(range(dataset_len))
    assert consumed == sampler.permutation(3).tolist()


def test_resize_4_3_1_2_matches_the_epoch_permutation() -> None:
    sampler = ElasticSampler(50, global_batch_size=7, seed=0)
    consumed: list[int] = []
    for world_size in (4, 3, 1, 2):
        sampler = _restore(sampler.state_dict(), dataset_len=50, global_batch_size=7)
        for _ in range(2):
            consumed += _run_step(sampler, world_size)
    while not sampler.epoch_finished():
        consumed += _run_step(sampler, 2)
    assert Counter(consumed) == Counter(range(50))
    assert consumed == sampler.permutation(0).tolist()


def test_last_batch_of_an_epoch_is_short_and_next_epoch_reshuffles() -> None:
    sampler = ElasticSampler(10, global_batch_size=4, seed=1)
    sizes = []
    while not sampler.epoch_finished():
        sizes.append(len(sampler.next_global_batch()))
    assert sizes == [4, 4, 2]
    with pytest.raises(RuntimeError, match="start_next_epoch"):
        sampler.next_global_batch()
    sampler.start_next_epoch()
    assert sampler.state_dict() == {"seed": 1, "epoch": 1, "samples_consumed": 0}
    assert not torch.equal(sampler.permutation(0), sampler.permutation(1))


def test_permutation_depends_only_on_seed_and_epoch() -> None:
    a = ElasticSampler(100, global_batch_size=3, seed=7)
    b = ElasticSampler(100, global_batch_size=50, seed=7)
    torch.manual_seed(999)  # the global generator must not matter
    assert torch.equal(a.permutation(2), b.permutation(2))
    assert not torch.equal(
        a.permutation(2), ElasticSampler(100, global_batch_size=3, seed=8).permutation(2)
    )
    # (seed, epoch) pairs that plain addition would confuse get different orders
    assert not torch.equal(
        ElasticSampler(100, global_batch_size=3, seed=1).permutation(0),
        ElasticSampler(100, global_batch_size=3, seed=0).permutation(1),
    )


def test_shard_is_contiguous_and_balanced() -> None:
    batch = list(range(10, 20))
    assert [ElasticSampler.shard(batch, r, 3) for r in range(3)] == [
        [10, 11, 12, 13],
        [14, 15, 16],
        [17, 18, 19],
    ]
    # world size larger than the batch: some ranks get nothing, nothing is duplicated
    assert [ElasticSampler.shard([5, 6], r, 3) for r in range(3)] == [[5], [6], []]


def test_state_dict_is_exactly_the_global_position() -> None:
    sampler = ElasticSampler(10, global_batch_size=4, seed=3)
    sampler.next_global_batch()
    assert sampler.state_dict() == {"seed": 3, "epoch": 0, "samples_consumed": 4}


@pytest.mark.parametrize(
    ("state", "field"),
    [
        ({"seed": 1, "epoch": 0}, "exactly the keys"),
        ({"seed": 1, "epoch": 0, "samples_consumed": 0, "world_size": 2}, "exactly the keys"),
        ({"seed": 1, "epoch": -1, "samples_consumed": 0}, "'epoch'"),
        ({"seed": 1, "epoch": 0, "samples_consumed": 11}, "'samples_consumed' is 11"),
        ({"seed": "1", "epoch": 0, "samples_consumed": 0}, "'seed'"),
    ],
)
def test_bad_state_is_rejected_naming_the_field(state: dict, field: str) -> None:
    sampler = ElasticSampler(10, global_batch_size=4, seed=1)
    with pytest.raises(ConfigError, match=field):
        sampler.load_state_dict(state)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"dataset_len": 0, "global_batch_size": 1, "seed": 0}, "dataset_len"),
        ({"dataset_len": 5, "global_batch_size": 0, "seed": 0}, "global_batch_size"),
        ({"dataset_len": 5, "global_batch_size": 1, "seed": -1}, "seed"),
    ],
)
def test_bad_constructor_arguments_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        ElasticSampler(kwargs.pop("dataset_len"), **kwargs)


def test_shard_rejects_a_rank_outside_the_world() -> None:
    with pytest.raises(ConfigError, match=r"rank must be an integer in \[0, 2\)"):
        ElasticSampler.shard([1, 2, 3], 2, 2)
