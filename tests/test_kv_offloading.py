"""The host KV tier (--kv-offloading-size): blocks the device cache evicts are kept in host
memory and copied back on a later hit, giving the tokens a cold run gives; models whose
state a block copy does not hold are refused with a clear error."""

from __future__ import annotations

import pytest

from conftest import data_url, make_image
from vlmserve import LLM, SamplingParams
from vlmserve.core.host_kv_tier import HostKVTier
from vlmserve.errors import ConfigError
from vlmserve.testing.checkpoints import build_qwen2_5_vl

GREEDY = SamplingParams(temperature=0, max_tokens=8, logprobs=1)
BLOCKS = 24  # device blocks of 16 tokens: three pictures' prompts


@pytest.fixture(scope="module")
def full_attention_path(tmp_path_factory):
    """The tiny Qwen2.5-VL with every layer full attention (as the released checkpoints)."""
    return str(build_qwen2_5_vl(tmp_path_factory.mktemp("qwen25-full"), sliding_window=None))


def picture_chat(seed: int, question: str = "Describe the image.") -> list[dict]:
    image = make_image(280, 252, seed)  # 73 prompt tokens with the template's
    return [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": question}]}]


def ask_then_evict(llm: LLM) -> tuple:
    """Picture 0, then enough other pictures to evict every block of it, then picture 0 again
    (another question: its picture's blocks are the shared prefix)."""
    first = llm.chat(picture_chat(0), GREEDY)[0]
    for seed in range(1, 6):
        llm.chat(picture_chat(seed), GREEDY)
    again = llm.chat(picture_chat(0, "What is in the picture?"), GREEDY)[0]
    return first, again


def test_evicted_picture_blocks_come_back_from_the_host_tier(full_attention_path):
    plain = LLM(full_attention_path, num_kv_blocks=BLOCKS, dtype="float32")
    _, cold = ask_then_evict(plain)
    assert cold.num_cached_tokens == 0  # the device cache alone lost picture 0's blocks
    expected = cold.outputs[0]
    del plain

    llm = LLM(full_attention_path, num_kv_blocks=BLOCKS, dtype="float32", kv_offloading_size=0.01)
    first, again = ask_then_evict(llm)
    stats = llm.engine.stats()
    prompt_blocks = (first.num_prompt_tokens - 1) // 16
    shared = next(i for i, (x, y) in enumerate(zip(first.prompt_token_ids, again.prompt_token_ids)) if x != y)
    assert again.num_cached_tokens == shared // 16 * 16 >= 3 * 16  # the picture's blocks (the questions differ)
    assert stats.connector_hits == again.num_cached_tokens and stats.connector_blocks_loaded == shared // 16
    assert stats.connector_blocks_saved >= prompt_blocks and stats.connector_blocks_held >= prompt_blocks
    got = again.outputs[0]
    assert got.token_ids == expected.token_ids
    for a, b in zip(got.logprobs, expected.logprobs):
        assert abs(a.logprobs[0] - b.logprobs[0]) < 1e-4
    assert not any(stats.blocks_in_use.values())


def test_a_reset_forgets_the_host_tier_too(full_attention_path):
    llm = LLM(full_attention_path, num_kv_blocks=BLOCKS, dtype="float32", kv_offloading_size=0.01)
    ask_then_evict(llm)
    assert llm.engine.stats().connector_blocks_held > 0
    assert llm.engine.reset_caches()
    assert llm.engine.stats().connector_blocks_held == 0
    assert llm.chat(picture_chat(0), GREEDY)[0].num_cached_tokens == 0


@pytest.mark.parametrize("case", ["sliding window", "hybrid", "draft model", "no prefix caching", "size"])
def test_what_the_host_tier_cannot_hold_is_refused(case, qwen25_path, qwen35_path, full_attention_path):
    settings = {
        "sliding window": (qwen25_path, {}, "SlidingWindowSpec layers"),
        "hybrid": (qwen35_path, {}, "MambaSpec layers"),
        "draft model": (full_attention_path, {"speculative_config": {"model": full_attention_path,
                                                                      "num_speculative_tokens": 2}},
                        "a draft model's KV blocks"),
        "no prefix caching": (full_attention_path, {"prefix_caching": False}, "needs prefix caching on"),
        "size": (full_attention_path, {"kv_offloading_size": -1.0}, "more than 0"),
    }
    path, extra, message = settings[case]
    kwargs = {"kv_offloading_size": 0.01, **extra}
    with pytest.raises(ConfigError, match=message):
        LLM(path, num_kv_blocks=BLOCKS, **kwargs)


def test_the_tier_keeps_the_latest_and_never_overwrites_what_a_step_reads():
    tier = HostKVTier(2)
    a, b, c = (("a", 0), ("b", 0), ("c", 0))
    tier.evicted(10, a)
    tier.evicted(11, b)
    assert tier.take_transfers().saves == [(10, 0), (11, 1)]
    slots = tier.reserve([a])  # a is read this step: the next save evicts b, the least recent other
    tier.load(slots, [20])
    tier.evicted(12, c)
    transfers = tier.take_transfers()
    assert transfers.loads == [(0, 20)] and transfers.saves == [(12, 1)]
    assert tier.find([a, c]) == 2 and tier.find([b]) == 0
    # a step that failed: what the steps in flight saved is dropped (its blocks held no valid keys)
    tier.commit_step()
    tier.commit_step()
    tier.evicted(13, b)  # evicts a, the least recent
    tier.take_transfers()
    tier.discard_unconfirmed()
    assert tier.find([b]) == 0 and tier.find([a]) == 0 and tier.find([c]) == 1


@pytest.mark.slow
def test_the_server_reports_host_tier_hits(full_attention_path):
    from test_openai_server import Server

    server = Server(full_attention_path, "--num-kv-blocks", str(BLOCKS), "--kv-offloading-size", "0.01")
    try:
        client = server.client()

        def ask(seed: int, question: str = "Describe the image.") -> str:
            content = [{"type": "image_url", "image_url": {"url": data_url(make_image(280, 252, seed))}},
                       {"type": "text", "text": question}]
            reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}],
                                                   max_tokens=4, temperature=0)
            return reply

        ask(0)
        for seed in range(1, 6):
            ask(seed)
        again = ask(0, "What is in the picture?")
        assert again.usage.prompt_tokens_details.cached_tokens == 3 * 16  # as in the test above
        assert server.metric("external_prefix_cache_hits_total") == again.usage.prompt_tokens_details.cached_tokens
        assert server.metric('kv_connector_bytes_total{direction="load"}') > 0
        assert server.metric('kv_connector_seconds_total{direction="save"}') > 0
        assert server.metric('kv_connector_seconds_total{direction="load"}') > 0
    finally:
        server.stop()


def test_a_crowded_batch_with_preemption_and_chunks_gives_the_roomy_engines_tokens(full_attention_path):
    """Twelve picture chats at once on a cache that holds three: chunked prefills,
    preemptions and evictions, blocks coming back from the host tier as requests return;
    every answer is the one an engine with room for all gives."""
    chats = [picture_chat(i % 6, "Describe the image." if i < 6 else "What is in the picture?") for i in range(12)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    roomy = [o.outputs[0].token_ids for o in LLM(full_attention_path, num_kv_blocks=512, dtype="float32")
             .chat(chats, params)]
    llm = LLM(full_attention_path, num_kv_blocks=BLOCKS, dtype="float32", kv_offloading_size=0.01,
              max_num_batched_tokens=48)
    crowded = llm.chat(chats, params)
    assert [o.outputs[0].token_ids for o in crowded] == roomy
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.connector_hits > 0
    assert not any(stats.blocks_in_use.values())
