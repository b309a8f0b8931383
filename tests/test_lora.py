"""LoRA adapters: made with PEFT on the test checkpoints, served by vlmserve in mixed
batches, checked against transformers + PEFT (fp32: greedy tokens equal, logprobs 1e-4)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from conftest import HFReference, make_image
from test_scheduler import FakeRunner, assert_everything_free, make_request, make_scheduler, run_to_completion
from vlmserve import LLM, LoRARequest, SamplingParams
from vlmserve.core.kv_cache_utils import BlockHasher
from vlmserve.lora.adapter import LoRAError
from vlmserve.request import Request
from vlmserve.testing.lora_adapters import write_lora_adapter

LANGUAGE = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Qwen2.5-VL's vision tower: attention, its output, the patch embedding (a Conv3d), the merger
VISION = ["qkv", "attn.proj", "patch_embed.proj", "merger.mlp.0", "merger.mlp.2"]
IMG = make_image(64, 64, 0)
IMG_B = make_image(56, 84, 5)


@pytest.fixture(scope="module")
def adapters(qwen25_path, tmp_path_factory):
    """Three adapters of the tiny Qwen2.5-VL: attention only (rank 4); the MLP (rank 8,
    rsLoRA, a per-module alpha); everything, the vision tower included (rank 16)."""
    root = tmp_path_factory.mktemp("loras")
    paths = {
        "attn": write_lora_adapter(qwen25_path, root / "attn", 4, ["q_proj", "v_proj", "o_proj"], seed=1),
        "mlp": write_lora_adapter(qwen25_path, root / "mlp", 8, ["gate_proj", "up_proj", "down_proj"], seed=2,
                                  use_rslora=True, alpha_pattern={"down_proj": 4}),
        "vision": write_lora_adapter(qwen25_path, root / "vision", 16, LANGUAGE + VISION, seed=3, std=0.1),
    }
    return {name: LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(paths.items())}


class PeftReference:
    """transformers' model under each adapter (PEFT), and without one."""

    def __init__(self, base: str, adapters: dict[str, LoRARequest]) -> None:
        from peft import PeftModel

        self.base = HFReference(base)
        self.refs = {None: self.base}
        for name, lora in adapters.items():
            ref = HFReference(base)
            ref.model = PeftModel.from_pretrained(ref.model, lora.lora_path).eval()
            self.refs[name] = ref

    def prompt(self, text: str, n_images: int) -> str:
        return self.base.prompt(text, n_images)

    def generate(self, adapter: str | None, prompt: str, images, max_tokens: int):
        return self.refs[adapter].generate(prompt, images, max_tokens)


@pytest.fixture(scope="module")
def peft_qwen25(qwen25_path, adapters):
    return PeftReference(qwen25_path, adapters)


def greedy(max_tokens=8):
    return SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=1, ignore_eos=True)


def check_all(llm, ref, cases, adapters, max_tokens=8):
    """Runs the cases (adapter name or None, text, images) as one batch; each answer equals
    the reference's under its adapter."""
    prompts = [{"prompt": ref.prompt(text, len(images)), "multi_modal_data": {"image": images}}
               for _, text, images in cases]
    loras = [adapters[name] if name else None for name, _, _ in cases]
    outputs = llm.generate(prompts, greedy(max_tokens), lora_request=loras)
    for (name, text, images), out in zip(cases, outputs):
        tokens, logprobs = ref.generate(name, ref.prompt(text, len(images)), images, max_tokens)
        got = out.outputs[0]
        assert got.token_ids == tokens, (name, text)
        chosen = torch.tensor([entry.logprobs[0] for entry in got.logprobs])
        assert torch.allclose(chosen, logprobs[torch.arange(len(tokens)), torch.tensor(tokens)], atol=1e-4)
    return outputs


MIXED = [(name, text, images) for name in ("attn", "mlp", "vision", None)
         for text, images in (("Describe the image. " * 3, [IMG]), ("Tell me a story about a fox.", []))]


