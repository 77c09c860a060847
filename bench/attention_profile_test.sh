#!/bin/bash
# bench/attention_profile.py against a stand-in ncu (CI has no GPU and no
# Nsight Compute): it records how it was called, writes an empty report and
# prints hand-written raw and SASS pages, ours with the forward and backward
# kernels, PyTorch's with FlashAttention-2's four kernels of a step (the
# summary must take flash_fwd_kernel and the dq_dk_dv one, not the shorter
# dot_do_o and convert_dq). Checks the TFLOP/s from the duration in its base
# unit, the stall shares (PC samples, not-issued duplicates left out), the
# per-kernel SASS tables and what ncu was asked.
set -euo pipefail
tool=$1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cat >"$tmp/ncu" <<'NCU'
#!/bin/bash
# A stand-in for Nsight Compute's ncu.
echo "$*" >>"$(dirname "$0")/calls"
if [ "$1" = --import ]; then
  rep=$2 page=$4
  case $(basename "$rep") in ours_*) side=ours ;; *) side=torch ;; esac
  cat "$(dirname "$0")/${side}_$page.csv" 2>/dev/null
  exit 0
fi
while [ $# -gt 0 ]; do
  if [ "$1" = -o ]; then : >"$2.ncu-rep"; fi
  shift
done
NCU
chmod +x "$tmp/ncu"
H='"ID","Process ID","Process Name","Host Name","Kernel Name","gpu__time_duration.sum","smsp__issue_active.avg.pct_of_peak_sustained_active","launch__registers_per_thread","sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active","smsp__pcsamp_warps_issue_stalled_long_scoreboard","smsp__pcsamp_warps_issue_stalled_long_scoreboard_not_issued","smsp__pcsamp_warps_issue_stalled_barrier","l1tex__t_bytes_pipe_lsu_mem_local_op_st.sum"'
U='"","","","","","nsecond","%","register/thread","%","","","","byte"'
cat >"$tmp/ours_raw.csv" <<CSV
==PROF== Disconnected from process 1
$H
$U
"0","1","attention_cuda_bench","h","flash_forward_kernel","1,000,000","41.5","255","30.25","30","29","10","4,096"
"1","1","attention_cuda_bench","h","flash_backward_kernel","5,000,000","38","255","25","5","5","15","0"
CSV
# PyTorch's page in the long form (a row a metric), as the details page
# prints them: the summary turns it wide.
L='"ID","Process ID","Process Name","Host Name","Kernel Name","Section Name","Metric Name","Metric Unit","Metric Value"'
{
  echo "$L"
  n=0
  for k in "flash_fwd_kernel 500,000 60 55 10 30" "flash_bwd_dot_do_o_kernel 20,000 10 0 1 0" \
    "flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel 2,000,000 55 50 3 9" "flash_bwd_convert_dq_kernel 30,000 10 0 1 0"; do
    set -- $k
    for m in "gpu__time_duration.sum,nsecond,$2" "smsp__issue_active.avg.pct_of_peak_sustained_active,%,$3" \
      "launch__registers_per_thread,register/thread,255" \
      "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,%,$4" \
      "smsp__pcsamp_warps_issue_stalled_long_scoreboard,,$5" "smsp__pcsamp_warps_issue_stalled_long_scoreboard_not_issued,,$5" \
      "smsp__pcsamp_warps_issue_stalled_barrier,,$6" "l1tex__t_bytes_pipe_lsu_mem_local_op_st.sum,byte,0"; do
      IFS=, read -r name unit value <<<"${m/2,000,000/2000000}"
      value=${value/500,000/500000}
      echo "\"$n\",\"2\",\"python3\",\"h\",\"$1\",\"s\",\"$name\",\"$unit\",\"$value\""
    done
    n=$((n + 1))
  done
} >"$tmp/torch_raw.csv"
S='"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)","stall_long_sb","stall_long_sb (Not Issued)","stall_barrier"'
cat >"$tmp/ours_source.csv" <<CSV
"Kernel Name","flash_forward_kernel"
$S
"0x10","LDSM.16.M88.4 R4, [R2]","5","5","0","0","0"
"0x20","HMMA.16816.F32.BF16 R8, R4, R6, R8","30","28","27","27","0"
"0x30","BAR.SYNC.DEFER_BLOCKING 0x0","15","15","0","0","15"
"Kernel Name","flash_backward_kernel"
$S
"0x10","@P0 BAR.SYNC 0x0","40","40","0","0","40"
"0x20","HMMA.16816.F32.BF16 R8, R4, R6, R8","10","10","5","5","0"
CSV
mkdir "$tmp/out"
out=$(python3 "$tool" --ncu "$tmp/ncu" --ours "bench --x" --dir "$tmp/out" --json "$tmp/p.json")
fail() { echo "$out"; echo "attention_profile_test: $*"; exit 1; }
# Three configurations, ours and torch's each: 6 profiles, 3 pages each.
[ "$(grep -c -- ' -o ' "$tmp/calls")" = 6 ] || fail "not 6 profiles: $(cat "$tmp/calls")"
[ "$(grep -c -- '^--import ' "$tmp/calls")" = 18 ] || fail "not 18 page exports"
grep -q -- "--clock-control none .*--set full .*--kernel-name regex:flash_(forward|backward)_kernel --launch-skip 2 --launch-count 2 bench --x --benchmark_filter=^BM_Attention/128/0/1/1/0/0/0/0/$" "$tmp/calls" || fail "ours' call"
grep -q -- "--profile-from-start off --launch-count 12 .*torch_step.py 64 1$" "$tmp/calls" || fail "torch's call"
[ -z "$(ls "$tmp/out"/*.ncu-rep 2>/dev/null)" ] || fail "reports left behind"
python3 - "$tmp/p.json" <<'PY' || fail "summary"
import json, sys
doc = json.load(open(sys.argv[1]))
rows = {r["name"]: r for r in doc["rows"]}
assert list(rows) == ["d64 causal", "d128 causal", "d128"], list(rows)
r = rows["d64 causal"]
# 4 b h T^2 d / 2 = 137.4 GFLOP in 1 ms (1,000,000 ns): 137.4 TFLOP/s.
assert r["ours_fwd"]["duration_us"] == 1000.0 and r["ours_fwd"]["tflops"] == 137.4, r["ours_fwd"]
assert r["torch_fwd"]["tflops"] == 274.9 and r["torch_fwd"]["kernel"] == "flash_fwd_kernel", r["torch_fwd"]
assert r["torch_bwd"]["kernel"].startswith("flash_bwd_dq_dk_dv"), r["torch_bwd"]
assert r["ours_bwd"]["tflops"] == round(137.4e9 * 2.5 / 5e-3 / 1e12, 1), r["ours_bwd"]
assert r["ours_fwd"]["stall_share"] == {"long_scoreboard": 0.75, "barrier": 0.25}, r["ours_fwd"]["stall_share"]
assert r["ours_fwd"]["issue_active_pct"] == 41.5 and r["ours_fwd"]["registers_per_thread"] == 255
assert r["ours_fwd"]["local_store_bytes"] == 4096 and r["torch_fwd"]["local_store_bytes"] == 0
assert list(r["ours_fwd"]["tensor_pipe_pct"].values()) == [30.25]
sass = r["ours_fwd"]["sass"]
assert sass["samples"] == 50 and sass["by_opcode"]["HMMA.16816.F32.BF16"] == 0.6, sass
assert sass["top_instructions"][0]["stalls"] == ["long_sb 27"], sass["top_instructions"][0]
assert r["ours_bwd"]["sass"]["by_opcode"]["BAR.SYNC"] == 0.8, r["ours_bwd"]["sass"]
# PyTorch's SASS page is missing here: no tables to pair with its kernels.
assert "sass" not in r["torch_fwd"]
PY
grep -q "issue_active_pct .* 41.5 .* 60.0" <<<"$out" || fail "table"
# A directory without pages is an error, not an empty summary.
mkdir "$tmp/empty"
if python3 "$tool" --summarize "$tmp/empty" >/dev/null 2>&1; then fail "accepted an empty directory"; fi
echo "attention_profile: ok"
