"""SentencePiece tokenizer: training (deterministic for a seed) and a small load/encode/decode wrapper.

Byte-exact mode (the default) trains with identity normalisation, keeps every whitespace and adds
no dummy prefix, with byte fallback, so `decode(encode(text)) == text` for any Unicode text.
One character needs help: sentencepiece writes spaces as U+2581 ("▁") and decodes every "▁" piece
back to a space, so `Tokenizer.encode` writes a literal U+2581 as its three UTF-8 byte-fallback
ids instead (byte pieces decode to the character itself); text without U+2581 gets exactly the
ids sentencepiece gives, and decoding is plain sentencepiece decoding. A model without byte pieces
or with a dummy prefix (not byte-exact) encodes as sentencepiece does, U+2581 becoming a space.
Ids: unk 0, bos 1, eos 2, no pad. Training writes PREFIX.model, PREFIX.vocab and PREFIX.json (the
settings used, the sentencepiece version and the model's sha256).
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import random
import sys
import threading
import time
from typing import Iterable, Iterator, Sequence

import sentencepiece as spm

MODEL_TYPES = ("bpe", "unigram")
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
_MAX_SENTENCE_BYTES = 1 << 16
HEARTBEAT_S = 10.0  # seconds between the "training: N s" lines while sentencepiece trains
SPACE_MARK = "\u2581"  # sentencepiece's whitespace symbol; a "▁" piece decodes to " "


class Tokenizer:
    """A trained sentencepiece model."""

    def __init__(self, model_path: str) -> None:
        if not os.path.isfile(model_path):
            raise ValueError(f"tokenizer model not found: {model_path}")
        self.path = model_path
        try:
            self._sp = spm.SentencePieceProcessor(model_file=model_path)
        except (RuntimeError, OSError) as e:  # sentencepiece: "Internal: ... ParseFromArray" for other files
            raise ValueError(f"{model_path} is not a sentencepiece model ({str(e).strip()}); pass the PREFIX.model "
                             f"file written by tools/train_tokenizer.py") from None
        self._mark_ids = self._space_mark_ids()

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    @property
    def eos_id(self) -> int:
        return self._sp.eos_id()

    @property
    def bos_id(self) -> int:
        return self._sp.bos_id()

    @property
    def unk_id(self) -> int:
        return self._sp.unk_id()

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; a literal U+2581 becomes its byte-fallback ids (see the module doc)."""
        if self._mark_ids is None or SPACE_MARK not in text:
            return self._sp.encode(text)
        return self._join(self._sp.encode(text.split(SPACE_MARK)))

    def encode_batch(self, texts: Sequence[str], num_threads: int = 1) -> list[list[int]]:
        """`encode` of each text, in `num_threads` C++ threads (the GIL is released while encoding)."""
        threads = max(1, num_threads)
        if self._mark_ids is None or not any(SPACE_MARK in t for t in texts):
            return self._sp.encode(list(texts), num_threads=threads)
        # Texts split at U+2581 into pieces, all pieces encoded in one call, then joined per text.
        pieces = [t.split(SPACE_MARK) for t in texts]
        flat = self._sp.encode([p for parts in pieces for p in parts], num_threads=threads)
        out, at = [], 0
        for parts in pieces:
            out.append(self._join(flat[at:at + len(parts)]))
            at += len(parts)
        return out

    def decode(self, ids: Sequence[int]) -> str:
        """Control ids (bos, eos) decode to nothing, so a document's tokens + EOS give it back."""
        return self._sp.decode([int(i) for i in ids])

    def _join(self, parts: list[list[int]]) -> list[int]:
        """The ids of text pieces that were separated by U+2581, with its byte ids between them."""
        out = list(parts[0])
        for ids in parts[1:]:
            out += self._mark_ids + ids
        return out

    def _space_mark_ids(self) -> list[int] | None:
        """U+2581 as byte-fallback ids, or None when the model has no byte pieces or adds a dummy
        prefix (each separately encoded piece would then start with a space)."""
        ids = [self._sp.piece_to_id(f"<0x{b:02X}>") for b in SPACE_MARK.encode("utf-8")]
        if not all(self._sp.is_byte(i) for i in ids):
            return None
        if self._sp.encode("a", out_type=str)[0].startswith(SPACE_MARK):
            return None
        return ids


