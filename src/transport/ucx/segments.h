// The TCP segment sizes of a process's UCX, carried in each lane address so that a process
// never sends a peer a segment larger than the peer receives: UCX asserts on such a segment and
// aborts the receiver (tcp_ep.c: "hdr->length <= rx_seg_size"), which gradlink may not let
// happen on peer input. gradlink sets both segments to 68 KiB (context.cc), so a 64 KiB
// partition travels in one; members whose settings differ (a user's UCX_TCP_*_SEG_SIZE on some
// of them, or an older build, which receives UCX's default 64 KiB) are refused at Connect()
// with a clear error instead.
//
// Pure functions; the address trailer is 4 magic bytes, then the receive and the send segment
// as little-endian u32s, appended to UCX's worker address.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "gradlink/status.h"

namespace gradlink::transport::ucx {

struct Segments {
  uint64_t send = 0;     // the largest segment this process sends: max(TX_SEG_SIZE, RX_SEG_SIZE)
  uint64_t receive = 0;  // RX_SEG_SIZE: the largest it takes. 0 in either: unknown
};

// A UCX memory-units value ("68k", "65536", "1m", "64KB"); nullopt when it is not a plain size
// ("inf", "auto", empty, malformed).
std::optional<uint64_t> ParseUcxSize(std::string_view value);

// From UCX_TCP_TX_SEG_SIZE and UCX_TCP_RX_SEG_SIZE as they are set (UCX 1.13's defaults, 8 and
// 64 KiB, for one unset). UCX sends zero-copy segments up to its receive segment size and
// copied ones up to its send segment size, so `send` is the larger of the two.
Segments SegmentsOf(std::optional<std::string> tx, std::optional<std::string> rx);

// `address` with the trailer for `own` appended.
void AppendSegments(std::vector<std::byte>& address, const Segments& own);

// UCX's address (the trailer removed) and the peer's segments (nullopt: no trailer).
struct PeerAddress {
  std::span<const std::byte> ucx;
  std::optional<Segments> segments;
};
PeerAddress SplitSegments(std::span<const std::byte> address);

// kMismatch naming both sides' settings when `own` may send `peer` a segment larger than it
// receives; OK otherwise, and when either side's figures are unknown. A peer without the
// trailer (nullopt: an older build) receives UCX's default, 64 KiB.
Status CheckSegments(const Segments& own, const std::optional<Segments>& peer,
                     const std::string& peer_name);

}  // namespace gradlink::transport::ucx
