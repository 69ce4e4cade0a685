"""block_ids_digest: a stable 8-byte digest of a request's block lists, one list per KV cache group."""

import hashlib

from hypothesis import given
from hypothesis import strategies as st

from protocol import block_ids_digest

# Layout, per group: group length as 4-byte little-endian unsigned, then each block id as 4-byte
# little-endian int32; blake2b with digest_size=8 over the concatenation. Values below were worked
# out once from that layout (hashlib.blake2b on the literal bytes) and are fixed here on purpose:
# a change of the digest breaks --check-block-tables between processes of different versions.
ONE_GROUP = [[1, 2, 3]]
ONE_GROUP_BYTES = b"\x03\x00\x00\x00" b"\x01\x00\x00\x00" b"\x02\x00\x00\x00" b"\x03\x00\x00\x00"
ONE_GROUP_HEX = "58d9788fceb1ee0e"

TWO_GROUPS = [[1, 2, 3], [4, 5]]
TWO_GROUPS_HEX = "6fe906e80d59e03e"
NO_GROUPS_HEX = "e4a6a0577479b2b4"  # blake2b-64 of b""
ONE_EMPTY_GROUP_HEX = "4e842f2f50cc089e"  # blake2b-64 of b"\0\0\0\0"


def test_fixed_values():
    assert block_ids_digest(ONE_GROUP).hex() == ONE_GROUP_HEX
    assert block_ids_digest(TWO_GROUPS).hex() == TWO_GROUPS_HEX
    assert block_ids_digest([]).hex() == NO_GROUPS_HEX
    assert block_ids_digest([[]]).hex() == ONE_EMPTY_GROUP_HEX


def test_fixed_values_match_the_documented_layout():
    assert hashlib.blake2b(ONE_GROUP_BYTES, digest_size=8).hexdigest() == ONE_GROUP_HEX
    two = ONE_GROUP_BYTES + b"\x02\x00\x00\x00" + b"\x04\x00\x00\x00" + b"\x05\x00\x00\x00"
    assert hashlib.blake2b(two, digest_size=8).hexdigest() == TWO_GROUPS_HEX
    assert hashlib.blake2b(b"", digest_size=8).hexdigest() == NO_GROUPS_HEX
    assert hashlib.blake2b(b"\x00" * 4, digest_size=8).hexdigest() == ONE_EMPTY_GROUP_HEX


def test_eight_bytes_and_pure():
    lists = [[7, 8], [9]]
    d = block_ids_digest(lists)
    assert isinstance(d, bytes) and len(d) == 8
    assert lists == [[7, 8], [9]]  # input untouched
    assert block_ids_digest([[7, 8], [9]]) == d  # equal content, equal digest


def test_differs_when_a_block_id_changes():
    base = block_ids_digest(TWO_GROUPS)
    assert block_ids_digest([[1, 2, 3], [4, 6]]) != base
    assert block_ids_digest([[0, 2, 3], [4, 5]]) != base
    assert block_ids_digest([[1, 2, 3], [4, 5 + 2**16]]) != base


def test_differs_when_the_order_changes():
    assert block_ids_digest([[3, 2, 1]]) != block_ids_digest([[1, 2, 3]])
    assert block_ids_digest([[4, 5], [1, 2, 3]]) != block_ids_digest(TWO_GROUPS)


def test_differs_when_the_group_split_changes():
    variants = [
        [[1, 2, 3]],
        [[1, 2], [3]],
        [[1], [2, 3]],
        [[1], [2], [3]],
        [[1, 2, 3], []],
        [[], [1, 2, 3]],
        [[]],
        [[], []],
        [],
    ]
    digests = {block_ids_digest(v) for v in variants}
    assert len(digests) == len(variants)


def test_differs_when_a_block_is_appended():
    assert block_ids_digest([[1, 2, 3, 0]]) != block_ids_digest([[1, 2, 3]])  # the null block is a block too


block_lists = st.lists(st.lists(st.integers(0, 2**31 - 1), max_size=5), max_size=3)


@given(block_lists, block_lists)
def test_distinct_lists_distinct_digests(a, b):
    assert (block_ids_digest(a) == block_ids_digest(b)) == (a == b)