def test_adapters_change_the_answers(peft_qwen25):
    """The test adapters are strong enough to change greedy answers (else parity proves nothing)."""
    prompt = peft_qwen25.prompt("Describe the image.", 1)
    answers = {name: tuple(peft_qwen25.generate(name, prompt, [IMG], 8)[0]) for name in (None, "attn", "mlp", "vision")}
    assert len(set(answers.values())) == 4


def test_mixed_batch_matches_peft_with_chunks_and_prefix_hits(qwen25_path, adapters, peft_qwen25):
    """Three adapters and the base model in one batch, prompts cut into chunks of 24
    tokens, two slots for three adapters (a request waits for a slot, never fails); run
    twice: the second run hits the prefix cache of its own adapter only."""
    llm = LLM(qwen25_path, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16, num_kv_blocks=256,
              max_num_batched_tokens=24)
    first = check_all(llm, peft_qwen25, MIXED, adapters)
    # one picture, shared by the base model and the adapter that leaves the tower alone
    # (attn); encoded its own way under the vision adapter and under the MLP one (its
    # module names match the tower's MLP too, and PEFT adapts both)
    assert llm.engine.engine_core.runner.encoder_runs == 3
    second = check_all(llm, peft_qwen25, MIXED, adapters)
    assert llm.engine.engine_core.runner.encoder_runs == 3
    for a, b in zip(first, second):
        assert a.num_cached_tokens == 0 and b.num_cached_tokens > 0
    # a prompt seen before under one adapter is new to another: no KV shared
    moved = check_all(llm, peft_qwen25, [("mlp", "Describe the image. " * 3, [IMG_B]),
                                         ("attn", "Describe the image. " * 3, [IMG_B])], adapters)
    assert moved[1].num_cached_tokens == 0


def test_preemption_keeps_each_requests_adapter(qwen25_path, adapters, peft_qwen25):
    llm = LLM(qwen25_path, dtype="float32", enable_lora=True, max_loras=3, max_lora_rank=16, num_kv_blocks=24,
              max_num_seqs=8)
    check_all(llm, peft_qwen25, MIXED, adapters, max_tokens=16)
    assert llm.engine.stats().num_preemptions > 0


def test_block_hashes_differ_per_adapter(adapters):
    def hashes(lora):
        return Request("r", list(range(40)), SamplingParams(), 0, block_hasher=BlockHasher(16),
                       lora_request=lora).block_hashes

    assert hashes(None) != hashes(adapters["attn"]) != hashes(adapters["mlp"])
    assert hashes(adapters["attn"]) == hashes(adapters["attn"])
    reloaded = dataclasses.replace(adapters["attn"], lora_int_id=9)  # the same name loaded again: new weights
    assert hashes(reloaded) != hashes(adapters["attn"])


def test_scheduler_runs_at_most_max_loras_adapters_and_the_rest_wait():
    sched = make_scheduler(budget=64, max_seqs=8)
    sched.config.max_loras = 2
    loras = [LoRARequest(f"a{i}", i, "/unused") for i in (1, 2, 3)]
    for i in range(6):
        request = make_request(f"r{i}", 10, 5, seed=i)
        request.lora_request = loras[i % 3]
        sched.add_request(request)
    seen = []

    def watch(step, so):
        adapters = {sched.requests[rid].lora_request.lora_int_id for rid in so.num_scheduled_tokens
                    if rid in sched.requests}
        seen.append(len({r.lora_request.lora_int_id for r in sched.running}))
        assert len(adapters) <= 2

    run_to_completion(sched, FakeRunner(sched), watch)
    assert max(seen) == 2
    assert_everything_free(sched)


