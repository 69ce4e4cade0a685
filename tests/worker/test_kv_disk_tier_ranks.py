"""RankMerge, the disk tier's view across tensor-parallel ranks: a transfer is finished once every rank reported it
(a load with the fewest blocks any rank loaded, a save only if every rank wrote it); a block one rank dropped is
reported at once, and once."""

from protocol.kv_transfer import KVConnectorOutput as Out
from worker.kv_connector.ranks import RankMerge


def test_a_load_finishes_when_every_rank_has_with_the_fewest_blocks():
    merge = RankMerge(2)
    assert merge.merge([Out(finished_loads=["a"], num_loaded_blocks=[6]), Out()]) is None
    done = merge.merge([Out(), Out(finished_loads=["a"], num_loaded_blocks=[3], num_failed_blocks=1)])
    assert (done.finished_loads, done.num_loaded_blocks, done.num_failed_blocks) == (["a"], [3], 1)


def test_a_save_is_saved_only_if_every_rank_wrote_it():
    merge = RankMerge(2)
    done = merge.merge([Out(saved_keys=[b"k", b"j"], save_bytes=20), Out(saved_keys=[b"k"], failed_save_keys=[b"j"],
                                                                          save_bytes=10)])
    assert (done.saved_keys, done.failed_save_keys, done.save_bytes) == ([b"k"], [b"j"], 30)


def test_a_removal_is_reported_at_the_first_rank_and_once():
    merge = RankMerge(2)
    assert merge.merge([Out(removed_keys=[b"k"]), Out()]).removed_keys == [b"k"]
    assert merge.merge([Out(), Out(removed_keys=[b"k"])]) is None  # the other rank catches up: nothing new
    assert merge.merge([Out(), Out(removed_keys=[b"k"])]).removed_keys == [b"k"]  # dropped again later: news
