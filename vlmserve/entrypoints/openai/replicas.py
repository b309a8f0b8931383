"""`vlmserve serve --replicas N`: engine replicas as a Ray Serve deployment, behind the
same OpenAI server (routes, streaming, errors, auth, HTTP limits, drain) as the
single-process `serve`.

The ingress is this process: it renders chats with the checkpoint's template, hashes each
request's pictures from their bytes (no decoding) and hands the request to Ray Serve's
handle, whose router (`affinity_router.PictureAffinityRouter`) picks the replica. Each
replica is an `AsyncLLM` (media processing, the engine) that streams `RequestOutput`s
back. Replicas push their /metrics text to a small hub actor every second; the ingress
reads the hub from a thread of its own (`HubView`) and serves them all with a `replica`
label, plus its routing counters. Ray Serve restarts a
replica that dies; the requests it was serving end with an OpenAI-format error.

A request the ingress gives up on (its client hung up) is cancelled through Ray Serve,
which is best effort: a cancel that crosses the request's start on the replica is lost.
So the ingress also posts its id to the hub, and each replica, when it pushes its
metrics, takes the ids posted since and aborts those it serves.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import signal
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

import ray
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from ray import serve
from ray.serve.config import AutoscalingConfig, RequestRouterConfig

from vlmserve.engine.args import EngineArgs
from vlmserve.engine.async_llm import AsyncLLM, EngineDeadError
from vlmserve.engine.chat import render_chat
from vlmserve.engine.chat_template import ChatTemplate
from vlmserve.reasoning.parsers import ReasoningParser, reasoning_parser
from vlmserve.engine.input_processor import MODALITIES, PromptInput
from vlmserve.engine.model_source import resolve_model_path, sampling_defaults
from vlmserve.entrypoints.openai.affinity_router import KEYS_KWARG, PICTURE_KEY, PictureAffinityRouter
from vlmserve.entrypoints.openai.routing_stats import ROUTING
from vlmserve.lora.request import LoRARequest
from vlmserve.metrics import PREFIX
from vlmserve.multimodal.hashing import mm_hash
from vlmserve.multimodal.media import MediaLoader
from vlmserve.multimodal.processor import normalize_settings
from vlmserve.outputs import RequestOutput
from vlmserve.pooling_params import PoolingParams
from vlmserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

APP = "vlmserve"
PREFILL_APP = "vlmserve-prefill"
# what a prefill replica is asked: the prompt, and one token to end it
PREFILL_ONLY = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
HUB = "vlmserve-replica-hub"
PUSH_SECONDS = 1.0  # also the longest a given-up request runs on when Ray's cancel is lost
ABORT_MEMORY_SECONDS = 600.0  # a given-up request that reaches its replica later than this runs
STALE_SECONDS = 5.0  # a replica that has not reported for this long is not counted healthy
HUB_READ_SECONDS = 0.25  # how often the ingress reads the hub's reports
TEXT_KEY_CHARS = 2000  # the opening text that names a text-only prompt


# ----------------------------------------------------------------------------- routing keys
def affinity_keys(loader: MediaLoader, prompt: PromptInput, default_settings: dict[str, Any]) -> list[str]:
    """What a replica that served a request holds in its caches, as the router keys it:
    the mm_hash of each picture and video (from their bytes, as the replica will hash
    them; a source that cannot be read is left out: the replica reports the error), or
    for a prompt without media its opening text (TEXT_KEY_CHARS). Pictures decide alone
    where there are some: a system prompt that every chat shares would draw them all to
    one replica."""
    keys = []
    for modality in MODALITIES:
        for i, source in enumerate(prompt.media.get(modality, [])):
            try:
                raw = loader.read(source, modality)
                settings = normalize_settings({**default_settings, **prompt.settings_for(modality, i)})
            except ValueError:
                continue
            keys.append(PICTURE_KEY + mm_hash(modality, raw.content, settings))
    if keys or not prompt.prompt:
        return keys
    return ["text:" + hashlib.blake2b(prompt.prompt[:TEXT_KEY_CHARS].encode(), digest_size=16).hexdigest()]


# ----------------------------------------------------------------------------- replicas
@ray.remote(num_cpus=0)
class ReplicaHub:
    """The replicas' latest /metrics text, by replica, and the requests the ingress gave
    up on, numbered in the order they were posted."""

    def __init__(self) -> None:
        self.reports: dict[str, tuple[float, str]] = {}
        self.given_up: dict[str, tuple[int, float]] = {}  # request id -> (number, when)
        self.posted = 0

    def give_up(self, request_id: str) -> None:
        self.posted += 1
        now = time.time()
        self.given_up[request_id] = (self.posted, now)
        for rid in [r for r, (_, at) in self.given_up.items() if now - at > ABORT_MEMORY_SECONDS]:
            del self.given_up[rid]

    def report(self, replica: str, text: str, seen: int) -> tuple[int, list[str]]:
        """Stores a replica's metrics; returns the last number and the requests given up
        on after number `seen`."""
        self.reports[replica] = (time.time(), text)
        return self.posted, [rid for rid, (n, _) in self.given_up.items() if n > seen]

    def all(self) -> dict[str, tuple[float, str]]:
        return dict(self.reports)


class EngineReplica:
    """One engine (an AsyncLLM) in a Ray Serve replica."""

    def __init__(self, engine_args: EngineArgs, max_pending_requests: int, threads: int,
                 served_model_name: str | None = None, metrics_names: str = "vllm") -> None:
        import torch

        torch.set_num_threads(max(1, threads))
        self.engine = AsyncLLM(engine_args, max_pending_requests=max_pending_requests,
                               served_model_name=served_model_name, metrics_names=metrics_names)
        self.name = serve.get_replica_context().replica_id.unique_id
        self.hub = ray.get_actor(HUB, namespace=APP)
        self.given_up: dict[str, float] = {}  # request id -> when the ingress gave up on it
        self.pusher = asyncio.get_event_loop().create_task(self._push_metrics())

    async def _push_metrics(self) -> None:
        seen = 0
        while True:
            try:
                seen, given_up = await self.hub.report.remote(self.name, self.engine.metrics.render().decode(), seen)
                self._give_up(given_up)
            except Exception:  # the hub is gone: the server is stopping
                logger.debug("metrics push failed", exc_info=True)
            await asyncio.sleep(PUSH_SECONDS)

    def _give_up(self, request_ids: list[str]) -> None:
        """Aborts the requests the ingress gave up on (unknown ids are no-ops) and
        remembers them: one still being processed is stopped at its first output."""
        now = time.time()
        for rid in request_ids:
            self.given_up[rid] = now
            self.engine.abort(rid)
        for rid in [r for r, at in self.given_up.items() if now - at > ABORT_MEMORY_SECONDS]:
            del self.given_up[rid]

    async def generate(self, request_id: str, prompt: PromptInput, params, priority: int = 0,
                       cache_salt: str | None = None, lora_request: LoRARequest | None = None,
                       pooling_params: PoolingParams | None = None,
                       affinity_keys: list[str] | None = None) -> AsyncIterator[RequestOutput]:
        """The request's outputs (affinity_keys are the router's; unused here). Cancelled
        (the client hung up, the ingress cancels): the engine's generator is closed at
        once, which aborts the request; so does the ingress giving up on it through the hub."""
        if request_id in self.given_up:
            return
        outputs = self.engine.generate(request_id, prompt, params, priority, cache_salt, lora_request, pooling_params)
        try:
            async for out in outputs:
                if request_id in self.given_up:
                    return
                yield out
        finally:
            await outputs.aclose()

    async def prompt_token_ids(self, prompt: PromptInput) -> list[int]:
        return await self.engine.prompt_token_ids(prompt)

    def check_lora(self, lora: LoRARequest) -> None:
        self.engine.check_lora(lora)

    def info(self) -> dict[str, Any]:
        return {"max_model_len": self.engine.max_model_len, "task": self.engine.task}

    def check_health(self) -> None:
        """Ray Serve restarts a replica whose engine stopped."""
        if not self.engine.is_alive():
            raise RuntimeError("the engine stopped")

    def __del__(self) -> None:
        self.pusher.cancel()
        self.engine.shutdown()


# ----------------------------------------------------------------------------- ingress
class HubView:
    """The replicas' reports as the ingress last read them from the hub, refreshed by a
    thread of its own: /health and /metrics read this view and never wait on a Ray call in
    the server's event loop, where a hub slow to answer stalled every request."""

    def __init__(self, hub: Any) -> None:
        self.hub = hub
        self.lock = threading.Lock()
        self.reports: dict[str, tuple[float, str]] = {}
        self.read_at = 0.0  # when the hub last answered
        self.stopped = threading.Event()
        threading.Thread(target=self._read, name="vlmserve-hub-view", daemon=True).start()

    def _read(self) -> None:
        while not self.stopped.is_set():
            try:
                reports = ray.get(self.hub.all.remote(), timeout=STALE_SECONDS)
                with self.lock:
                    self.reports, self.read_at = reports, time.time()
            except Exception:  # a slow or stopping hub: the view ages, and goes stale
                logger.debug("reading the replica hub failed", exc_info=True)
            self.stopped.wait(HUB_READ_SECONDS)

    def healthy(self) -> dict[str, str]:
        """The replicas that had reported in the last STALE_SECONDS when the hub last
        answered: name -> metrics text; none once the hub has not answered for as long."""
        with self.lock:
            reports, read_at = self.reports, self.read_at
        if time.time() - read_at > STALE_SECONDS:
            return {}
        return {name: text for name, (at, text) in reports.items() if read_at - at < STALE_SECONDS}

    def stop(self) -> None:
        self.stopped.set()


