"""Plain data that crosses the Ray boundaries between ingress, router and engine deployments.

Only ints, floats, strings, bytes, lists of them, numpy arrays, dataclasses of those and object
refs: no torch tensors, no live engine objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ray import ObjectRef

from neuron_runtime.kv_transfer import KVHandoff


@dataclass
class ImagePart:
    """One image of a prompt: where its placeholder tokens are, and the image itself.

    Exactly one of ``data`` and ``features`` is set: the encoded image bytes (the engine replica
    runs its own vision tower on them) or an object ref to ``ImageFeatures`` computed by a
    VisionEncoder replica (the router puts it there; the engine replica reads it zero-copy).
    """

    offset: int  # first placeholder position in the prompt's token ids
    length: int  # number of placeholder tokens
    content_hash: str  # sha256 of the image bytes: the encoder cache and prefix cache key
    data: bytes | None = None
    features: ObjectRef | None = None


@dataclass
class EncodeRequest:
    """One image for a VisionEncoder replica (routed by rendezvous hash of content_hash)."""

    content_hash: str
    data: bytes
    # W3C trace context (traceparent, tracestate) of the caller's span when the request is
    # traced (neuron_runtime/tracing.py); None otherwise.
    trace_context: dict[str, str] | None = None


@dataclass
class EncodeResult:
    """A VisionEncoder replica's answer: a ref to the ``ImageFeatures`` (owned by that replica,
    kept in its cache), and what encoding it cost."""

    content_hash: str
    features: ObjectRef
    num_bytes: int  # size of the embeddings
    cache_hit: bool
    queue_seconds: float  # waiting for a batch slot (0 on a cache hit)
    encode_seconds: float  # the batch's preprocess + vision tower + projector (0 on a hit)
    replica_id: str = ""


@dataclass(frozen=True)
class KVDestination:
    """A decode replica waiting for a prefilled request's handoff (the PD router opened that
    decode call before the prefill call): the prefill replica sends the handoff there itself,
    as a NIXL notification to ``agent_name`` under ``key``, instead of returning it through
    the router (deployments/nixl_transport.py)."""

    agent_name: str
    agent_info: ObjectRef  # the decode agent's NixlAgentInfo, loaded once per prefill replica
    key: str


@dataclass
class GenerateRequest:
    """A tokenized prompt and its SamplingParams fields (vLLM names)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: dict[str, Any]
    images: list[ImagePart] = field(default_factory=list)
    # W3C trace context (traceparent, tracestate) of the caller's span when the request is
    # traced (neuron_runtime/tracing.py); None otherwise.
    trace_context: dict[str, str] | None = None
    # A migrated request (router/migration.py): the tokens its lost replica already produced
    # and streamed. The engine recomputes them, counts them as output and goes on after them.
    resume_token_ids: list[int] = field(default_factory=list)
    # Prefill role: the decode replica waiting for this request's handoff (None: return it).
    kv_destination: KVDestination | None = None


@dataclass
class SeqDelta:
    """New tokens of one of the ``n`` sequences since the previous step."""

    index: int
    token_ids: list[int]
    # Per new token: {token id: logprob} for the sampled token and the top-N, when asked.
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | None = None  # the stop token id that ended it


