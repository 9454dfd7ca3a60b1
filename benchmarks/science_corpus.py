"""A text corpus from what a machine already has: the installed Python packages' sources and docs.

    python benchmarks/science_corpus.py --out DIR [--root SITE_PACKAGES ...] [--max-mb N]
        [--max-package-kb N] [--held-out-fraction F] [--held-out-key K]

Reads the .py/.rst/.md/.txt files under each root (default: this Python's site-packages, purelib
and platlib), and writes DIR/train.jsonl and DIR/held_out.jsonl (one JSON object per file:
`text`, `package`, `path`) and DIR/corpus.json (sizes, packages per split, skips by reason).

- A file's package is the distribution whose dist-info RECORD lists it (so torch/ and torchgen/
  are one package, and the nvidia-* wheels sharing nvidia/ are not), else the root entry it sits
  under (`foo/...` or `foo.py`). dist-info and egg-info folders themselves (metadata, licences),
  __pycache__ and hidden entries are not read.
- Held out by package: packages are ranked by a keyed blake2b hash of their name (the key is
  --held-out-key; the same ranking on every machine) and taken in that order while the held-out
  bytes stay within F of the corpus; a package that would overflow is passed over. Train and
  held-out never share a package.
- Deduplicated by the sha256 of the file's bytes: each content is written once; a content that a
  training package also holds is never held out (it goes to train), so no held-out text was
  trained on.
- Nothing outside a root is read: links are not followed out of it (a file whose real path is
  outside every root is skipped). Unreadable files, files that are not UTF-8 or hold a NUL byte
  (binary), empty ones and ones over --max-file-kb are skipped and counted by reason.
- --max-mb caps the bytes read (files in sorted order of (root, path), each taken while it fits);
  --max-package-kb caps the bytes taken from one package (a small corpus that still spans many).
"""
from __future__ import annotations

import argparse
import csv
import hashlib
import json
import os
import re
import sys
import sysconfig

EXTENSIONS = (".py", ".rst", ".md", ".txt")
SKIP_REASONS = ("unreadable", "binary", "not_utf8", "empty", "too_large", "outside_root", "duplicate")
_METADATA_SUFFIXES = (".dist-info", ".egg-info")


def default_roots() -> list[str]:
    """This Python's site-packages folders (purelib, platlib), each once."""
    paths = sysconfig.get_paths()
    return list(dict.fromkeys(os.path.realpath(paths[k]) for k in ("purelib", "platlib") if os.path.isdir(paths[k])))


def normalized(name: str) -> str:
    """A package name in PEP 503 form: lowercase, runs of -_. as one '-'."""
    return re.sub(r"[-_.]+", "-", name).lower()


def inside(path: str, roots: list[str]) -> bool:
    """Whether the real path of `path` lies in one of `roots` (real paths)."""
    return within(os.path.realpath(path), roots)


def within(real: str, roots: list[str]) -> bool:
    """Whether the real path `real` lies in one of `roots` (real paths)."""
    return any(real == r or real.startswith(r + os.sep) for r in roots)


def record_owners(root: str) -> dict[str, str]:
    """Relative path under `root` -> the distribution whose dist-info RECORD lists the file."""
    owners: dict[str, str] = {}
    for entry in sorted(os.listdir(root)):
        record = os.path.join(root, entry, "RECORD")
        if not entry.endswith(".dist-info") or not os.path.isfile(record) or not inside(record, [root]):
            continue
        dist = normalized(entry[: -len(".dist-info")].split("-", 1)[0])
        try:
            with open(record, newline="", encoding="utf-8") as f:
                for row in csv.reader(f):
                    if row and not row[0].startswith(".."):
                        owners[os.path.normpath(row[0])] = dist
        except (OSError, UnicodeDecodeError, csv.Error):
            continue  # a damaged RECORD: its files fall back to their root entry's name
    return owners


def candidate_files(root: str) -> list[str]:
    """Relative paths of the text files under `root`, sorted; metadata, caches and hidden entries skipped."""
    found = []
    for dirpath, dirs, names in os.walk(root):  # followlinks=False: a linked folder is not entered
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__"
                         and not d.endswith(_METADATA_SUFFIXES))
        rel_dir = os.path.relpath(dirpath, root)
        found += [os.path.normpath(os.path.join(rel_dir, n)) for n in names
                  if n.endswith(EXTENSIONS) and not n.startswith(".")]
    return sorted(found)


def package_of(rel: str, owners: dict[str, str]) -> str:
    top = rel.split(os.sep, 1)[0]
    return owners.get(rel) or normalized(top[:-3] if top.endswith(".py") else top)


