"""EAGLE and EAGLE-3 heads against an independent computation: transformers' own Llama
modules loaded with the same random head weights, fed the target's hidden states from
transformers' LlamaForCausalLM, must draft the same tokens as the engine's proposer."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file
from spec_decode_heads import make_eagle_head
from transformers.models.llama import modeling_llama as hf

from neuron_runtime.engine import LLMEngine
from neuron_runtime.engine_args import EngineArgs
from neuron_runtime.sampling_params import SamplingParams

PROMPT = [11, 12, 13, 14, 15, 16, 17, 18, 300, 301, 302, 11, 12]
K = 3


def causal_mask(n: int) -> torch.Tensor:
    return torch.full((n, n), float("-inf")).triu(1)[None, None]  # [1, 1, n, n] additive


class Reference:
    """The head's drafts computed densely over the whole sequence with transformers."""

    def __init__(self, target_path, head_path, method: str) -> None:
        self.target = transformers.LlamaForCausalLM.from_pretrained(target_path).float().eval()
        cfg_dict = json.loads((head_path / "config.json").read_text())
        cfg = transformers.LlamaConfig(**{**cfg_dict, "architectures": None})
        cfg._attn_implementation = "eager"
        self.method = method
        self.weights = load_file(head_path / "model.safetensors")
        hidden = cfg.hidden_size
        self.rotary = hf.LlamaRotaryEmbedding(cfg)
        prefix = "layers.0." if method == "eagle" else "midlayer."
        self.attn = hf.LlamaAttention(cfg, layer_idx=0)
        if method == "eagle3":  # q/k/v read [2H]
            for name in ("q_proj", "k_proj", "v_proj"):
                old = getattr(self.attn, name)
                setattr(self.attn, name, torch.nn.Linear(2 * hidden, old.out_features, bias=False))
        self.mlp = hf.LlamaMLP(cfg)
        self.post_norm = hf.LlamaRMSNorm(hidden, cfg.rms_norm_eps)
        self._load(self.attn, prefix + "self_attn.")
        self._load(self.mlp, prefix + "mlp.")
        self._load(self.post_norm, prefix + "post_attention_layernorm.")
        fc_in = self.weights["fc.weight"].shape[1]
        self.fc = torch.nn.Linear(fc_in, hidden, bias="fc.bias" in self.weights)
        self._load(self.fc, "fc.")
        if method == "eagle3":
            self.input_norm = hf.LlamaRMSNorm(hidden, cfg.rms_norm_eps)
            self.hidden_norm = hf.LlamaRMSNorm(hidden, cfg.rms_norm_eps)
            self.norm = hf.LlamaRMSNorm(hidden, cfg.rms_norm_eps)
            self._load(self.input_norm, "midlayer.input_layernorm.")
            self._load(self.hidden_norm, "midlayer.hidden_norm.")
            self._load(self.norm, "norm.")
            num_layers = self.target.config.num_hidden_layers
            self.aux_layers = [
                min(max(i, 0), num_layers - 1) for i in (2, num_layers // 2, num_layers - 3)
            ]

    def _load(self, module: torch.nn.Module, prefix: str) -> None:
        module.load_state_dict(
            {k[len(prefix) :]: v for k, v in self.weights.items() if k.startswith(prefix)}
        )

    def _layer(self, embeds: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Head outputs over positions 0 .. n - 1: (states for logits, states fed onward).
        hidden: [n, H] (EAGLE-3: after its fc for the target's rows)."""
        n = embeds.shape[0]
        rope = self.rotary(embeds[None], torch.arange(n)[None])
        if self.method == "eagle":
            residual = self.fc(torch.cat([embeds, hidden], -1))
            attn_in = residual
        else:
            residual = hidden
            attn_in = torch.cat([self.input_norm(embeds), self.hidden_norm(hidden)], -1)
        x = self.attn(attn_in[None], rope, causal_mask(n))[0][0] + residual
        x = self.mlp(self.post_norm(x)) + x
        return (x, x) if self.method == "eagle" else (self.norm(x), x)

    def _token(self, states: torch.Tensor) -> int:
        if self.method == "eagle":
            return int(self.target.lm_head(states).argmax())
        draft = int((states @ self.weights["lm_head.weight"].T).argmax())
        return draft + int(self.weights["d2t"][draft])

    @torch.no_grad()
    def drafts(self, tokens: list[int], k: int) -> list[int]:
        """tokens: the prompt plus the first sampled token (its hidden state not needed)."""
        out = self.target(torch.tensor([tokens[:-1]]), output_hidden_states=True)
        states = out.hidden_states  # [embeddings, layer 1 input, ..., final normed]
        if self.method == "eagle":
            feats = states[-1][0]
        else:
            feats = torch.cat([states[i][0] for i in self.aux_layers], -1)
        if self.method == "eagle3":
            feats = self.fc(feats)
        embed = self.target.model.embed_tokens
        ids = list(tokens[1:])  # position p takes token p + 1 (with the hidden state at p)
        onward: list[torch.Tensor] = []  # the head's own states, fed at the drafted positions
        drafts: list[int] = []
        for _ in range(k):
            rows = torch.cat([feats, *onward])
            logits_in, out = self._layer(embed(torch.tensor(ids)), rows)
            drafts.append(self._token(logits_in[-1]))
            ids.append(drafts[-1])
            onward.append(out[-1:])
        return drafts


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_eagle_head_drafts_match_a_dense_transformers_computation(
    tiny_llama_path, tmp_path, method
):
    cfg = json.loads((tiny_llama_path / "config.json").read_text())
    head = make_eagle_head(tmp_path / method, cfg, method, seed=3)
    engine = LLMEngine.from_engine_args(
        EngineArgs(
            model=str(tiny_llama_path),
            max_model_len=128,
            num_kv_blocks=32,
            speculative_config={
                "method": method,
                "num_speculative_tokens": K,
                "model": str(head),
                "min_acceptance_rate": 0.0,
            },
        )
    )
    engine.add_request("r", PROMPT, SamplingParams(temperature=0.0, max_tokens=8))
    engine.step()  # the prompt: first token, then the head drafts K tokens
    request = engine.scheduler.requests["r"]
    assert len(request.spec_token_ids) == K
    reference = Reference(tiny_llama_path, head, method)
    assert request.spec_token_ids == reference.drafts(request.all_token_ids, K)
    engine.abort_request("r")