@dataclass
class ReplicaPool:
    """The engine as the OpenAI server sees it (engine/protocol.py's EngineClient), over a
    Ray Serve handle to the replicas. It renders chats itself (the checkpoint's processor,
    no model), so that it can hash the pictures for the router."""

    handle: Any
    hf_processor: Any
    model_path: str
    max_model_len: int
    task: str
    sampling_defaults: dict[str, Any]
    loader: MediaLoader
    default_mm_kwargs: dict[str, Any]
    hub: Any
    started_ray: bool  # this process called ray.init
    joined_cluster: bool  # ... of a cluster that was already there (--ray-address)
    death_listeners: list = field(default_factory=list)  # (replicas are restarted, never the pool)
    in_flight: dict[str, Any] = field(default_factory=dict)  # request id -> its response stream
    shutdown_error: str | None = None
    max_pending_requests: int | None = None  # each replica has its own cap; the pool none
    chat_template: ChatTemplate | None = None  # --chat-template (None: the checkpoint's)
    reasoning: ReasoningParser | None = None  # --reasoning-parser's, for the checkpoint's tokenizer
    prefill_handle: Any = None  # --prefill-replicas: the replicas that compute prompts first

    def __post_init__(self) -> None:
        self.hub_view = HubView(self.hub)
        self.metrics = ReplicaMetrics(self)

    @property
    def tokenizer(self):
        return self.hf_processor.tokenizer

    def render_chat(self, messages, add_generation_prompt=True, chat_template_kwargs=None, tools=None,
                    continue_final_message=False) -> PromptInput:
        return render_chat(self.hf_processor, messages, add_generation_prompt, chat_template_kwargs, tools,
                           continue_final_message, self.chat_template)

    async def prompt_token_ids(self, prompt: PromptInput) -> list[int]:
        return await self.handle.prompt_token_ids.remote(prompt)

    def check_lora(self, lora: LoRARequest) -> None:
        """Checked by one replica (they all run the same model; the adapter's folder must be
        readable where each replica runs)."""
        try:
            self.handle.check_lora.remote(lora).result()
        except ray.exceptions.RayTaskError as e:
            raise e.cause if isinstance(e.cause, ValueError) else ValueError(str(e)) from None

    async def generate(self, request_id: str, prompt: PromptInput, params, priority: int = 0,
                       cache_salt: str | None = None, lora_request: LoRARequest | None = None,
                       pooling_params: PoolingParams | None = None) -> AsyncIterator[RequestOutput]:
        if self.shutdown_error:
            raise EngineDeadError(self.shutdown_error)
        loop = asyncio.get_running_loop()
        keys = await loop.run_in_executor(None, affinity_keys, self.loader, prompt, self.default_mm_kwargs)
        if self.prefill_handle is not None and pooling_params is None:
            # the prompt on a prefill replica first: its KV and pictures reach the pool
            # before its one token comes back, and the decode replica reads them there
            async for _ in self._stream(self.prefill_handle, request_id, prompt, PREFILL_ONLY, priority, cache_salt,
                                        lora_request, None, keys):
                pass
        async for out in self._stream(self.handle, request_id, prompt, params, priority, cache_salt, lora_request,
                                      pooling_params, keys):
            yield out

    async def _stream(self, handle: Any, request_id: str, prompt: PromptInput, params, priority: int,
                      cache_salt: str | None, lora_request: LoRARequest | None, pooling_params: PoolingParams | None,
                      keys: list[str]) -> AsyncIterator[RequestOutput]:
        stream = handle.options(stream=True).generate.remote(
            request_id, prompt, params, priority, cache_salt, lora_request, pooling_params, **{KEYS_KWARG: keys})
        self.in_flight[request_id] = stream
        finished = False
        try:
            while not finished:
                try:
                    out = await stream.__anext__()
                except StopAsyncIteration:
                    raise EngineDeadError("the replica ended the request without an answer") from None
                except (asyncio.CancelledError, GeneratorExit):
                    raise
                except ray.exceptions.RayTaskError as e:  # raised by the replica's engine: as it was
                    raise e.cause if isinstance(e.cause, Exception) else EngineDeadError(str(e)) from None
                except Exception as e:  # the replica died, or the server is stopping
                    raise EngineDeadError(self.shutdown_error or f"the replica serving this request failed "
                                          f"({type(e).__name__}); send it again") from None
                finished = out.finished
                yield out
        finally:
            self.in_flight.pop(request_id, None)
            if not finished:
                stream.cancel()  # the replica's generator is cancelled: its engine aborts the request
                self.hub.give_up.remote(request_id)  # ... and if Ray loses the cancel, the replica sees this

    def healthy_replicas(self) -> dict[str, str]:
        return self.hub_view.healthy()

    def is_alive(self) -> bool:
        return bool(self.healthy_replicas())

    def abort(self, request_id: str) -> None:
        stream = self.in_flight.get(request_id)
        if stream is not None:
            stream.cancel()
            self.hub.give_up.remote(request_id)

    def abort_all(self, error: str) -> None:
        self.shutdown_error = error
        for stream in list(self.in_flight.values()):
            stream.cancel()

    def shutdown(self) -> None:
        """After the drain: the local cluster this server started goes with it; on a
        cluster it joined, its application is deleted."""
        for stream in list(self.in_flight.values()):
            stream.cancel()
        self.hub_view.stop()
        if self.started_ray and not self.joined_cluster:
            ray.shutdown()  # stops every process of the local cluster
            return
        try:
            serve.delete(APP, _blocking=False)
            if self.prefill_handle is not None:
                serve.delete(PREFILL_APP, _blocking=False)
            ray.kill(self.hub)
        except Exception:
            logger.warning("could not delete the replicas' application", exc_info=True)
        if self.started_ray:
            ray.shutdown()


