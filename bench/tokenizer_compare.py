#!/usr/bin/env python3
"""ember's byte-level BPE (//text, through //tools:tokenize) beside Hugging
Face tokenizers (bench/peers/hf_tokenizers_peer.py, run with --python):

  (a) a corpus of a few MB: Debian's license texts and fortunes, plus
      generated stress text (every script, whitespace runs, numbers,
      contractions, special and added tokens, very long words);
  (b) trains on it with their BpeTrainer and with ours, same settings, and
      compares vocabularies and merges;
  (c) encodes it with both from the same tokenizer.json (three
      configurations: GPT-2's ByteLevel, with add_prefix_space and added
      tokens, LLaMA-3's Split + ByteLevel with ignore_merges) and compares ids;
  (d) times single-thread encoding of the same documents, interleaved,
      --rounds rounds, medians and ratio.

  bazel build -c opt //tools:tokenize
  python3 bench/tokenizer_compare.py --ours bazel-bin/tools/tokenize --python ~/.venvs/tok/bin/python

--write-fixture DIR writes the small HF-made fixture the C++ tests read
(text/testdata) instead.
"""
import argparse, glob, json, os, random, statistics, subprocess, sys, unicodedata

HERE = os.path.dirname(os.path.abspath(__file__))
PEER = os.path.join(HERE, "peers", "hf_tokenizers_peer.py")
SPECIALS = ["<|endoftext|>", "<|pad|>"]
# LLaMA-3's split pattern (its tokenizer.json's Split pre-tokenizer).
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


# ---------------------------------------------------------------- corpus
def debian_texts():
    """License texts and fortunes (the fortunes package), as documents."""
    docs = {}
    lic = sorted(p for p in glob.glob("/usr/share/common-licenses/*") if os.path.isfile(p))
    docs["licenses.txt"] = "".join(open(p, encoding="utf-8", errors="replace").read() for p in lic)
    fort = sorted(
        p
        for p in glob.glob("/usr/share/games/fortunes/*")
        if os.path.isfile(p) and not p.endswith((".dat", ".u8")) and not os.path.islink(p)
    )
    if fort:
        docs["fortunes.txt"] = "".join(open(p, encoding="utf-8", errors="replace").read() for p in fort)
    if os.path.exists("/usr/share/dict/words"):
        docs["dict.txt"] = open("/usr/share/dict/words", encoding="utf-8", errors="replace").read()
    return docs


def assigned_codepoints():
    """Code points assigned in Python's Unicode database (3.11: Unicode 14.0,
    PCRE2 10.42's version too), no surrogates. U+180E is left out: PCRE2
    still counts it as \\s, Oniguruma (Hugging Face) does not
    (docs/text.md)."""
    return [
        c
        for c in range(1, 0x110000)
        if unicodedata.category(chr(c)) not in ("Cn", "Cs") and c != 0x180E
    ]


SCRIPTS = {
    "latin": (0x61, 0x7A),
    "latin_ext": (0xC0, 0x24F),
    "greek": (0x3B1, 0x3C9),
    "cyrillic": (0x430, 0x44F),
    "hebrew": (0x5D0, 0x5EA),
    "arabic": (0x627, 0x64A),
    "devanagari": (0x915, 0x939),
    "thai": (0xE01, 0xE2E),
    "hangul": (0xAC00, 0xD7A3),
    "cjk": (0x4E00, 0x9FFF),
    "hiragana": (0x3041, 0x3096),
}
SPACES = [" ", "  ", "\t", "\n", "\r\n", "\u00a0", "\u3000", "\u2028", "\x0b", "\x0c", "\x85", " \n", "\n\n\n"]
CONTRACTIONS = ["it's", "IT'S", "we'll", "They're", "I'd", "you've", "I'm", "don\u2019t", "'''", "' s", "o'clock"]


