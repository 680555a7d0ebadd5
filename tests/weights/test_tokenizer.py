"""Our GPT-2 tokenizer gives tiktoken's GPT-2 ids, round-trips text, and ships OpenAI's files.

`<|endoftext|>` written inside a text encodes to the single id 50256, as transformers' GPT-2
tokenizer does (and tiktoken with allowed_special="all"): the service treats it as the special
token wherever it appears, and decoding gives the same text back.
"""

from __future__ import annotations

import pytest
import tiktoken
from tiktoken.load import load_tiktoken_bpe

from weights.bpe_source import EOS_ID, SHA256, fetch_tiktoken_ranks, sha256
from weights.prepare import CACHE_DIR
from weights.tokenizer import EOS_TEXT, GPT2Tokenizer, build_tokenizer

# GPT-2's pre-tokenizer pattern, as tiktoken_ext/openai_public.py defines the "gpt2" encoding.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

TEXTS = {
    "english": "The quick brown fox jumps over the lazy dog.",
    "contractions": "I'm sure you'll see they've said it's what we'd do, isn't it? DON'T",
    "unicode": "naïve café, Zürich — “quotes” and ¿qué? Ωμέγα ℝ∑∫",
    "emoji": "launch 🚀🚀 done ✅ family 👨‍👩‍👧 flag 🇯🇵",
    "cjk": "深度学习模型的注意力机制。日本語のテキスト、한국어 문장",
    "code": 'def f(x):\n\tif x >= 10:\n\t\treturn {"a": [1, 2]}  # ok\n',
    "whitespace-runs": "a   b\t\t c     \n   d",
    "blank-lines": "para one\n\npara two\n\n\n",
    "trailing-spaces": "ends with spaces   ",
    "leading-space": " leading",
    "digits": "3.14159 2024-11-22 1,000,000 0x1F",
    "eos-inside": "first<|endoftext|>second <|endoftext|>",
    "only-eos": "<|endoftext|>",
    "empty": "",
    "control-bytes": "nul\x00bell\x07del\x7f",
}


@pytest.fixture(scope="module")
def reference(monkeypatch_module) -> tiktoken.Encoding:
    """tiktoken's GPT-2 encoding built from the local ranks file: no download, no cache dir."""
    monkeypatch_module.setenv("TIKTOKEN_CACHE_DIR", "")  # read the local file, write nothing
    ranks_file = fetch_tiktoken_ranks(CACHE_DIR)  # already cached by `make weights`
    ranks = load_tiktoken_bpe(str(ranks_file), expected_hash=SHA256["gpt2.tiktoken"])
    return tiktoken.Encoding(
        name="gpt2-offline",
        pat_str=GPT2_PATTERN,
        mergeable_ranks=ranks,
        special_tokens={EOS_TEXT: EOS_ID},
        explicit_n_vocab=50257,
    )


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


@pytest.mark.parametrize("text", TEXTS.values(), ids=TEXTS.keys())
def test_ids_equal_tiktoken(tokenizer, reference, text):
    assert tokenizer.encode(text) == reference.encode(text, allowed_special="all")


@pytest.mark.parametrize("text", TEXTS.values(), ids=TEXTS.keys())
def test_decode_inverts_encode(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_batch_encoding_equals_single(tokenizer):
    texts = list(TEXTS.values())
    assert tokenizer.encode_batch(texts) == [tokenizer.encode(t) for t in texts]


def test_end_of_text(tokenizer, reference):
    assert tokenizer.eos_token_id == EOS_ID == 50256 == reference.eot_token
    assert tokenizer.encode(EOS_TEXT) == [50256]
    assert tokenizer.decode([50256]) == EOS_TEXT
    assert tokenizer.decode(tokenizer.encode("a<|endoftext|>b"), skip_special_tokens=True) == "ab"
    assert tokenizer.vocab_size == reference.n_vocab == 50257


def test_files_are_openais(default_model_dir):
    for name in ("vocab.json", "merges.txt"):
        assert sha256((default_model_dir / name).read_bytes()) == SHA256[name], name


def test_vocab_and_merges_pair_equals_tokenizer_json(tokenizer, default_model_dir, tmp_path):
    # A folder with only GPT-2's two original files must tokenize the same.
    for name in ("vocab.json", "merges.txt"):
        (tmp_path / name).write_bytes((default_model_dir / name).read_bytes())
    from_pair = GPT2Tokenizer.from_dir(tmp_path)
    built = GPT2Tokenizer(build_tokenizer(tmp_path / "vocab.json", tmp_path / "merges.txt"))
    for text in TEXTS.values():
        assert from_pair.encode(text) == built.encode(text) == tokenizer.encode(text)


def test_folder_without_tokenizer_files_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        GPT2Tokenizer.from_dir(tmp_path)
