"""The application builder that ``serve run serve_config.yaml`` imports (``app.builder:build_app``).

Arguments come from the config's ``args`` and are validated here: unknown keys are an error,
and ``validate_args`` checks them against the models on disk before anything is bound.
Deployment sizing (replicas, CPUs, queue limits) lives in serve_config.yaml's ``deployments``;
``app.config_check`` checks those against the args.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import os
from typing import Any, Literal, cast

import ray
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from ray.serve import Application
from ray.serve.config import RequestRouterConfig
from ray.serve.deployment import Deployment
from safetensors import SafetensorError

from app.ingress import OpenAIIngress
from deployments.decode import DecodeServer
from deployments.embedding import EmbeddingServer
from deployments.kv_transport import KVTransportConfig, TransportName
from deployments.llm_server import LLMServer
from deployments.prefill import PrefillServer
from deployments.vision_encoder import VisionEncoderServer
from neuron_runtime.accuracy.online import OnlineValidationConfig
from neuron_runtime.config import EngineConfig
from neuron_runtime.embedding import EMBEDDING_ARCHITECTURES
from neuron_runtime.engine_args import EngineArgs
from neuron_runtime.kv_budget import kv_capacity_tokens
from neuron_runtime.loader import iter_weights, load_hf_config
from neuron_runtime.model_store import resolve_model
from neuron_runtime.models.registry import model_class
from neuron_runtime.tokenizer import Tokenizer
from neuron_runtime.tracing import DEFAULT_TRACE_FILE
from router.pd_router import PDRouter

_ENGINE_ARG_NAMES = {f.name for f in dataclasses.fields(EngineArgs)}
logger = logging.getLogger(__name__)


def as_deployment(cls: object) -> Deployment:
    """An ``@serve.deployment`` class as the Deployment it is at run time (mypy does not
    apply class decorators)."""
    return cast(Deployment, cls)


def _router_config(**kwargs: Any) -> RequestRouterConfig:
    # RequestRouterConfig annotates its **kwargs as dicts; pydantic types its fields.
    return RequestRouterConfig(**kwargs)


class DisaggregationArgs(BaseModel):
    """Prefill/decode split: KV transport and its failure policy, prefill routing."""

    model_config = ConfigDict(extra="forbid")

    # How the KV moves from prefill to decode replicas: "nixl" (the decode replica reads the
    # prefill replica's cache blocks straight into its own through a NIXL agent, backend
    # kv_nixl_backend: UCX here, LIBFABRIC for EFA) or "object_store" (the KV copied out of
    # the blocks and ray.put; the decode replica reads the ref). With nixl the prefill replica
    # holds a handed-off prompt's blocks until they are read, kv_hold_timeout_s at most.
    kv_transport: TransportName = "nixl"
    kv_nixl_backend: str = Field("UCX", min_length=1)
    # A NIXL read overlapped layer by layer with the request's first decode step (true), or
    # waited for whole before it (false). Unset: overlapped where the adapter moves the bytes
    # (LIBFABRIC, EFA), whole over UCX, whose copies take a core the step would compute on.
    kv_read_layer_wise: bool | None = None
    kv_hold_timeout_s: float = Field(30.0, gt=0)
    # nixl: the router opens the decode call before the prefill call, and the prefill replica
    # sends the handoff to that decode replica itself (a NIXL notification) rather than back
    # through the router, which takes the handoff off the second token's path. False: the
    # handoff returns to the router, which then opens the decode call (a Ray hop more).
    kv_decode_first: bool = True
    # A decode call opened first waits this long for its prefill (queueing included) to
    # deliver the handoff, then fails the request.
    kv_delivery_timeout_s: float = Field(600.0, gt=0)

    # A decode replica waits this long for a prefilled request's KV, then applies the policy:
    # "recompute" runs the prompt on the decode replica, "fail" ends the request with an error.
    kv_fetch_timeout_s: float = Field(10.0, gt=0)
    on_kv_failure: Literal["recompute", "fail"] = "recompute"
    # A prefill replica lost mid-call: retry on another this many times.
    prefill_retries: int = Field(1, ge=0)
    # Prompts of at most this many tokens, without images, skip the prefill replicas: the
    # decode replica prefills them in its running batch, as a colocated engine does, and no KV
    # moves. Longer ones are prefilled apart, so they do not stall the decode batch for a
    # whole step. 0: every prompt goes to a prefill replica.
    max_local_prefill_tokens: int = Field(0, ge=0)
    # Those requests (n = 1 too) go from the ingress straight to a decode replica, picked as
    # the PD router picks one, instead of through the PD router: their tokens cross one
    # replica fewer (the router forwards every step it does not own), and the ingress
    # resumes them on another decode replica when theirs is lost (router/migration.py).
    direct_decode: bool = False
    # Longer prompts go to the prefill replicas while fewer than this many of a PD router's
    # requests are there (queued or computing); one that finds them at it is prefilled at
    # decode as a short prompt is, instead of waiting behind them. 0: no limit.
    max_prefill_queue: int = Field(0, ge=0)
    # How a prefill replica is picked: "prefix_affinity" (below) or Serve's "power_of_two".
    prefill_routing: Literal["prefix_affinity", "power_of_two"] = "prefix_affinity"
    # Prefix affinity: prefer the replica holding this share of the prompt's blocks, unless
    # its queue is longer than the shortest by more than max_imbalance.
    min_match_share: float = Field(0.5, gt=0, le=1)
    max_imbalance: int = Field(8, ge=0)
    routing_stats_period_s: float = Field(1.0, gt=0)


class MultimodalArgs(BaseModel):
    """Images: where they are encoded, and what the edge accepts (models with a vision tower)."""

    model_config = ConfigDict(extra="forbid")

    # "separate": VisionEncoder replicas (encode -> prefill -> decode; disaggregated mode only);
    # "inline": the engine replica runs its own vision tower; "auto": separate when
    # disaggregated, inline when colocated.
    encoder: Literal["auto", "separate", "inline"] = "auto"
    encoder_cache_mib: int = Field(256, ge=0)
    encoder_max_batch_size: int = Field(8, ge=1)
    encoder_batch_wait_timeout_s: float = Field(0.005, ge=0)
    max_image_bytes: int = Field(10 << 20, ge=1024)
    max_pixels: int = Field(4096 * 4096, ge=1)
    max_side: int = Field(8192, ge=1)
    max_images_per_request: int = Field(8, ge=0)
    fetch_timeout_s: float = Field(10.0, gt=0)
    # http(s) image URLs are refused unless their host is listed here (or a subdomain of one).
    allowed_domains: list[str] = Field(default_factory=list)

    def image_limits(self) -> dict[str, Any]:
        return {
            "max_image_bytes": self.max_image_bytes,
            "max_pixels": self.max_pixels,
            "max_side": self.max_side,
            "max_images_per_request": self.max_images_per_request,
            "fetch_timeout_s": self.fetch_timeout_s,
            "allowed_domains": list(self.allowed_domains),
        }


class TracingArgs(BaseModel):
    """Request traces (neuron_runtime/tracing.py, docs/tracing.md)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = False
    sample_ratio: float = Field(1.0, ge=0, le=1)
    # OTLP/HTTP collector (http://host:4318); the OTEL_EXPORTER_OTLP_* variables also select it.
    otlp_endpoint: str | None = None
    # The JSON-lines file spans go to without an OTLP endpoint.
    file: str = Field(DEFAULT_TRACE_FILE, min_length=1)
    service_name: str = Field("neuron-serve", min_length=1)
    export_interval_s: float = Field(1.0, gt=0)