@dataclass
class StepOutput:
    """What one engine step produced for one request."""

    seqs: list[SeqDelta]
    num_prompt_tokens: int
    num_cached_tokens: int = 0
    finished: bool = False
    error: str | None = None
    # Engine-side timings in seconds (set once known): waiting before the first schedule.
    queue_time_s: float | None = None
    # On the first output of a prefill (or colocated) engine: first schedule to first token.
    prefill_time_s: float | None = None
    # The serving replica's load after this step, on the last output only.
    stats: dict[str, Any] | None = field(default=None)
    # Disaggregated serving: on the prefill output, how long handing the KV over took; on
    # the first decode output, how the KV arrived.
    kv_transfer: KVTransferInfo | None = None
    # prompt_logprobs asked: per prompt token (None for the first), on the first output.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # Multimodal serving, on the first output: what encoding the request's images cost.
    image_encodes: list[EncodeResult] | None = None
    # A request submitted with a subscriber (deployments/step_channel.py): the step's index
    # in the request, and on its first step, unless finished, the replica whose step channel
    # may carry the rest.
    seq: int | None = None
    channel: str | None = None
    # The first step after the request resumed on another replica (router/migration.py).
    migrated: bool = False
    # A decode call opened before its prefill (DecodeRequest.await_handoff): its first step,
    # with no tokens, says where the prefill replica is to deliver the handoff.
    kv_destination: KVDestination | None = None
    # Such a call's next step, with no tokens either: the prompt's KV is in and the decode
    # engine's first step for it starts (the router passes the first token on then, so the
    # second follows it by one step).
    kv_arrived: bool = False
    # Sent before ``kv_arrived`` only when that step is slow to come (a full batch): the
    # handoff was delivered here and the request is in the engine, which ends it in time
    # (read, or recompute). The router's bound on a lost delivery stops there.
    kv_received: bool = False


@dataclass
class KVTransferInfo:
    # "nixl" (blocks read into blocks), "nixl_tokens" (caches of unequal layouts: read into a
    # staging buffer, imported as tokens), "object_store", or "recompute"
    transport: str
    stage: str  # "export" (prefill side, before the first token returns) | "import"
    num_bytes: int
    # export: handing the KV to the transport (nixl: the ticket; object store: the copy out of
    # the blocks and into the store); import: from the ticket's arrival at the decode replica
    # to the KV being in its blocks (nixl: loading the peer once, the READ)
    seconds: float
    failed: bool = False  # the fetch failed or timed out (then recomputed, or the request failed)


@dataclass
class PrefillResult:
    """A prefill replica's answer: the first token and, unless the request already ended on
    it, the handoff a decode replica continues from (its ticket set by the transport)."""

    step: StepOutput
    handoff: KVHandoff | None = None
    replica_id: str = ""
    # The handoff went to the request's ``kv_destination`` (else the router passes it on).
    delivered: bool = False


@dataclass
class DecodeRequest:
    """Continue a prefilled request: its prompt and the prefill engine's handoff, unchanged.

    A handoff without a ticket means: recompute the prompt on the decode replica. No handoff
    at all: a migrated request (router/migration.py), recomputed with ``resume_token_ids``,
    or, with none, a request the decode replica runs whole (a short prompt, prefilled there).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling: dict[str, Any]
    handoff: KVHandoff | None
    images: list[ImagePart] = field(default_factory=list)  # for a recompute of the prompt
    # W3C trace context (traceparent, tracestate) of the caller's span when the request is
    # traced (neuron_runtime/tracing.py); None otherwise.
    trace_context: dict[str, str] | None = None
    # Without a handoff: the tokens already produced and streamed (as in GenerateRequest).
    resume_token_ids: list[int] = field(default_factory=list)
    await_handoff: bool = False

    @classmethod
    def whole(cls, request: GenerateRequest) -> DecodeRequest:
        """``request`` run whole by a decode replica: its prompt (and any resumed tokens)
        prefilled there, its sampling as given."""
        return cls(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling=request.sampling,
            handoff=None,
            images=request.images,
            trace_context=request.trace_context,
            resume_token_ids=request.resume_token_ids,
        )


@dataclass
class ChannelRequest:
    """Open a step channel: the outbox of ``subscriber`` on the replica ``replica_id`` (the
    request routers pin the call to that replica)."""

    subscriber: str
    replica_id: str
    # The subscriber's Ray node: on the publisher's own node the steps go over a socket on
    # 127.0.0.1 (SocketChannel) instead of the call's messages. None: always the messages.
    node_id: str | None = None


@dataclass
class SocketChannel:
    """A step channel's first item when its steps go over a socket: connect to 127.0.0.1:port
    and send ``token``; the publisher answers ``reply`` (so the port's holder is proven to be
    it before anything is unpickled), then each frame is a 4-byte big-endian length and a
    pickled ``[(request_id, StepOutput), ...]`` batch. The call stays open while the socket
    does."""

    port: int
    token: str
    reply: str