def test_refusals_name_what_is_wrong(qwen25_path, adapters, tmp_path):
    llm = LLM(qwen25_path, dtype="float32", enable_lora=True, max_lora_rank=8, num_kv_blocks=64)
    prompt = "Tell me a story."
    with pytest.raises(LoRAError, match=r"rank 16 .* over --max-lora-rank 8"):
        llm.generate(prompt, greedy(), lora_request=adapters["vision"])
    head = write_lora_adapter(qwen25_path, tmp_path / "head", 4, ["lm_head"], seed=4)
    with pytest.raises(LoRAError, match="(adapts|whole weight of) lm_head"):
        llm.generate(prompt, greedy(), lora_request=LoRARequest("head", 7, str(head)))
    dora = write_lora_adapter(qwen25_path, tmp_path / "dora", 4, ["q_proj"], seed=5, use_dora=True)
    with pytest.raises(LoRAError, match="DoRA"):
        llm.generate(prompt, greedy(), lora_request=LoRARequest("dora", 8, str(dora)))
    saved = write_lora_adapter(qwen25_path, tmp_path / "saved", 4, ["q_proj"], seed=6, modules_to_save=["lm_head"])
    with pytest.raises(LoRAError, match="modules_to_save"):
        llm.generate(prompt, greedy(), lora_request=LoRARequest("saved", 9, str(saved)))
    with pytest.raises(LoRAError, match="no adapter_config.json"):
        llm.generate(prompt, greedy(), lora_request=LoRARequest("none", 10, str(tmp_path / "missing")))
    config = json.loads((head / "adapter_config.json").read_text())
    assert config["target_modules"] == ["lm_head"]  # what was refused is what PEFT wrote
    # nothing was left behind by the refusals: a good adapter still runs
    assert llm.generate(prompt, greedy(), lora_request=adapters["attn"])[0].outputs[0].token_ids
    off = LLM(qwen25_path, dtype="float32", num_kv_blocks=64)
    with pytest.raises(LoRAError, match="LoRA is off: start the engine with --enable-lora"):
        off.generate(prompt, greedy(), lora_request=adapters["attn"])


# -- the server ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lora_server(qwen25_path, adapters):
    from test_openai_server import Server

    server = Server(qwen25_path, "--dtype", "float32", "--num-kv-blocks", "256", "--max-loras", "2",
                    "--lora-modules", f"attn={adapters['attn'].lora_path}",
                    f'{{"name": "vision", "path": "{adapters["vision"].lora_path}"}}',
                    "--allow-runtime-lora-updating")
    yield server
    server.stop()


def picture_chat(client, model, max_tokens=8, stream=False):
    from conftest import data_url

    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(IMG)}},
                                             {"type": "text", "text": "Describe the image."}]}]
    return client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0,
                                          stream=stream, extra_body={"ignore_eos": True, "return_token_ids": True})