class ReplicaMetrics(Collector):
    """/metrics of the ingress: every healthy replica's series with a `replica` label,
    the number of healthy replicas, and the router's decisions."""

    def __init__(self, pool: ReplicaPool) -> None:
        self.pool = pool
        self.registry = CollectorRegistry()
        self.registry.register(self)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def collect(self):
        merged: dict[str, Metric] = {}
        reports = self.pool.healthy_replicas()
        for name, text in sorted(reports.items()):
            for family in text_string_to_metric_families(text):
                into = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type))
                for s in family.samples:
                    into.add_sample(s.name, {**s.labels, "replica": name}, s.value, s.timestamp)
        yield from merged.values()
        yield GaugeMetricFamily(f"{PREFIX}replicas_healthy", "Replicas that reported in the last few seconds.",
                                value=len(reports))
        decisions = CounterMetricFamily(f"{PREFIX}router_decisions", "Requests routed, by why the replica was chosen "
                                        "(affinity: it held most of the request's prefix and pictures; least_loaded: "
                                        "none did; imbalanced: it did but was too busy).", labels=["decision"])
        with ROUTING.lock:
            for decision, n in sorted(ROUTING.decisions.items()):
                decisions.add_metric([decision], n)
            keys, hits = ROUTING.picture_keys, ROUTING.picture_hits
        yield decisions
        yield CounterMetricFamily(f"{PREFIX}router_pictures", "Pictures and videos in routed requests.", value=keys)
        yield CounterMetricFamily(f"{PREFIX}router_picture_hits", "Pictures routed to a replica that had seen them "
                                  "(the affinity hit rate is this over router_pictures).", value=hits)


