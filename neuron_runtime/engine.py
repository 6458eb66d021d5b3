"""LLMEngine: the synchronous engine loop (schedule -> execute -> update -> outputs)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

from neuron_runtime.backends import get_backend
from neuron_runtime.config import EngineConfig
from neuron_runtime.engine_args import EngineArgs
from neuron_runtime.kv_cache import KVCacheManager
from neuron_runtime.kv_layout import cache_layout
from neuron_runtime.kv_transfer import (
    KVBlockSource,
    KVHandoff,
    KVMetadata,
    KVPayload,
    KVTransferError,
)
from neuron_runtime.model_runner import ModelRunnerOutput
from neuron_runtime.multimodal import MultiModalInput, check_placeholders
from neuron_runtime.output_processor import OutputProcessor
from neuron_runtime.outputs import RequestOutput, RequestOutputKind
from neuron_runtime.parallel.executor import make_runner
from neuron_runtime.request import Request, RequestStatus
from neuron_runtime.sampler import skip_draws
from neuron_runtime.sampling_params import SamplingParams
from neuron_runtime.scheduler import Scheduler, SchedulerOutput
from neuron_runtime.spec_decode.decoder import SpecDecoder
from neuron_runtime.spec_decode.metrics import SpecDecodeStats
from neuron_runtime.structured_output import GrammarCompiler, StructuredOutputManager
from neuron_runtime.tokenizer import Tokenizer

if TYPE_CHECKING:
    import numpy as np

    from neuron_runtime.accuracy.online import OnlineValidator

logger = logging.getLogger(__name__)

PromptType = str | list[int] | dict


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's load; leak checks compare it with the idle baseline."""

    num_running: int
    num_waiting: int
    num_kv_blocks_total: int
    num_kv_blocks_used: int
    num_kv_blocks_free: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_unfinished_outputs: int
    num_kv_exports: int = 0  # requests handed off to a decode engine (prefill role)
    num_kv_imports: int = 0  # requests continued from another engine's KV (decode role)
    num_aborted: int = 0  # requests aborted (a client left, a caller cancelled) unfinished
    # Blocks held outside any request: handed-off prompts not yet read (prefill role) and
    # blocks a block read is still writing into (decode role).
    num_kv_blocks_held: int = 0
    num_kv_reads: int = 0  # block reads in flight (decode role)
    num_grammar_states: int = 0  # grammar-constrained requests (compiling or running)
    # Speculative decoding counters (vLLM's spec_decode metrics); None without speculation.
    spec_decode: SpecDecodeStats | None = None


@dataclass
class _BlockRead:
    source: KVBlockSource
    hold_key: str  # the hold on the blocks it writes into
    joined: bool = False  # its request ran in a step while the KV was landing (once at most)


def _first_step(read: _BlockRead) -> None:
    """Tells a block read's owner that its request's first step starts (once)."""
    callback, read.source.on_first_step = read.source.on_first_step, None
    if callback is None:
        return
    try:
        callback()
    except Exception:  # noqa: BLE001 - the owner's news, never the engine's failure
        logger.exception("a KV read's first-step callback failed")


