"""What vLLM's clients rely on, through the official `openai` client against a real
`vlmserve serve`: several prompts and token-id prompts, echo with logprobs (how evaluation
harnesses score log-likelihoods), prompt_logprobs, stop_reason, continuous usage,
return_token_ids, chat echo with continue_final_message, truncate_prompt_tokens, custom
roles, the context check of max_tokens, forced tool calls cut short, /tokenize and
/detokenize, the model card, unknown fields logged."""

from __future__ import annotations

import json
import math

import httpx
import openai
import pytest

from conftest import make_image
from test_openai_server import data_url
from vlmserve import LLM, SamplingParams

pytestmark = pytest.mark.slow

IMG = make_image(90, 70, seed=21)


@pytest.fixture(scope="module")
def server(short_context_server):
    return short_context_server


@pytest.fixture(scope="module")
def client(server):
    return server.client()


@pytest.fixture(scope="module")
def llm(qwen25_path):
    return LLM(qwen25_path, num_kv_blocks=256, max_model_len=1024)


def test_several_prompts_as_text_and_token_ids(client, llm):
    ids = llm.get_tokenizer().encode("The shapes", add_special_tokens=False)
    done = client.completions.create(model="tiny", prompt=["Hello", "A red circle", "Why"], n=2, max_tokens=3,
                                     temperature=0, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in done.choices) == list(range(6))
    by_index = {c.index: c.text for c in done.choices}
    alone = client.completions.create(model="tiny", prompt="A red circle", max_tokens=3, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert by_index[2] == by_index[3] == alone.choices[0].text  # prompt 1's two samples follow prompt 0's
    assert done.usage.completion_tokens == 18
    assert done.usage.prompt_tokens == sum(client.completions.create(model="tiny", prompt=p, max_tokens=1).usage
                                           .prompt_tokens for p in ["Hello", "A red circle", "Why"])
    one = client.completions.create(model="tiny", prompt=ids, max_tokens=4, temperature=0,
                                    extra_body={"ignore_eos": True})
    text = client.completions.create(model="tiny", prompt="The shapes", max_tokens=4, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert one.choices[0].text == text.choices[0].text
    two = client.completions.create(model="tiny", prompt=[ids, ids[:1]], max_tokens=2, temperature=0)
    assert len(two.choices) == 2
    streamed = client.completions.create(model="tiny", prompt=["Hello", "Why"], max_tokens=3, temperature=0,
                                         stream=True, extra_body={"ignore_eos": True})
    texts: dict[int, str] = {}
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert texts == {0: by_index[0], 1: by_index[4]}
    with pytest.raises(openai.BadRequestError, match="at least one prompt"):
        client.completions.create(model="tiny", prompt=[], max_tokens=2)


def test_echo_with_logprobs_scores_the_prompt_as_the_engine_does(client, llm):
    """lm-evaluation-harness's log-likelihood request: echo, logprobs, max_tokens 0 or 1."""
    prompt = "A small red circle in the top left"
    want = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0))[0]
    ids = want.prompt_token_ids
    for max_tokens in (0, 1):
        done = client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, logprobs=1, echo=True,
                                         temperature=0)
        c = done.choices[0]
        lp = c.logprobs
        assert c.text.startswith(prompt)
        assert len(lp.tokens) == len(ids) + max_tokens
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        for i, entry in enumerate(want.prompt_logprobs, 1):
            assert math.isclose(lp.token_logprobs[i], entry.logprobs[0], abs_tol=1e-4)
        assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
        if max_tokens == 0:
            assert c.text == prompt and c.finish_reason == "length" and done.usage.completion_tokens == 0
    streamed = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, logprobs=0, echo=True,
                                         temperature=0, stream=True)
    chunks = [c for c in streamed if c.choices]
    assert chunks[0].choices[0].text.startswith(prompt)
    assert chunks[0].choices[0].logprobs.token_logprobs[0] is None
    with pytest.raises(openai.BadRequestError, match="max_tokens must be at least 1"):
        client.completions.create(model="tiny", prompt=prompt, max_tokens=0)


def test_prompt_logprobs_on_completions_and_chat(client, server, llm):
    prompt = "The quick brown fox"
    want = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=2, temperature=0))[0]
    body = httpx.post(server.base + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 1,
                                                            "prompt_logprobs": 2}, timeout=60).json()
    got = body["choices"][0]["prompt_logprobs"]
    assert got[0] is None and len(got) == len(want.prompt_token_ids)
    for position, entry in zip(got[1:], want.prompt_logprobs):
        token = str(entry.token_ids[0])
        assert math.isclose(position[token]["logprob"], entry.logprobs[0], abs_tol=1e-4)
        assert position[token]["rank"] == entry.rank and 2 <= len(position) <= 3
    chat = httpx.post(server.base + "/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "prompt_logprobs": 0},
        timeout=60).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    for bad, words in ((-2, "positive value or -1"), (21, "greater than max allowed")):
        r = httpx.post(server.base + "/v1/completions", json={"prompt": "x", "prompt_logprobs": bad}, timeout=60)
        assert r.status_code == 400 and words in r.json()["error"]["message"]
    r = httpx.post(server.base + "/v1/completions", json={"prompt": "x", "prompt_logprobs": 1, "stream": True})
    assert r.status_code == 400 and "not available when `stream=True`" in r.json()["error"]["message"]


