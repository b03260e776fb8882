#!/usr/bin/env python3
"""Tokenizes text into moetrain token shards (docs/data.md).

    python3 tools/prepare_data.py --tokenizer HF_DIR --out OUT_DIR [options] INPUT...

INPUT: .jsonl/.json files (one JSON object per line, text in --text-key), plain text files, .parquet
files (needs pyarrow: `make data-deps`), directories (their files of those kinds, sorted) or globs.
Plain text is one document per file unless --text-split says otherwise.

Each document is tokenized with the model's own tokenizer (HF_DIR/tokenizer.json, no special tokens
added) and followed by the EOS id (from HF_DIR's tokenizer_config.json, generation_config.json or
config.json, or --eos-id). Documents are packed back to back into shards OUT_DIR/PREFIX-NNNNN.bin
in the MTTOKENS v1 format that data.kind: tokens reads (src/data.h); a shard is closed at the first
document end at or past --shard-tokens, so no document is split across shards. Beside each shard,
PREFIX-NNNNN.idx lists where its documents start (format in docs/data.md). Every file is written
as NAME.tmp and renamed when complete. The report at the end gives documents, tokens and shards.
"""
import argparse
import glob
import json
import os
import struct
import sys

TOKENS_MAGIC = b"MTTOKENS"
INDEX_MAGIC = b"MTDOCIDX"
VERSION = 1


def die(msg):
    print(f"prepare_data: {msg}", file=sys.stderr)
    sys.exit(2)


def load_tokenizer(tok_dir):
    try:
        from tokenizers import Tokenizer
    except ImportError:
        die("the 'tokenizers' package is not installed (run `make data-deps`, which does "
            "`pip install -r tools/requirements.txt`)")
    path = os.path.join(tok_dir, "tokenizer.json")
    if not os.path.isfile(path):
        die(f"{path}: no tokenizer.json (--tokenizer must be a Hugging Face model or tokenizer "
            f"directory)")
    try:
        return Tokenizer.from_file(path)
    except Exception as e:  # the library raises its own exception types
        die(f"{path}: cannot load the tokenizer: {e}")


def read_json(path):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        die(f"{path}: cannot read JSON: {e}")


def find_eos(tok, tok_dir):
    """EOS id and where it came from: tokenizer_config.json's eos_token, then the eos_token_id of
    generation_config.json, then of config.json (the first one when it is a list)."""
    p = os.path.join(tok_dir, "tokenizer_config.json")
    if os.path.isfile(p):
        eos = read_json(p).get("eos_token")
        if isinstance(eos, dict):
            eos = eos.get("content")
        if isinstance(eos, str):
            i = tok.token_to_id(eos)
            if i is None:
                die(f"{p}: eos_token {eos!r} is not in the tokenizer's vocabulary")
            return i, f"{p} eos_token {eos!r}"
    for name in ("generation_config.json", "config.json"):
        p = os.path.join(tok_dir, name)
        if os.path.isfile(p):
            e = read_json(p).get("eos_token_id")
            if isinstance(e, list) and e:
                e = e[0]
            if isinstance(e, int):
                return e, f"{p} eos_token_id"
    die(f"{tok_dir}: found no EOS token (tokenizer_config.json eos_token, generation_config.json or "
        f"config.json eos_token_id); pass --eos-id")


def expand_inputs(items):
    files = []
    for it in items:
        if os.path.isdir(it):
            found = sorted(os.path.join(it, n) for n in os.listdir(it)
                           if os.path.isfile(os.path.join(it, n)) and not n.startswith("."))
            if not found:
                die(f"{it}: directory has no files")
            files += found
        elif os.path.isfile(it):
            files.append(it)
        else:
            found = sorted(p for p in glob.glob(it) if os.path.isfile(p))
            if not found:
                die(f"{it}: no such file, directory or matching glob")
            files += found
    return files


def kind_of(path, forced):
    if forced != "auto":
        return forced
    low = path.lower()
    if low.endswith((".jsonl", ".json", ".ndjson")):
        return "jsonl"
    if low.endswith(".parquet"):
        return "parquet"
    return "text"


def documents(path, kind, key, split):
    """Yields the documents (strings) of one input file."""
    if kind == "jsonl":
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except ValueError as e:
                    die(f"{path}:{n}: not valid JSON: {e}")
                if not isinstance(obj, dict) or key not in obj:
                    die(f"{path}:{n}: no field {key!r} (choose it with --text-key)")
                if not isinstance(obj[key], str):
                    die(f"{path}:{n}: field {key!r} is {type(obj[key]).__name__}, not a string")
                yield obj[key]
    elif kind == "parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            die(f"{path}: reading parquet needs pyarrow, which is not installed "
                f"(`pip install -r tools/requirements-parquet.txt`)")
        try:
            pf = pq.ParquetFile(path)
        except Exception as e:
            die(f"{path}: cannot open parquet: {e}")
        if key not in pf.schema_arrow.names:
            die(f"{path}: no column {key!r} (columns: {', '.join(pf.schema_arrow.names)}; "
                f"choose one with --text-key)")
        for batch in pf.iter_batches(columns=[key]):
            for v in batch.column(0).to_pylist():
                if v is None:
                    continue
                if not isinstance(v, str):
                    die(f"{path}: column {key!r} holds {type(v).__name__} values, not text")
                yield v
    else:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except UnicodeDecodeError as e:
            die(f"{path}: not UTF-8 text: {e}")
        if split == "file":
            yield text
        elif split == "line":
            for line in text.splitlines():
                if line.strip():
                    yield line
        else:  # paragraphs separated by blank lines
            para = []
            for line in text.splitlines():
                if line.strip():
                    para.append(line)
                elif para:
                    yield "\n".join(para)
                    para = []
            if para:
                yield "\n".join(para)


