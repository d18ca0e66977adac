#!/usr/bin/env python3
"""Writes the seed corpora of the fuzz targets (valid frames and payloads, plus edge cases)."""
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
MAGIC = 0x314B4C47


def header(type_, flags=0, job=1, sender=0, key=0, partition=0, dtype=0, code=0, round_=0,
           count=0, payload=0, cookie=0):
    return struct.pack("<IBBHIIQIBBHQQQQ", MAGIC, 1, type_, flags, job, sender, key, partition,
                       dtype, code, 0, round_, count, payload, cookie)


def s(b):
    return struct.pack("<I", len(b)) + b


def write(folder, name, data):
    os.makedirs(os.path.join(HERE, "corpus", folder), exist_ok=True)
    with open(os.path.join(HERE, "corpus", folder, name), "wb") as f:
        f.write(data)


frames = {
    "register": header(1, payload=40),
    "push_fp32": header(32, dtype=1, count=1024, payload=4096, round_=7, cookie=9),
    "push_fp16_avg": header(32, flags=1, dtype=3, count=3, payload=6),
    "pull": header(33, dtype=6, count=2, payload=16),
    "data_error": header(34, code=5, payload=20),
    "abort": header(10, code=3, payload=12),
    "huge_count": header(32, dtype=1, count=(1 << 64) - 1, payload=(1 << 64) - 4),
    "truncated": header(32)[:40],
}
for name, data in frames.items():
    write("frame", name, data)

addr = b"\x01\x02\x03\x04"
register = bytes([1]) + struct.pack("<i", -1) + s(b"host") + s(addr) + s(addr)
welcome = struct.pack("<IIII", 0, 1, 1, 2) + bytes([1]) + struct.pack("<I", 0) + s(b"w") + s(addr) + s(addr) \
    + bytes([2]) + struct.pack("<I", 0) + s(b"s") + s(addr) + s(addr)
declare = s(b"fc1.weight") + struct.pack("<Q", 4 << 20)
assign = s(b"t") + struct.pack("<I", 1) + struct.pack("<QQI", 0, 97, 0)
text = s(b"kMismatch: key 0x1 't'")
for i, (name, payload) in enumerate([("register", register), ("welcome", welcome),
                                     ("declare", declare), ("assign", assign), ("text", text)]):
    # The target's first byte picks the decoder (byte % 5); for assign, byte 3 means a total of
    # 97 elements on one server.
    data = bytes([i]) + payload
    write("messages", name, data)