class LLMEngine:
    """Owns tokenizer, scheduler, KV cache manager and model runner; steps them together."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.backend = get_backend(
            config.device, config.num_threads, config.graph.graph_mode, config.model.dtype
        )
        self.tokenizer = Tokenizer(config.model.path)
        self.runner = make_runner(config, self.backend)  # rank 0 of a TP group when sharded
        self.vision = self.runner.vision  # None for a text-only model
        block_size = config.cache.block_size
        capacity = self.runner.num_blocks * block_size
        if capacity < config.model.max_model_len:
            raise ValueError(
                f"the KV cache holds {capacity} tokens ({self.runner.num_blocks} blocks), fewer "
                f"than max_model_len ({config.model.max_model_len}): raise the KV budget or "
                "lower max_model_len"
            )
        self.kv = KVCacheManager(
            self.runner.num_blocks, block_size, config.cache.enable_prefix_caching
        )
        # Grammar masks fill ahead on their own thread only where a core is free while the
        # forward pass runs; else each row fills when the sampler needs it (structured_output/).
        forward_takes_every_core = config.device == "cpu" and (
            config.num_threads is None or config.num_threads >= len(os.sched_getaffinity(0))
        )
        self.structured = StructuredOutputManager(
            GrammarCompiler(
                self.tokenizer.hf_tokenizer, config.model.vocab_size, self.tokenizer.eos_token_id
            ),
            fill_ahead=not forward_takes_every_core,
        )
        self.scheduler = Scheduler(
            config.scheduler, self.kv, config.model.max_model_len, self.structured
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self.kv_layout = cache_layout(self.runner.kv_caches)
        self.spec: SpecDecoder | None = None
        if config.speculative is not None:
            self.spec = SpecDecoder(config, self.runner, self.kv, self.structured)
            self.runner.spec = self.spec
        self._handoffs: dict[str, KVHandoff] = {}  # parent id -> handoff waiting for its output
        self._reads: dict[str, _BlockRead] = {}  # req_id -> its KV arriving by block read
        self._orphan_reads: list[_BlockRead] = []  # reads whose request ended or restarted
        self.num_kv_exports = 0
        self.num_kv_imports = 0
        # Online validation (accuracy/online.py attaches it): sampled requests' prompt logits.
        self.online_validation: OnlineValidator | None = None

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        return cls(args.create_engine_config())

    @property
    def max_model_len(self) -> int:
        return self.config.model.max_model_len

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
        *,
        export_kv: bool = False,
        handoff: KVHandoff | None = None,
        mm_inputs: list[MultiModalInput] | None = None,
    ) -> None:
        """Queues a request; ValueError (nothing queued) when the prompt or params are invalid.

        ``mm_inputs``: the prompt's images, their placeholders already in the prompt ids
        (``multimodal.expand_image_tokens``). Inputs with only an image are encoded now by the
        model's vision tower; precomputed features are checked and used as they are.

        Disaggregated serving uses two roles. ``export_kv`` (prefill): once its first token
        is out the request leaves this engine: its final output carries a ``KVHandoff`` and
        no finish reason, and its prompt blocks stay held until ``release_kv``. ``handoff``
        (decode): the request continues after the tokens the prefill engine produced, from
        ``handoff.kv`` (a payload, or a block read), or by recomputing the prompt (None).
        """
        if request_id in self.output_processor.parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, prompt_ids = self._tokenize(prompt)
        params = self._check_lengths(prompt_ids, params)
        vocab = self.config.model.vocab_size
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise ValueError(f"logit_bias keys must be token ids in [0, {vocab})")
        if params.allowed_token_ids and max(params.allowed_token_ids) >= vocab:
            raise ValueError(f"allowed_token_ids must be token ids in [0, {vocab})")
        bad_words = self.tokenizer.bad_words_token_ids(params.bad_words or [])
        if (export_kv or handoff is not None) and params.n != 1:
            raise ValueError("a KV handoff carries one sequence: split n > 1 into n requests")
        images = self._images(prompt_ids, mm_inputs or [])
        child_ids = (
            [request_id] if params.n == 1 else [f"{request_id}#{i}" for i in range(params.n)]
        )
        eos = self.tokenizer.eos_token_id
        requests = []
        for index, child_id in enumerate(child_ids):
            child_params = params if params.n == 1 else params.child(index)
            request = Request(child_id, prompt_ids, child_params, eos, mm_inputs=images)
            request.bad_words_token_ids = bad_words
            requests.append(request)
        prefilled = None
        if handoff is not None:
            prefilled = self._continue_from(requests[0], handoff)
        for index, request in enumerate(requests):
            request.export_kv = export_kv
            self.scheduler.add_request(request, fork_of=child_ids[0] if index else None)
        self.output_processor.add(
            request_id, text, prompt_ids, params, child_ids, kind, prefilled=prefilled
        )
        online = self.online_validation
        if online is not None and handoff is None and not images and online.wants():
            self.runner.prompt_logit_taps[child_ids[0]] = len(prompt_ids)

    def _continue_from(self, request: Request, handoff: KVHandoff) -> list[int]:
        """Sets a decode-role request up after the handed-off tokens; returns those tokens."""
        outputs = list(handoff.output_token_ids)
        if not outputs:
            raise ValueError("a KV handoff must carry the tokens the prefill side produced")
        if request.max_tokens is not None and len(outputs) >= request.max_tokens:
            raise ValueError("the handed-off tokens already reach max_tokens")
        kv = handoff.kv
        if isinstance(kv, KVPayload):
            kv.check(self.config.model, request.prompt_token_ids, request.mm_inputs)
            request.kv_import = kv
        elif isinstance(kv, KVBlockSource):
            kv.metadata.check(self.config.model, request.prompt_token_ids, request.mm_inputs)
            mismatch = self.kv_layout.mismatch(kv.layout)
            if mismatch is not None:
                raise KVTransferError(f"KV blocks of another cache layout ({mismatch})")
            request.kv_import = kv  # step() starts the read once the scheduler admits it
        if handoff.draft_hidden is not None and kv is not None and self.spec is not None:
            self.spec.import_state(request, handoff.draft_hidden)  # EAGLE's first drafts
        request.all_token_ids.extend(outputs)
        seed = request.params.seed
        if seed is not None and not request.params.greedy:
            if handoff.generator_state is None:
                # A migrated request (its replica was lost with the generator): replay the
                # draws the lost replica made for those tokens.
                self._replay_generator(request.req_id, seed, len(outputs))
            else:
                self.runner.restore_generator(request.req_id, seed, handoff.generator_state)
        self.num_kv_imports += 1
        return outputs

    def step(self) -> list[RequestOutput]:
        scheduled = self.scheduler.schedule()
        if self.spec is not None:  # handed-off requests draft in their first step here
            self.spec.propose_arrivals(scheduled, self.scheduler.requests)
        arriving, failed, joining = self._read_kv(scheduled)
        runnable = scheduled
        if arriving or failed:
            held_back = arriving | set(failed)
            seqs = [s for s in scheduled.seqs if s.req_id not in held_back]
            runnable = dataclasses.replace(scheduled, seqs=seqs)
        if not runnable.seqs and not failed and (self._reads or self._orphan_reads):
            time.sleep(0.0005)  # only transfers in flight: wait for them, do not spin
        reads = [self._reads[req_id].source for req_id in joining]
        seeds = {req_id: self.runner.generator_state(req_id) for req_id in joining}
        arrivals: contextlib.AbstractContextManager[set[KVBlockSource]] = (
            self.runner.kv_arriving(reads) if reads else contextlib.nullcontext(set())
        )
        with arrivals as missed:
            result = self._execute(runnable) if runnable.seqs else ModelRunnerOutput()
        late = self._join_reads(seeds, missed, result, failed)
        if late:
            runnable = dataclasses.replace(
                runnable, seqs=[s for s in runnable.seqs if s.req_id not in late]
            )
        result.failed.update(failed)
        if result.prompt_logits:
            self._validate_online(result.prompt_logits)
        if result.prompt_logprobs:
            self.output_processor.add_prompt_logprobs(result.prompt_logprobs)
        if failed:
            runnable = dataclasses.replace(
                runnable, seqs=runnable.seqs + [s for s in scheduled.seqs if s.req_id in failed]
            )
        updated = self.scheduler.update(runnable, result.sampled, result.failed, result.accepted)
        self._hand_off(updated)
        draft_logprobs = self.spec.take_logprobs() if self.spec is not None else {}
        outputs, stopped, failed_outputs = self.output_processor.process(
            updated, result.logprobs, draft_logprobs
        )
        for child_id in stopped:
            self.scheduler.finish(child_id, RequestStatus.FINISHED_STOPPED)
        for child_id in failed_outputs:
            self.scheduler.finish(child_id, RequestStatus.FINISHED_ERROR)
        for request in updated:
            if request.status.finished:
                self.runner.release(request.req_id)
        if self.spec is not None:
            self.spec.propose(self.scheduler.running)
        for output in outputs:
            handoff = self._handoffs.pop(output.request_id, None) if output.finished else None
            if handoff is not None:
                # The sequence goes on at a decode engine: it has no finish reason.
                output.kv_handoff = handoff
                for completion in output.outputs:
                    completion.finish_reason = completion.stop_reason = None
        return outputs

    def _execute(self, scheduled: SchedulerOutput) -> ModelRunnerOutput:
        """The runner's step; when it raises, the requests that caused it fail alone.

        Each slice then runs by itself, so only the requests whose own slice raises end with
        the error and the rest of the batch goes on. Re-running a slice writes the same KV
        into its own slots again; a seeded generator is wound back to its request's tokens
        (the failed step may have drawn from it). A tensor-parallel step is not re-run: its
        ranks may be inside different collectives.
        """
        try:
            return self.runner.execute(scheduled)
        except Exception as exc:  # noqa: BLE001 - one request's failure is not the batch's
            if self.config.parallel.tensor_parallel_size > 1:
                raise  # the other ranks may wait in a collective of the failed step
            if len(scheduled.seqs) == 1:
                return ModelRunnerOutput(failed={scheduled.seqs[0].req_id: _step_error(exc)})
            n = len(scheduled.seqs)
            logger.warning("a step of %d slices failed (%r): running each alone", n, exc)
        result = ModelRunnerOutput()
        for seq in scheduled.seqs:
            self._rewind_generator(seq.req_id)
            try:
                part = self.runner.execute(dataclasses.replace(scheduled, seqs=[seq]))
            except Exception as exc:  # noqa: BLE001
                logger.warning("request %s failed its step: %r", seq.req_id, exc)
                result.failed[seq.req_id] = _step_error(exc)
                continue
            result.merge(part)
        return result

    def _rewind_generator(self, req_id: str) -> None:
        """A seeded request's generator as it was before this step's draws."""
        request = self.scheduler.requests.get(req_id)
        if request is None or self.runner.generator_state(req_id) is None:
            return
        seed = request.params.seed
        assert seed is not None  # the runner keeps generators of seeded requests only
        self._replay_generator(req_id, seed, len(request.output_token_ids))

    def _replay_generator(self, req_id: str, seed: int, num_tokens: int) -> None:
        """Sets the request's generator to where sampling ``num_tokens`` tokens left it."""
        device = self.runner.generator_device
        drawn = skip_draws(seed, num_tokens, self.config.model.vocab_size, device)
        self.runner.restore_generator(req_id, seed, drawn.get_state().numpy())

    def _validate_online(self, prompt_logits: dict[str, np.ndarray]) -> None:
        """Hands sampled requests' first-token logits to the online validator's queue."""
        assert self.online_validation is not None
        for child_id, logits in prompt_logits.items():
            request = self.scheduler.requests[child_id]
            parent_id = self.output_processor.child_to_parent[child_id]
            self.online_validation.submit(parent_id, request.prompt_token_ids, logits)

    def _hand_off(self, updated: list[Request]) -> None:
        """Prefill role: hands off the requests whose first token just came out.

        The prompt's blocks are held (one more reference each) under a fresh handoff id and
        the request leaves the running batch; ``release_kv`` drops the hold once the decode
        side has read them (or gave up). Nothing is copied here.
        """
        bs = self.config.cache.block_size
        for request in updated:
            if not request.export_kv or request.status != RequestStatus.RUNNING:
                continue  # not a prefill-role request, or it ended on its first token
            prompt = request.prompt_token_ids
            block_ids = request.block_table[: -(-len(prompt) // bs)]
            parent_id = self.output_processor.child_to_parent[request.req_id]
            handoff_id = f"{parent_id}@{uuid.uuid4().hex[:12]}"
            self.kv.hold(handoff_id, block_ids)
            self._handoffs[parent_id] = KVHandoff(
                metadata=KVMetadata.describe(self.config.model, prompt, request.mm_inputs),
                output_token_ids=list(request.output_token_ids),
                generator_state=self.runner.generator_state(request.req_id),
                handoff_id=handoff_id,
                layout=self.kv_layout,
                block_ids=tuple(block_ids),
                draft_hidden=None if self.spec is None else self.spec.export_state(request.req_id),
            )
            self.scheduler.finish(request.req_id, RequestStatus.FINISHED_HANDED_OFF)
            self.num_kv_exports += 1

    def read_kv(self, handoff: KVHandoff) -> KVPayload:
        """Prefill role: a copy of a handed-off prompt's KV, from its held blocks.

        Safe from another thread while the hold lasts: held blocks are full prompt blocks or
        the prompt's last block, which nobody writes once the request has left.
        """
        assert handoff.handoff_id in self.kv.held, f"{handoff.handoff_id} is not held"
        kv = self.runner.export_kv(list(handoff.block_ids), handoff.metadata.num_tokens)
        return KVPayload(handoff.metadata, kv)

    def release_kv(self, handoff_id: str) -> bool:
        """Prefill role: frees a handed-off prompt's blocks; False if they are not held."""
        return self.kv.release(handoff_id)

    def _read_kv(self, scheduled: SchedulerOutput) -> tuple[set[str], dict[str, str], set[str]]:
        """Decode role: starts the block reads of newly admitted requests and polls the others.

        Returns the requests whose KV is still arriving (left out of this step), those whose
        read failed without recompute (req_id -> error), and those that run in this step
        while their KV lands layer by layer (a layer-wise read, once per read; eager forwards
        only: a graph cannot wait between layers). A failed read with recompute sets the
        request back to zero computed tokens: the next step computes its prompt.
        """
        for req_id in scheduled.preempted_req_ids:
            read = self._reads.pop(req_id, None)
            if read is not None:
                self._orphan_reads.append(read)  # the restart recomputes; its blocks were freed
        self._orphan_reads = [r for r in self._orphan_reads if not self._finished(r)]
        arriving: set[str] = set()
        failed: dict[str, str] = {}
        joining: set[str] = set()
        can_join = self.spec is None and not self.config.graph.static
        bs = self.config.cache.block_size
        for seq in scheduled.seqs:
            source = seq.kv_import
            if isinstance(source, KVBlockSource):
                seq.kv_import = None
                block_ids = seq.block_table[: -(-source.metadata.num_tokens // bs)]
                read = _BlockRead(source, f"read:{seq.req_id}@{uuid.uuid4().hex[:12]}")
                self.kv.hold(read.hold_key, block_ids)
                self._reads[seq.req_id] = read
                try:
                    if self.config.parallel.tensor_parallel_size > 1:
                        # A block read lands in rank 0's cache only: the payload path re-splits.
                        raise KVTransferError("block reads need tensor_parallel_size 1")
                    source.start(block_ids)
                except KVTransferError as exc:
                    self._read_failed(seq.req_id, exc, failed)
                    arriving.add(seq.req_id)
                    continue
            read = self._reads.get(seq.req_id)
            if read is None:
                continue
            try:
                done = read.source.poll()
            except KVTransferError as exc:
                self._read_failed(seq.req_id, exc, failed)
                arriving.add(seq.req_id)  # this step's slice assumed the KV was there
                continue
            if done:
                del self._reads[seq.req_id]
                self.kv.release(read.hold_key)
                _first_step(read)
            elif can_join and read.source.layer_wise and not read.joined:
                read.joined = True
                joining.add(seq.req_id)
                _first_step(read)
            else:
                arriving.add(seq.req_id)
        return arriving - set(failed), failed, joining

    def _join_reads(
        self,
        joining: dict[str, np.ndarray | None],
        missed: set[KVBlockSource],
        result: ModelRunnerOutput,
        failed: dict[str, str],
    ) -> set[str]:
        """After a forward that ran requests whose KV was landing (each layer waited for its
        own blocks): keeps the output of those whose every layer was in when waited for.
        The others leave the step as if never run (returned), their token dropped and their
        seeded generator set back to ``joining``'s state: still landing (they wait outside
        the batch now), to recompute, or failed (into ``failed``).
        """
        late = set()
        for req_id, generator_state in joining.items():
            read = self._reads[req_id]
            try:
                if read.source.poll() and read.source not in missed:
                    del self._reads[req_id]
                    self.kv.release(read.hold_key)
                    continue
            except KVTransferError as exc:
                self._read_failed(req_id, exc, failed)
            late.add(req_id)
            for per_request in (result.sampled, result.logprobs, result.failed, result.accepted):
                per_request.pop(req_id, None)
            seed = self.scheduler.requests[req_id].params.seed
            if generator_state is None or seed is None:
                self.runner.generators.pop(req_id, None)
            else:
                self.runner.restore_generator(req_id, seed, generator_state)
        return late

    def _read_failed(self, req_id: str, exc: KVTransferError, failed: dict[str, str]) -> None:
        read = self._reads.pop(req_id)
        self.kv.release(read.hold_key)
        _first_step(read)  # no KV to wait for now: the request runs (recomputes) or ends
        if read.source.recompute_on_failure:
            self.scheduler.requests[req_id].num_computed_tokens = 0
        else:
            failed[req_id] = f"the prompt's KV could not be read: {exc}"

    def _finished(self, read: _BlockRead) -> bool:
        """Polls an orphaned read; once it has ended (either way) its blocks are freed."""
        try:
            if not read.source.poll():
                return False
        except KVTransferError:
            pass
        self.kv.release(read.hold_key)
        return True

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Ends a request wherever it is and frees its blocks; returns its final output.

        A handoff id (prefill role) releases that handed-off prompt's blocks.
        """
        if self.release_kv(request_id):
            return None
        for child_id in self.output_processor.child_ids(request_id):
            self.scheduler.finish(child_id, RequestStatus.FINISHED_ABORTED)
            self.runner.release(child_id)
            if self.spec is not None:
                self.spec.release(child_id)
            read = self._reads.pop(child_id, None)
            if read is not None:
                self._orphan_reads.append(read)
        self._handoffs.pop(request_id, None)
        return self.output_processor.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._orphan_reads)

    def stats(self) -> EngineStats:
        pool = self.kv.pool
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=self.scheduler.num_waiting,
            num_kv_blocks_total=pool.num_blocks,
            num_kv_blocks_used=pool.num_used_blocks,
            num_kv_blocks_free=pool.num_free_blocks,
            kv_cache_usage=self.kv.usage(),
            prefix_cache_queries=self.kv.prefix_cache_queries,
            prefix_cache_hits=self.kv.prefix_cache_hits,
            num_preemptions=self.scheduler.num_preemptions,
            num_unfinished_outputs=len(self.output_processor.parents),
            num_kv_exports=self.num_kv_exports,
            num_kv_imports=self.num_kv_imports,
            num_aborted=self.output_processor.num_aborted,
            num_kv_blocks_held=self.kv.num_held_blocks,
            num_kv_reads=len(self._reads) + len(self._orphan_reads),
            num_grammar_states=self.structured.num_states,
            spec_decode=None if self.spec is None else self.spec.stats(),
        )

    def _images(
        self, prompt_ids: list[int], mm_inputs: list[MultiModalInput]
    ) -> list[MultiModalInput]:
        """The prompt's images in order, with features; ValueError if they do not fit."""
        if self.vision is None:
            if mm_inputs:
                raise ValueError(
                    f"model {self.config.model.name or self.config.model.path!r} has no vision "
                    "tower: it cannot take images"
                )
            return []
        vision = self.vision
        mm_inputs = check_placeholders(
            prompt_ids, mm_inputs, vision.image_token_id, vision.tokens_per_image
        )
        return vision.features(mm_inputs) if mm_inputs else []

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        text: str | None
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            text, ids = prompt.get("prompt"), list(prompt["prompt_token_ids"])
        elif isinstance(prompt, dict) and "prompt" in prompt:
            text, ids = prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
        elif isinstance(prompt, list):
            text, ids = None, list(prompt)
        else:
            raise ValueError(
                "prompt must be a string, a list of token ids, or a dict with 'prompt' or "
                "'prompt_token_ids'"
            )
        if not ids:
            raise ValueError("prompt is empty")
        vocab = self.config.model.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt_token_ids must be integers in [0, {vocab}), got {bad[:5]}")
        return text, ids

    def _check_lengths(self, prompt_ids: list[int], params: SamplingParams) -> SamplingParams:
        limit = self.max_model_len
        if len(prompt_ids) >= limit:
            raise ValueError(
                f"prompt has {len(prompt_ids)} tokens; max_model_len is {limit}, "
                "which must leave room for at least one output token"
            )
        room = limit - len(prompt_ids)
        if params.max_tokens is None:
            return params.replace(max_tokens=room)
        if params.max_tokens > room:
            raise ValueError(
                f"max_tokens ({params.max_tokens}) + prompt tokens ({len(prompt_ids)}) "
                f"exceeds max_model_len ({limit})"
            )
        return params


def _step_error(exc: Exception) -> str:
    return f"the engine step failed for this request: {exc!r}"
