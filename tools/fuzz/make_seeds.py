#!/usr/bin/env python3
"""Writes the seed corpora of the fuzz targets (testdata/fuzz/<target>/ in
core/, data/ and distributed/): small valid inputs of every kind each parser
reads, plus the edge cases worth starting from. Re-run after a format
changes; libFuzzer grows its own corpus from these (tools/fuzz.sh)."""
import json
import os
import struct
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


def write(target_dir, name, data):
    d = os.path.join(ROOT, target_dir)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())


# ---- safetensors: u64 header length, JSON header, data section ----
def safetensors(tensors, metadata=None):
    header, data = {}, b""
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    if metadata is not None:
        header["__metadata__"] = metadata
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + data


def seeds_safetensors():
    t = "core/testdata/fuzz/safetensors_fuzz"
    write(t, "f32_2x3", safetensors([("w", "F32", [2, 3], struct.pack("<6f", *range(6)))]))
    write(t, "mixed_dtypes", safetensors([
        ("a", "F16", [2], b"\x00\x3c\x00\x40"),
        ("b", "BF16", [1, 2], b"\x80\x3f\x00\x40"),
        ("c", "I64", [1], struct.pack("<q", -7)),
        ("d", "U8", [3], b"\x01\x02\x03"),
        ("e", "BOOL", [2], b"\x00\x01"),
        ("f", "F64", [], struct.pack("<d", 2.5)),
        ("g", "I32", [0, 4], b""),
    ], metadata={"format": "pt", "note": "seed"}))
    write(t, "empty", safetensors([]))
    write(t, "nested_header", struct.pack("<Q", 64) + b"[" * 63 + b"]")


# ---- IDX / MNIST: first byte splits the rest into images and labels ----
def idx(type_code, dims, payload):
    return bytes([0, 0, type_code, len(dims)]) + b"".join(struct.pack(">I", d) for d in dims) + payload


def seeds_idx():
    t = "data/testdata/fuzz/idx_fuzz"
    images = idx(0x08, [3, 2, 2], bytes(range(12)))
    labels = idx(0x08, [3], bytes([0, 9, 4]))
    body = images + labels
    split = (len(images) * 255 + len(body) - 1) // len(body)
    write(t, "mnist_3x2x2", bytes([split]) + body)
    write(t, "mnist_bad_label", bytes([split]) + images + idx(0x08, [3], bytes([0, 10, 4])))
    write(t, "float_1d", bytes([255]) + idx(0x0D, [2], struct.pack(">2f", 1.5, -2.0)))
    write(t, "int_2d", bytes([255]) + idx(0x0C, [2, 1], struct.pack(">2i", 7, -7)))
    write(t, "zero_images", bytes([128]) + idx(0x08, [0, 28, 28], b""))


# ---- CIFAR-10: records of a label byte and 3x32x32 pixels ----
def seeds_cifar():
    t = "data/testdata/fuzz/cifar_fuzz"
    rec = lambda label: bytes([label]) + bytes((i * 7 + label) % 256 for i in range(3072))
    write(t, "one_file_two_records", b"\x00" + rec(3) + rec(9))
    write(t, "two_files", b"\x01" + rec(1) + rec(2))
    write(t, "truncated", b"\x00" + rec(5)[:1000])
    write(t, "bad_label", b"\x00" + rec(11))


# ---- trainer.json of the checkpoint fuzz fixture (SGD momentum, StepLR) ----
def seeds_checkpoint():
    t = "distributed/checkpoint/testdata/fuzz/checkpoint_fuzz"
    # What the fixture saves (EMBER_FUZZ_PRINT_SEED=1 bazel-bin/distributed/checkpoint/checkpoint_fuzz FILE).
    good = {
        "format": "ember-checkpoint", "version": 1,
        "optimizer": {"name": "SGD", "param_groups": [{"options": {
            "dampening": 0.0, "initial_lr": 0.1, "lr": 0.1, "maximize": 0.0, "momentum": 0.9, "nesterov": 0.0,
            "weight_decay": 0.0}, "params": [0, 1, 2, 3]}]},
        "scheduler": {"last_epoch": 1, "base_lrs": [0.1], "last_lr": [0.1]},
        "epoch": 3, "step": 30, "rng": {"seed": 0, "offset": 4}, "extra": {"sampler_seed": 1},
    }
    write(t, "good.json", json.dumps(good))
    write(t, "negative_epoch.json", json.dumps(dict(good, epoch=-1)))
    write(t, "no_optimizer.json", json.dumps(dict(good, optimizer=None)))
    write(t, "wrong_types.json", json.dumps(dict(good, step="30", extra=[1])))
    write(t, "deep.json", "[" * 300 + "]" * 300)


# ---- TCPStore wire: see store_fuzz.cc for what the first byte selects ----
def frame(body):
    return struct.pack("<I", len(body)) + body


def s(x):
    x = x if isinstance(x, bytes) else x.encode()
    return struct.pack("<I", len(x)) + x


def q(v):
    return struct.pack("<q", v)


def seeds_store():
    t = "distributed/store/testdata/fuzz/store_fuzz"
    SET, GET, ADD, CAS, CHECK, WAIT, DELETE, NUMKEYS, WAITW, HELLO, BYE, LOST = range(1, 13)
    server = {
        "set_get": frame(bytes([SET]) + s("k") + s("v")) + frame(bytes([GET]) + s("k") + q(100)),
        "add": frame(bytes([ADD]) + s("n") + q(5)) + frame(bytes([ADD]) + s("n") + q(-9)),
        "cas": frame(bytes([CAS]) + s("c") + s("") + s("x")) + frame(bytes([CAS]) + s("c") + s("x") + s("y")),
        "check_wait": frame(bytes([CHECK]) + struct.pack("<I", 2) + s("a") + s("b"))
        + frame(bytes([WAIT]) + struct.pack("<I", 1) + s("a") + q(10)),
        "delete_num": frame(bytes([DELETE]) + s("k")) + frame(bytes([NUMKEYS])),
        "workers": frame(bytes([WAITW]) + q(1) + q(10)),
        "hello_bye_lost": frame(bytes([HELLO]) + q(3)) + frame(bytes([LOST])) + frame(bytes([BYE])),
        "hello_then_close": frame(bytes([HELLO]) + q(7)) + frame(bytes([GET]) + s("never") + q(20)),
    }
    for name, data in server.items():
        write(t, "server_" + name, b"\x00" + data)
    opening = b"EMBRSTO1" + frame(s("fuzz"))
    write(t, "handshake_good", b"\x02" + opening + frame(bytes([NUMKEYS])))
    write(t, "handshake_wrong_token", b"\x02" + b"EMBRSTO1" + frame(s("nope")))
    client = {
        "ok_value": frame(b"\x00" + s("value")),
        "timeout": frame(b"\x01" + struct.pack("<I", 1) + s("key")),
        "error": frame(b"\x02" + s("something failed")),
        "rank_lost": frame(b"\x03" + struct.pack("<I", 1) + q(2) + s("127.0.0.1:4000") + q(12)),
        "short_body": frame(b"\x00" + struct.pack("<I", 100) + b"abc"),
    }
    for name, data in client.items():
        write(t, "client_" + name, b"\x01" + data)


if __name__ == "__main__":
    seeds_safetensors()
    seeds_idx()
    seeds_cifar()
    seeds_checkpoint()
    seeds_store()
    print("seed corpora written", file=sys.stderr)
