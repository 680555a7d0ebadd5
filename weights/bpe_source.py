"""GPT-2's vocab.json and merges.txt rebuilt from the BPE ranks a PyPI package ships.

The `openai-whisper` sdist carries `gpt2.tiktoken` (MIT), the GPT-2 BPE ranks. The files built
from it are checked byte for byte against the sha256s of OpenAI's encoder.json and vocab.bpe.
"""

from __future__ import annotations

import base64
import json
import tarfile
from pathlib import Path

from weights.registry import fetch_sdist, sha256

WHISPER_SDIST = "openai-whisper==20250625"
WHISPER_SDIST_FILE = "openai_whisper-20250625.tar.gz"
TIKTOKEN_MEMBER = "whisper/assets/gpt2.tiktoken"
SHA256 = {
    WHISPER_SDIST_FILE: "37a91a3921809d9f44748ffc73c0a55c9f366c85a3ef5c2ae0cc09540432eb96",
    "gpt2.tiktoken": "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930",
    "vocab.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
    "merges.txt": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
}
EOS_ID = 50256


def _checked(name: str, data: bytes) -> bytes:
    digest = sha256(data)
    if digest != SHA256[name]:
        raise RuntimeError(f"{name}: sha256 {digest} does not match the expected {SHA256[name]}")
    return data


def fetch_tiktoken_ranks(cache_dir: Path) -> Path:
    """gpt2.tiktoken, taken from the whisper sdist on PyPI (downloaded once into cache_dir)."""
    target = cache_dir / "gpt2.tiktoken"
    if target.exists() and sha256(target.read_bytes()) == SHA256["gpt2.tiktoken"]:
        return target
    sdist = fetch_sdist(WHISPER_SDIST, WHISPER_SDIST_FILE, SHA256[WHISPER_SDIST_FILE], cache_dir)
    with tarfile.open(sdist) as archive:
        member = next(m for m in archive.getmembers() if m.name.endswith(TIKTOKEN_MEMBER))
        data = archive.extractfile(member).read()
    target.write_bytes(_checked("gpt2.tiktoken", data))
    return target


def read_ranks(path: Path) -> dict[bytes, int]:
    ranks = {}
    for line in path.read_bytes().splitlines():
        if line.strip():
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (openai/gpt-2 encoder.py)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


def _merge_pair(token: bytes, rank: int, ranks: dict[bytes, int]) -> tuple[bytes, bytes]:
    """The two parts BPE joins to make `token`: replay BPE on its bytes with lower ranks only."""
    parts = [bytes([b]) for b in token]
    while len(parts) > 2:
        candidates = [
            (ranks[parts[i] + parts[i + 1]], i)
            for i in range(len(parts) - 1)
            if ranks.get(parts[i] + parts[i + 1], rank) < rank
        ]
        _, i = min(candidates)
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    return parts[0], parts[1]


def vocab_and_merges(ranks: dict[bytes, int]) -> tuple[bytes, bytes]:
    to_text = _byte_to_unicode()
    text = lambda token: "".join(to_text[b] for b in token)  # noqa: E731
    encoder = {text(token): rank for token, rank in ranks.items()}
    encoder["<|endoftext|>"] = EOS_ID
    merges = [
        " ".join(map(text, _merge_pair(token, rank, ranks)))
        for token, rank in sorted(ranks.items(), key=lambda item: item[1])
        if len(token) > 1
    ]
    vocab_json = json.dumps(encoder).encode()
    merges_txt = ("#version: 0.2\n" + "\n".join(merges) + "\n").encode()
    return _checked("vocab.json", vocab_json), _checked("merges.txt", merges_txt)


def write_tokenizer_files(out_dir: Path, cache_dir: Path) -> None:
    """vocab.json, merges.txt and tokenizer.json for GPT-2 in out_dir."""
    from weights.tokenizer import build_tokenizer

    vocab_json, merges_txt = vocab_and_merges(read_ranks(fetch_tiktoken_ranks(cache_dir)))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "vocab.json").write_bytes(vocab_json)
    (out_dir / "merges.txt").write_bytes(merges_txt)
    build_tokenizer(out_dir / "vocab.json", out_dir / "merges.txt").save(str(out_dir / "tokenizer.json"))