def model_sha256(model_path: str) -> str:
    with open(model_path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def training_sentences(documents: Iterable[str], max_sentences: int, seed: int) -> tuple[list[str], int]:
    """The non-blank lines of all documents (sentencepiece trains on lines), a uniform sample of
    at most `max_sentences` of them drawn with `seed`, kept in input order; and the line count."""
    rng = random.Random(seed)
    reservoir: list[tuple[int, str]] = []
    seen = 0
    for text in documents:
        for line in text.split("\n"):
            if not line.strip() or len(line.encode("utf-8")) > _MAX_SENTENCE_BYTES:
                continue
            if len(reservoir) < max_sentences:
                reservoir.append((seen, line))
            else:
                j = rng.randrange(seen + 1)
                if j < max_sentences:
                    reservoir[j] = (seen, line)
            seen += 1
    reservoir.sort()
    return [line for _, line in reservoir], seen


def train_tokenizer(documents: Iterable[str], prefix: str, vocab_size: int, *, model_type: str = "bpe",
                    byte_exact: bool = True, seed: int = 0, max_sentences: int = 2_000_000,
                    character_coverage: float = 0.9995, num_threads: int = 1,
                    extra: dict | None = None, progress: bool = False, verbose: bool = False) -> dict:
    """Trains and writes PREFIX.model / .vocab / .json; returns the settings written to the JSON.
    `progress`: a bar of the documents read, then a line every HEARTBEAT_S seconds while
    sentencepiece trains (stderr); `verbose`: sentencepiece's own log (its merge count for BPE)."""
    if model_type not in MODEL_TYPES:
        raise ValueError(f"--model-type {model_type!r} is not one of: {', '.join(MODEL_TYPES)}")
    if vocab_size < 260:
        raise ValueError(f"--vocab-size {vocab_size} is too small: byte fallback alone needs 256 + 3 ids")
    from megatron_taper.data.corpus import progress_bar

    bar = progress_bar("[tokenizer] reading", progress)
    sentences, n_lines = training_sentences(documents if bar is None else _counted(documents, bar), max_sentences,
                                            seed)
    if bar is not None:
        bar.close()
    if not sentences:
        raise ValueError("no text to train the tokenizer on (all inputs empty or skipped)")
    options = dict(
        vocab_size=vocab_size, model_type=model_type, byte_fallback=True,
        character_coverage=character_coverage, unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID, pad_id=-1,
        input_sentence_size=0, shuffle_input_sentence=False, max_sentence_length=_MAX_SENTENCE_BYTES,
        num_threads=max(1, num_threads), minloglevel=0 if verbose else 2,
    )
    if byte_exact:
        options.update(normalization_rule_name="identity", remove_extra_whitespaces=False,
                       add_dummy_prefix=False, allow_whitespace_only_pieces=True)
    if model_type == "unigram":
        options.update(hard_vocab_limit=False)
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    # model_writer keeps the output path out of the model's trainer spec: same seed, same bytes.
    model = io.BytesIO()
    spm.set_random_generator_seed(seed)
    label = f"[tokenizer] training {model_type} (vocab {vocab_size}) on {len(sentences):,} lines"
    try:
        with _heartbeat(label, progress):
            spm.SentencePieceTrainer.train(sentence_iterator=iter(sentences), model_writer=model, **options)
    except RuntimeError as e:
        raise ValueError(f"sentencepiece refused the settings (--vocab-size {vocab_size}?): {e}") from None
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    vocab = "".join(f"{sp.id_to_piece(i)}\t{sp.get_score(i):g}\n" for i in range(sp.get_piece_size()))
    _write_atomic(prefix + ".vocab", vocab.encode("utf-8"))
    _write_atomic(prefix + ".model", model.getvalue())
    settings = {
        "model": os.path.abspath(prefix + ".model"),
        "sha256": model_sha256(prefix + ".model"),
        "sentencepiece_version": spm.__version__,
        "seed": seed,
        "byte_exact": byte_exact,
        "training_lines": len(sentences),
        "input_lines": n_lines,
        "trainer_options": {k: v for k, v in options.items() if k not in ("minloglevel", "num_threads")},
        **(extra or {}),
    }
    _write_atomic(prefix + ".json", json.dumps(settings, indent=1, sort_keys=True).encode("utf-8"))
    return settings


def _counted(documents: Iterable[str], bar) -> Iterator[str]:
    for text in documents:
        bar.update(1)
        yield text


@contextlib.contextmanager
def _heartbeat(label: str, enabled: bool) -> Iterator[None]:
    """Prints `label`, then its elapsed time every HEARTBEAT_S seconds from a thread (sentencepiece
    releases the GIL while it trains) and once when done; nothing when not `enabled`."""
    if not enabled:
        yield
        return
    started, stop = time.time(), threading.Event()
    print(f"{label} ...", file=sys.stderr, flush=True)

    def beat() -> None:
        while not stop.wait(HEARTBEAT_S):
            print(f"{label}: {time.time() - started:.0f} s", file=sys.stderr, flush=True)

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
    print(f"{label}: done in {time.time() - started:.1f} s", file=sys.stderr, flush=True)


def _write_atomic(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
