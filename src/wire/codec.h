// Bounds-checked little-endian encoding of control-frame payloads.
//
// Writer appends; Reader consumes and never reads past its span: every Get* returns false on
// truncation or an out-of-range length, after which the Reader stays failed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

namespace gradlink::wire {

class Writer {
 public:
  void U8(uint8_t v) { Raw(&v, 1); }
  void U16(uint16_t v) { Le(v); }
  void U32(uint32_t v) { Le(v); }
  void U64(uint64_t v) { Le(v); }
  void I32(int32_t v) { Le(static_cast<uint32_t>(v)); }
  // Length-prefixed (u32) byte string.
  void Bytes(std::span<const std::byte> b) {
    U32(static_cast<uint32_t>(b.size()));
    Raw(b.data(), b.size());
  }
  void Str(std::string_view s) { Bytes(std::as_bytes(std::span(s.data(), s.size()))); }

  std::vector<std::byte>& buffer() { return buf_; }
  std::vector<std::byte> Take() { return std::move(buf_); }

 private:
  template <typename T>
  void Le(T v) {
    std::byte b[sizeof(T)];
    for (size_t i = 0; i < sizeof(T); ++i) b[i] = std::byte((v >> (8 * i)) & 0xFF);
    Raw(b, sizeof(T));
  }
  void Raw(const void* p, size_t n) {
    const auto* c = static_cast<const std::byte*>(p);
    buf_.insert(buf_.end(), c, c + n);
  }
  std::vector<std::byte> buf_;
};

class Reader {
 public:
  explicit Reader(std::span<const std::byte> data) : data_(data) {}

  bool U8(uint8_t* v) { return Le(v); }
  bool U16(uint16_t* v) { return Le(v); }
  bool U32(uint32_t* v) { return Le(v); }
  bool U64(uint64_t* v) { return Le(v); }
  bool I32(int32_t* v) {
    uint32_t u;
    if (!Le(&u)) return false;
    *v = static_cast<int32_t>(u);
    return true;
  }
  // A length-prefixed byte string of at most `max_len` bytes.
  bool Bytes(std::vector<std::byte>* out, uint32_t max_len) {
    uint32_t n;
    if (!U32(&n) || n > max_len || n > remaining()) return Fail();
    out->assign(data_.begin() + pos_, data_.begin() + pos_ + n);
    pos_ += n;
    return true;
  }
  bool Str(std::string* out, uint32_t max_len) {
    uint32_t n;
    if (!U32(&n) || n > max_len || n > remaining()) return Fail();
    out->assign(reinterpret_cast<const char*>(data_.data()) + pos_, n);
    pos_ += n;
    return true;
  }
  size_t remaining() const { return ok_ ? data_.size() - pos_ : 0; }
  bool ok() const { return ok_; }
  // True when everything was consumed and nothing failed.
  bool Done() const { return ok_ && pos_ == data_.size(); }

 private:
  bool Fail() {
    ok_ = false;
    return false;
  }
  template <typename T>
  bool Le(T* v) {
    if (!ok_ || remaining() < sizeof(T)) return Fail();
    T r = 0;
    for (size_t i = 0; i < sizeof(T); ++i) r |= T(std::to_integer<uint8_t>(data_[pos_ + i])) << (8 * i);
    *v = r;
    pos_ += sizeof(T);
    return true;
  }
  std::span<const std::byte> data_;
  size_t pos_ = 0;
  bool ok_ = true;
};

}  // namespace gradlink::wire