def test_server_serves_adapters_by_model_name(lora_server, peft_qwen25):
    client = lora_server.client()
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {"tiny", "attn", "vision"}
    assert cards["attn"].parent == "tiny" and cards["tiny"].parent is None
    prompt = peft_qwen25.prompt("Describe the image.", 1)
    for model, adapter in (("attn", "attn"), ("vision", "vision"), ("tiny", None)):
        tokens, _ = peft_qwen25.generate(adapter, prompt, [IMG], 8)
        answer = picture_chat(client, model)
        assert answer.model == model
        assert answer.choices[0].token_ids == tokens, model
    # streamed, under an adapter
    chunks = list(picture_chat(client, "vision", stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    tokens, _ = peft_qwen25.generate("vision", prompt, [IMG], 8)
    assert text == peft_qwen25.base.processor.tokenizer.decode(tokens, skip_special_tokens=True)
    with pytest.raises(Exception, match="model 'nope' does not exist"):
        picture_chat(client, "nope")


def test_adapters_load_and_unload_while_requests_run(lora_server, adapters, peft_qwen25, tmp_path, qwen25_path):
    import concurrent.futures

    import httpx

    client = lora_server.client()
    prompt = peft_qwen25.prompt("Describe the image.", 1)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        running = pool.submit(picture_chat, client, "attn", 64)
        loaded = httpx.post(lora_server.base + "/v1/load_lora_adapter",
                            json={"lora_name": "mlp", "lora_path": adapters["mlp"].lora_path}, timeout=60)
        assert loaded.status_code == 200 and "added" in loaded.text
        answer = picture_chat(client, "mlp")
        assert answer.choices[0].token_ids == peft_qwen25.generate("mlp", prompt, [IMG], 8)[0]
        unloaded = httpx.post(lora_server.base + "/v1/unload_lora_adapter", json={"lora_name": "attn"}, timeout=60)
        assert unloaded.status_code == 200
        # the request that was running under it finishes under it
        long = running.result(timeout=120)
        assert long.choices[0].token_ids[:8] == peft_qwen25.generate("attn", prompt, [IMG], 8)[0]
    assert "attn" not in {m.id for m in client.models.list().data}
    with pytest.raises(Exception, match="model 'attn' does not exist"):
        picture_chat(client, "attn")
    again = httpx.post(lora_server.base + "/v1/load_lora_adapter",
                       json={"lora_name": "mlp", "lora_path": adapters["mlp"].lora_path}, timeout=60)
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    dora = write_lora_adapter(qwen25_path, tmp_path / "dora", 4, ["q_proj"], seed=5, use_dora=True)
    refused = httpx.post(lora_server.base + "/v1/load_lora_adapter", json={"lora_name": "dora", "lora_path": str(dora)},
                         timeout=60)
    assert refused.status_code == 400 and "DoRA" in refused.json()["error"]["message"]
    missing = httpx.post(lora_server.base + "/v1/unload_lora_adapter", json={"lora_name": "nope"}, timeout=60)
    assert missing.status_code == 404
    assert httpx.get(lora_server.base + "/health").status_code == 200


def test_caption_under_an_adapter(qwen25_path, adapters, peft_qwen25, tmp_path):
    """`vlmserve caption --lora` on real files: every caption is the adapter's (rank 16 is
    over the default limit only for the engine's flag: --lora raises it); a bad adapter is
    one line and exit code 2."""
    from conftest import png_bytes
    from test_caption_cli import caption, rows_of

    (tmp_path / "pics").mkdir()
    (tmp_path / "pics" / "a.png").write_bytes(png_bytes(IMG))
    (tmp_path / "pics" / "b.png").write_bytes(png_bytes(IMG_B))
    out = tmp_path / "captions.jsonl"
    caption(qwen25_path, str(tmp_path / "pics"), "--out", str(out), "--dtype", "float32", "--max-tokens", "8",
            "--ignore-eos", "--max-lora-rank", "8", "--lora", adapters["vision"].lora_path, check=True)
    tokenizer = peft_qwen25.base.processor.tokenizer
    prompt = peft_qwen25.prompt("Describe the image.", 1)
    for row in rows_of(out):
        image = IMG if row["path"].endswith("a.png") else IMG_B
        tokens, _ = peft_qwen25.generate("vision", prompt, [image], 8)
        assert row["caption"] == tokenizer.decode(tokens, skip_special_tokens=True)
    bad = caption(qwen25_path, str(tmp_path / "pics"), "--out", str(tmp_path / "bad.jsonl"), "--lora",
                  str(tmp_path / "nowhere"))
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines()[-1].startswith("vlmserve: --lora: ") and "no adapter_config.json" in bad.stderr


def test_hybrid_qwen35_mixed_batch_matches_peft(qwen35_path, tmp_path_factory):
    """The Qwen3.5 hybrid: adapters on its Gated DeltaNet projections (in_proj_qkv, z, b,
    a, out_proj: one fused layer in vlmserve), its gated attention, its MLP; three adapters
    and the base model in one batch on two slots, chunked prefill, then prefix hits
    (recurrent-state snapshots per adapter); then preemption in a small cache."""
    root = tmp_path_factory.mktemp("loras35")
    loras = {
        "gdn": LoRARequest("gdn", 1, str(write_lora_adapter(
            qwen35_path, root / "gdn", 8, ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"], seed=11,
            std=0.1))),
        "attn": LoRARequest("attn", 2, str(write_lora_adapter(
            qwen35_path, root / "attn", 4, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "down_proj"],
            seed=12, std=0.1))),
        "mlp": LoRARequest("mlp", 3, str(write_lora_adapter(
            qwen35_path, root / "mlp", 2, ["up_proj", "down_proj"], seed=13, std=0.2, use_rslora=True))),
    }
    ref = PeftReference(qwen35_path, loras)
    cases = [(name, text, images) for name in ("gdn", "attn", "mlp", None)
             for text, images in (("Describe the image. " * 3, [IMG]), ("Tell me a story about a fox.", []))]
    prompt = ref.prompt("Describe the image.", 1)
    assert len({tuple(ref.generate(name, prompt, [IMG], 8)[0]) for name in ("gdn", "attn", "mlp", None)}) == 4
    llm = LLM(qwen35_path, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8, num_kv_blocks=256,
              max_num_batched_tokens=32)
    check_all(llm, ref, cases, loras)
    again = check_all(llm, ref, cases, loras)
    assert all(out.num_cached_tokens > 0 for out in again)
    small = LLM(qwen35_path, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8, num_kv_blocks=12,
                max_num_seqs=6)
    check_all(small, ref, cases, loras, max_tokens=16)
    assert small.engine.stats().num_preemptions > 0


# -- the GPU path (Triton kernels, here in Triton's interpreter) -----------------------------------
@pytest.mark.parametrize("pattern", ["interleaved", "one adapter", "none"])
def test_triton_segment_kernels_match_torch(pattern):
    """Shrink and expand over tokens ordered into per-slot segments equal the CPU's grouped
    matmuls: tokens of 3 slots interleaved with tokens of none, one adapter for every row
    (an encoder run), no adapter at all."""
    from vlmserve.kernels import lora as lora_kernels
    from vlmserve.kernels import triton_lora

    gen = torch.Generator().manual_seed(0)
    rows, k, n, slots, ranks = 37, 48, 40, 3, 24
    x = torch.randn(rows, k, generator=gen)
    a, b = torch.randn(slots, ranks, k, generator=gen), torch.randn(slots, n, ranks, generator=gen)
    if pattern == "one adapter":
        mapping = lora_kernels.LoRAMapping(None, [(1, slice(None))])
    else:
        token_slots = torch.randint(-1, slots, (rows,), generator=gen, dtype=torch.int32)
        if pattern == "none":
            token_slots.fill_(-1)
        groups = [(s, (token_slots == s).nonzero().flatten()) for s in range(slots) if (token_slots == s).any()]
        mapping = lora_kernels.LoRAMapping(token_slots, groups)
    base = torch.randn(rows, n, generator=gen)
    want, got = base.clone(), base.clone()
    lora_kernels.add_lora(want, x, a, b, mapping)
    triton_lora.add_lora_triton(got, x, a, b, mapping)
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)
    assert (pattern != "none") == (not torch.equal(got, base))


