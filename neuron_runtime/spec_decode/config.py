"""``speculative_config``: vLLM's keys, validated once into a frozen dataclass."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram", "draft_model", "eagle", "eagle3")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """How the engine proposes tokens for the target model to verify.

    ``method``:
    - ``ngram``: prompt lookup; the last ``prompt_lookup_max`` .. ``prompt_lookup_min`` tokens
      are searched for earlier in the sequence and the tokens that followed are proposed.
    - ``draft_model``: a smaller model with the same tokenizer (``model``), its KV paged in the
      engine's own blocks. Without ``model`` (or with the target's own name) and with
      ``num_draft_layers`` N, the draft is the target's first N layers plus its final norm and
      head (self-speculation): no extra weights and no extra KV, for those layers' KV is the
      target's own.
    - ``eagle`` / ``eagle3``: an EAGLE head (``model``: a folder in the published layout) fed
      with the target's token embeddings and hidden states.
    ``num_speculative_tokens``: tokens proposed per step (k); each verify step feeds k + 1.
    """

    method: str
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    num_draft_layers: int | None = None
    # A request stops proposing for a few steps when its recent acceptance (accepted / draft
    # tokens, averaged over its last verify steps) falls below this; 0 never backs off.
    min_acceptance_rate: float = 0.1
    # No drafts while more than this many requests run (vLLM's key): a large batch is
    # compute-bound, where verifying k + 1 rows per request costs more than it saves.
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(
                f"speculative_config.method must be one of {', '.join(METHODS)}, "
                f"got {self.method!r}"
            )
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                "speculative_config.num_speculative_tokens must be an integer in "
                f"[1, {MAX_SPECULATIVE_TOKENS}], got {k!r}"
            )
        lookup = (self.prompt_lookup_min, self.prompt_lookup_max)
        if self.method == "ngram":
            for name, value in zip(("prompt_lookup_min", "prompt_lookup_max"), lookup, strict=True):
                if value is not None and (not isinstance(value, int) or value < 1):
                    raise ValueError(
                        f"speculative_config.{name} must be an integer >= 1, got {value!r}"
                    )
            if self.lookup_min > self.lookup_max:
                raise ValueError(
                    f"speculative_config.prompt_lookup_min ({self.lookup_min}) must not exceed "
                    f"prompt_lookup_max ({self.lookup_max})"
                )
        elif any(v is not None for v in lookup):
            raise ValueError("speculative_config.prompt_lookup_min/max apply to method 'ngram'")
        if self.method in ("eagle", "eagle3") and not self.model:
            raise ValueError(
                f"speculative_config.model (the EAGLE head) is required for {self.method}"
            )
        if self.num_draft_layers is not None:
            if self.method != "draft_model":
                raise ValueError("speculative_config.num_draft_layers applies to 'draft_model'")
            if not isinstance(self.num_draft_layers, int) or self.num_draft_layers < 1:
                raise ValueError(
                    "speculative_config.num_draft_layers must be an integer >= 1, "
                    f"got {self.num_draft_layers!r}"
                )
        if self.method == "draft_model" and not self.model and self.num_draft_layers is None:
            raise ValueError(
                "speculative_config for 'draft_model' needs model (a draft model) or "
                "num_draft_layers (the target's first layers as the draft)"
            )
        if self.disable_by_batch_size is not None and (
            not isinstance(self.disable_by_batch_size, int) or self.disable_by_batch_size < 1
        ):
            raise ValueError(
                "speculative_config.disable_by_batch_size must be an integer >= 1, "
                f"got {self.disable_by_batch_size!r}"
            )
        if not 0.0 <= self.min_acceptance_rate < 1.0:
            raise ValueError(
                "speculative_config.min_acceptance_rate must be in [0, 1), "
                f"got {self.min_acceptance_rate!r}"
            )

    @property
    def lookup_min(self) -> int:
        """Unset: ``prompt_lookup_max`` (short matches in free text predict little)."""
        if self.prompt_lookup_min is not None:
            return self.prompt_lookup_min
        return self.lookup_max

    @property
    def lookup_max(self) -> int:
        """Unset: ``prompt_lookup_min``, or 3 when neither is set."""
        if self.prompt_lookup_max is not None:
            return self.prompt_lookup_max
        return self.prompt_lookup_min or 3

    def self_speculative(self, target_name: str) -> bool:
        """True when the draft is the target's own first ``num_draft_layers`` layers."""
        return (
            self.method == "draft_model"
            and self.num_draft_layers is not None
            and self.model in (None, "", target_name)
        )

    @classmethod
    def from_dict(cls, value: dict[str, Any] | SpeculativeConfig) -> SpeculativeConfig:
        """The config from ``speculative_config`` as users write it; unknown keys are refused."""
        if isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a mapping, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown keys: {unknown}")
        for key in ("method", "num_speculative_tokens"):
            if key not in value:
                raise ValueError(f"speculative_config.{key} is required")
        return cls(**value)
