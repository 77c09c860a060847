"""Writes powersgd_torch.json: PyTorch's powerSGD_hook on a small DDP model,
two ranks over Gloo, for powersgd_test.cc to match.

Run by hand with a PyTorch 2 (`python3 powersgd_fixture.py`, from this
directory); the JSON is committed. The model is Linear(16, 12), tanh,
Linear(12, 8); one bucket; 6 steps of fixed parameters (no optimizer: each
step's gradients depend on its inputs only, and the hook's state carries the
error feedback and the warm start across steps); start_powerSGD_iter 2,
min_compression_rate 1 (both weight matrices compressed, the biases not).
Q's first value is set here (the hook otherwise draws it from torch's
generator, which ember does not reproduce); the P memory is set beside it,
so torch takes the warm-start branch and orthogonalizes the given Q. The
gradients are recorded in float32 and, from a float64 run of the same, as
"grads_float64": the reference float32 results are held to.
"""
import json
import math
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
from torch.nn.parallel import DistributedDataParallel as DDP

WORLD, STEPS, BATCH = 2, 6, 4


def values(n, phase):
    return [math.sin(0.37 * k + phase) + 0.3 * math.cos(1.3 * k * phase + 0.2) for k in range(n)]


def initial_q(m, r):
    return torch.tensor(values(m * r, 0.11 * m + r), dtype=torch.float32).view(m, r)


def run(rank, rank_r, out, dtype):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(29700 + rank_r)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(16, 12), torch.nn.Tanh(), torch.nn.Linear(12, 8)).to(dtype)
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_(torch.tensor(values(p.numel(), 0.5 + i), dtype=torch.float32).to(dtype).view(p.shape) * 0.3)
    params = {name: p.detach().reshape(-1).tolist() for name, p in model.named_parameters()}
    ddp = DDP(model, bucket_cap_mb=1000)
    state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=rank_r, start_powerSGD_iter=2,
                               min_compression_rate=1, use_error_feedback=True, warm_start=True,
                               orthogonalization_epsilon=0, random_seed=0)
    ddp.register_comm_hook(state, psgd.powerSGD_hook)
    steps, inputs, qs_given = [], [], {}
    for s in range(STEPS):
        if s == 2:  # the first compressed step: Q given (bucket order: W2 8x12, then W1 12x16)
            qs = [initial_q(12, min(8, rank_r)), initial_q(16, min(12, rank_r))]
            qs_given = {f"{q.shape[0]}x{q.shape[1]}": q.reshape(-1).tolist() for q in qs}
            state.q_memory_dict[0] = torch.cat([q.reshape(-1) for q in qs]).to(dtype)
            state.p_memory_dict[0] = torch.zeros(8 * min(8, rank_r) + 12 * min(12, rank_r), dtype=dtype)
        x = torch.tensor(values(WORLD * BATCH * 16, 1.7 * s + 0.1), dtype=torch.float32).view(WORLD * BATCH, 16)
        y = torch.tensor(values(WORLD * BATCH * 8, 0.9 * s + 0.4), dtype=torch.float32).view(WORLD * BATCH, 8)
        x, y = x.to(dtype), y.to(dtype)
        inputs.append({"x": x.reshape(-1).tolist(), "y": y.reshape(-1).tolist()})
        model.zero_grad()
        out_ = ddp(x[rank * BATCH:(rank + 1) * BATCH])
        torch.nn.functional.mse_loss(out_, y[rank * BATCH:(rank + 1) * BATCH]).backward()
        steps.append({name: p.grad.reshape(-1).tolist() for name, p in model.named_parameters()})
    if rank == 0:
        out[rank_r] = {"params": params, "inputs": inputs, "initial_q": qs_given, "grads": steps}
    dist.destroy_process_group()


def main():
    result = {"torch": torch.__version__, "world": WORLD, "steps": STEPS, "batch": BATCH, "ranks": {}}
    with mp.Manager() as manager:
        for rank_r in (2, 4):
            out = manager.dict()
            mp.spawn(run, args=(rank_r, out, torch.float32), nprocs=WORLD)
            result["ranks"][str(rank_r)] = out[rank_r]
            # The same in float64: how far float32 arithmetic (torch's and
            # ours, which orthogonalize differently above rank 2) may stray.
            out64 = manager.dict()
            mp.spawn(run, args=(rank_r, out64, torch.float64), nprocs=WORLD)
            result["ranks"][str(rank_r)]["grads_float64"] = out64[rank_r]["grads"]
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "powersgd_torch.json"), "w") as f:
        json.dump(result, f, indent=None)
        f.write("\n")


if __name__ == "__main__":
    main()