class ProfilerArgs(BaseModel):
    """``POST /start_profile`` and ``/stop_profile`` (app/profiling.py, docs/tracing.md)."""

    model_config = ConfigDict(extra="forbid")

    # Traces go here on each replica's node; unset: $NEURON_SERVE_PROFILER_DIR, else
    # /tmp/neuron-serve/profiles.
    output_dir: str | None = Field(None, min_length=1)
    row_limit: int = Field(20, ge=1)  # ops in the summary table
    timeout_s: float = Field(120.0, gt=0)  # for every replica's answer


class AccuracyArgs(BaseModel):
    """Online validation (neuron_runtime/accuracy/online.py, docs/accuracy.md): this share of
    requests has its prompt logits re-checked against transformers by the prefill or
    colocated replica, off the engine loop; 0 builds nothing."""

    model_config = ConfigDict(extra="forbid")

    sample_rate: float = Field(0.0, ge=0, le=1)
    # The reference's dtype; it picks the default bounds, which the four after it replace.
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    atol: float | None = Field(None, ge=0)
    rtol: float | None = Field(None, ge=0)
    kl: float | None = Field(None, ge=0)
    topk: float | None = Field(None, ge=0, le=1)
    top_k: int = Field(5, ge=1)
    # Checks waiting for the worker at most; past it a sampled request is dropped and counted.
    max_queue: int = Field(4, ge=1)
    seed: int | None = None

    def config(self) -> OnlineValidationConfig | None:
        return OnlineValidationConfig(**self.model_dump()) if self.sample_rate > 0 else None


