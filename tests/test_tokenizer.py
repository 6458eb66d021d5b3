"""Tokenizer wrapper, streaming detokenization and stop strings.

Real SmolLM2 tokenizer (byte-level BPE), plus two tiny tokenizers built here: a GPT-2-style
byte-level BPE and a Llama-style SentencePiece BPE with byte fallback. The reference for every
streaming check is the tokenizer's own whole-sequence decode.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from neuron_runtime.tokenizer import IncrementalDetokenizer, StopChecker, Tokenizer

CRAFTED = [
    "Hello, world!",
    "naïve café — déjà vu",
    "日本語のテキストと中文",
    "emoji 🙂👍🏽🇫🇷 family 👨‍👩‍👧",
    "combining e\u0301 a\u0300\u0323 and Hangul 한국어",
    "spelled specials <|im_start|>user\n<|im_end|> <|endoftext|> </s>",
    "  leading and trailing spaces  \n\n\ttabs",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 math 𝑥² ≤ ∞",
]
ALPHABET = list("abc xyz.,\n") + ["é", "ß", "日", "語", "🙂", "👍🏽", "\u0301", "€", "<|im_end|>"]


def _random_strings(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choices(ALPHABET, k=rng.randint(1, 40))) for _ in range(count)]


def _stream(
    tokenizer: Tokenizer,
    prompt: list[int],
    output: list[int],
    skip_special_tokens: bool = True,
    seed: int = 0,
) -> list[str]:
    """Feed ``output`` in random chunks of 1-3 tokens; return the deltas (flush last)."""
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens)
    rng = random.Random(seed)
    deltas, i = [], 0
    while i < len(output):
        step = rng.randint(1, 3)
        deltas.append(detok.update(output[i : i + step]))
        i += step
    deltas.append(detok.flush())
    return deltas


@pytest.fixture(scope="module")
def smollm(default_model_path: Path) -> Tokenizer:
    return Tokenizer(default_model_path)


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>"],
    )
    # Few merges: most non-ASCII characters stay split over several byte tokens.
    raw.train_from_iterator(
        CRAFTED * 3 + ["the quick brown fox jumps over the lazy dog"] * 20, trainer
    )
    folder = tmp_path_factory.mktemp("byte_level")
    fast = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|endoftext|>")
    fast.save_pretrained(folder)
    return Tokenizer(folder)


def _sentencepiece_tokenizer(folder: Path, chat_template: str | None) -> Tokenizer:
    """Llama-2-style: Metaspace, byte fallback, BOS added by the post-processor."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    pieces += ["▁"] + list("abcdefghijklmnopqrstuvwxyz.,!") + ["▁t", "he", "▁the"]
    vocab = {piece: i for i, piece in enumerate(pieces)}
    merges = [("▁", "t"), ("h", "e"), ("▁t", "he")]
    raw = RawTokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    raw.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    raw.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    raw.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.add_special_tokens({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(folder)
    return Tokenizer(folder)


@pytest.fixture(scope="module")
def sentencepiece(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return _sentencepiece_tokenizer(tmp_path_factory.mktemp("sp"), None)


# --- the wrapper ---------------------------------------------------------------------------


def test_smollm_properties(smollm: Tokenizer) -> None:
    assert smollm.vocab_size == 49152
    assert (smollm.bos_token_id, smollm.eos_token_id) == (1, 2)
    assert smollm.convert_ids_to_tokens([1, 2]) == ["<|im_start|>", "<|im_end|>"]
    assert {0, 1, 2} <= smollm.all_special_ids
    # SmolLM2 adds no BOS to plain text.
    ids = smollm.encode("Hello world")
    assert ids and ids[0] != smollm.bos_token_id
    assert smollm.decode(ids) == "Hello world"
    assert smollm.encode("<|im_end|>", add_special_tokens=False) == [2]
    assert smollm.decode([2, *ids]) == "Hello world"
    assert smollm.decode([2, *ids], skip_special_tokens=False) == "<|im_end|>Hello world"


def test_smollm_chat_template(smollm: Tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Capital of France?"},
    ]
    assert smollm.apply_chat_template(messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\nCapital of France?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # Without a system message the template supplies SmolLM's default one.
    rendered = smollm.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert rendered.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    ids = smollm.encode_chat(messages)
    assert ids[0] == smollm.bos_token_id and ids[1] != smollm.bos_token_id
    assert smollm.decode(ids, skip_special_tokens=False) == smollm.apply_chat_template(messages)
    assert smollm.apply_chat_template(messages, tokenize=True) == ids


def test_bos_is_added_exactly_once(tmp_path: Path) -> None:
    messages = [{"role": "user", "content": "hi"}]
    with_bos = _sentencepiece_tokenizer(
        tmp_path / "a", "{{ bos_token }}{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    )
    without_bos = _sentencepiece_tokenizer(
        tmp_path / "b", "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    )
    for tokenizer in (with_bos, without_bos):
        ids = tokenizer.encode_chat(messages)
        assert ids.count(tokenizer.bos_token_id) == 1 and ids[0] == tokenizer.bos_token_id


def test_no_chat_template_is_a_value_error(sentencepiece: Tokenizer) -> None:
    with pytest.raises(ValueError, match="no chat template"):
        sentencepiece.apply_chat_template([{"role": "user", "content": "hi"}])


# --- incremental detokenization -------------------------------------------------------------


@pytest.mark.parametrize("name", ["smollm", "byte_level"])
def test_streamed_text_equals_decode(name: str, request: pytest.FixtureRequest) -> None:
    tokenizer: Tokenizer = request.getfixturevalue(name)
    prompt = tokenizer.encode("Some prompt text: 日本")
    for seed, text in enumerate(CRAFTED + _random_strings(150)):
        ids = tokenizer.encode(text, add_special_tokens=False)
        for skip in (True, False):
            expected = tokenizer.decode(ids, skip_special_tokens=skip)
            deltas = _stream(tokenizer, prompt, ids, skip, seed)
            assert "".join(deltas) == expected, (text, skip)
            if "\ufffd" not in expected:
                assert not any("\ufffd" in d for d in deltas), (text, deltas)


def test_split_character_is_held_back(byte_level: Tokenizer) -> None:
    ids = byte_level.encode("🙂", add_special_tokens=False)
    assert len(ids) > 1  # the emoji spans several byte tokens
    detok = IncrementalDetokenizer(byte_level, [])
    assert [detok.update([t]) for t in ids] == [""] * (len(ids) - 1) + ["🙂"]
    # An unfinished character at the very end comes out with flush(), as decode() shows it.
    detok = IncrementalDetokenizer(byte_level, [])
    assert detok.update(ids[:-1]) == ""
    assert detok.flush() == byte_level.decode(ids[:-1])


def test_sentencepiece_byte_fallback(sentencepiece: Tokenizer) -> None:
    prompt = sentencepiece.encode("the prompt")
    for seed, text in enumerate(CRAFTED + _random_strings(100, seed=1)):
        ids = sentencepiece.encode(text, add_special_tokens=False)
        # Without a prompt the joined deltas are exactly decode(ids)...
        assert "".join(_stream(sentencepiece, [], ids, seed=seed)) == sentencepiece.decode(ids)
        # ...and after a prompt they are the text decode adds to the prompt's (leading space
        # included, which a bare decode(ids) would strip).
        continuation = sentencepiece.decode(prompt + ids)[len(sentencepiece.decode(prompt)) :]
        assert "".join(_stream(sentencepiece, prompt, ids, seed=seed)) == continuation


def test_window_stays_short(smollm: Tokenizer) -> None:
    ids = smollm.encode("word " * 500, add_special_tokens=False)
    detok = IncrementalDetokenizer(smollm, [])
    for t in ids:
        detok.update([t])
        assert len(detok._ids) <= 3


# --- stop strings ---------------------------------------------------------------------------


def _run_stop(
    tokenizer: Tokenizer, text: str, checker: StopChecker
) -> tuple[str, str | None, list[str]]:
    """Stream ``text`` token by token through the checker, as the engine does."""
    detok = IncrementalDetokenizer(tokenizer, [])
    out, streamed, sent = "", [], 0
    for t in tokenizer.encode(text, add_special_tokens=False):
        out += detok.update([t])
        hit = checker.check(out)
        if hit is not None:
            return hit[0], hit[1], streamed
        safe = checker.safe_length(out)
        streamed.append(out[sent:safe])
        sent = max(sent, safe)
    return out, None, streamed


def test_stop_string_spanning_tokens(smollm: Tokenizer) -> None:
    text = "The capital of France is Paris. It is lovely."
    stop = "s Paris. I"
    ids = smollm.encode(text, add_special_tokens=False)
    assert not any(stop in smollm.decode([t]) for t in ids)  # no single token holds it
    out, reason, streamed = _run_stop(smollm, text, StopChecker([stop]))
    assert (out, reason) == ("The capital of France i", stop)
    # Nothing of the stop string leaked into the stream before it completed.
    assert out.startswith("".join(streamed))

    out, reason, streamed = _run_stop(smollm, text, StopChecker([stop], True))
    assert (out, reason) == ("The capital of France is Paris. I", stop)
    assert out.startswith("".join(streamed))


def test_earliest_stop_wins() -> None:
    checker = StopChecker(["world", "lo w"])
    assert checker.check("hello") is None
    assert checker.check("hello world!") == ("hel", "lo w")


def test_stop_found_only_once_it_completes() -> None:
    checker = StopChecker(["</answer>"])
    text = ""
    for piece in ["The answer", " is 4</", "ans", "wer> trailing"]:
        text += piece
        hit = checker.check(text)
    assert hit == ("The answer is 4", "</answer>")


def test_safe_length_holds_back_a_possible_stop_prefix() -> None:
    checker = StopChecker(["<|end|>", "STOP"])
    assert checker.safe_length("hello <|en") == len("hello ")
    assert checker.safe_length("hello ST") == len("hello ")
    assert checker.safe_length("hello <|x") == len("hello <|x")
    assert checker.safe_length("") == 0
    assert StopChecker(["<|end|>"], include_stop_str_in_output=True).safe_length("a <|") == 4


@pytest.mark.parametrize("stop", [[], [""], ["ok", ""]])
def test_invalid_stop_strings(stop: list[str]) -> None:
    with pytest.raises(ValueError, match="non-empty strings"):
        StopChecker(stop)