def stress_text(rng, size, cps):
    out, n = [], 0
    while n < size:
        k = rng.random()
        if k < 0.35:
            lo, hi = SCRIPTS[rng.choice(list(SCRIPTS))]
            w = "".join(chr(rng.randint(lo, hi)) for _ in range(rng.randint(1, 12)))
            if rng.random() < 0.2:
                w = w.capitalize()
            if rng.random() < 0.1:
                w += "\u0301"  # a combining mark after a letter
        elif k < 0.45:
            w = "".join(chr(rng.choice(cps)) for _ in range(rng.randint(1, 8)))
        elif k < 0.55:
            w = rng.choice(
                [
                    str(rng.randint(0, 10 ** rng.randint(1, 30))),
                    f"{rng.random() * 1e6:.3f}",
                    f"{rng.randint(1, 999)},{rng.randint(0, 999):03d},{rng.randint(0, 999):03d}",
                    f"{rng.random():.2e}",
                    "\u0663\u0664\u0665",
                    "\u096a\u096b",
                    "\uff11\uff12\uff13",
                    "\u216b",
                    "x\u00b2+y\u00b3",
                    "2024-05-20T12:34:56Z",
                ]
            )
        elif k < 0.62:
            w = rng.choice(CONTRACTIONS)
        elif k < 0.67:
            w = rng.choice(
                SPECIALS
                + [
                    "<|endoftext|><|endoftext|>",
                    "< |endoftext|>",
                    "<|endoftext|",
                    " <mask>",
                    "<mask>",
                    "Hello world",
                    "xHello world",
                    "Hello worlds",
                ]
            )
        elif k < 0.75:
            w = rng.choice(["\U0001F600", "\U0001F468\u200D\U0001F469\u200D\U0001F467", "\u2764\ufe0f", "\U0001F44D\U0001F3FD"])
        elif k < 0.85:
            w = rng.choice(["def f(x):\n    return x**2  # square\n", "if (a && b) { c++; }", "http://example.com/a?b=c&d=e", "#!/bin/sh", "$HOME/.config", "a_b-c.d/e\\f"])
        else:
            w = "".join(rng.choice(SPACES) for _ in range(rng.randint(1, 6)))
        out.append(w)
        out.append(rng.choice(SPACES) if rng.random() < 0.3 else " ")
        n += len(w) + 1
    # Long pieces: past the 256-byte cache limit and the scan/heap cut.
    out.append(" " * 5000 + "x" + "=" * 3000 + "\n")
    out.append("".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/") for _ in range(4000)))
    out.append("\n" + "a" * 700 + " " + "\u00e9" * 300 + "\n\t\t\n   \n")
    return "".join(out)


def build_corpus(dirname, seed=1234, stress_bytes=1_000_000):
    os.makedirs(dirname, exist_ok=True)
    rng = random.Random(seed)
    cps = assigned_codepoints()
    docs = debian_texts()
    docs["stress.txt"] = stress_text(rng, stress_bytes, cps)
    # Every assigned code point (Unicode 14), 64 to a line.
    docs["allchars.txt"] = "\n".join("".join(map(chr, cps[i : i + 64])) for i in range(0, len(cps), 64))
    paths = []
    for name, text in docs.items():
        p = os.path.join(dirname, name)
        with open(p, "w", encoding="utf-8", newline="") as f:
            f.write(text)
        paths.append(p)
    return paths


# ---------------------------------------------------------------- configurations
def variants(hf_json, dirname):
    """The trained tokenizer.json in three configurations; returns paths."""
    base = json.load(open(hf_json, encoding="utf-8"))
    out = {"gpt2": hf_json}
    v = json.loads(json.dumps(base))
    v["pre_tokenizer"]["add_prefix_space"] = True
    n = max(v["model"]["vocab"].values()) + 1
    v["added_tokens"] += [
        {"id": n, "content": "<mask>", "single_word": False, "lstrip": True, "rstrip": False, "normalized": False, "special": True},
        {"id": n + 1, "content": "Hello world", "single_word": True, "lstrip": False, "rstrip": False, "normalized": True, "special": False},
    ]
    out["prefix_added"] = os.path.join(dirname, "prefix_added.json")
    json.dump(v, open(out["prefix_added"], "w", encoding="utf-8"), ensure_ascii=False)
    v = json.loads(json.dumps(base))
    v["pre_tokenizer"] = {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": LLAMA3_PATTERN}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
        ],
    }
    v["model"]["ignore_merges"] = True
    out["llama3"] = os.path.join(dirname, "llama3.json")
    json.dump(v, open(out["llama3"], "w", encoding="utf-8"), ensure_ascii=False)
    return out