# Set once for the whole application (top-level BuildArgs fields), never in engine_args.
_RESERVED_ENGINE_ARGS = frozenset({"model", "max_model_len", "num_threads"})
Role = Literal["prefill", "decode"]


def _check_engine_arg_names(value: dict[str, Any]) -> dict[str, Any]:
    unknown = set(value) - _ENGINE_ARG_NAMES
    reserved = set(value) & _RESERVED_ENGINE_ARGS
    if unknown:
        raise ValueError(f"unknown engine_args: {sorted(unknown)}")
    if reserved:
        raise ValueError(f"set {sorted(reserved)} at the top level, not in engine_args")
    return value


class RoleArgs(BaseModel):
    """One engine role of the disaggregated app (``prefill:`` or ``decode:``): EngineArgs
    fields that replace the shared ``engine_args`` for that role's replicas, e.g.
    ``decode: {engine_args: {tensor_parallel_size: 2}}``."""

    model_config = ConfigDict(extra="forbid")

    engine_args: dict[str, Any] = Field(default_factory=dict)

    @field_validator("engine_args")
    @classmethod
    def _known_engine_args(cls, value: dict[str, Any]) -> dict[str, Any]:
        return _check_engine_arg_names(value)


class BuildArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # "colocated": one LLMServer deployment runs prefill and decode; "disaggregated": a
    # PDRouter in front of PrefillServer and DecodeServer deployments.
    mode: Literal["colocated", "disaggregated"] = "colocated"
    disaggregation: DisaggregationArgs = Field(default_factory=DisaggregationArgs)
    multimodal: MultimodalArgs = Field(default_factory=MultimodalArgs)
    tracing: TracingArgs = Field(default_factory=TracingArgs)
    profiler: ProfilerArgs = Field(default_factory=ProfilerArgs)
    accuracy: AccuracyArgs = Field(default_factory=AccuracyArgs)

    model: str = "smollm2-135m-instruct"
    served_model_name: str | None = None
    max_model_len: int = Field(2048, ge=16)
    # Threads of each engine replica's CPU kernels; unset, a replica takes its
    # ray_actor_options.num_cpus rounded up (deployments/engine_replica.py).
    num_threads: int | None = Field(None, ge=1)
    # Further EngineArgs fields (num_kv_blocks, max_num_seqs, ...); unknown names are rejected.
    # data_parallel_size N runs N replicas of each engine deployment (one DP rank each).
    engine_args: dict[str, Any] = Field(default_factory=dict)
    # Disaggregated mode: per-role overrides of engine_args (tensor_parallel_size, KV budget,
    # max_num_seqs, ...); each role's replicas own a placement group of its own TP degree.
    prefill: RoleArgs = Field(default_factory=RoleArgs)
    decode: RoleArgs = Field(default_factory=RoleArgs)
    embedding_model: str | None = "all-minilm-l6-v2"
    # Falls back to $NEURON_SERVE_API_KEY; no key means no authentication.
    api_key: str | None = None
    max_body_bytes: int = Field(1 << 20, ge=1024)
    max_n: int = Field(8, ge=1)
    max_prompts: int = Field(16, ge=1)
    # Tokens after a request's first travel over step channels (router/streams.py): one Ray
    # message per engine step per downstream replica; false: one per request per step.
    step_channels: bool = True
    # A step channel from a replica on the same node comes over a socket on 127.0.0.1, not
    # Ray messages (deployments/step_channel.py: a fraction of the CPU per engine step).
    step_channel_sockets: bool = True
    # Streamed responses leave the ingress at most once per this many ms, the SSE events of
    # the steps that came meanwhile together (one message to Serve's HTTP proxy instead of
    # one per token); a token that comes later than this after the last send goes at once.
    stream_batching_interval_ms: float = Field(0.0, ge=0, le=1000)
    # A request whose replica (LLMServer, DecodeServer) is lost mid-stream resumes on another
    # one at most this many times, then ends with an error (router/migration.py).
    max_migrations: int = Field(3, ge=0)
    health_stall_timeout_s: float = Field(30.0, gt=0)
    # Every serving-path thread but the engines' own (Ray's and Serve's threads and the event
    # loop in each engine replica, the ingress and PD router replicas) runs at least this many
    # nice steps behind the engines' threads (deployments/thread_priority.py): 0 lifts none
    # above them, so Ray's C++ threads, which it leaves at 0 while its workers run at 15, no
    # longer preempt the kernel threads. None leaves every thread as Ray set it.
    serving_threads_nice: int | None = Field(0, ge=0, le=19)

    @field_validator("engine_args")
    @classmethod
    def _known_engine_args(cls, value: dict[str, Any]) -> dict[str, Any]:
        return _check_engine_arg_names(value)

    @model_validator(mode="after")
    def _roles_need_disaggregation(self) -> BuildArgs:
        for role in ("prefill", "decode"):
            if self.mode != "disaggregated" and getattr(self, role).engine_args:
                raise ValueError(f"{role}.engine_args needs mode 'disaggregated'")
        return self

    def separate_encoder(self) -> bool:
        """Whether images go to VisionEncoder replicas (only for a model with a vision tower)."""
        mode = self.multimodal.encoder
        if mode == "separate" and self.mode != "disaggregated":
            raise ValueError("multimodal.encoder 'separate' needs mode 'disaggregated'")
        if mode == "inline" or (mode == "auto" and self.mode != "disaggregated"):
            return False
        return has_vision_tower(self.model)

    def full_engine_args(self, role: Role | None = None) -> dict[str, Any]:
        """The engine args of one replica of ``role`` (the shared ones for None): one
        data-parallel rank, so ``data_parallel_size`` is left out (``data_parallel_size``)."""
        overrides = getattr(self, role).engine_args if role else {}
        merged = {**self.engine_args, **overrides}
        merged.pop("data_parallel_size", None)
        tp = merged.get("tensor_parallel_size", 1)
        if isinstance(tp, int) and tp > 1:
            # In Serve a replica's ranks are actors in its placement group (_engine_options).
            merged.setdefault("distributed_executor_backend", "ray")
        return {
            **merged,
            "model": self.model,
            "max_model_len": self.max_model_len,
            "num_threads": self.num_threads,
        }

    def data_parallel_size(self, role: Role | None = None) -> int:
        """Engine replicas of ``role``'s deployment (the colocated one for None)."""
        overrides = getattr(self, role).engine_args if role else {}
        value = overrides.get("data_parallel_size", self.engine_args.get("data_parallel_size", 1))
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            where = f"{role}.engine_args" if "data_parallel_size" in overrides else "engine_args"
            raise ValueError(f"{where}.data_parallel_size must be an integer >= 1, got {value!r}")
        return value