class ShardWriter:
    def __init__(self, out, prefix, width, shard_tokens):
        self.out, self.prefix, self.width, self.limit = out, prefix, width, shard_tokens
        self.fmt = "<H" if width == 2 else "<I"
        self.shards = []  # (name, tokens, docs)
        self.f = None

    def _open(self):
        self.name = f"{self.prefix}-{len(self.shards):05d}"
        self.tmp = os.path.join(self.out, self.name + ".bin.tmp")
        self.f = open(self.tmp, "wb")
        # the count is patched on close; until then the header and the size disagree
        self.f.write(TOKENS_MAGIC + struct.pack("<IIQ", VERSION, self.width, 0))
        self.count, self.starts = 0, []

    def add(self, ids):
        if self.f is None:
            self._open()
        self.starts.append(self.count)
        code = "H" if self.width == 2 else "I"
        self.f.write(struct.pack(f"<{len(ids)}{code}", *ids))
        self.count += len(ids)
        if self.count >= self.limit:
            self.close()

    def close(self):
        if self.f is None:
            return
        self.f.seek(16)
        self.f.write(struct.pack("<Q", self.count))
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        self.f = None
        idx_tmp = os.path.join(self.out, self.name + ".idx.tmp")
        with open(idx_tmp, "wb") as g:
            g.write(INDEX_MAGIC + struct.pack("<IIQQ", VERSION, 0, len(self.starts), self.count))
            g.write(struct.pack(f"<{len(self.starts)}Q", *self.starts))
            g.flush()
            os.fsync(g.fileno())
        os.replace(self.tmp, os.path.join(self.out, self.name + ".bin"))
        os.replace(idx_tmp, os.path.join(self.out, self.name + ".idx"))
        self.shards.append((self.name, self.count, len(self.starts)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("inputs", nargs="+", help="files, directories or globs")
    ap.add_argument("--tokenizer", required=True, help="HF model/tokenizer directory (tokenizer.json)")
    ap.add_argument("--out", required=True, help="output directory (created)")
    ap.add_argument("--prefix", default="shard", help="shard file name prefix (default shard)")
    ap.add_argument("--format", choices=["auto", "jsonl", "text", "parquet"], default="auto",
                    help="input format (default: by extension; other extensions are text)")
    ap.add_argument("--text-key", default="text", help="JSONL field / parquet column (default text)")
    ap.add_argument("--text-split", choices=["file", "paragraph", "line"], default="file",
                    help="plain text: one document per file (default), per blank-line-separated "
                         "paragraph, or per non-empty line")
    ap.add_argument("--eos-id", type=int, help="EOS id (default: from the tokenizer directory)")
    ap.add_argument("--shard-tokens", type=int, default=1 << 28,
                    help="close a shard at the first document end at or past this many tokens "
                         "(default 2^28)")
    ap.add_argument("--dtype", choices=["auto", "u16", "u32"], default="auto",
                    help="token width (default u16 when the vocabulary fits, else u32)")
    ap.add_argument("--force", action="store_true", help="replace shards of the same prefix in --out")
    a = ap.parse_args(argv)
    if a.shard_tokens < 1:
        die(f"--shard-tokens {a.shard_tokens} must be positive")

    tok = load_tokenizer(a.tokenizer)
    if a.eos_id is not None:
        eos, eos_from = a.eos_id, "--eos-id"
    else:
        eos, eos_from = find_eos(tok, a.tokenizer)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    if not 0 <= eos < vocab:
        die(f"EOS id {eos} ({eos_from}) is outside the tokenizer's vocabulary of {vocab}")
    width = {"u16": 2, "u32": 4}.get(a.dtype, 2 if vocab <= 65536 else 4)
    if width == 2 and vocab > 65536:
        die(f"--dtype u16 cannot hold the tokenizer's {vocab} ids (use u32)")

    files = expand_inputs(a.inputs)
    os.makedirs(a.out, exist_ok=True)
    old = sorted(glob.glob(os.path.join(glob.escape(a.out), glob.escape(a.prefix) + "-*.bin")))
    if old and not a.force:
        die(f"{a.out}: already holds {len(old)} shard(s) named {a.prefix}-*.bin (pass --force to "
            f"replace them, or choose another --out/--prefix)")
    for p in old:
        os.remove(p)
        idx = p[:-4] + ".idx"
        if os.path.exists(idx):
            os.remove(idx)

    w = ShardWriter(a.out, a.prefix, width, a.shard_tokens)
    n_docs = n_tokens = n_empty = 0
    try:
        for path in files:
            for text in documents(path, kind_of(path, a.format), a.text_key, a.text_split):
                ids = tok.encode(text, add_special_tokens=False).ids
                if not ids:
                    n_empty += 1
                    continue
                ids.append(eos)
                w.add(ids)
                n_docs += 1
                n_tokens += len(ids)
        w.close()
    except BaseException:
        if w.f is not None:
            w.f.close()
            os.remove(w.tmp)
        raise
    if n_docs == 0:
        die(f"no documents in {len(files)} input file(s)")
    print(f"prepare_data: {n_docs} documents, {n_tokens} tokens (EOS {eos} from {eos_from}, "
          f"uint{8 * width}) in {len(w.shards)} shard(s) under {a.out}"
          + (f"; {n_empty} empty document(s) skipped" if n_empty else ""))
    for name, count, docs in w.shards:
        print(f"  {name}.bin  {count} tokens, {docs} documents")
    print(f"train with:  data: {{kind: tokens, path: {a.out}, eos_id: {eos}}}   "
          f"(model.vocab_size >= {vocab})")


if __name__ == "__main__":
    main()