def read_text(path: str) -> tuple[str | None, str]:
    """(text, "") or (None, the skip reason)."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError:
        return None, "unreadable"
    if b"\x00" in raw:
        return None, "binary"
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None, "not_utf8"
    return (text, "") if text.strip() else (None, "empty")


def held_out_packages(sizes: dict[str, int], fraction: float, key: int) -> set[str]:
    """Packages in the order of a keyed hash of their name, each taken while the held-out bytes stay
    within `fraction` of the total."""
    budget, taken, chosen = fraction * sum(sizes.values()), 0, set()
    ranked = sorted(sizes, key=lambda name: hashlib.blake2b(name.encode(), digest_size=8,
                                                            key=key.to_bytes(8, "little")).digest())
    for name in ranked:
        if taken + sizes[name] <= budget:
            chosen.add(name)
            taken += sizes[name]
    return chosen


def build_corpus(out: str, roots: list[str] | None = None, *, max_bytes: int = 0, max_package_bytes: int = 0,
                 held_out_fraction: float = 0.05, key: int = 0, max_file_bytes: int = 1_000_000) -> dict:
    """Writes OUT/train.jsonl, OUT/held_out.jsonl and OUT/corpus.json (returned); see the module docstring."""
    if not 0.0 < held_out_fraction < 1.0:
        raise ValueError(f"--held-out-fraction {held_out_fraction} must be in (0, 1)")
    roots = [os.path.realpath(r) for r in (roots or default_roots())]
    for root in roots:
        if not os.path.isdir(root):
            raise ValueError(f"--root {root}: not a folder")
    skipped = dict.fromkeys(SKIP_REASONS, 0)
    files: list[tuple[str, str, str, str]] = []  # (package, root-relative path, sha256, text)
    seen_bytes, package_bytes = 0, {}
    for root in roots:
        owners = record_owners(root)
        for rel in candidate_files(root):
            # os.walk does not enter linked folders and the roots are real paths, so only the file
            # itself can be a link: resolve just those (realpath stats every component of a path)
            path = os.path.join(root, rel)
            link = os.path.islink(path)
            real = os.path.realpath(path) if link else path
            if link and not within(real, roots):
                skipped["outside_root"] += 1
                continue
            try:
                size = os.path.getsize(real)
            except OSError:  # e.g. a dangling link
                skipped["unreadable"] += 1
                continue
            if size > max_file_bytes:
                skipped["too_large"] += 1
                continue
            package = package_of(rel, owners)
            if (max_bytes and seen_bytes + size > max_bytes) or (
                    max_package_bytes and package_bytes.get(package, 0) + size > max_package_bytes):
                continue  # too big for what is left of a cap; smaller later files may still fit
            text, reason = read_text(real)
            if text is None:
                skipped[reason] += 1
                continue
            seen_bytes += len(text.encode("utf-8"))
            package_bytes[package] = package_bytes.get(package, 0) + len(text.encode("utf-8"))
            files.append((package, rel, hashlib.sha256(text.encode("utf-8")).hexdigest(), text))
    held_out = held_out_packages(package_bytes, held_out_fraction, key)
    if not held_out:
        raise ValueError(f"no package fits in --held-out-fraction {held_out_fraction} of the {seen_bytes:,} bytes "
                         f"read ({len(package_bytes)} packages): raise the fraction or --max-mb")
    # each content once: its first copy in a training package if any holds it, else its first copy
    kept: dict[str, int] = {}
    for i, (package, _, digest, _) in enumerate(files):
        if digest not in kept or (files[kept[digest]][0] in held_out and package not in held_out):
            kept[digest] = i
    skipped["duplicate"] = len(files) - len(kept)
    os.makedirs(out, exist_ok=True)
    splits = {s: {"documents": 0, "bytes": 0, "packages": set()} for s in ("train", "held_out")}
    with open(os.path.join(out, "train.jsonl"), "w") as train_f, open(os.path.join(out, "held_out.jsonl"), "w") as ho_f:
        for i in sorted(kept.values()):
            package, rel, _, text = files[i]
            split = "held_out" if package in held_out else "train"
            record = {"text": text, "package": package, "path": rel}
            (ho_f if split == "held_out" else train_f).write(json.dumps(record, ensure_ascii=False) + "\n")
            stats = splits[split]
            stats["documents"] += 1
            stats["bytes"] += len(text.encode("utf-8"))
            stats["packages"].add(package)
    report = {"roots": roots, "extensions": list(EXTENSIONS), "max_bytes": max_bytes,
              "max_package_bytes": max_package_bytes, "key": key,
              "held_out_fraction": held_out_fraction, "files_read": len(files), "bytes_read": seen_bytes,
              "skipped": skipped,
              "splits": {s: {"documents": v["documents"], "bytes": v["bytes"], "packages": sorted(v["packages"])}
                         for s, v in splits.items()}}
    with open(os.path.join(out, "corpus.json"), "w") as f:
        json.dump(report, f, indent=1)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for train.jsonl, held_out.jsonl, corpus.json")
    parser.add_argument("--root", action="append", help="a folder to read (repeatable; default: site-packages)")
    parser.add_argument("--max-mb", type=float, default=0.0, help="cap on the bytes read (0 = no cap)")
    parser.add_argument("--max-package-kb", type=float, default=0.0, help="cap on one package's bytes (0 = none)")
    parser.add_argument("--max-file-kb", type=float, default=1000.0, help="skip files larger than this")
    parser.add_argument("--held-out-fraction", type=float, default=0.05)
    parser.add_argument("--held-out-key", type=int, default=0, help="key of the package-name hash")
    args = parser.parse_args(argv)
    try:
        report = build_corpus(args.out, args.root, max_bytes=int(args.max_mb * 1e6), key=args.held_out_key,
                              max_package_bytes=int(args.max_package_kb * 1e3),
                              held_out_fraction=args.held_out_fraction, max_file_bytes=int(args.max_file_kb * 1e3))
    except ValueError as e:
        print(f"science_corpus: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({k: report[k] for k in ("files_read", "bytes_read", "skipped")}
                     | {s: {k: v for k, v in st.items() if k != "packages"} | {"packages": len(st["packages"])}
                        for s, st in report["splits"].items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