def test_stop_reason_continuous_usage_and_token_ids(client, llm):
    tok = llm.get_tokenizer()
    free = client.completions.create(model="tiny", prompt="The shapes", max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert free.choices[0].finish_reason == "length" and free.choices[0].stop_reason is None
    red = tok.encode(" red", add_special_tokens=False)
    assert len(red) == 1
    forced = {"logit_bias": {str(red[0]): 100}, "ignore_eos": True}  # the answer: " red red red ..."
    by_string = client.completions.create(model="tiny", prompt="The shapes", max_tokens=8, temperature=0,
                                          stop=["blue", "red"], extra_body=forced)
    assert by_string.choices[0].finish_reason == "stop" and by_string.choices[0].stop_reason == "red"
    by_id = client.completions.create(model="tiny", prompt="The shapes", max_tokens=8, temperature=0,
                                      extra_body={**forced, "stop_token_ids": [red[0]]})
    assert by_id.choices[0].finish_reason == "stop" and by_id.choices[0].stop_reason == red[0]
    chunks = list(client.completions.create(model="tiny", prompt="The shapes", max_tokens=5, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True},
                                            stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counts == sorted(counts) and counts[-1] == 5 and all(c.usage is not None for c in chunks)
    with_ids = client.completions.create(model="tiny", prompt="The shapes", max_tokens=4, temperature=0,
                                         logprobs=1, extra_body={"ignore_eos": True, "return_token_ids": True,
                                                                 "return_tokens_as_token_ids": True})
    c = with_ids.choices[0].model_dump()
    assert len(c["prompt_token_ids"]) == with_ids.usage.prompt_tokens and len(c["token_ids"]) == 4
    assert c["logprobs"]["tokens"] == [f"token_id:{t}" for t in c["token_ids"]]
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                          temperature=0, logprobs=True, extra_body={
                                              "ignore_eos": True, "return_token_ids": True,
                                              "return_tokens_as_token_ids": True}).model_dump()
    assert len(chat["prompt_token_ids"]) == chat["usage"]["prompt_tokens"]
    assert [e["token"] for e in chat["choices"][0]["logprobs"]["content"]] == \
        [f"token_id:{t}" for t in chat["choices"][0]["token_ids"]]


def test_logprobs_zero_gives_the_sampled_token(client):
    done = client.completions.create(model="tiny", prompt="Hello", max_tokens=3, logprobs=0, temperature=0)
    lp = done.choices[0].logprobs
    assert all(list(top) == [token] for top, token in zip(lp.top_logprobs, lp.tokens))


def test_chat_echo_continue_final_message_and_truncation(client, server, llm):
    messages = [{"role": "user", "content": "Describe the picture."},
                {"role": "assistant", "content": "It shows a"}]
    done = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0,
                                          extra_body={"echo": True, "continue_final_message": True,
                                                      "add_generation_prompt": False, "ignore_eos": True})
    c = done.choices[0]
    assert c.message.content.startswith("It shows a") and c.message.role == "assistant"
    continued = llm.generate([llm.engine.render_chat(messages, add_generation_prompt=False,
                                                     continue_final_message=True)],
                             SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert c.message.content == "It shows a" + continued.outputs[0].text
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0, stream=True,
                                            extra_body={"echo": True, "continue_final_message": True,
                                                        "add_generation_prompt": False, "ignore_eos": True})
    assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices) == c.message.content
    with pytest.raises(openai.BadRequestError, match="Cannot set both"):
        client.chat.completions.create(model="tiny", messages=messages, extra_body={"continue_final_message": True})
    long = [{"role": "user", "content": "word " * 200}]
    cut = client.chat.completions.create(model="tiny", messages=long, max_tokens=2,
                                         extra_body={"truncate_prompt_tokens": 50})
    assert cut.usage.prompt_tokens == 50
    with pytest.raises(openai.BadRequestError, match="truncate_prompt_tokens=5000 cannot be greater"):
        client.chat.completions.create(model="tiny", messages=long, extra_body={"truncate_prompt_tokens": 5000})
    pictured = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(IMG)}},
                                             {"type": "text", "text": "word " * 100}]}]
    tokens = httpx.post(server.base + "/tokenize", json={"model": "tiny", "messages": pictured}).json()["tokens"]
    pad = llm.get_tokenizer().convert_tokens_to_ids("<|image_pad|>")
    at = [i for i, t in enumerate(tokens) if t == pad]
    with pytest.raises(openai.BadRequestError, match="would cut through image 0"):
        client.chat.completions.create(model="tiny", messages=pictured,
                                       extra_body={"truncate_prompt_tokens": len(tokens) - at[1]})
    keep = len(tokens) - at[-1] - 1  # the picture wholly cut away: no picture left
    kept = client.chat.completions.create(model="tiny", messages=pictured, max_tokens=2,
                                          extra_body={"truncate_prompt_tokens": keep})
    assert kept.usage.prompt_tokens == keep and not any(kept.model_dump()["usage"].get("media", {}).values())