def test_mixed_batch_on_triton_kernels(qwen25_path, adapters, peft_qwen25):
    llm = LLM(qwen25_path, dtype="float32", use_triton=True, enable_lora=True, max_loras=3, max_lora_rank=16,
              num_kv_blocks=256)
    check_all(llm, peft_qwen25, [("attn", "Describe the image.", [IMG]), ("vision", "Describe the image.", [IMG]),
                                 (None, "Tell me a story.", [])], adapters, max_tokens=4)


def test_an_adapter_folder_gone_after_its_check_fails_its_request_alone(qwen25_path, adapters, tmp_path):
    """The front end checked the adapter; its folder is then removed before the request
    reaches the engine core: that request is refused (LoRAError) and leaves nothing
    behind, the request beside it runs to its end."""
    import shutil

    gone = tmp_path / "gone"
    shutil.copytree(adapters["attn"].lora_path, gone)
    lora = LoRARequest("gone", 9, str(gone))
    llm = LLM(qwen25_path, dtype="float32", enable_lora=True, max_lora_rank=16, num_kv_blocks=64)
    engine = llm.engine
    bad = engine.process_request("bad", "Tell me a story.", greedy(), lora_request=lora)  # checked here
    shutil.rmtree(gone)
    engine.add_request("good", "Tell me a story.", greedy(), lora_request=adapters["mlp"])
    with pytest.raises(LoRAError, match="no adapter_config.json"):
        engine.add_processed(bad)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert [o.request_id for o in outputs if o.finished] == ["good"]
    assert len(outputs[-1].outputs[0].token_ids) == 8
    stats = engine.stats()
    assert stats.num_running == stats.num_waiting == 0 and not any(stats.blocks_in_use.values())
