#!/usr/bin/env python3
"""Writes the seed corpora of the fuzz targets (valid frames and payloads, plus edge cases)."""
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
MAGIC = 0x314B4C47


def header(type_, flags=0, job=1, sender=0, key=0, partition=0, dtype=0, code=0, round_=0,
           count=0, payload=0, cookie=0):
    return struct.pack("<IBBHIIQIBBHQQQQ", MAGIC, 2, type_, flags, job, sender, key, partition,
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
# Weight, memory budget, available memory.
register = bytes([1]) + struct.pack("<i", -1) + s(b"host") + s(addr) + s(addr) + struct.pack("<dQQBH", 1.0, 0, 0, 0, 0)
# A server with placement weight 0.25, and (refused) weights out of range: 0, -1, NaN, inf, 1e7.
register_server = bytes([2]) + struct.pack("<i", -1) + s(b"srv") + s(addr) + s(addr) + struct.pack("<dQQBH", 0.25, 64 << 20, 8 << 30, 1, 9100)
register_bad_weights = [bytes([2]) + struct.pack("<i", -1) + s(b"srv") + s(addr) + s(addr) + struct.pack("<dQQBH", w, 0, 0, 0, 0)
                        for w in (0.0, -1.0, float("nan"), float("inf"), 1e7)]
welcome = struct.pack("<IIII", 0, 1, 1, 2) + bytes([1]) + struct.pack("<I", 0) + s(b"w") + s(addr) + s(addr) \
    + bytes([2]) + struct.pack("<I", 0) + s(b"s") + s(addr) + s(addr) + struct.pack("<Q", 0x1234)
declare = s(b"fc1.weight") + struct.pack("<Q", 4 << 20)
assign = s(b"t") + struct.pack("<I", 1) + struct.pack("<QQI", 0, 97, 0)
text = s(b"kMismatch: key 0x1 't'")
for i, (name, payload) in enumerate([("register", register), ("welcome", welcome),
                                     ("declare", declare), ("assign", assign), ("text", text)]):
    # The target's first byte picks the decoder (byte % 7); for assign, byte 3 means a total of
    # 97 elements on one server.
    data = bytes([i]) + payload
    write("messages", name, data)
write("messages", "register_server_weight", bytes([0]) + register_server)
for j, payload in enumerate(register_bad_weights):
    write("messages", "register_bad_weight_%d" % j, bytes([0]) + payload)
# Restart: a worker resuming (7 keys follow, 3 barriers entered and released, 3 server ids of
# which 1 lost), and one tensor's resume (its declaration and plan; byte 6: 97 elements, 1 server).
write("messages", "register_resume", bytes([0]) + bytes([1]) + struct.pack("<i", 0) + s(b"host") +
      s(addr) + s(addr) + struct.pack("<dQQBH", 1.0, 0, 0, 0, 0) + bytes([1]) +
      struct.pack("<IQQIII", 7, 3, 3, 3, 1, 1))
spec = struct.pack("<BBIII", 0, 0, 0, 0, 0)
full_declare = s(b"t") + struct.pack("<QIB", 0, 0, 0) + spec
full_assign = s(b"t") + struct.pack("<I", 1) + struct.pack("<QQI", 0, 97, 0) + bytes([0]) + spec
write("messages", "resume_key", bytes([6]) + s(full_declare) + bytes([1]) + s(full_assign))
# A stall report (byte 0: 7 + 8 * 3, 4 workers): key 5 partition 0 round 2, 61 s, rank 3
# missing, ranks 0-2 pushed.
write("messages", "stall_report", bytes([7 + 8 * 3]) + struct.pack("<I", 1) +
      struct.pack("<QIQQ", 5, 0, 2, 61000) + struct.pack("<II", 1, 3) +
      struct.pack("<IIII", 3, 0, 1, 2))

# ---- handshake_fuzz: byte 0 mode, then steps [op][len][payload]. The target's fixed secret,
# job hash, epoch and nonces (handshake_fuzz.cc) let honest transcripts be computed here.
import hashlib  # noqa: E402
import hmac  # noqa: E402

HS_SECRET = b"fuzz-job-secret-0123456789"
HS_JOB = 0x12345678
HS_EPOCH = 7
HS_NONCE_S = b"\x22" * 32  # the fuzzed server's nonce
HS_NONCE_C = b"\x11" * 32  # the fuzzed client's nonce


def hs_mac(label, role, rank, nc, ns):
    t = label + struct.pack("<I", HS_JOB) + nc + ns + struct.pack("<BiQ", role, rank, HS_EPOCH)
    return hmac.new(HS_SECRET, t, hashlib.sha256).digest()


def step(op, payload=b""):
    return bytes([op, len(payload)]) + payload


HELLO, CHALLENGE, PROOF, AUTHOK = 0, 1, 2, 3
SCHED, MEMBER = b"gradlink-v1 scheduler", b"gradlink-v1 member"


def hello(nc, role, rank):
    return step(HELLO, nc + struct.pack("<Bi", role, rank))


nc = b"\x33" * 32
handshake = {
    "server_honest": b"\x00" + hello(nc, 1, -1) + step(PROOF, hs_mac(MEMBER, 1, -1, nc, HS_NONCE_S)),
    "server_honest_server_rank5": b"\x00" + hello(nc, 2, 5) + step(PROOF, hs_mac(MEMBER, 2, 5, nc, HS_NONCE_S)),
    "server_after_done": b"\x00" + hello(nc, 1, 0) + step(PROOF, hs_mac(MEMBER, 1, 0, nc, HS_NONCE_S))
    + hello(nc, 1, 0),
    "server_reflected_mac": b"\x00" + hello(nc, 1, -1) + step(PROOF, hs_mac(SCHED, 1, -1, nc, HS_NONCE_S)),
    "server_wrong_proof": b"\x00" + hello(nc, 1, -1) + step(PROOF, b"\x00" * 32) + step(PROOF, b"\x00" * 32),
    "server_echo_nonce": b"\x00" + hello(HS_NONCE_S, 1, -1),
    "server_bad_role": b"\x00" + hello(nc, 3, -1),
    "server_bad_rank": b"\x00" + hello(nc, 1, -2),
    "server_short_hello": b"\x00" + step(HELLO, nc),
    "server_raw_type": b"\x00" + step(0x80 | 32, b"x" * 8),
}
for mode in (1, 3, 5, 7):
    role = 2 if mode & 2 else 1
    rank = 5 if mode & 4 else -1
    ns = b"\x44" * 32
    handshake["client_honest_%d" % mode] = bytes([mode]) + step(
        CHALLENGE, ns + hs_mac(SCHED, role, rank, HS_NONCE_C, ns)) + step(AUTHOK)
ns = b"\x44" * 32
good_challenge = step(CHALLENGE, ns + hs_mac(SCHED, 1, -1, HS_NONCE_C, ns))
handshake.update({
    "client_reflected_mac": b"\x01" + step(CHALLENGE, ns + hs_mac(MEMBER, 1, -1, HS_NONCE_C, ns)),
    "client_echo_nonce": b"\x01" + step(CHALLENGE, HS_NONCE_C + hs_mac(SCHED, 1, -1, HS_NONCE_C, HS_NONCE_C)),
    "client_start_twice": b"\x01" + step(0xff) + good_challenge,
    "client_no_start": b"\x09" + good_challenge + step(0xff) + good_challenge,
    "client_authok_payload": b"\x01" + good_challenge + step(AUTHOK, b"\x00"),
    "client_after_done": b"\x01" + good_challenge + step(AUTHOK) + step(AUTHOK),
})
for name, data in handshake.items():
    write("handshake", name, data)

# ---- server_fuzz: byte 0 ISA, then ops [op (partition << 4 | kind)] + operands. Partitions:
# 0 fp32[5] x3 workers, 1 int32[3] x1, 2 fp16[4] x2, 3 int32[7] x4 (server_fuzz.cc).
PARTS = [("<5f", 3), ("<3i", 1), ("<4e", 2), ("<7i", 4)]


def push(p, rank, flags=0, cookie=0, m_extra=b"", round_mode=0, dtype=None, count=None):
    m = rank | (round_mode << 3) | (0x20 if dtype is not None else 0) | (0x40 if count is not None else 0)
    out = bytes([p << 4 | 0, m, flags, cookie])
    if round_mode == 3:
        out += m_extra
    if dtype is not None:
        out += bytes([dtype])
    if count is not None:
        out += bytes([count])
    return out


def end_ok(p, rank, values):
    fmt = PARTS[p][0]
    return bytes([p << 4 | 1, rank]) + struct.pack(fmt, *values)


def end_fail(p, rank):
    return bytes([p << 4 | 2, rank])


def progress(p):
    return bytes([p << 4 | 3])


def send_done(p, slot):
    return bytes([p << 4 | 4, slot])


def gone(p, rank):
    return bytes([p << 4 | 5, rank])


def full_round(p, rnd, flags=0, order=None):
    fmt, w = PARTS[p]
    n = int(fmt[1:-1])
    out = b""
    for r in (order or range(w)):
        vals = [(r + 1) * (i + 1) * (1.5 if fmt[-1] in "fe" else 1) * (-1) ** (rnd + i) for i in range(n)]
        if fmt[-1] == "i":
            vals = [int(v) for v in vals]
        out += push(p, r, flags, cookie=r + 16 * rnd) + end_ok(p, r, vals) + progress(p)
    return out + b"".join(send_done(p, rnd % 2) for _ in range(w))


server = {}
for isa in range(4):
    for p in range(4):
        server["rounds_isa%d_p%d" % (isa, p)] = bytes([isa]) + full_round(p, 0) + full_round(p, 1, flags=1) \
            + full_round(p, 2, order=list(reversed(range(PARTS[p][1]))))
server["interleaved"] = b"\x00" + b"".join(full_round(p, 0) for p in range(4)) + full_round(0, 1, flags=1)
server["two_rounds_in_flight"] = b"\x00" + full_round(0, 0)[:-6] + full_round(0, 1) + send_done(0, 0) * 3 \
    + progress(0)
server["int32_overflow"] = b"\x00" + push(3, 0) + bytes([3 << 4 | 1, 0]) + struct.pack("<7i", *([2**31 - 1] * 7)) \
    + b"".join(push(3, r) + bytes([3 << 4 | 1, r]) + struct.pack("<7i", *([-(2**31)] * 7)) for r in (1, 2, 3)) \
    + progress(3)
server["fp32_nan_inf"] = b"\x00" + b"".join(
    push(0, r, 1) + bytes([1, r]) + struct.pack("<5I", 0x7fc00001 + r, 0x7f800000, 0xff800000, 0x80000000, 1)
    for r in range(3)) + progress(0)
server["mismatch_dtype"] = b"\x00" + push(0, 0) + end_ok(0, 0, [1] * 5) + push(0, 1, dtype=5) \
    + push(0, 2) + end_ok(0, 2, [2] * 5) + progress(0) + push(0, 1) + progress(0)
server["mismatch_count"] = b"\x00" + push(1, 0, count=4) + progress(1) + full_round(1, 1)
server["mismatch_flags"] = b"\x00" + push(2, 0, flags=1) + end_ok(2, 0, [1, 2, 3, 4]) + push(2, 1, flags=0) \
    + end_ok(2, 1, [1, 2, 3, 4]) + progress(2)
server["push_failed"] = b"\x00" + push(0, 0) + end_fail(0, 0) + push(0, 1) + end_ok(0, 1, [1] * 5) \
    + push(0, 2) + progress(0) + end_ok(0, 2, [3] * 5) + progress(0) + full_round(0, 1)
server["gone"] = b"\x00" + push(3, 0) + gone(3, 1) + gone(3, 1) + end_ok(3, 0, [1] * 7) + progress(3) \
    + push(3, 2) + end_ok(3, 2, [5] * 7) + push(3, 3) + end_ok(3, 3, [7] * 7) + progress(3) \
    + send_done(3, 0) * 4 + progress(3) + push(3, 0)
server["bad_headers"] = b"\x00" + push(0, 7) + push(0, 0, round_mode=1) + push(0, 0, round_mode=2) \
    + push(0, 0, round_mode=3, m_extra=b"\x05") + push(0, 0) + push(0, 0) + end_ok(0, 3, [0] * 5) \
    + send_done(0, 2) + send_done(0, 0) + gone(0, 3) + progress(0)
for name, data in server.items():
    write("server", name, data)
