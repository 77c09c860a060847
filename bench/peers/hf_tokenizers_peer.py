"""Hugging Face tokenizers' side of bench/tokenizer_compare.py (run with the
Python of a venv that has `tokenizers`: python3 -m venv ~/.venvs/tok &&
~/.venvs/tok/bin/pip install tokenizers).

  train   --out T.json --vocab-size N --min-frequency F [--special S]... [--add-prefix-space] FILE...
  encode  --tokenizer T.json --out IDS.json FILE...   each FILE encoded whole, add_special_tokens=False
  time    --tokenizer T.json --mode encode|batch_fast [--lines] FILE...
          one warm-up, then one timed pass; prints JSON. Each FILE encoded whole, or with --lines
          each line (with its ending) by itself
  version

Single thread: RAYON_NUM_THREADS=1 and TOKENIZERS_PARALLELISM=false are set
before tokenizers is imported.
"""
import os

os.environ["RAYON_NUM_THREADS"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"

import argparse, json, sys, time  # noqa: E402

import tokenizers  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402


def read(path):
    with open(path, encoding="utf-8", newline="") as f:
        return f.read()


def train(a):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=a.add_prefix_space)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=a.vocab_size,
        min_frequency=a.min_frequency,
        special_tokens=a.special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    t0 = time.perf_counter()
    tok.train(a.files, trainer)
    print(json.dumps({"train_s": time.perf_counter() - t0}))
    tok.save(a.out)


def encode(a):
    tok = Tokenizer.from_file(a.tokenizer)
    ids = [tok.encode(read(f), add_special_tokens=False).ids for f in a.files]
    with open(a.out, "w") as f:
        json.dump(ids, f)


def _lines(text):
    parts = text.split("\n")
    out = [p + "\n" for p in parts[:-1]]
    if parts[-1]:
        out.append(parts[-1])
    return out


def timing(a):
    tok = Tokenizer.from_file(a.tokenizer)
    docs = [read(f) for f in a.files]
    nbytes = sum(len(d.encode("utf-8")) for d in docs)
    if a.lines:
        # str.splitlines would also cut at \r, \x0b, \x85, \u2028...: only \n here, as ours.
        docs = [x for d in docs for x in _lines(d)]

    def once():
        if a.mode == "encode":
            return sum(len(tok.encode(d, add_special_tokens=False).ids) for d in docs)
        return sum(len(e.ids) for e in tok.encode_batch_fast(docs, add_special_tokens=False))

    once()  # warm-up: the word cache, as ours gets
    t0 = time.perf_counter()
    ntok = once()
    s = time.perf_counter() - t0
    print(json.dumps({"mode": a.mode, "lines": a.lines, "bytes": nbytes, "tokens": ntok, "seconds": s, "mb_s": nbytes / s / 1e6}))


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train")
    t.add_argument("--out", required=True)
    t.add_argument("--vocab-size", type=int, required=True)
    t.add_argument("--min-frequency", type=int, default=0)
    t.add_argument("--special", action="append", default=[])
    t.add_argument("--add-prefix-space", action="store_true")
    t.add_argument("files", nargs="+")
    e = sub.add_parser("encode")
    e.add_argument("--tokenizer", required=True)
    e.add_argument("--out", required=True)
    e.add_argument("files", nargs="+")
    m = sub.add_parser("time")
    m.add_argument("--tokenizer", required=True)
    m.add_argument("--mode", choices=["encode", "batch_fast"], default="encode")
    m.add_argument("--lines", action="store_true")
    m.add_argument("files", nargs="+")
    sub.add_parser("version")
    a = ap.parse_args()
    if a.cmd == "train":
        train(a)
    elif a.cmd == "encode":
        encode(a)
    elif a.cmd == "time":
        timing(a)
    else:
        print(json.dumps({"tokenizers": tokenizers.__version__, "python": sys.version.split()[0]}))


if __name__ == "__main__":
    main()
