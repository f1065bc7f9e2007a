"""In-process checks of the reliability building blocks: the resumable sampler, the hang report's parts and the
listing of incomplete checkpoints."""

from __future__ import annotations

import os
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import DistributedSampler

from lightspeed.core.errors import CollectiveTimeoutError
from lightspeed.core.reliability.hang_report import (
    Heartbeat,
    StoreUnreachable,
    collective_name,
    describe_missing_ranks,
    heartbeat_interval,
    heartbeats,
    is_peer_lost,
    peer_lost_message,
    ranks_that_left,
    silent_ranks,
)
from lightspeed.core.reliability.last_checkpoint import describe_skipped, incomplete_checkpoints
from lightspeed.core.reliability.process_group import set_rendezvous_environment
from lightspeed.core.reliability.resumable_sampler import ResumableDistributedSampler


def _sampler(n: int, replicas: int, rank: int, batches_done: int = 0, **kwargs: object) -> ResumableDistributedSampler:
    return ResumableDistributedSampler(
        range(n),
        num_replicas=replicas,
        rank=rank,
        shuffle=kwargs.get("shuffle", True),  # type: ignore[arg-type]
        seed=3,
        drop_last=kwargs.get("drop_last", False),  # type: ignore[arg-type]
        batch_size=2,
        consumed_batches=lambda: batches_done,
    )


@pytest.mark.parametrize(("n", "replicas", "shuffle", "drop_last"), [(22, 4, True, False), (22, 3, False, True)])
def test_the_sampler_hands_out_exactly_what_distributed_sampler_does(
    n: int, replicas: int, shuffle: bool, drop_last: bool
) -> None:
    for epoch in (0, 5):
        for rank in range(replicas):
            ours = _sampler(n, replicas, rank, shuffle=shuffle, drop_last=drop_last)
            theirs = DistributedSampler(range(n), replicas, rank, shuffle=shuffle, seed=3, drop_last=drop_last)
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            assert list(ours) == list(theirs) and len(ours) == len(theirs)


@pytest.mark.parametrize("new_replicas", [2, 4, 3])
def test_a_restored_sampler_continues_the_epoch_on_any_number_of_ranks(new_replicas: int) -> None:
    n, old_replicas, batch = 48, 4, 2
    saved = _sampler(n, old_replicas, 0, batches_done=3)
    saved.set_epoch(1)
    state = saved.state_dict()
    assert state["samples_consumed"] == 3 * batch * old_replicas
    full = [list(_sampler_at(n, old_replicas, r, 1)) for r in range(old_replicas)]
    seen = {i for r in range(old_replicas) for i in full[r][: 3 * batch]}
    rest = []
    for rank in range(new_replicas):
        resumed = _sampler(n, new_replicas, rank)
        resumed.load_state_dict(state)
        resumed.set_epoch(1)
        rest += list(resumed)
        resumed.set_epoch(1)
        assert len(list(resumed)) == len(resumed)  # only the first iteration after a restore skips
    assert sorted(rest + sorted(seen)) == list(range(n))  # no sample twice, none skipped


def _sampler_at(n: int, replicas: int, rank: int, epoch: int) -> ResumableDistributedSampler:
    sampler = _sampler(n, replicas, rank)
    sampler.set_epoch(epoch)
    return sampler


def test_a_restored_position_is_dropped_when_the_epoch_moved_on() -> None:
    saved = _sampler(16, 2, 0, batches_done=8)
    state = saved.state_dict()  # end of epoch 0: Lightning resumes at epoch 1
    resumed = _sampler(16, 2, 0)
    resumed.load_state_dict(state)
    resumed.set_epoch(1)
    assert len(list(resumed)) == 8


def test_a_position_in_an_epoch_the_loop_counts_as_finished_is_dropped_with_a_warning() -> None:
    saved = _sampler(16, 2, 0, batches_done=1)  # `max_steps` ended epoch 0 after one batch; fit returned, then saved
    state = saved.state_dict()
    resumed = _sampler(16, 2, 0)
    resumed.load_state_dict(state)
    resumed.set_epoch(1)  # Lightning resumes at the next epoch
    with pytest.warns(UserWarning, match=r"stopped epoch 0 after 4 of its 16 samples, but training resumes at epoch 1"):
        assert len(list(resumed)) == 8


def test_a_restored_position_from_other_data_is_refused() -> None:
    state = _sampler(16, 2, 0).state_dict()
    with pytest.raises(ValueError, match="had 16 samples, this run's has 20"):
        _sampler(20, 2, 0).load_state_dict(state)


def test_the_collective_is_named_from_the_traceback() -> None:
    import torch.distributed as dist

    try:
        dist.all_reduce(torch.ones(1))  # no process group: raises inside torch.distributed.all_reduce
    except (RuntimeError, ValueError) as err:
        assert collective_name(err.__traceback__) == "`torch.distributed.all_reduce`", traceback.format_exc()
    try:
        raise RuntimeError("no collective")
    except RuntimeError as err:
        assert collective_name(err.__traceback__) is None


