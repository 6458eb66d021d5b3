"""Both sides of a comparison, fed the same token sequence (teacher forcing).

``OurModel`` is the engine's own model runner (the backend's ops, the paged KV cache, the
runner's input preparation), fed one sequence the way the scheduler feeds it: the prompt in
prefill chunks (the first from an empty cache, the others attending to cached blocks too),
then every continuation token as a decode step. ``Reference`` is transformers' implementation
of the same checkpoint, run once over the whole sequence. ``OurEncoder`` is the encoder
(embedding) models' counterpart of ``OurModel``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from neuron_runtime.accuracy.metrics import DTYPES
from neuron_runtime.backends import get_backend
from neuron_runtime.engine_args import EngineArgs
from neuron_runtime.model_runner import ModelRunner
from neuron_runtime.multimodal import MultiModalInput, hash_image, load_image, place_images
from neuron_runtime.sampling_params import SamplingParams
from neuron_runtime.scheduler import ScheduledSeq, SchedulerOutput
from neuron_runtime.tokenizer import Tokenizer


@dataclass
class Sample:
    """One sequence to compare: token ids (image placeholders expanded), the prompt's length,
    its images (as placeholders spans + the pixels both sides see)."""

    name: str
    token_ids: list[int]
    num_prompt_tokens: int
    mm_inputs: list[MultiModalInput] = field(default_factory=list)
    pixel_values: np.ndarray | None = None  # [images, 3, S, S] float32, as the engine encodes


def tokenize_prompt(
    tokenizer: Tokenizer, vision: Any, name: str, prompt: str, images: list[Any]
) -> Sample:
    """A prompt (``<image>`` once per image) -> a Sample; ValueError if they do not fit."""
    ids = tokenizer.encode(prompt)
    if not images:
        return Sample(name, ids, len(ids))
    if vision is None:
        raise ValueError(f"prompt {name!r} has images but the model has no vision tower")
    ids, spans = place_images(ids, vision.image_token_id, vision.tokens_per_image, len(images))
    mm_inputs = [
        MultiModalInput(offset, length, hash_image(image), image=image)
        for (offset, length), image in zip(spans, images, strict=True)
    ]
    pixels = vision.processor.preprocess([load_image(image) for image in images])
    return Sample(name, ids, len(ids), mm_inputs, pixels)


class OurModel:
    """The engine's model runner over one sequence at a time (see the module docstring).

    ``prefill_chunk`` tokens per prefill step; not a multiple of ``block_size`` by default, so
    chunks start mid-block as they do under a token budget shared with other requests.
    ``dtype`` is the engine's (EngineArgs.dtype: bf16 linear layers where the CPU has them).
    """

    def __init__(
        self,
        model: str,
        max_model_len: int,
        device: str = "cpu",
        num_threads: int | None = None,
        block_size: int = 16,
        prefill_chunk: int = 37,
        dtype: str = "float32",
    ) -> None:
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        num_blocks = -(-max_model_len // block_size)
        args = EngineArgs(
            model=model,
            max_model_len=max_model_len,
            block_size=block_size,
            num_kv_blocks=num_blocks,
            device=device,
            num_threads=num_threads,
            graph_mode="eager",
            dtype=dtype,
        )
        self.config = args.create_engine_config()
        backend = get_backend(device, num_threads, "eager", dtype)
        self.runner = ModelRunner(self.config, backend)
        self.model: Any = self.runner.model
        self.tokenizer = Tokenizer(self.config.model.path)
        self.block_size = block_size
        self.prefill_chunk = prefill_chunk

    @property
    def vision(self) -> Any:
        return self.runner.vision

    def logits(self, sample: Sample) -> torch.Tensor:
        """Our logits at every position of ``sample``: [len(token_ids), vocab] float32 (CPU).

        The prompt is prefilled in chunks, the tokens after it are decode steps; the KV of
        the sequence is left in blocks ``block_table`` (0, 1, ...) for ``export_kv``.
        """
        ids = sample.token_ids
        n = len(ids)
        if n > self.config.model.max_model_len:
            raise ValueError(
                f"sample {sample.name!r} is {n} tokens, over max_model_len "
                f"{self.config.model.max_model_len}"
            )
        mm_inputs = self.vision.features(sample.mm_inputs) if sample.mm_inputs else []
        block_table = self.block_table(n)
        params = SamplingParams(temperature=0.0, max_tokens=1)
        rows = []
        pos = 0
        with torch.inference_mode():
            while pos < n:
                end = min(pos + self.prefill_chunk, sample.num_prompt_tokens)
                end = pos + 1 if end <= pos else end  # past the prompt: one decode token
                seq = ScheduledSeq(
                    req_id=sample.name,
                    token_ids=ids[pos:end],
                    start_pos=pos,
                    block_table=block_table,
                    sample=False,
                    params=params,
                    mm_inputs=[
                        m for m in mm_inputs if m.offset < end and m.offset + m.length > pos
                    ],
                )
                step = self.runner.prepare_inputs(SchedulerOutput([seq], end - pos))
                hidden, _ = self.runner.forward(step)
                rows.append(self.model.compute_logits(hidden).float().cpu())
                pos = end
        return torch.cat(rows)

    def block_table(self, num_tokens: int) -> list[int]:
        return list(range(-(-num_tokens // self.block_size)))

    def export_kv(self, num_tokens: int) -> np.ndarray:
        """The KV of the last sequence's first ``num_tokens`` tokens, contiguous:
        [2, layers, kv_heads, num_tokens, head_dim] (the runner's own export)."""
        return self.runner.export_kv(self.block_table(num_tokens), num_tokens)


class OurEncoder:
    """An encoder (embedding) model as the embedding engine runs it: last hidden states."""

    def __init__(self, model: str, device: str = "cpu", num_threads: int | None = None) -> None:
        from neuron_runtime.embedding import EmbeddingEngine

        self.engine = EmbeddingEngine(model, num_threads=num_threads, device=device)
        self.model: torch.nn.Module = self.engine.model
        self.tokenizer = self.engine.tokenizer
        self.vision = None

    def hidden_states(self, sample: Sample) -> torch.Tensor:
        """[len(token_ids), hidden] float32 (CPU)."""
        device = self.engine.backend.device
        ids = torch.tensor([sample.token_ids], device=device)
        with torch.inference_mode():
            out = self.model(ids, torch.ones_like(ids, dtype=torch.bool))
        return out[0].float().cpu()


class Reference:
    """transformers' implementation of the checkpoint at ``path``, in ``dtype``, on the CPU."""

    def __init__(self, path: str | Path, architecture: str, dtype: str = "float32") -> None:
        import transformers

        self.dtype = DTYPES[dtype]
        if architecture == "BertModel":
            cls: Any = transformers.AutoModel
        elif architecture == "LlavaForConditionalGeneration":
            cls = transformers.LlavaForConditionalGeneration
        else:
            cls = transformers.AutoModelForCausalLM
        self.model = cls.from_pretrained(path, dtype=self.dtype).eval()
        self.is_encoder = architecture == "BertModel"

    def _inputs(self, sample: Sample, token_ids: list[int]) -> dict[str, torch.Tensor]:
        inputs = {"input_ids": torch.tensor([token_ids])}
        if sample.pixel_values is not None:
            inputs["pixel_values"] = torch.from_numpy(sample.pixel_values).to(self.dtype)
        return inputs

    def continue_greedy(self, sample: Sample, num_tokens: int) -> Sample:
        """``sample`` with ``num_tokens`` greedy tokens of the reference appended."""
        if num_tokens == 0 or self.is_encoder:
            return sample
        ids = list(sample.token_ids)
        with torch.inference_mode():
            for _ in range(num_tokens):
                logits = self.model(**self._inputs(sample, ids)).logits[0, -1]
                ids.append(int(logits.argmax()))
        return Sample(
            sample.name, ids, sample.num_prompt_tokens, sample.mm_inputs, sample.pixel_values
        )

    def logits(self, sample: Sample) -> torch.Tensor:
        """[len(token_ids), vocab] float32, or the last hidden states of an encoder."""
        with torch.inference_mode():
            if self.is_encoder:
                out = self.model(torch.tensor([sample.token_ids])).last_hidden_state
            else:
                out = self.model(**self._inputs(sample, sample.token_ids)).logits
        return out[0].float()

    def logits_and_cache(
        self, sample: Sample
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """A decoder's logits [len(token_ids), vocab] and, per layer, its cached (keys,
        values) [kv_heads, tokens kept, head_dim] (a sliding-window layer may keep only the
        last tokens), float32."""
        with torch.inference_mode():
            out = self.model(**self._inputs(sample, sample.token_ids), use_cache=True)
        cache = out.get("cache") or out.past_key_values  # "cache" from transformers 5.2x
        past = [(layer.keys[0].float(), layer.values[0].float()) for layer in cache.layers]
        return out.logits[0].float(), past
