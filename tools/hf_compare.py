"""ember against a live transformers, both ways (nn/hf.h, //tools:ckpt).

Hugging Face -> ember: random GPT2LMHeadModel and LlamaForCausalLM models of
odd sizes (vocab 37, GQA 4 heads over 2 kv heads, MQA, tied and untied
heads, sharded with an index, stored in bfloat16) saved by save_pretrained;
`ckpt logits DIR` must give transformers' float32 logits.

ember -> Hugging Face: //examples:gpt trains on a mesh (a LLaMA started with
--init-from-hf from a random transformers model on dp_shard 2 x tp 2; a
GPT-2 from scratch under FSDP), `ckpt export-hf` writes the checkpoint out,
from_pretrained loads it and must give the logits `ckpt logits` computes
from the sharded checkpoint itself.

The error measure is max |ember - transformers| / max |transformers| over
all logits; each must be <= 1e-5. Prints one line per case and a count;
exits 1 on a failure.

  ~/.venvs/hf/bin/python tools/hf_compare.py --ckpt bazel-bin/tools/ckpt --gpt bazel-bin/examples/gpt
"""
import argparse
import os
import random
import shutil
import subprocess
import sys
import tempfile

import torch
from safetensors.torch import load_file
from transformers import (AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM)

TOLERANCE = 1e-5
# 37 characters: a vocabulary that is not a multiple of 8, shared by the
# training text below and the random model --init-from-hf starts from.
ALPHABET = "abcdefghijklmnopqrstuvwxyz .,;!?'-()\n"