class _Store:
    """A dict with the two TCPStore calls the report uses; rank 1's counter never moves, rank 2's does."""

    def __init__(self) -> None:
        self.data = {"lightspeed/heartbeat/0": b"5|step 3", "lightspeed/heartbeat/1": b"7|step 2"}
        self.data["lightspeed/heartbeat/2"] = b"1|step 4"

    def check(self, keys: list[str]) -> bool:
        return all(k in self.data for k in keys)

    def get(self, key: str) -> bytes:
        return self.data[key]

    def tick(self, _: float) -> None:
        self.data["lightspeed/heartbeat/2"] = b"2|step 4"


def test_stopped_ranks_are_told_from_live_ones_by_their_heartbeat() -> None:
    store = _Store()
    stopped, notes = describe_missing_ranks(store, 4, 0, 0.5, "step 3", sleep=store.tick)
    assert stopped == [1, 3]
    assert notes == (
        "rank 1: no heartbeat for 1.0s (stopped, dead or hung in native code); rank 2: alive at step 4; "
        "rank 3: never sent a heartbeat"
    )
    assert heartbeat_interval(timedelta(seconds=8)) == 0.8 and heartbeat_interval(timedelta(minutes=30)) == 10.0


class _SlowStore:
    """A store whose writes take ``seconds`` (a store under load, or one whose server is going away)."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.writes, self.in_write = seconds, 0, threading.Event()

    def delete_key(self, key: str) -> bool:
        return False

    def set(self, key: str, value: str) -> None:
        self.in_write.set()
        time.sleep(self.seconds)
        self.writes += 1


def test_stopping_the_heartbeat_waits_for_the_write_in_progress() -> None:
    # at exit, a heartbeat thread still inside a native store write aborts the process once Python is finalizing
    store = _SlowStore(0.5)
    beat = Heartbeat(store, 0, interval=0.0).start()  # start() writes once itself, then the thread writes
    assert store.in_write.wait(5)
    store.in_write.clear()
    assert store.in_write.wait(5)  # the thread is inside a write
    beat.stop()
    assert not beat._thread.is_alive() and store.writes >= 2


def test_a_stopped_heartbeat_marks_its_rank_as_gone_until_it_starts_again() -> None:
    import torch.distributed as dist

    from _support.launch import free_port

    store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, timeout=timedelta(seconds=10))
    beats = [Heartbeat(store, rank, interval=30.0, position=lambda: "step 7").start() for rank in range(3)]
    assert ranks_that_left(store, 3, 0) == {}
    beats[1].stop()
    beats[2].stop()
    assert ranks_that_left(store, 3, 0) == {1: "step 7", 2: "step 7"}
    assert ranks_that_left(store, 3, 1) == {2: "step 7"}  # a rank never names itself
    beats[1] = Heartbeat(store, 1, interval=30.0).start()  # the same rank in a process group created again
    assert ranks_that_left(store, 3, 0) == {2: "step 7"}
    for beat in beats[:2]:
        beat.stop()


def test_a_rank_whose_heartbeat_stood_still_without_marking_its_exit_is_silent() -> None:
    import torch.distributed as dist

    from _support.launch import free_port

    store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, timeout=timedelta(seconds=10))
    beats = [Heartbeat(store, rank, interval=0.05, position=lambda: "step 6").start() for rank in range(3)]
    time.sleep(0.2)
    beats[2]._stop.set()  # as SIGKILL ends it: no last write marks the exit
    beats[2]._thread.join()
    before = heartbeats(store, 3)
    time.sleep(0.2)
    try:
        assert silent_ranks(store, 3, 0, before) == {2: "step 6"}
        assert silent_ranks(store, 3, 2, before) == {}  # a rank never names itself
    finally:
        for beat in beats[:2]:
            beat.stop()
    assert ranks_that_left(store, 3, 2) == {0: "step 6", 1: "step 6"}  # stopped as usual: marked, not silent


class _CutStore:
    """The store of a host whose link to node 0's host is down: every read blocks (until the test ends)."""

    def __init__(self) -> None:
        self.released = threading.Event()

    def check(self, keys: list[str]) -> bool:
        self.released.wait(30)
        return False


def test_reads_of_a_store_that_does_not_answer_give_up_at_their_deadline() -> None:
    store = _CutStore()
    try:
        started = time.monotonic()
        with pytest.raises(StoreUnreachable, match="the job's store did not answer for 0.3s"):
            describe_missing_ranks(store, 4, 2, 0.1, read_deadline=0.3)
        with pytest.raises(StoreUnreachable):
            ranks_that_left(store, 4, 2, wait=1.0, read_deadline=0.3)
        assert time.monotonic() - started < 3
    finally:
        store.released.set()


