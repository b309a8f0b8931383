from vlmserve.core.kv_cache_utils import BlockHasher
from vlmserve.multimodal.inputs import MultiModalFeature
from vlmserve.request import Request
from vlmserve.sampling_params import SamplingParams

BS = 4
IMG = 99


def request(tokens, images=(), salt=None):
    feats = [MultiModalFeature("image", h, off, n, {}) for h, off, n in images]
    return Request("r", tokens, SamplingParams(), None, feats, cache_salt=salt, block_hasher=BlockHasher(BS))


PROMPT = [1, 2, 3] + [IMG] * 6 + [4, 5, 6, 7, 8, 9]  # image over tokens 3..8


def test_only_full_blocks_are_hashed_and_chained():
    r = request(PROMPT)
    assert len(r.block_hashes) == len(PROMPT) // BS == 3
    r.append_output_token_ids(10)
    assert len(r.block_hashes) == 4  # 16 tokens now
    other = request([0] + PROMPT[1:])  # first token differs: every later hash differs too
    assert all(a != b for a, b in zip(r.block_hashes, other.block_hashes))


def test_same_image_same_hashes_different_image_different():
    a = request(PROMPT, [("imgA", 3, 6)])
    b = request(PROMPT, [("imgA", 3, 6)])
    c = request(PROMPT, [("imgB", 3, 6)])
    plain = request(PROMPT)
    assert a.block_hashes == b.block_hashes
    # block 0 (tokens 0..3) overlaps the image at token 3, so it already differs
    assert all(x != y for x, y in zip(a.block_hashes, c.block_hashes))
    assert all(x != y for x, y in zip(a.block_hashes, plain.block_hashes))


def test_blocks_before_the_image_are_shared():
    a = request([1, 2, 3, 4] + [IMG] * 4, [("imgA", 4, 4)])
    c = request([1, 2, 3, 4] + [IMG] * 4, [("imgB", 4, 4)])
    assert a.block_hashes[0] == c.block_hashes[0]
    assert a.block_hashes[1] != c.block_hashes[1]


def test_cache_salt_separates_everything():
    a = request(PROMPT, salt="alice")
    b = request(PROMPT, salt="bob")
    assert all(x != y for x, y in zip(a.block_hashes, b.block_hashes))
    assert request(PROMPT, salt="alice").block_hashes == a.block_hashes
