"""`vlmserve serve --replicas 2`: two engine replicas on a local Ray cluster (Ray Serve)
behind one ingress, driven by the official client. The single server's API tests pass
against it unchanged; then what replicas add: picture-aware routing, a queue that sends
requests elsewhere, a replica killed mid-stream, the drain on SIGTERM."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import openai
import pytest

import test_openai_server as single
from conftest import make_image
from test_openai_server import KEY, Server, data_url, image_chat

pytestmark = pytest.mark.slow  # a Ray cluster and two engines


@pytest.fixture(scope="module")
def server(qwen25_path, media_dir):
    s = Server(qwen25_path, "--replicas", "2", "--replica-cpus", "1", "--affinity-imbalance", "3",
               "--api-key", KEY, "--allowed-local-media-path", str(media_dir), "--max-request-mb", "1",
               "--num-kv-blocks", "512", start_timeout=300)  # a Ray cluster: 30-60 s, more on a cold or busy machine
    yield s
    s.stop()


media_dir = single.media_dir


def replica_series(server: Server, name: str) -> dict[str, float]:
    """A replica-labelled series of the ingress's /metrics, summed per replica."""
    text = _metrics_text(server)
    out: dict[str, float] = {}
    for labels, value in re.findall(rf"^(?:vlmserve|vllm):{re.escape(name)}{{([^}}]*)}} (\S+)$", text, re.M):
        replica = re.search(r'replica="([^"]+)"', labels)
        if replica:
            out[replica.group(1)] = out.get(replica.group(1), 0.0) + float(value)
    return out


def _metrics_text(server: Server) -> str:
    import httpx

    return httpx.get(server.base + "/metrics").text


def wait_for(condition, timeout: float = 30.0, what: str = "") -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if condition():
            return
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


def ray_driver(server: Server, script: str, timeout: float = 120) -> str:
    """Runs script as a Ray driver of the server's cluster in a process of its own, and
    returns what it prints. Not in pytest's process: a Ray 2.60 driver keeps its metrics
    exporter thread after ray.shutdown(), and that thread logging while the process exits
    crashed pytest (SIGSEGV, after every test had passed). The cluster is the one the
    server's log names ("auto" would be the latest one started on this machine)."""
    address = re.search(r"replicas on the Ray cluster at (\S+)", "".join(server.log)).group(1)
    program = textwrap.dedent("""
        import os, sys, time
        os.environ.setdefault("RAY_AUTH_MODE", "token")  # as the server's local cluster has it (its token in ~/.ray)
        import ray
        ray.init(address={address!r}, log_to_driver=False)
        try:
        {body}
        finally:
            ray.shutdown()
        sys.stdout.flush()
        os._exit(0)  # past Ray's exit-time crash above
    """).format(address=address, body=textwrap.indent(textwrap.dedent(script), "    "))
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def chat(client, picture, text: str, **kwargs):
    return client.chat.completions.create(model="tiny", max_tokens=kwargs.pop("max_tokens", 4), temperature=0,
                                          messages=image_chat(data_url(picture), text), **kwargs)


# ----------------------------------------------------------------------------- the same API
@pytest.mark.parametrize("test", [
    single.test_chat_with_images_streamed_and_not_equal_to_the_llm_api,
    single.test_n_stop_logprobs,
    single.test_errors_have_the_right_status_and_the_next_request_works,
    single.test_more_of_the_api_equals_the_llm_api,
    single.test_resolution_per_request,
    single.test_json_schema_through_parse_and_streaming,
    single.test_named_and_required_tool_calls_then_the_tool_result,
    single.test_sampling_parameters_over_the_api,
    single.test_a_client_that_hangs_up_on_a_plain_request_aborts_it,
    single.test_concurrent_streams_hangups_and_health_under_load,
    single.test_metrics_lists_every_series,
], ids=lambda t: t.__name__)
def test_the_single_servers_tests_pass(test, server, qwen25_path, media_dir):
    import inspect

    available = {"server": server, "qwen25_path": qwen25_path, "media_dir": media_dir}
    test(**{name: available[name] for name in inspect.signature(test).parameters})


def test_models_health_and_metrics_of_the_ingress(server):
    client = server.client()
    assert [m.id for m in client.models.list().data] == ["tiny"]  # the served model, once
    import httpx

    assert httpx.get(server.base + "/health").json() == {"status": "ok"}
    wait_for(lambda: len(replica_series(server, "num_requests_running")) == 2, what="both replicas' series")
    text = _metrics_text(server)
    assert re.search(r"^vlmserve:replicas_healthy 2\.0$", text, re.M)
    assert "vlmserve:router_decisions_total" in text and "vlmserve:router_pictures_total" in text


