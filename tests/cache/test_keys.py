"""Block keys (DESIGN §3): canonical bytes, chained digests, tagged extras, object names."""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest

from kvtier.cache import BlockHasher, MMItem, ModelFingerprint, namespace_seed, object_name
from kvtier.cache.keys import block_key, encode_tokens

BS = 4
SEED = namespace_seed(None)


def keys_of(tokens, bs=BS, seed=SEED, **kw):
    return BlockHasher(bs, seed, **kw).extend(tokens)


def test_numpy_ints_give_the_same_keys_as_python_ints():
    tokens = list(range(3, 3 + 4 * BS))
    assert keys_of([np.int64(t) for t in tokens]) == keys_of(tokens)
    assert keys_of(np.array(tokens, dtype=np.int32)) == keys_of(tokens)
    # (typed Sequence[int]; an array of token ids is what callers holding numpy pass)
    assert encode_tokens(np.array(tokens, dtype=np.uint16)) == encode_tokens(tokens)  # type: ignore[arg-type]


def test_known_answer_digest_computed_with_hashlib():
    le32 = lambda n: struct.pack("<I", n)  # noqa: E731
    seed = hashlib.sha256(b"kvtier-ns" + le32(1) + le32(0)).digest()  # version 1, no fingerprint, no salt
    block0 = b"".join(struct.pack("<i", t) for t in (1, 2, 3, 4))
    block1 = b"".join(struct.pack("<i", t) for t in (5, 6, 7, 70000))
    key0 = hashlib.sha256(seed + block0).digest()
    key1 = hashlib.sha256(key0 + block1).digest()
    assert namespace_seed(None) == seed
    assert keys_of([1, 2, 3, 4, 5, 6, 7, 70000]) == [key0, key1]
    assert block_key(key0, [5, 6, 7, 70000]) == key1


def test_model_fingerprint_changes_the_seed():
    fp = ModelFingerprint("LlamaForCausalLM", 2, 2, 64, "bfloat16", 16)
    other = ModelFingerprint("LlamaForCausalLM", 2, 2, 64, "float16", 16)
    assert len({namespace_seed(None), namespace_seed(fp), namespace_seed(other)}) == 3


def test_lora_tag_changes_every_key():
    tokens = list(range(2 * BS))
    plain, lora_a, lora_b = keys_of(tokens), keys_of(tokens, lora_name="a"), keys_of(tokens, lora_name="b")
    assert all(len({p, a, b}) == 3 for p, a, b in zip(plain, lora_a, lora_b))


def test_multimodal_item_changes_the_blocks_it_overlaps_only():
    tokens = list(range(3 * BS))
    plain = keys_of(tokens)
    overlapping = keys_of(tokens, mm_items=[MMItem(b"img", offset=BS + 1, length=2)])  # inside block 1
    assert overlapping[0] == plain[0]
    assert overlapping[1] != plain[1] and overlapping[2] != plain[2]  # chained after it
    ends_at_block = keys_of(tokens, mm_items=[MMItem(b"img", offset=0, length=BS)])  # ends where block 1 starts
    assert ends_at_block[0] != plain[0]
    only_block1 = keys_of(tokens, mm_items=[MMItem(b"img", offset=BS, length=BS)])
    assert only_block1[0] == plain[0] and only_block1[1] != plain[1]


def test_multimodal_item_position_is_part_of_the_key():
    tokens = list(range(2 * BS))
    a = keys_of(tokens, mm_items=[MMItem(b"img", offset=0, length=2)])
    b = keys_of(tokens, mm_items=[MMItem(b"img", offset=1, length=2)])
    assert a[0] != b[0]


def test_partial_key_names_hex_and_token_count():
    h = BlockHasher(BS, SEED)
    assert h.partial_key() is None
    h.extend([1, 2, 3, 4, 5, 6])
    name = h.partial_key()
    assert name is not None
    hex_part, tag, n = name.split(":")
    expected = hashlib.sha256(h.keys[0] + struct.pack("<2i", 5, 6)).hexdigest()
    assert (hex_part, tag, n) == (expected, "partial", "2")


def test_partial_key_of_a_prefix_equals_a_hasher_that_stopped_there():
    tokens = list(range(3, 40))
    longer = BlockHasher(BS, SEED)
    longer.extend(tokens)  # a request that went on (D: prompt + generated)
    for n in (1, BS - 1, BS, BS + 2, 3 * BS + 1, len(tokens)):
        stopped = BlockHasher(BS, SEED)
        stopped.extend(tokens[:n])
        assert longer.partial_key(n, tokens) == stopped.partial_key()


def test_object_name_adds_tensor_parallel_suffix():
    key = keys_of(list(range(BS)))[0]
    assert object_name(key, "ns") == f"kvt:ns:{key.hex()}"
    assert object_name(key, "ns", tp_rank=1, tp_size=2) == f"kvt:ns:{key.hex()}:tp1of2"
    with pytest.raises(ValueError, match="tp_rank"):
        object_name(key, "ns", tp_rank=2, tp_size=2)


def test_cache_salt_changes_every_key():
    tokens = list(range(3 * BS))
    plain = keys_of(tokens)
    salted = keys_of(tokens, seed=namespace_seed(None, "tenant-1"))
    other = keys_of(tokens, seed=namespace_seed(None, "tenant-2"))
    assert all(len({p, s, o}) == 3 for p, s, o in zip(plain, salted, other))


def test_incremental_extend_equals_one_shot():
    tokens = [(i * 7919) % 50000 for i in range(10 * BS + 3)]
    one_shot = BlockHasher(BS, SEED)
    one_shot.extend(tokens)
    step = BlockHasher(BS, SEED)
    got = []
    for i in range(0, len(tokens), 3):
        got += step.extend(tokens[i : i + 3])
    assert got == one_shot.keys == step.keys
    assert step.partial_key() == one_shot.partial_key()
    lazy = BlockHasher(BS, SEED)
    lazy.add_tokens(tokens[:17])
    lazy.add_tokens(tokens[17:])
    assert lazy.keys == one_shot.keys  # labels first, digests when asked for


@pytest.mark.parametrize("bad", [-1, 2**31, 2**40, 1.5, True, False, np.float32(2.0), "7", None])
def test_bad_token_raises_value_error_naming_it(bad):
    for tokens in ([1, 2, bad, 3], list(range(40)) + [bad]):  # short and long (vectorized) paths
        with pytest.raises(ValueError, match=repr(bad).replace("(", r"\(").replace(")", r"\)")):
            BlockHasher(BS, SEED).extend(tokens)


def test_rejected_tokens_leave_the_hasher_unchanged():
    h = BlockHasher(BS, SEED)
    h.extend([1, 2, 3, 4])
    with pytest.raises(ValueError):
        h.extend([5, -6, 7, 8])
    assert h.num_tokens == 4 and len(h.keys) == 1


@pytest.mark.parametrize("hash_name, nbytes", [("sha256", 32), ("xxh3_128", 16)])
def test_key_length_per_digest(hash_name, nbytes):
    seed = namespace_seed(None, hash_name=hash_name)
    assert len(seed) == nbytes
    assert all(len(k) == nbytes for k in keys_of(list(range(2 * BS)), seed=seed, hash_name=hash_name))


def test_unknown_hash_name_is_named():
    with pytest.raises(ValueError, match="'md5'"):
        namespace_seed(None, hash_name="md5")
