"""Scoring query-document pairs: a reranker made the Qwen3-VL-Reranker way (a generative
Qwen3-VL whose score is sigmoid(logit "yes" - logit "no") at the last token of its own
prompt), checked against transformers' logits on the prompt vLLM's
qwen3_vl_reranker.jinja writes (fp32: 1e-5); an embedding model's cosine similarity; the
server's /v1/score and /v1/rerank with pictures, and what they refuse."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import data_url, make_image
from vlmserve import LLM, PoolingParams
from vlmserve.errors import ConfigError
from vlmserve.testing.checkpoints import DEFAULT_CORPUS, build_qwen3_vl

RED, BLUE = make_image(64, 64, 1), make_image(56, 84, 7)
INSTRUCTION = "Given a search query, retrieve relevant candidates that answer the query."


def write_reranker(path: Path) -> Path:
    """A tiny Qwen3-VL whose vocabulary has "yes" and "no", its config.json carrying the
    two tokens as vLLM's hf_overrides for Qwen3-VL-Reranker set them."""
    build_qwen3_vl(path, corpus=DEFAULT_CORPUS + ["yes no"] * 40)
    config_file = path / "config.json"
    config = json.loads(config_file.read_text())
    config.update(classifier_from_token=["no", "yes"], is_original_qwen3_reranker=True)
    config_file.write_text(json.dumps(config))
    return path


class TransformersReranker:
    """The reference: transformers' generative model on the prompt that vLLM's
    qwen3_vl_reranker.jinja renders (a picture as <|vision_start|><|image_pad|><|vision_end|>)."""

    def __init__(self, path: Path) -> None:
        from transformers import AutoModelForImageTextToText, AutoProcessor

        self.processor = AutoProcessor.from_pretrained(path)
        self.model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
        tokenizer = self.processor.tokenizer
        self.no, self.yes = tokenizer.convert_tokens_to_ids("no"), tokenizer.convert_tokens_to_ids("yes")

    @staticmethod
    def side(text: str, images: list) -> str:
        return "<|vision_start|><|image_pad|><|vision_end|>" * len(images) + text

    @torch.no_grad()
    def score(self, query: tuple[str, list], document: tuple[str, list], instruction: str = INSTRUCTION,
              activation: bool = True) -> float:
        prompt = ('<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the '
                  'Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n'
                  f"<Instruct>: {instruction}<Query>:{self.side(*query)}\n<Document>:{self.side(*document)}"
                  "<|im_end|>\n<|im_start|>assistant\n")
        images = query[1] + document[1]
        inputs = self.processor(text=[prompt], images=images or None, return_tensors="pt")
        logits = self.model(**inputs).logits[0, -1].float()
        difference = logits[self.yes] - logits[self.no]
        return float(torch.sigmoid(difference) if activation else difference)


def content(text: str, images: list, url: bool = False) -> dict:
    pictures = [{"type": "image_url", "image_url": {"url": data_url(im)}} if url else {"type": "image", "image": im}
                for im in images]
    return {"content": [*pictures, {"type": "text", "text": text}]}


@pytest.fixture(scope="module")
def reranker(tmp_path_factory) -> Path:
    return write_reranker(tmp_path_factory.mktemp("reranker"))


@pytest.fixture(scope="module")
def hf_reranker(reranker) -> TransformersReranker:
    return TransformersReranker(reranker)


DOCUMENTS = [("a red circle in the top left.", []), ("", [RED]), ("this picture:", [BLUE]),
             ("two blue squares and a green triangle", [])]


