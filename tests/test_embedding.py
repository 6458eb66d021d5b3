"""Embeddings: BertModel vs transformers (real all-MiniLM-L6-v2 and tiny random configs), pooling,
EmbeddingEngine batching and input checks, and LLM(task="embed")."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from neuron_runtime import LLM, EmbeddingEngine
from neuron_runtime.loader import load_hf_config, load_model
from neuron_runtime.model_store import resolve_model
from neuron_runtime.models.bert import BertModel
from neuron_runtime.pooling import cls_pool, last_token_pool, mean_pool, pooling_mode

LONG = " ".join(
    ["The committee reviewed the quarterly report, noting that revenue grew in every region"] * 20
)
SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A monkey is playing drums.",
    "hi",
    "Le café est très bon, n'est-ce pas ? Déjà vu.",
    "日本語のテキストと中文，还有한국어 🙂👍🏽",
    "  leading spaces, tabs\tand\nnewlines  ",
    "Numbers 3.14159 and e-mail a.b@example.com, URL https://example.org/x?y=1",
    LONG,
]


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    # The test machines' few CPUs are shared; a second torch thread mostly waits on them.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def minilm_path() -> Path:
    return resolve_model("all-minilm-l6-v2")


@pytest.fixture(scope="module")
def engine() -> EmbeddingEngine:
    # A small batch size so that SENTENCES spans several batches.
    return EmbeddingEngine("all-minilm-l6-v2", max_batch_size=4)


def _reference(path: Path, texts: list[str]) -> np.ndarray:
    """sentence-transformers' recipe written out: transformers, mean pooling, L2 normalize."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    rows = []
    with torch.no_grad():
        for text in texts:
            encoded = tokenizer(text, return_tensors="pt")
            hidden = model(**encoded).last_hidden_state[0]  # [S, H], no padding
            rows.append(torch.nn.functional.normalize(hidden.mean(dim=0), dim=-1))
    return torch.stack(rows).numpy()


def test_matches_transformers_on_real_weights(engine: EmbeddingEngine, minilm_path: Path) -> None:
    result = engine.embed(SENTENCES)
    assert result.embeddings.shape == (len(SENTENCES), 384)
    assert result.embeddings.dtype == np.float32
    reference = _reference(minilm_path, SENTENCES)
    cosine = (result.embeddings * reference).sum(axis=1)
    assert cosine.min() > 0.9999, cosine
    np.testing.assert_allclose(result.embeddings, reference, atol=1e-5)
    expected_tokens = [len(engine.tokenizer.encode(text)) for text in SENTENCES]
    assert result.num_prompt_tokens == expected_tokens
    assert expected_tokens[4] == 3 and expected_tokens[-1] > 250


def test_batched_equals_one_at_a_time(engine: EmbeddingEngine) -> None:
    batched = engine.embed(SENTENCES).embeddings
    single = np.concatenate([engine.embed([text]).embeddings for text in SENTENCES])
    np.testing.assert_allclose(batched, single, atol=1e-5)


def test_token_ids_and_unnormalized(engine: EmbeddingEngine) -> None:
    texts = SENTENCES[:3]
    ids = [engine.tokenizer.encode(text) for text in texts]
    np.testing.assert_allclose(
        engine.embed(ids).embeddings, engine.embed(texts).embeddings, atol=1e-6
    )
    raw = engine.embed(texts, normalize=False).embeddings
    norms = np.linalg.norm(raw, axis=1, keepdims=True)
    assert not np.allclose(norms, 1.0)
    np.testing.assert_allclose(raw / norms, engine.embed(texts).embeddings, atol=1e-6)


def test_paraphrase_is_closer_than_unrelated(engine: EmbeddingEngine) -> None:
    query, paraphrase, unrelated = engine.embed(
        [
            "How do I reset my password?",
            "What are the steps to change my login password?",
            "The volcano erupted and covered the village in ash.",
        ]
    ).embeddings
    assert query @ paraphrase > 0.6
    assert query @ paraphrase > query @ unrelated + 0.4


def test_rejects_bad_inputs(engine: EmbeddingEngine) -> None:
    with pytest.raises(ValueError, match="non-empty list"):
        engine.embed([])
    with pytest.raises(ValueError, match="input 1 is an empty string"):
        engine.embed(["ok", ""])
    with pytest.raises(ValueError, match="input 0 has no token ids"):
        engine.embed([[]])
    with pytest.raises(ValueError, match="input 0 has token ids outside"):
        engine.embed([[101, 10**6]])
    with pytest.raises(ValueError, match="not a mix"):
        engine.embed(["text", [101, 102]])  # type: ignore[list-item]
    too_long = "word " * 600
    with pytest.raises(ValueError, match=r"input 1 is 602 tokens long, over max_model_len 512"):
        engine.embed(["fine", too_long])
    with pytest.raises(ValueError, match=r"input 0 is 513 tokens long"):
        engine.embed([[101] * 513])


def test_truncate_keeps_max_model_len_tokens(engine: EmbeddingEngine) -> None:
    result = engine.embed(["word " * 600, "short"], truncate=True)
    assert result.num_prompt_tokens == [512, 3]
    assert engine.embed([[101] * 600], truncate=True).num_prompt_tokens == [512]