def replica_options(args, num_replicas: int | None = None) -> dict[str, Any]:
    """The deployment's Ray Serve options from serve's flags: resources per replica, a
    fixed number of replicas (num_replicas, else --replicas) or autoscaling, the router."""
    autoscaling = None
    if args.max_replicas:
        autoscaling = AutoscalingConfig(min_replicas=args.min_replicas, max_replicas=args.max_replicas,
                                        target_ongoing_requests=args.target_ongoing_requests,
                                        initial_replicas=max(args.min_replicas, min(args.replicas, args.max_replicas)))
    # a replica split across ranks holds a GPU for each (its ranks are processes of its node)
    gpus = max(args.replica_gpus, args.tensor_parallel_size * args.pipeline_parallel_size if args.device.startswith("cuda") else 0)
    options: dict[str, Any] = dict(
        ray_actor_options={"num_cpus": args.replica_cpus, "num_gpus": gpus},
        max_ongoing_requests=args.max_pending_requests,
        health_check_period_s=2, health_check_timeout_s=10, graceful_shutdown_timeout_s=5,
    )
    if autoscaling and num_replicas is None:
        options["autoscaling_config"] = autoscaling
    else:
        options["num_replicas"] = num_replicas or args.replicas
    if args.router == "affinity":
        options["request_router_config"] = RequestRouterConfig(
            request_router_class=f"{PictureAffinityRouter.__module__}.{PictureAffinityRouter.__name__}",
            request_router_kwargs={"imbalance": args.affinity_imbalance})
    return options