def build_app(args: dict[str, Any] | None = None) -> Application:
    """``import_path`` target: validated args -> the ingress bound to its deployments.

    Settings the models cannot take raise ValueError here, where Serve builds the application
    (the driver for an import path, the controller's build task for a config file), so the
    application fails to deploy with that one line instead of every replica failing in its
    constructor and Serve restarting them forever.
    """
    build_args = BuildArgs(**(args or {}))
    validate_args(build_args)
    warning = listener_warning(ray.util.get_node_ip_address())
    if warning:
        logger.warning(warning)
    return build_openai_app(build_args)


def listener_warning(node_ip: str) -> str | None:
    """The warning for a Ray node address other hosts can reach (None for loopback).

    Ray binds GCS, the raylet, its workers and the dashboard agent to the node address; a
    local cluster started without the variable below takes the host's network address.
    """
    try:
        if ipaddress.ip_address(node_ip).is_loopback:
            return None
    except ValueError:
        if node_ip == "localhost":
            return None
    return (
        f"Ray's node address is {node_ip}, not loopback: GCS, the raylet, its workers and the "
        "dashboard agent listen on it; for a single host, start Ray (serve run, ray start) "
        "with RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 in the environment and the dashboard host "
        "127.0.0.1 (ray start --dashboard-host 127.0.0.1), as the Makefile does"
    )