def randomize(model, seed):
    """Every weight random (norms around 1), so that a swapped or misnamed
    tensor shows in the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            norm = p.dim() == 1 and ("norm" in name or name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")))
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g) if norm else 0.1 * torch.randn(p.shape, generator=g))
    return model.eval()


def rel_error(ours, theirs):
    return ((ours.double() - theirs.double()).abs().max() / theirs.double().abs().max()).item()


def ids_text(ids):
    return "/".join(",".join(str(int(t)) for t in row) for row in ids)


def run(cmd):
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if r.returncode != 0:
        raise RuntimeError("%s exited %d:\n%s" % (" ".join(cmd), r.returncode, r.stdout[-4000:]))
    return r.stdout


def ember_logits(ckpt, src, ids, work):
    out = os.path.join(work, "logits-%d.safetensors" % random.getrandbits(32))
    run([ckpt, "logits", src, ids_text(ids), out])
    return load_file(out)["logits"]


def hf_models():
    """(name, model, save_pretrained kwargs, from_pretrained dtype)."""
    gpt2 = dict(vocab_size=37, n_positions=24, n_embd=48, n_layer=3, n_head=4, bos_token_id=None, eos_token_id=None)
    llama = dict(vocab_size=37, hidden_size=32, intermediate_size=44, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=32, rope_theta=5000.0, rms_norm_eps=1e-6,
                 bos_token_id=None, eos_token_id=None)
    return [
        ("gpt2 tied, 3 layers x 48", GPT2LMHeadModel(GPT2Config(**gpt2)), {}),
        ("gpt2 untied, sharded", GPT2LMHeadModel(GPT2Config(**dict(gpt2, tie_word_embeddings=False))),
         {"max_shard_size": "40KB"}),
        ("llama GQA 4/2 heads, untied", LlamaForCausalLM(LlamaConfig(**dict(llama, tie_word_embeddings=False))), {}),
        ("llama GQA 4/2 heads, tied, sharded", LlamaForCausalLM(LlamaConfig(**dict(llama, tie_word_embeddings=True))),
         {"max_shard_size": "20KB"}),
        ("llama MQA 6/1 heads, theta 1e6", LlamaForCausalLM(
            LlamaConfig(**dict(llama, hidden_size=48, num_attention_heads=6, num_key_value_heads=1, rope_theta=1e6,
                               intermediate_size=72, tie_word_embeddings=False))), {}),
        ("llama stored in bfloat16", LlamaForCausalLM(LlamaConfig(**dict(llama, tie_word_embeddings=False))),
         {"bf16": True}),
    ]


def hf_to_ember(args, work, results):
    ids = torch.randint(0, 37, (3, 13), generator=torch.Generator().manual_seed(7))
    for k, (name, model, kw) in enumerate(hf_models()):
        randomize(model, 100 + k)
        d = os.path.join(work, "hf-%d" % k)
        kw = dict(kw)
        if kw.pop("bf16", False):
            # Stored in bfloat16; both sides compute in float32 from the
            # widened weights (from_pretrained with dtype float32).
            model.to(torch.bfloat16).save_pretrained(d, **kw)
            model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        else:
            model.save_pretrained(d, **kw)
        with torch.no_grad():
            theirs = model(ids).logits
        ours = ember_logits(args.ckpt, d, ids, work)
        results.append(("transformers -> ember: " + name, rel_error(ours, theirs)))


def write_text(path, seed):
    """Quotes of random words over ALPHABET, in the fortunes format
    ("%" lines between quotes), every character present."""
    rng = random.Random(seed)
    letters, marks = ALPHABET[:26], ALPHABET[27:36]
    quotes = []
    for q in range(300):
        words = []
        for _ in range(rng.randint(4, 14)):
            w = "".join(rng.choice(letters) for _ in range(rng.randint(1, 7)))
            words.append(w + (rng.choice(marks) if rng.random() < 0.2 else ""))
        quotes.append(" ".join(words) + "\n" + ("(" + ALPHABET + ")\n" if q == 0 else ""))
    with open(path, "w") as f:
        f.write("\n%\n".join(quotes) + "\n")


def ember_to_hf(args, work, results):
    text = os.path.join(work, "text")
    write_text(text, 1)
    ids = torch.randint(0, 37, (2, 16), generator=torch.Generator().manual_seed(8))
    common = ["--data", text, "--seq", "16", "--max-steps", "4", "--global-batch", "8", "--sample-len", "0",
              "--eval-every", "100", "--lr", "3e-3"]
    # A LLaMA from a random transformers model with the text's vocabulary,
    # trained on dp_shard 2 x tp 2.
    start = os.path.join(work, "llama-start")
    randomize(
        LlamaForCausalLM(
            LlamaConfig(vocab_size=len(ALPHABET), hidden_size=32, intermediate_size=44, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, rope_theta=5000.0,
                        rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None)),
        11).save_pretrained(start)
    runs = [
        ("llama --init-from-hf, trained on dp_shard 2 x tp 2",
         ["--nproc", "4", "--dp-shard", "2", "--tp", "2", "--init-from-hf", start]),
        ("gpt2 from scratch, trained under FSDP on 2 ranks",
         ["--nproc", "2", "--layers", "3", "--dim", "48", "--heads", "4"]),
    ]
    for k, (name, flags) in enumerate(runs):
        ck = os.path.join(work, "run-%d" % k)
        run([args.gpt] + common + flags + ["--checkpoint-dir", ck])
        step = os.path.join(ck, "step_4")
        out = os.path.join(work, "export-%d" % k)
        run([args.ckpt, "export-hf", step, out])
        ours = ember_logits(args.ckpt, step, ids, work)  # from the sharded checkpoint itself
        model = AutoModelForCausalLM.from_pretrained(out).eval()
        with torch.no_grad():
            theirs = model(ids).logits
        results.append(("ember -> transformers: %s (%s)" % (name, type(model).__name__), rel_error(ours, theirs)))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ckpt", required=True, help="//tools:ckpt")
    p.add_argument("--gpt", required=True, help="//examples:gpt")
    p.add_argument("--work", default=None, help="scratch directory (default: a new temporary one)")
    args = p.parse_args()
    torch.manual_seed(0)
    random.seed(0)
    work = args.work or tempfile.mkdtemp(prefix="hf_compare_")
    os.makedirs(work, exist_ok=True)
    results = []
    hf_to_ember(args, work, results)
    ember_to_hf(args, work, results)
    failed = 0
    for name, err in results:
        ok = err <= TOLERANCE
        failed += not ok
        print("%-4s %-72s max rel error %.2e" % ("ok" if ok else "FAIL", name, err))
    print("%d of %d cases within %g%s" % (len(results) - failed, len(results), TOLERANCE,
                                          "" if not failed else "; %d FAILED" % failed))
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
