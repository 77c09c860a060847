"""Writes nn/testdata/hf/: a tiny random GPT2LMHeadModel (gpt2/) and
LlamaForCausalLM (llama/, grouped-query: 4 heads over 2 kv heads) as
transformers' save_pretrained writes them, and expected.safetensors with
the token ids and the logits transformers computes for them in float32.
//nn:hf_test loads both with ember and compares. Odd sizes on purpose:
vocab 37 (not a multiple of 8), intermediate 44, rope_theta 5000, rms_norm_eps
1e-6; every weight (norms and biases too) random, so that a swapped or
misnamed tensor changes the logits.

Run with a Python that has torch, transformers and safetensors
(tools/hf_compare.sh makes ~/.venvs/hf):
  ~/.venvs/hf/bin/python nn/testdata/hf/make_fixture.py nn/testdata/hf
"""
import os
import shutil
import sys

import torch
from safetensors.torch import save_file
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM


def randomize(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name or name.endswith("ln_1.weight") or name.endswith(
                    "ln_2.weight") or name.endswith("ln_f.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return model


def main(out):
    torch.manual_seed(0)
    gpt2 = randomize(
        GPT2LMHeadModel(
            GPT2Config(vocab_size=37, n_positions=24, n_embd=32, n_layer=2, n_head=4, bos_token_id=None,
                       eos_token_id=None)), 1).eval()
    llama = randomize(
        LlamaForCausalLM(
            LlamaConfig(vocab_size=37, hidden_size=32, intermediate_size=44, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                        rope_theta=5000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=None,
                        eos_token_id=None)), 2).eval()
    ids = torch.randint(0, 37, (2, 11), generator=torch.Generator().manual_seed(3))
    expected = {"ids": ids}
    for name, model in (("gpt2", gpt2), ("llama", llama)):
        d = os.path.join(out, name)
        shutil.rmtree(d, ignore_errors=True)
        model.save_pretrained(d, safe_serialization=True)
        gen = os.path.join(d, "generation_config.json")
        if os.path.exists(gen):
            os.remove(gen)
        with torch.no_grad():
            expected[name + ".logits"] = model(ids).logits.float().contiguous()
    save_file(expected, os.path.join(out, "expected.safetensors"), metadata={"format": "pt"})


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__)))