def test_roles_context_and_malformed_parts(client):
    narrated = client.chat.completions.create(model="tiny", max_tokens=2, messages=[
        {"role": "narrator", "content": "Once upon a time."}, {"role": "user", "content": "Go on."}])
    plain = client.chat.completions.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": "Go on."}])
    assert narrated.usage.prompt_tokens > plain.usage.prompt_tokens  # the template rendered it
    for field in ("max_tokens", "max_completion_tokens"):
        with pytest.raises(openai.BadRequestError, match=f"{field}=5000 cannot be greater than max_model_len=1024"):
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                           **{field: 5000})
    with pytest.raises(openai.BadRequestError, match="max_tokens=5000 cannot be greater"):
        client.completions.create(model="tiny", prompt="x", max_tokens=5000)
    with pytest.raises(openai.BadRequestError, match=r"image_url must be an object"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": data_url(IMG)}]}])


def test_a_forced_call_cut_short_leaves_no_markup(client):
    tool = {"type": "function", "function": {"name": "describe", "parameters": {
        "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}
    messages = [{"role": "user", "content": "Describe it."}]
    for choice in ("required", {"type": "function", "function": {"name": "describe"}}):
        done = client.chat.completions.create(model="tiny", messages=messages, tools=[tool], tool_choice=choice,
                                              max_tokens=6, temperature=1.0, seed=1)
        c = done.choices[0]
        assert c.finish_reason == "length" and not c.message.tool_calls and "<tool_call>" not in (c.message.content or "")
        stream = client.chat.completions.create(model="tiny", messages=messages, tools=[tool], tool_choice=choice,
                                                max_tokens=6, temperature=1.0, seed=1, stream=True)
        deltas = [ch.choices[0].delta for ch in stream if ch.choices]
        assert "<tool" not in "".join(d.content or "" for d in deltas) and not any(d.tool_calls for d in deltas)


def test_tokenize_detokenize_and_the_model_card(server, llm):
    tok = llm.get_tokenizer()
    r = httpx.post(server.base + "/tokenize", json={"prompt": "A red circle", "return_token_strs": True}).json()
    assert r["tokens"] == tok.encode("A red circle") and r["count"] == len(r["tokens"]) and r["max_model_len"] == 1024
    assert r["token_strs"] == tok.convert_ids_to_tokens(r["tokens"])
    back = httpx.post(server.base + "/detokenize", json={"tokens": r["tokens"]}).json()
    assert back == {"prompt": "A red circle"}
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(IMG)}},
                                             {"type": "text", "text": "What is it?"}]}]
    chat = httpx.post(server.base + "/tokenize", json={"messages": messages}).json()
    served = httpx.post(server.base + "/v1/chat/completions", json={"messages": messages, "max_tokens": 1}).json()
    assert chat["count"] == served["usage"]["prompt_tokens"]  # the picture's tokens counted
    assert httpx.post(server.base + "/detokenize", json={"tokens": [10 ** 7]}).status_code == 400
    card = httpx.get(server.base + "/v1/models").json()["data"][0]
    assert card["id"] == "tiny" and card["root"] and card["parent"] is None and card["max_model_len"] == 1024
    assert card["permission"][0]["object"] == "model_permission"


def test_unknown_fields_are_logged_once_per_name(server):
    for _ in range(2):
        r = httpx.post(server.base + "/v1/completions", json={"prompt": "x", "max_tokens": 1, "tempreature": 0.5})
        assert r.status_code == 200
    lines = [line for line in server.log if "present in the request but ignored" in line]
    assert len(lines) == 1 and "tempreature" in lines[0]


def test_metrics_can_keep_vlmserves_names():
    from vlmserve.metrics import EngineStats
    from vlmserve.metrics import EngineMetrics

    stats = EngineStats(0, 0, [], {}, 0, 0.0, [], [], 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
    vllm = EngineMetrics(lambda: stats, "m", 1024).render().decode()
    old = EngineMetrics(lambda: stats, "m", 1024, names="vlmserve").render().decode()
    assert 'vllm:num_requests_running{engine="0",model_name="m"} 0.0' in vllm
    assert "vlmserve:num_requests_running 0.0" in old and "vllm:" not in old
    assert "vlmserve:encoder_cache_hits_total" in vllm  # vlmserve's own, either way
    json.dumps(vllm)
