"""Per-request sampling parameters, with vLLM's field names."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from neuron_runtime.structured_output.params import StructuredOutputsParams

MAX_LOGPROBS = 20
MAX_PENALTY = 2.0  # presence/frequency penalties live in [-2, 2], as in OpenAI's API
MAX_LOGIT_BIAS = 100.0
# A seed is a signed 64-bit integer (what torch's generators take; the n > 1 samples' seeds
# seed + 1 .. seed + n - 1 stay within the unsigned 64-bit range they also accept).
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
# A top-k from here on keeps every token of any vocabulary: it means off (0), as it would
# otherwise overflow the int64 tensors the sampler builds.
TOP_K_ALL = 2**31


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop, for one request.

    Field names and defaults follow vLLM's SamplingParams, so code written against it ports
    unchanged. ``temperature == 0`` means greedy. Invalid values raise ValueError naming the
    field; the HTTP layer turns that into a 400.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    detokenize: bool = True
    # Log-probabilities of the sampled token plus this many top tokens, per output token.
    logprobs: int | None = None
    # Log-probabilities of each prompt token (after the first) plus this many top tokens.
    # Such a request skips the prefix cache: every prompt position must be computed.
    prompt_logprobs: int | None = None
    # Penalties on tokens already seen: presence/frequency subtract from the logits of output
    # tokens (once / per occurrence); repetition (> 1 discourages) divides positive logits and
    # multiplies negative ones of prompt and output tokens, as in vLLM.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # token id -> value added to its logit before sampling.
    logit_bias: dict[int, float] | None = None
    # Only these tokens may be sampled (None: any).
    allowed_token_ids: list[int] | None = None
    # Words never to produce: the engine tokenizes each (as given and after a space) and bans
    # a word's last token whenever the output already ends with the rest of it.
    bad_words: list[str] | None = None
    # Grammar-constrained decoding: a JSON schema, regex, choice or grammar the output must
    # match (structured_output/). A dict is read as StructuredOutputsParams' fields.
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        # -1 is vLLM's spelling of "no top-k"; keep one internal meaning (0 = off).
        if self.top_k == -1 or (isinstance(self.top_k, int) and self.top_k >= TOP_K_ALL):
            self.top_k = 0
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        self._validate()

    def _validate(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not math.isfinite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(
                f"top_k must be -1 (off), 0 (off) or a positive integer, got {self.top_k}"
            )
        if not math.isfinite(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or self.max_tokens < 1
        ):
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        if self.seed is not None and (
            not isinstance(self.seed, int) or not SEED_MIN <= self.seed <= SEED_MAX
        ):
            raise ValueError(
                f"seed must be an integer in [{SEED_MIN}, {SEED_MAX}], got {self.seed!r}"
            )
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be a list of non-empty strings")
        if self.logprobs is not None and (
            not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(
                f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}"
            )
        if self.prompt_logprobs is not None and (
            not isinstance(self.prompt_logprobs, int)
            or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(
                f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}], "
                f"got {self.prompt_logprobs!r}"
            )
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative integers")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not math.isfinite(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise ValueError(f"{name} must be in [-{MAX_PENALTY}, {MAX_PENALTY}], got {value}")
        if not math.isfinite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ValueError(
                f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}"
            )
        if self.allowed_token_ids is not None and (
            not self.allowed_token_ids
            or any(not isinstance(t, int) or t < 0 for t in self.allowed_token_ids)
        ):
            raise ValueError("allowed_token_ids must be a non-empty list of token ids >= 0")
        if self.bad_words is not None and any(
            not isinstance(w, str) or not w.strip() for w in self.bad_words
        ):
            raise ValueError("bad_words must be a list of non-empty strings")
        for token_id, bias in (self.logit_bias or {}).items():
            if not isinstance(token_id, int) or token_id < 0:
                raise ValueError(f"logit_bias keys must be token ids >= 0, got {token_id!r}")
            if not math.isfinite(bias) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(
                    f"logit_bias values must be in [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}], "
                    f"got {bias} for token {token_id}"
                )

        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise ValueError("structured_outputs must be a StructuredOutputsParams")
            # The grammar decides when EOS may come; these would overrule it.
            if self.ignore_eos:
                raise ValueError("ignore_eos cannot be combined with structured_outputs")
            if self.min_tokens:
                raise ValueError("min_tokens cannot be combined with structured_outputs")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """True when sampling needs the tokens seen so far (any penalty is not neutral)."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def child(self, index: int) -> SamplingParams:
        """Params for the index-th of ``n`` parallel samples: n=1, seed offset by the index."""
        seed = None if self.seed is None else self.seed + index
        return dataclasses.replace(self, n=1, seed=seed)

    def replace(self, **changes: object) -> SamplingParams:
        """A validated copy with some fields changed."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]
