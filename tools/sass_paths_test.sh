#!/bin/bash
# tools/sass_paths.py on a hand-written SASS listing (a stand-in cuobjdump
# prints it): a loop whose masked block is branched around, with a loop
# inside it, and a kernel the pattern leaves out. The full-tile iteration is
# the header (3), the inner loop's body once (2) and the tail (2): 7
# instructions, 2 tensor-core, not the masked block's 2 more. Then the
# exponentials among tensor-core instructions: one behind a barrier is not.
set -euo pipefail
tool=$1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cat >"$tmp/listing" <<'SASS'
	code for sm_90
		Function : _Z6kernelPf
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   LDSM.16.M88.4 R4, [R2] ;
        /*0020*/                   HMMA.16816.F32.BF16 R8, R4, R6, R8 ;
        /*0030*/              @P0 BRA 0x60 ;
        /*0040*/                   ISETP.GE.AND P1, PT, R3, 0x1, PT ;
        /*0050*/                   FSEL R8, R8, -INF , !P1 ;
        /*0060*/                   MUFU.EX2 R9, R8 ;
        /*0070*/              @P3 BRA 0x60 ;
        /*0080*/                   HMMA.16816.F32.BF16 R10, R4, R6, R10 ;
        /*0090*/              @P2 BRA 0x10 ;
        /*00a0*/                   EXIT ;
        /*00b0*/                   BRA 0xb0;
		Function : _Z5otherPf
        /*0000*/                   EXIT ;
		Function : _Z4softPf
        /*0000*/                   HMMA.16816.F32.BF16 R8, R4, R6, R8 ;
        /*0010*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0020*/                   MUFU.EX2 R9, R8 ;
        /*0030*/                   HMMA.16816.F32.BF16 R10, R4, R6, R10 ;
        /*0040*/                   MUFU.EX2 R9, R8 ;
        /*0050*/                   FADD R9, R9, R9 ;
        /*0060*/                   HMMA.16816.F32.BF16 R10, R4.reuse, R6, R10 ;
        /*0070*/                   HMMA.16816.F32.BF16 R12, R4, R7, R12 ;
        /*0080*/              @P2 BRA 0x0 ;
        /*0090*/                   EXIT ;
		Function : _Z5timedPf
        /*0000*/                   LDSM.16.M88.4 R4, [R2] ;                 /* 0x000000000204783b */
                                                                            /* 0x000e020000000000 */
        /*0010*/                   FADD R9, R9, R9 ;                        /* 0x0000000909097221 */
                                                                            /* 0x000fc40000000000 */
        /*0020*/                   HMMA.16816.F32.BF16 R8, R4, R6, R8 ;     /* 0x000000060408723c */
                                                                            /* 0x001fc20000000000 */
        /*0030*/              @P2 BRA 0x0 ;                                 /* 0xfffffffc00002947 */
                                                                            /* 0x000fca0000000000 */
        /*0040*/                   EXIT ;                                   /* 0x000000000000794d */
                                                                            /* 0x000fca0000000000 */
SASS
printf '#!/bin/bash\ncat %q\n' "$tmp/listing" >"$tmp/cuobjdump"
chmod +x "$tmp/cuobjdump"
out=$(python3 "$tool" --cuobjdump "$tmp/cuobjdump" fake.cubin '^kernel')
grep -q "^kernel(float\*)$" <<<"$out" || { echo "$out"; exit 1; }
grep -q "kernel: 12 instructions, 2 tensor-core" <<<"$out" || { echo "$out"; exit 1; }
grep -q "loop 0x0010-0x0090 (9 instructions): full-tile iteration 7 instructions, 2 tensor-core, 3.50 a tensor-core instruction (a loop inside counted once: 1)" <<<"$out" || { echo "$out"; exit 1; }
grep -q "    control 3, ldsm 1, mufu 1$" <<<"$out" || { echo "$out"; exit 1; }
# The MUFU between the two HMMAs is beside them; in soft(), the one behind
# a barrier is not, the one among the products is.
grep -q "    mufu beside tensor-core instructions: 1 of 1$" <<<"$out" || { echo "$out"; exit 1; }
out=$(python3 "$tool" --cuobjdump "$tmp/cuobjdump" fake.cubin '^soft')
grep -q "    mufu beside tensor-core instructions: 1 of 2$" <<<"$out" || { echo "$out"; exit 1; }
# Its products come one, one, then two in a row; one reuses a register.
grep -q "    tensor-core runs: 1.3 on average, 2 longest; 1 of 4 reuse an operand register$" <<<"$out" ||
  { echo "$out"; exit 1; }
if grep -q "other" <<<"$out"; then echo "$out"; exit 1; fi
# No control bits in kernel()'s listing: no issue model.
out=$(python3 "$tool" --cuobjdump "$tmp/cuobjdump" fake.cubin '^kernel')
if grep -q "one warp alone" <<<"$out"; then echo "$out"; exit 1; fi
# timed(): the LDSM (stall 1, sets scoreboard 0), the FADD (stall 2), the
# HMMA waiting on scoreboard 0 (it issues 33 cycles after the LDSM, having
# waited 30 of them), the branch (stall 5): 33 + 1 + 5 = 39 cycles a round;
# the stall counts alone sum to 9.
out=$(python3 "$tool" --cuobjdump "$tmp/cuobjdump" fake.cubin '^timed')
grep -q "    one warp alone: 39 cycles an iteration (stall counts 9, scoreboard waits 30)$" <<<"$out" ||
  { echo "$out"; exit 1; }
if out=$(python3 "$tool" --cuobjdump "$tmp/cuobjdump" fake.cubin 'nothing' 2>&1); then echo "accepted a pattern matching nothing"; exit 1; fi
grep -q "no kernel of fake.cubin matches 'nothing' (4 kernels)" <<<"$out" || { echo "$out"; exit 1; }
echo "sass_paths: ok"