def test_engine_attributes(engine: EmbeddingEngine) -> None:
    assert (engine.model_name, engine.max_model_len, engine.dimensions) == (
        "all-minilm-l6-v2",
        512,
        384,
    )
    assert engine.pooling == "mean"


def test_llm_task_embed(engine: EmbeddingEngine) -> None:
    llm = LLM(model="all-minilm-l6-v2", task="embed")
    result = llm.embed(["A man is eating food.", "A monkey is playing drums."])
    np.testing.assert_allclose(
        result.embeddings, engine.embed(SENTENCES[:4:3]).embeddings, atol=1e-5
    )
    assert llm.embed("one text").embeddings.shape == (1, 384)
    assert llm.get_tokenizer() is llm.embedding_engine.tokenizer
    with pytest.raises(ValueError, match=r"LLM.generate\(\) needs an LLM built with task='gen"):
        llm.generate("Hello")
    with pytest.raises(ValueError, match=r"LLM.chat\(\) needs"):
        llm.chat([{"role": "user", "content": "Hello"}])
    with pytest.raises(ValueError, match="task must be 'generate' or 'embed'"):
        LLM(model="all-minilm-l6-v2", task="classify")  # type: ignore[arg-type]


def test_generate_llm_refuses_embed_and_decoders_cannot_embed(tiny_llama_path: Path) -> None:
    llm = LLM(model=str(tiny_llama_path), max_model_len=64, num_kv_blocks=4)
    with pytest.raises(ValueError, match=r"LLM.embed\(\) needs an LLM built with task='embed'"):
        llm.embed(["Hello"])
    with pytest.raises(ValueError, match="LlamaForCausalLM.*cannot embed"):
        EmbeddingEngine(str(tiny_llama_path))


def _tiny_bert(out: Path, hf_class: str = "BertModel", **overrides: object) -> torch.nn.Module:
    import transformers

    settings: dict[str, object] = dict(
        vocab_size=120,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=40,
        initializer_range=0.2,
    )
    settings.update(overrides)
    torch.manual_seed(0)
    config = transformers.BertConfig(**settings)
    model = getattr(transformers, hf_class)(config).float().eval()
    model.save_pretrained(out, safe_serialization=True)
    return model


@pytest.mark.parametrize(
    ("hf_class", "hidden_act"),
    [("BertModel", "gelu"), ("BertModel", "gelu_new"), ("BertForMaskedLM", "gelu")],
)
def test_tiny_random_bert_matches_transformers(
    tmp_path: Path, hf_class: str, hidden_act: str
) -> None:
    # BertForMaskedLM checkpoints prefix every key with "bert." and add an MLM head.
    reference = _tiny_bert(tmp_path, hf_class, hidden_act=hidden_act)
    ours = load_model(BertModel, load_hf_config(tmp_path), tmp_path)
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, 120, (3, 11), generator=generator)
    mask = torch.ones(3, 11, dtype=torch.bool)
    mask[1, 7:] = False
    mask[2, 2:] = False
    encoder = reference.bert if hf_class == "BertForMaskedLM" else reference
    with torch.no_grad():
        expected = encoder(input_ids=input_ids, attention_mask=mask.long()).last_hidden_state
        actual = ours(input_ids, mask)
    # Padding positions are garbage in both; compare real tokens only.
    torch.testing.assert_close(actual[mask], expected[mask], rtol=0, atol=1e-4)


def test_checkpoint_mismatch_is_reported(tmp_path: Path) -> None:
    _tiny_bert(tmp_path)
    config = load_hf_config(tmp_path)
    with pytest.raises(ValueError, match="checkpoint shape"):
        load_model(BertModel, {**config, "hidden_size": 64}, tmp_path)
    with pytest.raises(ValueError, match="position_embedding_type"):
        BertModel({**config, "position_embedding_type": "relative_key"})


def test_poolers_on_padded_batch() -> None:
    hidden = torch.arange(2 * 4 * 3, dtype=torch.float32).view(2, 4, 3)
    mask = torch.tensor([[True, True, True, True], [True, True, False, False]])
    torch.testing.assert_close(
        mean_pool(hidden, mask), torch.stack([hidden[0].mean(0), hidden[1, :2].mean(0)])
    )
    torch.testing.assert_close(cls_pool(hidden, mask), hidden[:, 0])
    torch.testing.assert_close(
        last_token_pool(hidden, mask), torch.stack([hidden[0, 3], hidden[1, 1]])
    )


def _pooling_config(folder: Path, **flags: bool) -> Path:
    (folder / "1_Pooling").mkdir(parents=True)
    (folder / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 8, **flags})
    )
    return folder


def test_pooling_mode_from_sentence_transformers_config(tmp_path: Path, minilm_path: Path) -> None:
    assert pooling_mode(minilm_path) == "mean"
    assert pooling_mode(tmp_path) == "mean"  # no 1_Pooling folder
    assert pooling_mode(_pooling_config(tmp_path / "cls", pooling_mode_cls_token=True)) == "cls"
    assert pooling_mode(_pooling_config(tmp_path / "last", pooling_mode_lasttoken=True)) == "last"
    with pytest.raises(ValueError, match="pooling_mode_max_tokens"):
        pooling_mode(_pooling_config(tmp_path / "max", pooling_mode_max_tokens=True))