# ---------------------------------------------------------------- runners
def run(cmd, **kw):
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{r.stderr}")
    return r.stdout


def peer(a, *args):
    return run([a.python, PEER, *args])


def ours_ids(a, tok, files):
    return [list(map(int, line.split())) for line in run([a.ours, "--tokenizer", tok, "--print", *files]).splitlines()]


def compare_training(a, files, work, vocab, min_freq, prefix):
    flags = ["--vocab-size", str(vocab), "--min-frequency", str(min_freq)]
    for s in SPECIALS:
        flags += ["--special", s]
    if prefix:
        flags.append("--add-prefix-space")
    hf_path, our_path = os.path.join(work, f"hf_{vocab}.json"), os.path.join(work, f"ours_{vocab}.json")
    peer(a, "train", "--out", hf_path, *flags, *files)
    run([a.ours, "--train", *flags, "--out", our_path, *files])
    hf, ours = json.load(open(hf_path, encoding="utf-8")), json.load(open(our_path, encoding="utf-8"))
    hm = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in hf["model"]["merges"]]
    om = [tuple(m) for m in ours["model"]["merges"]]
    first = next((i for i, (x, y) in enumerate(zip(hm, om)) if x != y), None)
    res = {
        "vocab_size": vocab,
        "min_frequency": min_freq,
        "add_prefix_space": prefix,
        "merges_hf": len(hm),
        "merges_ours": len(om),
        "merges_equal": hm == om,
        "vocab_equal": hf["model"]["vocab"] == ours["model"]["vocab"],
        "added_equal": hf["added_tokens"] == ours["added_tokens"],
    }
    if first is not None:
        res["first_difference"] = {"rank": first, "hf": hm[first], "ours": om[first]}
    # Hugging Face loads the file we wrote and encodes as we do with it.
    res["ours_loaded_by_hf_ids_equal"] = compare_ids(a, our_path, files[:1], work)["equal"]
    return res, hf_path


def compare_ids(a, tok, files, work):
    out = os.path.join(work, "hf_ids.json")
    peer(a, "encode", "--tokenizer", tok, "--out", out, *files)
    hf, ours = json.load(open(out)), ours_ids(a, tok, files)
    res = {"tokens": sum(map(len, hf)), "docs": {}}
    for f, h, o in zip(files, hf, ours):
        d = {"tokens": len(h), "equal": h == o}
        if h != o:
            i = next((k for k, (x, y) in enumerate(zip(h, o)) if x != y), min(len(h), len(o)))
            d["first_difference"] = {"index": i, "hf": h[i : i + 5], "ours": o[i : i + 5]}
        res["docs"][os.path.basename(f)] = d
    res["equal"] = all(d["equal"] for d in res["docs"].values())
    return res


def throughput(a, tok, files, lines):
    """Rounds of: ours, HF's encode() per document (or line), HF's
    encode_batch_fast on one thread; each a fresh process with one warm-up."""
    rows, unit = [], ["--lines"] if lines else []
    for r in range(a.rounds):
        out = run([a.ours, "--tokenizer", tok, "--bench", "--rounds", "1", *unit, *files])
        ours = float(out.strip().splitlines()[-1].split()[1])
        enc = json.loads(peer(a, "time", "--tokenizer", tok, "--mode", "encode", *unit, *files))
        fast = json.loads(peer(a, "time", "--tokenizer", tok, "--mode", "batch_fast", *unit, *files))
        rows.append({"ours": ours, "hf_encode": enc["mb_s"], "hf_batch_fast": fast["mb_s"]})
        print(f"  round {r}: ours {ours:.2f} MB/s, HF encode {enc['mb_s']:.2f}, HF encode_batch_fast {fast['mb_s']:.2f}")
    med = {k: statistics.median(x[k] for x in rows) for k in rows[0]}
    med["ratio_vs_best_hf"] = med["ours"] / max(med["hf_encode"], med["hf_batch_fast"])
    return {"rounds": rows, "median": med}


