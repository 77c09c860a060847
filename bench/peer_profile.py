"""One profiled step of a PyTorch peer (resnet50_cuda_peer.py,
gpt_cuda_peer.py) as the lines bench/gpu_perf_summary.py reads: the top ops
by self device time (torch.profiler with CUDA activity; self CPU time with
--device cpu, gpu_perf.sh --smoke), and the step's kernel launches.

  rows, launches = profile_step(step, device, top)
  for r in rows: print(f"torch_op {tags} {op_fields(r)}")
"""
import torch


def profile_step(step, device, top):
    """Runs step() once under torch.profiler. Returns the top `top` ops as
    dicts (calls, self_ms, total_ms, name) by self device time (CPU time on a
    CPU), and on CUDA (kernels, copies) launched, else None."""
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        step()
    launches = None
    if device == "cuda":
        # Kernel launches (and copies) of the step, beside ours (the launch
        # budgets of bench/step_counts_test.cc).
        dev_events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        copies = sum(1 for e in dev_events if e.name.startswith("Memcpy") or e.name.startswith("Memset"))
        launches = (len(dev_events) - copies, copies)
    avgs = prof.key_averages()
    # torch 2.4+ names device time self_device_time_total (the cuda_ names
    # are deprecated, then gone); 1.13 has only the cuda_ ones.
    dev = "device" if avgs and hasattr(avgs[0], "self_device_time_total") else "cuda"
    key, total_key = ((f"self_{dev}_time_total", f"{dev}_time_total") if device == "cuda"
                      else ("self_cpu_time_total", "cpu_time_total"))
    rows = sorted(avgs, key=lambda e: getattr(e, key, 0), reverse=True)[:top]
    return [{"calls": e.count, "self_ms": getattr(e, key, 0) / 1e3, "total_ms": getattr(e, total_key, 0) / 1e3,
             "name": e.key} for e in rows], launches


def op_fields(r):
    """A row as gpu_perf_summary.py's fields (name= last: it takes the rest)."""
    return f"calls={r['calls']} self_ms={r['self_ms']:.3f} total_ms={r['total_ms']:.3f} name={r['name']}"