def test_a_timeout_on_a_host_cut_off_from_the_store_names_the_other_hosts_ranks(monkeypatch) -> None:
    from lightspeed.core.reliability import process_group

    store = _CutStore()
    state = {"store": store, "rank": 2, "world_size": 4, "timeout": timedelta(seconds=1), "interval": 0.1}
    state.update(same_host=range(2, 4), store_address="host-a:29500", timeout_source=process_group.STRATEGY_TIMEOUT)
    monkeypatch.setattr(process_group, "_monitor", state)
    try:
        error = process_group.explain_timeout(RuntimeError("[gloo] Timed out waiting 1000ms for recv operation"))
    finally:
        store.released.set()
    assert isinstance(error, CollectiveTimeoutError)
    assert str(error).startswith(
        "Rank 2 waited 1s (the strategy's `timeout=`) in a collective: ranks 0, 1 did not arrive (the job's store at "
        "host-a:29500 (node 0's host) did not answer for 1s: this host lost its connection to ranks 0, 1 on the "
        "other host(s) (a network fault, or their host went away))."
    )
    assert state["store_lost"]

    waits: list[float] = []

    class _Heartbeat:
        def stop(self, wait: float) -> None:
            waits.append(wait)

    monkeypatch.setattr(process_group, "_owned", True)
    monkeypatch.setattr(process_group, "_heartbeat", _Heartbeat())
    monkeypatch.setattr(process_group, "group_is_initialized", lambda: False)
    process_group.destroy_owned_group()
    assert waits == [0]  # its thread waits on the store client a stuck read holds: not joined


def test_a_collective_ended_by_a_rank_that_left_is_told_apart_and_named() -> None:
    import torch.distributed as dist

    lost = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:31903. This is ...")
    assert is_peer_lost(lost)
    assert is_peer_lost(
        RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:541] Application timeout caused pair closure")
    )
    assert not is_peer_lost(RuntimeError("Connection closed by peer"))  # not from a collective or a backend
    assert not is_peer_lost(ValueError("gloo: Connection closed by peer"))
    try:
        dist.all_reduce(torch.ones(1))  # no process group: a traceback through torch.distributed.all_reduce
    except (RuntimeError, ValueError) as err:
        error = RuntimeError("Connection reset by peer")
        error.__traceback__ = err.__traceback__
    assert is_peer_lost(error)
    assert peer_lost_message(0, {1: "step 3"}, "`torch.distributed.all_reduce`", lost) == (
        "Rank 0 was waiting in `torch.distributed.all_reduce` when rank 1 left the job at step 3, so the "
        "collective can never complete; the rank that left printed its own error first (a timeout in a collective of "
        "its own, or the failure that ended it). Exiting so that an elastic launcher (torchrun --max-restarts) can "
        "restart the job from the last checkpoint. Backend error: [gloo/transport/tcp/pair.cc:553] Connection closed "
        "by peer [127.0.0.1]:31903. This is ..."
    )
    assert peer_lost_message(2, {}, None, lost).startswith(
        "Rank 2 was waiting in a collective when another rank closed its connection without saying so (killed, or its "
        "machine went away), so"
    )
    assert "ranks 1, 3 left the job (rank 1 at step 3; rank 3 at step 2)" in peer_lost_message(
        0, {1: "step 3", 3: "step 2"}, None, lost
    )
    assert peer_lost_message(0, {}, None, lost, silent={3: "step 6"}).startswith(
        "Rank 0 was waiting in a collective when rank 3 ended without a word at step 6, so the collective can never "
        "complete; its heartbeat stopped and it recorded no exit: it was killed (SIGKILL, the out-of-memory killer) "
        "or its machine went away. Exiting so"
    )


def test_incomplete_checkpoints_are_listed_and_explained(tmp_path: Path) -> None:
    for name in ("last.ckpt", "a.ckpt.lightspeed-staging", "last.ckpt.lightspeed-replaced", "b.ckpt"):
        (tmp_path / name).mkdir()
    found = incomplete_checkpoints(tmp_path)
    assert [p.name for p in found] == ["a.ckpt.lightspeed-staging", "last.ckpt.lightspeed-replaced"]
    assert describe_skipped(found) == (
        f"{str(found[0])!r} (an interrupted save; removed at the next save); {str(found[1])!r} holds the previous "
        f"complete version of {str(tmp_path / 'last.ckpt')!r} (a save was killed while swapping directories); rename "
        "it to 'last.ckpt' to resume from it"
    )
    assert incomplete_checkpoints(tmp_path / "missing") == []


@pytest.mark.parametrize("rank_variables", [True, False])
def test_the_rendezvous_environment_names_rank_zeros_store_and_for_deepspeed_the_ranks(
    monkeypatch: pytest.MonkeyPatch, rank_variables: bool
) -> None:
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.setenv(name, "recorded")  # so that monkeypatch restores each as it was (absent: removed)
        monkeypatch.delenv(name)
    cluster = SimpleNamespace(main_address="198.18.0.1", main_port=29512)
    process = SimpleNamespace(cluster_environment=cluster, global_rank=3, local_rank=1, world_size=4)
    set_rendezvous_environment(process, rank_variables=rank_variables)
    assert (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]) == ("198.18.0.1", "29512")
    ranks = [os.environ.get(name) for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK")]
    assert ranks == (["3", "4", "1"] if rank_variables else [None, None, None])  # DDP's processes: as they were