def validate_args(args: BuildArgs) -> EngineConfig:
    """Checks the args against the models on disk; ValueError names the setting and the limit.

    The engine's own EngineArgs -> EngineConfig validation (max_model_len against the model's
    max_position_embeddings, cache and scheduler limits, the parallel degrees against the
    model's heads), then what an engine replica would otherwise find only after loading its
    weights: the KV budget against max_model_len, the architecture, the weight files and the
    tokenizer; the same for each role's overrides and for the embedding model.
    """
    config = _check_engine(args, None)
    if args.mode == "disaggregated":
        for role in ("prefill", "decode"):
            _check_role(args, role, config)
    else:
        args.data_parallel_size()
    _check_files("model", args.model, config.model.path)
    if args.embedding_model is not None:
        _check_embedding_model(args.embedding_model)
    args.separate_encoder()
    return config


def _check_role(args: BuildArgs, role: Role, shared: EngineConfig) -> None:
    """A role's engine (its overrides applied), its replica count and its KV transport."""
    config = _check_engine(args, role) if getattr(args, role).engine_args else shared
    args.data_parallel_size(role)
    tp = config.parallel.tensor_parallel_size
    if tp > 1 and args.disaggregation.kv_transport == "nixl":
        # NIXL registers rank 0's cache: its kv heads only.
        raise ValueError(
            f"{role} tensor_parallel_size {tp} needs disaggregation.kv_transport "
            "'object_store' (the KV payload is re-split over the ranks' heads; the NIXL block "
            "transport reads one rank's cache)"
        )


def _check_engine(args: BuildArgs, role: Role | None) -> EngineConfig:
    where = f"{role}.engine_args" if role else "engine_args"
    overrides = {**args.engine_args, **(getattr(args, role).engine_args if role else {})}
    tp = overrides.get("tensor_parallel_size", 1)
    if isinstance(tp, bool) or not isinstance(tp, int):
        raise ValueError(f"{where}.tensor_parallel_size must be an integer, got {tp!r}")
    try:
        config = EngineArgs(**args.full_engine_args(role)).create_engine_config()
        model_class(config.model.architecture)
    except (TypeError, ValueError) as err:
        prefix = f"{role}.engine_args: " if role else ""
        raise ValueError(f"{prefix}model {args.model!r}: {err}") from None
    capacity = kv_capacity_tokens(config)
    if capacity < config.model.max_model_len:
        cache = config.cache
        if cache.num_blocks:
            budget = f"{where}.num_kv_blocks {cache.num_blocks}"
        elif overrides.get("kv_cache_memory_bytes") is not None:
            budget = f"{where}.kv_cache_memory_bytes {cache.kv_cache_bytes}"
        else:
            budget = (
                f"the default budget of {cache.kv_cache_bytes} bytes, bounded by "
                f"{where}.kv_cache_memory_fraction of the memory available"
            )
        raise ValueError(
            f"model {args.model!r}: max_model_len {config.model.max_model_len} exceeds the "
            f"KV cache's {capacity} tokens ({budget}, blocks of {cache.block_size} tokens); "
            "raise the KV budget or lower max_model_len"
        )
    return config


def _check_embedding_model(model: str) -> None:
    try:
        path = resolve_model(model)
        architecture = (load_hf_config(path).get("architectures") or [""])[0]
    except ValueError as err:
        raise ValueError(f"embedding_model {model!r}: {err}") from None
    if architecture not in EMBEDDING_ARCHITECTURES:
        raise ValueError(
            f"embedding_model {model!r} ({architecture or 'no architecture'}) cannot embed; "
            f"supported architectures: {list(EMBEDDING_ARCHITECTURES)}"
        )
    _check_files("embedding_model", model, path)


