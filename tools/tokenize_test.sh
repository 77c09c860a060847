#!/usr/bin/env bash
# //tools:tokenize end to end on text/testdata: --print / --decode round
# trip, shards and their index, --train, and named errors that leave
# nothing behind.
set -euo pipefail
TOK=$1
D=text/testdata
T=$(mktemp -d "${TEST_TMPDIR:-/tmp}/tokenize.XXXXXX")
fail() { echo "FAIL: $*" >&2; exit 1; }

# --print then --decode gives the text back, byte for byte.
"$TOK" --tokenizer $D/hf_bpe.json --print < $D/sample.txt > $T/ids.txt
[ "$(wc -l < $T/ids.txt)" -eq 1 ] || fail "--print: one line per input"
"$TOK" --tokenizer $D/hf_bpe.json --decode < $T/ids.txt > $T/back.txt
cmp -s $D/sample.txt $T/back.txt || fail "--decode of --print is not the text"
# The ids are Hugging Face's (the fixture).
python3 - "$T/ids.txt" <<'PY' || fail "--print ids differ from Hugging Face's"
import json, sys
ours = list(map(int, open(sys.argv[1]).read().split()))
assert ours == json.load(open("text/testdata/sample_ids.json"))["ids"]["hf_bpe.json"]
PY
echo -n "<|endoftext|>hi" | "$TOK" --tokenizer $D/hf_bpe.json --print | grep -q '^0 ' || fail "special token id"
echo 0 | "$TOK" --tokenizer $D/hf_bpe.json --decode --skip-special | cmp -s - /dev/null || fail "--skip-special"

# Shards of 1000 tokens with an EOT before each document.
"$TOK" --tokenizer $D/hf_bpe.json --out $T/shards --shard-tokens 1000 --eot '<|endoftext|>' $D/sample.txt $D/corpus.txt
python3 - "$T/shards" "$T/ids.txt" <<'PY' || fail "shards or index wrong"
import json, os, struct, sys
d = sys.argv[1]
idx = json.load(open(os.path.join(d, "index.json")))
assert idx["magic"] == 20240520 and idx["version"] == 1 and idx["dtype"] == "uint16", idx
assert idx["vocab_size"] == 800 and len(idx["tokenizer"]["xxh3_64"]) == 16
tokens = []
for s in idx["shards"]:
    b = open(os.path.join(d, s["file"]), "rb").read()
    magic, version, n = struct.unpack("<3i", b[:12])
    assert (magic, version, n) == (20240520, 1, s["tokens"]) and len(b) == 1024 + 2 * n
    tokens += struct.unpack(f"<{n}H", b[1024:])
assert all(s["tokens"] == 1000 for s in idx["shards"][:-1]) and sum(s["tokens"] for s in idx["shards"]) == idx["total_tokens"]
sample = list(map(int, open(sys.argv[2]).read().split()))
assert tokens[0] == 0 and tokens[1:1 + len(sample)] == sample and tokens[1 + len(sample)] == 0
PY

# --split-on / --val-every: documents cut at "%" lines, every 2nd held out.
printf 'one doc\n%%\ntwo doc\n%%\nthree\n%%\nfour\n' > $T/fort.txt
"$TOK" --tokenizer $D/hf_bpe.json --out $T/split --split-on % --val-every 2 $T/fort.txt 2> $T/split.log
grep -q "from 4 documents" $T/split.log || fail "--split-on: $(cat $T/split.log)"
python3 - "$T/split" <<'PY' || fail "train/val shards wrong"
import json, os, sys
idx = json.load(open(os.path.join(sys.argv[1], "index.json")))
assert sorted(s["split"] for s in idx["shards"]) == ["train", "val"], idx
assert [s["file"] for s in idx["shards"]] == ["train_000000.bin", "val_000000.bin"], idx
PY

# Training: a tokenizer that loads and round-trips.
"$TOK" --train --vocab-size 500 --min-frequency 2 --special '<|endoftext|>' --out $T/trained.json $D/corpus.txt 2> $T/train.log
grep -q "500 tokens" $T/train.log || fail "--train summary: $(cat $T/train.log)"
"$TOK" --tokenizer $T/trained.json --print $D/sample.txt | "$TOK" --tokenizer $T/trained.json --decode | cmp -s - $D/sample.txt \
  || fail "trained tokenizer round trip"

# Named errors, exit 1, and nothing written.
expect_error() {  # expect_error PATTERN CMD...
  local pattern=$1; shift
  if "$@" > $T/out 2> $T/err; then fail "no error from: $*"; fi
  grep -qF -- "$pattern" $T/err || fail "error of '$*' lacks '$pattern': $(cat $T/err)"
}
python3 -c "
import json; d = json.load(open('$D/hf_bpe.json')); d['model']['type'] = 'WordPiece'
json.dump(d, open('$T/wordpiece.json', 'w'))"
expect_error "$T/wordpiece.json: model.type: 'WordPiece' is not supported; only BPE is supported" \
  "$TOK" --tokenizer $T/wordpiece.json --out $T/never $D/sample.txt
[ ! -e $T/never ] || fail "a failed run created its output directory"
printf 'ok \xff\n' > $T/bad.txt
expect_error "$T/bad.txt: not valid UTF-8 at byte 3" "$TOK" --tokenizer $D/hf_bpe.json --out $T/never2 $D/sample.txt $T/bad.txt
[ -z "$(ls -d $T/never2* 2>/dev/null)" ] || fail "a failed run left shards behind"
expect_error "exists and is not an empty directory" "$TOK" --tokenizer $D/hf_bpe.json --out $T/shards $D/sample.txt
expect_error "--eot: '<nope>' is not a token" "$TOK" --tokenizer $D/hf_bpe.json --out $T/never3 --eot '<nope>' $D/sample.txt
echo "1 2 99999" > $T/badids.txt
expect_error "standard input: token 2 '99999' is not an id in [0, 800)" "$TOK" --tokenizer $D/hf_bpe.json --decode < $T/badids.txt
expect_error "--train needs --vocab-size" "$TOK" --train --out $T/x.json $D/corpus.txt
[ ! -e $T/x.json ] || fail "a failed --train wrote a file"
expect_error "unknown flag '--bogus'" "$TOK" --bogus
"$TOK" --help | grep -q "llm.c" || fail "--help"
echo PASS