def test_reranker_scores_match_transformers(reranker, hf_reranker):
    """The checkpoint is a reranker by its config.json alone: one query against text and
    picture documents, a picture in the query, raw logit differences, another
    instruction; the same query again reads its prefix from the cache; nothing is left
    held once the prompts are done."""
    llm = LLM(str(reranker), dtype="float32", num_kv_blocks=256)
    query = ("Which one shows a red circle?", [])
    documents = [text if not images else content(text, images) for text, images in DOCUMENTS]
    for _ in range(2):
        outs = llm.score(query[0], documents)
        for out, document in zip(outs, DOCUMENTS):
            assert abs(out.outputs.score - hf_reranker.score(query, document)) < 1e-5
    assert all(out.num_cached_tokens > 0 for out in outs)  # the second time: the shared system + query prefix
    picture_query = ("Find pictures like this one:", [BLUE])
    one = llm.score(content(*picture_query), content("", [RED]), instruction="Match the colour.")[0]
    assert abs(one.outputs.score - hf_reranker.score(picture_query, ("", [RED]), "Match the colour.")) < 1e-5
    stats = llm.engine.stats()
    assert stats.num_running == 0 and not any(stats.blocks_in_use.values())
    assert stats.encoder_cache_entries_in_use == 0


def test_a_generation_checkpoint_as_a_reranker_by_flags(reranker, hf_reranker):
    """The same checkpoint without the config entry: --runner pooling with
    classifier_from_token in --pooler-config; use_activation=False gives the raw logit
    difference; per-pair queries."""
    plain = reranker.parent / "plain"
    plain.mkdir(exist_ok=True)
    for f in reranker.iterdir():
        (plain / f.name).write_bytes(f.read_bytes())
    config = json.loads((plain / "config.json").read_text())
    del config["classifier_from_token"], config["is_original_qwen3_reranker"]
    (plain / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="this model generates text"):
        LLM(str(plain), dtype="float32", num_kv_blocks=64).score("q", "d")
    llm = LLM(str(plain), dtype="float32", num_kv_blocks=128, runner="pooling",
              pooler_config={"classifier_from_token": ["no", "yes"], "use_activation": False})
    queries, documents = ["red?", "blue?"], ["a red circle", "a blue square"]
    for out, q, d in zip(llm.score(queries, documents), queries, documents):
        assert abs(out.outputs.score - hf_reranker.score((q, []), (d, []), activation=False)) < 1e-4
    with pytest.raises(ValueError, match="2 items in data_1 for 3 in data_2"):
        llm.score(queries, documents + ["x"])
    with pytest.raises(ValueError, match="dimensions does not apply"):
        llm.embed("x", PoolingParams(dimensions=4))


def test_reranker_tokens_must_be_in_the_vocabulary(qwen2vl_path):
    with pytest.raises(ConfigError, match="'no' is not a token of this checkpoint's vocabulary"):
        LLM(qwen2vl_path, dtype="float32", num_kv_blocks=64, runner="pooling",
            pooler_config={"classifier_from_token": ["no", "yes"]})
    with pytest.raises(ConfigError, match="two tokens"):
        LLM(qwen2vl_path, dtype="float32", num_kv_blocks=64, runner="pooling",
            pooler_config={"classifier_from_token": ["yes"]})


def test_an_embedding_model_scores_by_cosine_similarity(qwen2vl_path, tmp_path):
    """An embedder scores each pair as the cosine of the two sides' vectors: text as it is,
    content with pictures rendered as a user turn; a query shared by every pair is
    embedded once."""
    from test_embeddings import TransformersEmbedder
    from vlmserve.testing.embedders import write_embedder

    path = str(write_embedder(qwen2vl_path, tmp_path / "st"))
    ref = TransformersEmbedder(path)
    llm = LLM(path, dtype="float32", num_kv_blocks=256)
    outs = llm.score("a red circle", ["a red circle", content("Describe the image.", [RED])])
    query = ref.embed("a red circle", [])
    wants = [ref.embed("a red circle", []), ref.embed(ref.prompt("Describe the image.", 1), [RED])]
    for out, want in zip(outs, wants):
        assert abs(out.outputs.score - float(torch.nn.functional.cosine_similarity(query, want, dim=0))) < 1e-5
    assert abs(outs[0].outputs.score - 1) < 1e-5