def _check_files(arg: str, model: str, path: str | os.PathLike[str]) -> None:
    """Every weight file's header reads (no tensor is loaded) and the tokenizer loads."""
    try:
        for _ in iter_weights(path, keep=lambda name: False):
            pass
    except (OSError, ValueError, SafetensorError) as err:
        raise ValueError(f"{arg} {model!r}: its weights in {path} do not read: {err}") from None
    try:
        Tokenizer(path)
    except Exception as err:  # transformers raises OSError, ValueError or its own types
        lines = str(err).strip().splitlines() or [type(err).__name__]
        raise ValueError(
            f"{arg} {model!r}: the tokenizer in {path} does not load: {lines[0].rstrip(': ')}"
        ) from None


def build_openai_app(
    args: BuildArgs,
    llm_engine_cls: type | None = None,
    llm_options: dict[str, Any] | None = None,
    ingress_options: dict[str, Any] | None = None,
    prefill_options: dict[str, Any] | None = None,
    decode_options: dict[str, Any] | None = None,
    encoder_options: dict[str, Any] | None = None,
) -> Application:
    """The application, with hooks for tests: a fake engine class and deployment options."""
    engine_args = args.full_engine_args()
    decode = None  # the DecodeServer deployment, for the ingress's direct decode calls
    if args.mode == "disaggregated":
        llm, decode = _disaggregated(
            args, llm_engine_cls, prefill_options, decode_options, encoder_options
        )
    else:
        llm = (
            as_deployment(LLMServer)
            .options(
                request_router_config=_pinning_router(),
                **engine_options(args, None, LLMServer, llm_options),
            )
            .bind(
                engine_args,
                llm_engine_cls,
                args.health_stall_timeout_s,
                tracing_config=args.tracing.model_dump(),
                accuracy=args.accuracy.config(),
                serving_threads_nice=args.serving_threads_nice,
            )
        )
    embedder = (
        as_deployment(EmbeddingServer).bind(args.embedding_model) if args.embedding_model else None
    )
    config = {
        "served_model_name": args.served_model_name or args.model,
        "engine_args": engine_args,
        "embedding_model_name": args.embedding_model,
        "api_key": args.api_key or os.environ.get("NEURON_SERVE_API_KEY") or None,
        "max_body_bytes": args.max_body_bytes,
        "max_n": args.max_n,
        "max_prompts": args.max_prompts,
        "step_channels": args.step_channels,
        "step_channel_sockets": args.step_channel_sockets,
        "stream_batching_interval_ms": args.stream_batching_interval_ms,
        "max_migrations": args.max_migrations,
        "image_limits": args.multimodal.image_limits(),
        "tracing": args.tracing.model_dump(),
        "profiler": args.profiler.model_dump(),
        "serving_threads_nice": args.serving_threads_nice,
    }
    direct = args.mode == "disaggregated" and args.disaggregation.direct_decode
    if direct:
        config["direct_decode_max_prompt_tokens"] = args.disaggregation.max_local_prefill_tokens
    return (
        as_deployment(OpenAIIngress)
        .options(**(ingress_options or {}))
        .bind(llm, embedder, config, decode if direct else None)
    )