@pytest.mark.parametrize("flags,expected", [
    (["--replicas", "3", "--replica-cpus", "4", "--replica-gpus", "0.5"], {"num_replicas": 3}),
    (["--replicas", "2", "--min-replicas", "1", "--max-replicas", "6", "--target-ongoing-requests", "12"],
     {"autoscaling": (1, 6, 12.0, 2)}),
])
def test_the_flags_map_to_ray_serve_options(flags, expected):
    from vlmserve.entrypoints.cli import build_parser
    from vlmserve.entrypoints.openai.replicas import replica_options

    args = build_parser().parse_args(["serve", *flags])
    options = replica_options(args)
    assert options["ray_actor_options"] == {"num_cpus": args.replica_cpus, "num_gpus": args.replica_gpus}
    split = replica_options(build_parser().parse_args(["serve", *flags, "--device", "cuda", "--tensor-parallel-size", "4"]))
    assert split["ray_actor_options"]["num_gpus"] == 4  # a GPU for each of a replica's ranks
    assert options["request_router_config"].request_router_class.endswith("PictureAffinityRouter")
    if "num_replicas" in expected:
        assert options["num_replicas"] == 3 and "autoscaling_config" not in options
    else:
        a = options["autoscaling_config"]
        assert (a.min_replicas, a.max_replicas, a.target_ongoing_requests, a.initial_replicas) == expected["autoscaling"]
        assert "num_replicas" not in options
    assert "request_router_config" not in replica_options(build_parser().parse_args(
        ["serve", *flags, "--router", "default"]))


# ----------------------------------------------------------------------------- routing
def test_the_same_picture_in_two_chats_is_served_by_one_replica(server):
    client = server.client()
    picture = make_image(150, 110, seed=301)
    first = chat(client, picture, "Describe the image.")
    assert first.usage.media == {"encoded": 1, "encoder_cache": 0, "prefix_cache": 0}
    second = chat(client, picture, "How many shapes are there?")  # another chat, the same picture
    assert second.usage.media["encoded"] == 0  # its embeddings came from that replica's caches
    assert second.usage.media["encoder_cache"] + second.usage.media["prefix_cache"] == 1


def test_different_pictures_spread_over_both_replicas(server):
    client = server.client()
    before = replica_series(server, "prompt_tokens_total")
    for i in range(6):
        chat(client, make_image(120 + i, 100, seed=400 + i), "Describe the image.")
    wait_for(lambda: all(replica_series(server, "prompt_tokens_total").get(r, 0) > before.get(r, 0)
                         for r in replica_series(server, "prompt_tokens_total")) and
             len(replica_series(server, "prompt_tokens_total")) == 2, what="both replicas to serve")


def test_a_queue_on_one_replica_sends_new_requests_to_the_other(server):
    """Long answers about one picture pile up on the replica that has it; past 3 more in
    flight than the other one, the next goes to the other."""
    client = server.client()
    picture = make_image(140, 100, seed=501)
    chat(client, picture, "Describe the image.")
    imbalanced = _decisions(server).get("imbalanced", 0)
    streams = [chat(client, picture, f"Question {i}: what is in this picture?", max_tokens=2000, stream=True,
                    extra_body={"ignore_eos": True}) for i in range(6)]
    try:
        for s in streams:
            next(iter(s))  # each has started
        assert _decisions(server).get("imbalanced", 0) > imbalanced
    finally:
        for s in streams:
            s.close()


def _decisions(server: Server) -> dict[str, float]:
    return {d: float(v) for d, v in re.findall(r'^vlmserve:router_decisions_total\{decision="(\w+)"\} (\S+)$',
                                               _metrics_text(server), re.M)}


# ----------------------------------------------------------------------------- faults
def test_a_request_given_up_through_the_hub_is_aborted_by_its_replica(server):
    """Ray Serve's cancel is best effort (one that crosses the request's start on the
    replica is lost), so the ingress also posts a request it gives up on to the hub, and
    the replica serving it aborts it. Posted here by hand for a stream nobody cancelled,
    as if Ray had lost the cancel: the replica stops it and frees its blocks."""
    from vlmserve.entrypoints.openai.replicas import APP, HUB

    client = server.client()
    running = lambda: sum(replica_series(server, "num_requests_running").values())  # noqa: E731
    wait_for(lambda: running() == 0, what="earlier requests to end")
    stream = client.chat.completions.create(model="tiny", max_tokens=3000, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True},
                                            messages=[{"role": "user", "content": "Tell a long story. " * 3}])
    chunks = iter(stream)
    request_id = next(chunks).id  # the engine's request id
    wait_for(lambda: running() == 1, what="a report of the request running")
    ray_driver(server, f"ray.get(ray.get_actor({HUB!r}, namespace={APP!r}).give_up.remote({request_id!r}))")
    with pytest.raises(openai.APIError, match="ended the request without an answer"):
        for _ in chunks:
            pass
    wait_for(lambda: running() == 0 and not sum(replica_series(server, "kv_cache_blocks_in_use").values()),
             what="the replica to free the request")
    assert chat(client, make_image(90, 90, seed=7), "Describe the image.").usage.completion_tokens  # next works