# -- the server ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reranker_server(reranker):
    from test_openai_server import Server

    server = Server(str(reranker), "--dtype", "float32", "--num-kv-blocks", "256")
    yield server
    server.stop()


def post(server, path: str, body: dict):
    import httpx

    return httpx.post(server.base + path, json={"model": "tiny", **body}, headers={"Authorization": "Bearer none"},
                      timeout=60)


def test_server_scores_and_reranks_with_pictures(reranker_server, hf_reranker):
    query = ("Which one shows a red circle?", [])
    documents = [text if not images else content(text, images, url=True) for text, images in DOCUMENTS]
    want = [hf_reranker.score(query, d) for d in DOCUMENTS]
    body = post(reranker_server, "/v1/score", {"text_1": query[0], "text_2": documents}).json()
    assert [d["index"] for d in body["data"]] == [0, 1, 2, 3] and body["usage"]["prompt_tokens"] > 0
    assert all(abs(d["score"] - w) < 1e-5 for d, w in zip(body["data"], want))
    # the queries/documents names, one query per document
    pairs = post(reranker_server, "/score", {"queries": [query[0]] * 2, "documents": documents[:2]}).json()
    assert [round(d["score"], 5) for d in pairs["data"]] == [round(w, 5) for w in want[:2]]
    ranked = post(reranker_server, "/v1/rerank", {"query": query[0], "documents": documents, "top_n": 2}).json()
    order = sorted(range(4), key=lambda i: -want[i])[:2]
    assert [r["index"] for r in ranked["results"]] == order
    assert all(abs(r["relevance_score"] - want[r["index"]]) < 1e-5 for r in ranked["results"])
    first = ranked["results"][0]["document"]
    assert first == ({"text": documents[order[0]]} if isinstance(documents[order[0]], str)
                     else {"multi_modal": documents[order[0]]["content"]})
    raw = post(reranker_server, "/v2/rerank", {"query": query[0], "documents": documents[:1], "use_activation": False,
                                               "instruction": "Find red."}).json()
    assert abs(raw["results"][0]["relevance_score"]
               - hf_reranker.score(query, DOCUMENTS[0], "Find red.", activation=False)) < 1e-4


def test_server_refuses_bad_pairs_and_other_endpoints(reranker_server, short_context_server):
    import openai

    cases = [({"text_1": ["a", "b"], "text_2": ["x", "y", "z"]}, "2 items in text_1 for 3 in text_2"),
             ({"text_1": "a"}, "send the pairs to score as queries and documents"),
             ({"queries": "a", "documents": []}, "documents is empty"),
             ({"queries": "a", "documents": [{"content": [{"type": "audio", "audio": "x"}]}]},
              "unsupported content part type 'audio'"),
             ({"queries": "a", "documents": [{"text": "no content"}]}, "documents[0] must be a string or"),
             ({"queries": "a", "documents": [content("", [RED], url=True)], "truncate_prompt_tokens": 10**6},
              "truncate_prompt_tokens")]
    for body, message in cases:
        response = post(reranker_server, "/v1/score", body)
        assert response.status_code == 400, response.text
        assert message in response.json()["error"]["message"]
    bad_picture = {"queries": "a", "documents": [{"content": [{"type": "image_url", "image_url": {"url": "data:x"}}]}]}
    assert post(reranker_server, "/v1/score", bad_picture).status_code == 400
    client = reranker_server.client()
    with pytest.raises(openai.BadRequestError, match="this model is a reranker"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="this model is a reranker"):
        client.embeddings.create(model="tiny", input="hi")
    refused = post(short_context_server, "/v1/rerank", {"query": "a", "documents": ["b"]})
    assert refused.status_code == 400 and "--runner pooling" in refused.json()["error"]["message"]
    assert post(reranker_server, "/v1/score", {"text_1": "a", "text_2": "b"}).json()["data"][0]["score"] > 0