# ---------------------------------------------------------------- fixture
def write_fixture(a):
    """text/testdata: a small corpus, HF's training on it (the expected
    merges), and HF's ids for a sample in three configurations."""
    d = a.write_fixture
    rng = random.Random(7)
    cps = assigned_codepoints()
    lic = debian_texts()["licenses.txt"]
    corpus = lic[:40000] + stress_text(rng, 20000, cps)
    with open(os.path.join(d, "corpus.txt"), "w", encoding="utf-8", newline="") as f:
        f.write(corpus)
    flags = ["--vocab-size", "800", "--min-frequency", "2"] + sum((["--special", s] for s in SPECIALS), [])
    hf_json = os.path.join(d, "hf_bpe.json")
    peer(a, "train", "--out", hf_json, *flags, os.path.join(d, "corpus.txt"))
    sample = stress_text(random.Random(8), 12000, cps) + lic[50000:56000]
    with open(os.path.join(d, "sample.txt"), "w", encoding="utf-8", newline="") as f:
        f.write(sample)
    tmp = os.path.join(a.work, "fixture")
    os.makedirs(tmp, exist_ok=True)
    expected = {}
    for name, path in variants(hf_json, tmp).items():
        if name != "gpt2":
            dst = os.path.join(d, f"hf_bpe_{name}.json")
            os.replace(path, dst)
            path = dst
        out = os.path.join(tmp, "ids.json")
        peer(a, "encode", "--tokenizer", path, "--out", out, os.path.join(d, "sample.txt"))
        expected[os.path.basename(path)] = json.load(open(out))[0]
    with open(os.path.join(d, "sample_ids.json"), "w") as f:
        json.dump({"tokenizers": json.loads(peer(a, "version"))["tokenizers"], "ids": expected}, f, separators=(",", ":"))
    print("wrote", d)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ours", default="bazel-bin/tools/tokenize")
    ap.add_argument("--python", default=os.path.expanduser("~/.venvs/tok/bin/python"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--vocab-size", type=int, default=8000)
    ap.add_argument("--work", default="/tmp/ember_tokenizer_compare")
    ap.add_argument("--results", default=os.path.join(HERE, "results", "tokenizer.json"))
    ap.add_argument("--write-fixture", metavar="DIR")
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    if a.write_fixture:
        return write_fixture(a)
    files = build_corpus(os.path.join(a.work, "corpus"))
    size = sum(os.path.getsize(f) for f in files)
    print(f"corpus: {len(files)} documents, {size / 1e6:.2f} MB")
    result = {"peer": json.loads(peer(a, "version")), "corpus_bytes": size, "training": [], "ids": {}}
    hf_json = None
    for vocab, freq, prefix in [(a.vocab_size, 2, False), (2000, 0, True)]:
        res, path = compare_training(a, files, a.work, vocab, freq, prefix)
        hf_json = hf_json or path
        result["training"].append(res)
        print("training:", json.dumps(res, ensure_ascii=False))
    for name, tok in variants(hf_json, a.work).items():
        res = compare_ids(a, tok, files, a.work)
        result["ids"][name] = res
        print(f"ids ({name}): {'equal' if res['equal'] else 'DIFFERENT'} over {res['tokens']} tokens",
              "" if res["equal"] else json.dumps(res["docs"], ensure_ascii=False))
    result["throughput"] = {}
    for unit in ["documents", "lines"]:
        print(f"throughput (one thread, MB/s), each {unit[:-1]} encoded by itself:")
        t = result["throughput"][unit] = throughput(a, hf_json, files, unit == "lines")
        print("  medians:", json.dumps(t["median"]))
    os.makedirs(os.path.dirname(a.results), exist_ok=True)
    with open(a.results, "w") as f:
        json.dump(result, f, indent=1, ensure_ascii=False)
    ok = all(t["merges_equal"] and t["vocab_equal"] for t in result["training"]) and all(
        r["equal"] for r in result["ids"].values()
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