def start_replicas(args, engine_args: EngineArgs) -> ReplicaPool:
    """Joins the Ray cluster at --ray-address (or starts a local one), deploys the
    replicas and waits until they are up."""
    started = not ray.is_initialized()
    if started:
        handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        ray.init(address=args.ray_address, namespace=APP, log_to_driver=False, include_dashboard=False)
        for sig, handler in handlers.items():  # Ray's would exit at once; the server drains first
            signal.signal(sig, handler)
    # where to look (`ray status --address ...`), and what a driver of this cluster joins
    logger.info("replicas on the Ray cluster at %s", ray.get_runtime_context().gcs_address)
    serve.start(http_options={"location": "NoServer"})  # HTTP is this process's own server
    hub = ReplicaHub.options(name=HUB, namespace=APP, get_if_exists=True).remote()
    deployment = serve.deployment(EngineReplica, name="engine").options(**replica_options(args))
    threads = max(1, int(args.replica_cpus))
    handle = serve.run(deployment.bind(engine_args, args.max_pending_requests, threads, args.served_model_name,
                                       args.metrics_names), name=APP,
                       route_prefix=None)
    prefill = start_prefill_replicas(args, engine_args, threads) if args.prefill_replicas else None
    model_path = resolve_model_path(engine_args.model, engine_args.revision, engine_args.download_dir)
    from transformers import AutoProcessor

    info = handle.info.remote().result()
    defaults = sampling_defaults(model_path) if engine_args.generation_config == "auto" else {}
    pool = ReplicaPool(handle, AutoProcessor.from_pretrained(model_path), model_path, info["max_model_len"],
                       info["task"], defaults,
                       MediaLoader(engine_args.media_limits()), dict(engine_args.mm_processor_kwargs), hub, started,
                       joined_cluster=args.ray_address is not None,
                       chat_template=ChatTemplate.of(engine_args.chat_template, engine_args.chat_template_content_format),
                       prefill_handle=prefill)
    if engine_args.reasoning_parser:  # the replicas checked it against the same tokenizer
        pool.reasoning = reasoning_parser(engine_args.reasoning_parser, pool.tokenizer)
    deadline = time.time() + 60
    while not pool.is_alive() and time.time() < deadline:  # the first metrics push
        time.sleep(0.2)
    return pool


def start_prefill_replicas(args, engine_args: EngineArgs, threads: int) -> Any:
    """--prefill-replicas: replicas that put what they compute in the pool and read nothing
    from it (kv_producer), in an application of their own."""
    producer = replace(engine_args, kv_transfer_config={**engine_args.kv_transfer_config, "kv_role": "kv_producer"})
    deployment = serve.deployment(EngineReplica, name="prefill").options(
        **replica_options(args, num_replicas=args.prefill_replicas))
    return serve.run(deployment.bind(producer, args.max_pending_requests, threads, args.served_model_name,
                                     args.metrics_names), name=PREFILL_APP, route_prefix=None)
