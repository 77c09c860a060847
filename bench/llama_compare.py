# The one-process LLaMA-style training step beside PyTorch eager's, rounds
# interleaved in one run (the machine is noisy): our BM_LlamaStep
# (bench/llama_bench.cc) and bench/peers/torch2/llama_peer.py on the same
# model, batch and optimizer, float32, each in a fresh process with all
# cores. Prints each round, the medians and the ratio ours/peer (the
# target: at most 0.8).
#
#   bazel build -c opt //bench:llama_bench
#   python3 bench/llama_compare.py --ours bazel-out/k8-opt/bin/bench/llama_bench --python PY --rounds 3
import json, statistics

import compare_common
from compare_common import compare_parser


def main():
    ap = compare_parser()
    ap.add_argument("--out", help="also write the figures as JSON")
    a = ap.parse_args()
    ours, peer, version = [], [], "?"
    for r in range(a.rounds):
        o = compare_common.run_ours(a.ours, "^BM_LlamaStep", False)["step_ms_median"]
        p = compare_common.run_peer(a.python, "llama_peer", ["--steps", "8"], False)
        version = p["torch"]
        ours.append(o)
        peer.append(p["step_ms_median"])
        print(f"round {r + 1}: ember {o:.1f} ms, torch {version} {p['step_ms_median']:.1f} ms", flush=True)
    mo, mp = statistics.median(ours), statistics.median(peer)
    print(f"LLaMA step (6 x d512, GQA 8/4, SwiGLU 1408, vocab 8192, 4 x 256 tokens, AdamW, float32): "
          f"ember {mo:.1f} ms, torch {version} eager {mp:.1f} ms, ratio {mo / mp:.2f}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"ember_ms": ours, "torch_ms": peer, "torch": version, "ratio": mo / mp}, f, indent=1)


if __name__ == "__main__":
    main()