def _disaggregated(
    args: BuildArgs,
    engine_cls: type | None,
    prefill_options: dict[str, Any] | None,
    decode_options: dict[str, Any] | None,
    encoder_options: dict[str, Any] | None,
) -> tuple[Any, Any]:
    """PDRouter -> PrefillServer (prefix-affinity routed) and DecodeServer (KV-capacity
    routed), and VisionEncoder replicas (rendezvous routed) for a model with a vision tower;
    the router and the decode deployment."""
    pd = args.disaggregation
    transport = KVTransportConfig(
        pd.kv_transport, pd.kv_hold_timeout_s, pd.kv_nixl_backend, pd.kv_read_layer_wise
    )
    if pd.prefill_routing == "prefix_affinity":
        prefill_router = _router_config(
            request_router_class="router.request_routers:PrefixAffinityRouter",
            request_router_kwargs={
                "min_match_share": pd.min_match_share,
                "max_imbalance": pd.max_imbalance,
            },
            request_routing_stats_period_s=pd.routing_stats_period_s,
        )
    else:
        prefill_router = _router_config()
    prefill = (
        as_deployment(PrefillServer)
        .options(
            request_router_config=prefill_router,
            **engine_options(args, "prefill", PrefillServer, prefill_options),
        )
        .bind(
            args.full_engine_args("prefill"),
            engine_cls,
            args.health_stall_timeout_s,
            transport,
            tracing_config=args.tracing.model_dump(),
            accuracy=args.accuracy.config(),
            serving_threads_nice=args.serving_threads_nice,
        )
    )
    decode = (
        as_deployment(DecodeServer)
        .options(
            request_router_config=_router_config(
                request_router_class="router.request_routers:KVCapacityRouter",
                request_routing_stats_period_s=pd.routing_stats_period_s,
            ),
            **engine_options(args, "decode", DecodeServer, decode_options),
        )
        .bind(
            args.full_engine_args("decode"),
            engine_cls,
            args.health_stall_timeout_s,
            pd.kv_fetch_timeout_s,
            pd.on_kv_failure,
            transport,
            tracing_config=args.tracing.model_dump(),
            kv_delivery_timeout_s=pd.kv_delivery_timeout_s,
            serving_threads_nice=args.serving_threads_nice,
        )
    )
    encoder = None
    if args.separate_encoder():
        mm = args.multimodal
        encoder = (
            as_deployment(VisionEncoderServer)
            .options(
                request_router_config=_router_config(
                    request_router_class="router.request_routers:RendezvousRouter"
                ),
                **(encoder_options or {}),
            )
            .bind(
                args.model,
                mm.encoder_cache_mib,
                mm.encoder_max_batch_size,
                mm.encoder_batch_wait_timeout_s,
                mm.max_pixels,
                tracing_config=args.tracing.model_dump(),
            )
        )
    router = (
        as_deployment(PDRouter)
        .options(request_router_config=_pinning_router())
        .bind(
            prefill,
            decode,
            pd.prefill_retries,
            encoder,
            args.step_channels,
            tracing_config=args.tracing.model_dump(),
            max_migrations=args.max_migrations,
            decode_first=pd.kv_transport == "nixl" and pd.kv_decode_first,
            serving_threads_nice=args.serving_threads_nice,
            max_local_prefill_tokens=pd.max_local_prefill_tokens,
            max_prefill_queue=pd.max_prefill_queue,
            step_channel_sockets=args.step_channel_sockets,
        )
    )
    return router, decode


def engine_options(
    args: BuildArgs, role: Role | None, cls: object, options: dict[str, Any] | None
) -> dict[str, Any]:
    """An engine deployment's options: ``data_parallel_size`` replicas (each one DP rank with
    its own ranks), and for a TP > 1 engine whose ranks are Ray actors a placement group of
    one bundle per rank, each holding what one replica asks for (rank 0 is the replica)."""
    options = dict(options or {})
    dp = args.data_parallel_size(role)
    if dp > 1:
        if "autoscaling_config" in options or options.get("num_replicas", dp) != dp:
            raise ValueError(
                f"data_parallel_size {dp} fixes {as_deployment(cls).name}'s replicas at {dp}: "
                "set neither num_replicas nor autoscaling_config for it"
            )
        options["num_replicas"] = dp
    engine_args = args.full_engine_args(role)
    tp = engine_args.get("tensor_parallel_size", 1)
    if tp > 1 and engine_args["distributed_executor_backend"] == "ray":
        actor = options.get("ray_actor_options") or as_deployment(cls).ray_actor_options or {}
        bundle = {"CPU": float(actor.get("num_cpus", 1))}
        if actor.get("num_gpus"):
            bundle["GPU"] = float(actor["num_gpus"])
        bundle.update({k: float(v) for k, v in (actor.get("resources") or {}).items()})
        options.setdefault("placement_group_bundles", [bundle] * tp)
        options.setdefault("placement_group_strategy", "STRICT_PACK")
    return options


def _pinning_router() -> RequestRouterConfig:
    """Power of two choices, and step channels to the replica they name (router/streams.py)."""
    return _router_config(request_router_class="router.request_routers:LoadRouter")


def has_vision_tower(model: str) -> bool:
    return "vision_config" in load_hf_config(resolve_model(model))
