"""Embeddings: checkpoints made with sentence-transformers from the test models, served
by vlmserve's pooling runner, checked against transformers' pooled hidden states (fp32:
cosine within 1e-5) and sentence-transformers' own vectors."""

from __future__ import annotations

import pytest
import torch

from conftest import make_image
from vlmserve import LLM, PoolingParams, SamplingParams
from vlmserve.testing.embedders import write_embedder

IMG, IMG_B = make_image(64, 64, 0), make_image(56, 84, 5)


class TransformersEmbedder:
    """The reference: transformers' bare model (AutoModel), its last hidden states pooled."""

    def __init__(self, path: str) -> None:
        from transformers import AutoModel, AutoProcessor

        self.processor = AutoProcessor.from_pretrained(path)
        self.model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()

    def prompt(self, text: str, n_images: int) -> str:
        content = [{"type": "image"}] * n_images + [{"type": "text", "text": text}]
        return self.processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=False)

    @torch.no_grad()
    def embed(self, prompt: str, images, pooling: str = "LAST", normalize: bool = True, dims: int | None = None):
        inputs = self.processor(text=[prompt], images=images or None, return_tensors="pt")
        hidden = self.model(**inputs).last_hidden_state[0].float()
        vector = {"LAST": hidden[-1], "MEAN": hidden.mean(0), "CLS": hidden[0]}[pooling][:dims]
        return torch.nn.functional.normalize(vector, dim=-1) if normalize else vector


def prompts_of(ref: TransformersEmbedder) -> list[tuple[str, list]]:
    return [("a small red circle in the top left.", []), (ref.prompt("Describe the image in detail. " * 3, 1), [IMG]),
            (ref.prompt("Compare the two pictures.", 2), [IMG, IMG_B])]


def assert_close(got: list[float], want: torch.Tensor) -> None:
    got = torch.tensor(got)
    assert got.shape == want.shape
    assert 1 - torch.nn.functional.cosine_similarity(got, want, dim=0) < 1e-5
    assert torch.allclose(got, want, atol=1e-4)


@pytest.fixture(scope="module", params=["qwen2vl", "qwen3vl"])
def embedder(request, tmp_path_factory):
    base = request.getfixturevalue(f"{request.param}_path")
    return str(write_embedder(base, tmp_path_factory.mktemp(f"{request.param}-embedder") / "st"))


def test_embeddings_match_transformers_with_prefix_hits(embedder):
    """A sentence-transformers checkpoint embeds by itself (modules.json: last token,
    normalised): text, one picture, two pictures, in one batch; again, from the prefix
    and encoder caches."""
    ref = TransformersEmbedder(embedder)
    llm = LLM(embedder, dtype="float32", num_kv_blocks=256)
    cases = prompts_of(ref)
    prompts = [{"prompt": p, "multi_modal_data": {"image": images}} for p, images in cases]
    first = llm.embed(prompts)
    second = llm.embed(prompts)
    for (prompt, images), a, b in zip(cases, first, second):
        want = ref.embed(prompt, images)
        assert_close(a.outputs.embedding, want)
        assert_close(b.outputs.embedding, want)
    assert all(out.num_cached_tokens > 0 for out in second[1:])  # the pictures' prompts hit the cache
    assert llm.engine.engine_core.runner.encoder_runs == 2  # each picture encoded once
    stats = llm.engine.stats()
    assert stats.num_running == 0 and not any(stats.blocks_in_use.values())  # blocks freed once the prompt is done
    assert stats.encoder_cache_entries_in_use == 0


def test_sentence_transformers_gives_the_same_vectors(embedder):
    """sentence-transformers renders each input as a user message by the chat template
    (a picture before its text): the same prompt given to vlmserve gives its vector."""
    from sentence_transformers import SentenceTransformer

    ref = TransformersEmbedder(embedder)
    inputs = [("two blue squares", []), ("Describe the image.", [IMG]), ("What is this?", [IMG_B])]
    st_inputs = [{"image": images[0], "text": text} if images else text for text, images in inputs]
    want = SentenceTransformer(embedder, device="cpu").encode(st_inputs, convert_to_tensor=True)
    got = LLM(embedder, dtype="float32", num_kv_blocks=64).embed(
        [{"prompt": ref.prompt(text, len(images)), "multi_modal_data": {"image": images}} for text, images in inputs])
    for vector, out in zip(want, got):
        assert_close(out.outputs.embedding, vector.float())


@pytest.mark.parametrize("pooling", ["MEAN", "CLS"])
def test_mean_and_cls_pooling_through_prompt_chunks(qwen2vl_path, pooling):
    """--runner pooling on a generation checkpoint, MEAN or CLS pooling across prompt
    chunks of 16 tokens (never from the prefix cache: they read every token); Matryoshka
    dimensions and normalisation per request."""
    ref = TransformersEmbedder(qwen2vl_path)
    llm = LLM(qwen2vl_path, dtype="float32", num_kv_blocks=256, runner="pooling",
              pooler_config={"pooling_type": pooling, "normalize": False}, max_num_batched_tokens=16)
    cases = prompts_of(ref)
    prompts = [{"prompt": p, "multi_modal_data": {"image": images}} for p, images in cases]
    for params, normalize, dims in ((None, False, None), (PoolingParams(dimensions=24, normalize=True), True, 24)):
        outs = llm.embed(prompts, params)
        for (prompt, images), out in zip(cases, outs):
            assert_close(out.outputs.embedding, ref.embed(prompt, images, pooling, normalize, dims))
            assert out.num_cached_tokens == 0


def test_generation_and_embedding_requests_go_to_the_right_model(qwen2vl_path, embedder):
    with pytest.raises(ValueError, match="this model embeds"):
        LLM(embedder, dtype="float32", num_kv_blocks=64).generate("hello", SamplingParams(max_tokens=2))
    generator = LLM(qwen2vl_path, dtype="float32", num_kv_blocks=64)
    with pytest.raises(ValueError, match="this model generates text"):
        generator.embed("hello")
    with pytest.raises(ValueError, match="dimensions=1000"):
        LLM(embedder, dtype="float32", num_kv_blocks=64).embed("hello", PoolingParams(dimensions=1000))