def test_a_stalled_hub_stalls_no_request(server):
    """The hub only carries metrics and give-ups: while its process is stopped (SIGSTOP),
    /health and /metrics answer from the ingress's last view of it and chats are served.
    (They used to wait on the hub inside the server's event loop, and with them every
    request of the ingress.) Once it runs again, fresh reports come through."""
    import httpx
    from vlmserve.entrypoints.openai.replicas import APP, HUB

    hub_pid = int(ray_driver(server, f"print(ray.get(ray.get_actor({HUB!r}, namespace={APP!r})"
                                     f".__ray_call__.remote(lambda hub: os.getpid())))"))
    served = sum(replica_series(server, "request_success_total").values())
    os.kill(hub_pid, signal.SIGSTOP)
    try:
        assert httpx.get(server.base + "/health", timeout=20).json() == {"status": "ok"}
        assert len(replica_series(server, "num_requests_running")) == 2
        assert chat(server.client(), make_image(100, 90, seed=9), "Describe the image.").usage.completion_tokens == 4
    finally:
        os.kill(hub_pid, signal.SIGCONT)
    wait_for(lambda: sum(replica_series(server, "request_success_total").values()) > served,
             what="the chat's report once the hub runs again")


def test_a_replica_killed_mid_stream(server):
    """Its stream ends with an OpenAI-format error (no hang), the next request goes to
    the survivor, and Ray Serve starts a new replica."""
    client = server.client()
    running = lambda: replica_series(server, "num_requests_running")  # noqa: E731
    wait_for(lambda: len(running()) == 2 and not any(running().values()), what="earlier requests to end")
    stream = client.chat.completions.create(model="tiny", max_tokens=3000, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True},
                                            messages=[{"role": "user", "content": "Describe the image. " * 3}])
    chunks = iter(stream)
    next(chunks)
    wait_for(lambda: any(running().values()), what="a report")  # the only request: ours
    busy = next(r for r, v in running().items() if v > 0)
    ray_driver(server, f"""
        names = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].endswith("#" + {busy!r})]
        ray.kill(ray.get_actor(names[0]["name"], namespace=names[0]["namespace"]))
    """)
    started = time.time()
    with pytest.raises(openai.APIError, match="the replica serving this request failed"):
        for _ in chunks:
            pass
    assert time.time() - started < 30
    assert client.chat.completions.create(model="tiny", max_tokens=3,
                                          messages=[{"role": "user", "content": "hello"}]).usage.completion_tokens
    replicas = ray_driver(server, """
        deadline = time.time() + 90
        while time.time() < deadline:
            count = sum("SERVE_REPLICA" in a["name"] for a in ray.util.list_named_actors(all_namespaces=True))
            if count == 2:
                break
            time.sleep(0.5)
        print(count)
    """)
    assert replicas.split() == ["2"], "Ray Serve did not start a new replica"
    wait_for(lambda: len(replica_series(server, "num_requests_running")) == 2 and busy not in
             replica_series(server, "num_requests_running"), timeout=90, what="a new replica's report")


def test_sigterm_drains_then_the_cluster_is_gone(server):
    """Last: a request in flight when SIGTERM comes is answered in full; then the server
    exits and the local Ray cluster it started goes with it."""
    stream = server.client().chat.completions.create(
        model="tiny", max_tokens=1500, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True}, messages=[{"role": "user", "content": "hello"}])
    chunks = iter(stream)
    next(chunks)  # the server answers a stream once its first output is there: it is in flight
    code: list[int] = []
    stopper = threading.Thread(target=lambda: code.append(server.stop(signal.SIGTERM)))
    stopper.start()
    usage = [c.usage for c in chunks if c.usage is not None]
    stopper.join()
    assert usage[0].completion_tokens == 1500
    assert code[0] in (0, -signal.SIGTERM)  # as the single server: uvicorn re-raises it
    wait_for(lambda: subprocess.run(["pgrep", "-f", "ray::ServeReplica"], capture_output=True).returncode != 0,
             timeout=20, what="the replicas to stop")
