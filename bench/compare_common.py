# What the compare scripts (fsdp_compare.py, tp_compare.py) share: the
# environment that returns freed memory to the OS the same way for both
# sides, and reading a peer script's JSON records out of its output.
import json

# Peak RSS measured alike for ours and the peer: glibc returns freed blocks
# above 64 KiB at once, and our caching allocator keeps nothing.
LOW_MEM_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "EMBER_CPU_CACHE_MB": "0"}


def peer_record(out, script):
    """Rank 0's record of `script` in a peer's output (its ranks print
    concurrently: two records may share a line); raises on its error record."""
    dec, pos, records = json.JSONDecoder(), 0, []
    while (start := out.find("{", pos)) >= 0:
        try:
            d, pos = dec.raw_decode(out, start)
            records.append(d)
        except json.JSONDecodeError:
            pos = start + 1
    for d in records:
        if d.get("script") == script:
            if d.get("kind") == "error":
                raise RuntimeError(d["error"])
            if d.get("rank") == 0:
                return d
    raise RuntimeError("no result from the peer:\n" + out)
