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


# -- the server ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def embedding_server(qwen2vl_path, tmp_path_factory):
    from test_openai_server import Server

    path = write_embedder(qwen2vl_path, tmp_path_factory.mktemp("served-embedder") / "st")
    server = Server(str(path), "--dtype", "float32", "--num-kv-blocks", "256")
    yield server, str(path)
    server.stop()


def test_server_embeddings_with_the_official_client(embedding_server):
    import base64

    import httpx
    import numpy as np

    from conftest import data_url

    server, path = embedding_server
    ref = TransformersEmbedder(path)
    client = server.client()
    texts = ["two blue squares", "a small red circle in the top left."]
    got = client.embeddings.create(model="tiny", input=texts)
    assert [d.index for d in got.data] == [0, 1] and got.usage.prompt_tokens > 0
    for text, item in zip(texts, got.data):
        assert_close(item.embedding, ref.embed(text, []))
    packed = client.embeddings.create(model="tiny", input=texts[0], encoding_format="base64", dimensions=16)
    vector = np.frombuffer(base64.b64decode(packed.data[0].embedding), dtype="<f4")  # the client leaves it as sent
    assert_close(vector.tolist(), ref.embed(texts[0], [], dims=16))
    # vLLM's multimodal form: chat messages with a picture, rendered by the template
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(IMG)}},
                                             {"type": "text", "text": "Describe the image."}]}]
    body = httpx.post(server.base + "/v1/embeddings", json={"model": "tiny", "messages": messages},
                      headers={"Authorization": "Bearer none"}, timeout=60).json()
    assert_close(body["data"][0]["embedding"], ref.embed(ref.prompt("Describe the image.", 1), [IMG]))
    # token ids
    ids = ref.processor.tokenizer.encode(texts[1])
    assert_close(client.embeddings.create(model="tiny", input=ids).data[0].embedding, ref.embed(texts[1], []))


def test_server_refuses_what_an_embedding_model_cannot_do(embedding_server):
    import openai

    server, _ = embedding_server
    client = server.client()
    with pytest.raises(openai.BadRequestError, match="this model embeds"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="dimensions=4096"):
        client.embeddings.create(model="tiny", input="hi", dimensions=4096)
    with pytest.raises(openai.BadRequestError, match="input"):
        client.embeddings.create(model="tiny", input=[])
    assert client.embeddings.create(model="tiny", input="still fine").data[0].embedding


def test_embeddings_on_a_generation_model_are_refused(short_context_server):
    import openai

    with pytest.raises(openai.BadRequestError, match="start the server with --runner pooling"):
        short_context_server.client().embeddings.create(model="tiny", input="hi")


# -- the embed command -----------------------------------------------------------------------------
def test_embed_command_on_files_and_texts(embedding_server, tmp_path):
    """`vlmserve embed` on real files (a copy, a broken file) and a texts file, to Parquet
    and to .npy: each vector is LLM.embed's for the same prompt; --resume redoes nothing."""
    import subprocess
    import sys

    import numpy as np
    import pyarrow.parquet as pq

    from conftest import png_bytes

    _, path = embedding_server
    folder = tmp_path / "pics"
    folder.mkdir()
    (folder / "a.png").write_bytes(png_bytes(IMG))
    (folder / "b.png").write_bytes(png_bytes(IMG_B))
    (folder / "copy.png").write_bytes(png_bytes(IMG))
    (folder / "broken.png").write_bytes(b"not a picture")
    texts = tmp_path / "texts.txt"
    texts.write_text("two blue squares\nWhat is in the picture? [a guess]\n")

    def embed(out, *extra):
        return subprocess.run([sys.executable, "-m", "vlmserve.entrypoints.cli", "embed", str(folder), "--out", str(out),
                               "--texts", str(texts), "--model", path, "--dtype", "float32", "--num-kv-blocks", "256",
                               "--no-progress", *extra], capture_output=True, text=True, timeout=600)

    done = embed(tmp_path / "vectors.parquet")
    assert done.returncode == 1, done.stderr  # the broken file failed; the rest is written
    table = pq.read_table(tmp_path / "vectors.parquet").to_pylist()
    rows = {r["path"].rsplit("/", 1)[-1]: r for r in table}
    assert set(rows) == {"a.png", "b.png", "copy.png", "broken.png", "text:two blue squares",
                         "text:What is in the picture? [a guess]"}
    assert rows["broken.png"]["embedding"] is None and rows["broken.png"]["error"]
    assert rows["copy.png"]["duplicate_of"].endswith("a.png") and rows["copy.png"]["embedding"] == rows["a.png"]["embedding"]
    llm = LLM(path, dtype="float32", num_kv_blocks=256)
    prompt = llm.engine.render_chat([{"role": "user", "content": [{"type": "image", "image": "x"},
                                                                  {"type": "text", "text": "Describe the image."}]}])
    want = llm.embed([{"prompt": prompt.prompt, "multi_modal_data": {"image": [image]}} for image in (IMG, IMG_B)])
    assert_close(rows["a.png"]["embedding"], torch.tensor(want[0].outputs.embedding))
    assert_close(rows["b.png"]["embedding"], torch.tensor(want[1].outputs.embedding))
    text = llm.embed(llm.engine.render_chat([{"role": "user", "content": "two blue squares"}]))[0]
    assert_close(rows["text:two blue squares"]["embedding"], torch.tensor(text.outputs.embedding))
    again = embed(tmp_path / "vectors.parquet", "--resume")
    assert "skipped 6" in again.stderr and pq.read_table(tmp_path / "vectors.parquet").num_rows == 6
    npy = embed(tmp_path / "vectors.npy", "--dimensions", "16")
    matrix = np.load(tmp_path / "vectors.npy")
    names = (tmp_path / "vectors.paths.txt").read_text().splitlines()
    assert matrix.shape == (5, 16) and len(names) == 5 and not any(n.endswith("broken.png") for n in names)
    assert np.allclose(np.linalg.norm(matrix, axis=1), 1, atol=1e-5), npy.stderr


def test_the_shipped_model_embeds():
    """`embed` works on a fresh machine: the shipped model pools its last token; its vectors
    find pictures of the same shape and colour better than chance (1/18)."""
    from vlmserve.training.embedding_recall import recall_at_1

    assert recall_at_1(LLM(runner="pooling"), per_class=2) > 2 / 18


@pytest.mark.slow
def test_embed_on_a_local_ray_cluster_gives_the_vectors_of_one_machine(embedding_server, tmp_path):
    import subprocess
    import sys

    import pyarrow.parquet as pq

    from conftest import png_bytes

    _, path = embedding_server
    folder = tmp_path / "pics"
    folder.mkdir()
    for i in range(6):
        (folder / f"p{i}.png").write_bytes(png_bytes(make_image(48 + 8 * i, 56, seed=40 + i)))
    (folder / "copy.png").write_bytes((folder / "p0.png").read_bytes())
    tables = {}
    for name, extra in (("local", []), ("ray", ["--ray", "--ray-workers", "2"])):
        out = tmp_path / f"{name}.parquet"
        done = subprocess.run([sys.executable, "-m", "vlmserve.entrypoints.cli", "embed", str(folder), "--out", str(out),
                               "--model", path, "--dtype", "float32", "--num-kv-blocks", "256", "--no-progress", *extra],
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr
        tables[name] = {r["path"]: r for r in pq.read_table(out).to_pylist()}
    assert set(tables["ray"]) == set(tables["local"]) and len(tables["ray"]) == 7
    for key, row in tables["local"].items():
        assert_close(tables["ray"][key]["embedding"], torch.tensor(row["embedding"]))
