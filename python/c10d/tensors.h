// python/c10d/: how torch tensors reach gradlink's worker (dtypes, flat buffers, staging
// copies, reductions) and the errors that reach Python, for the process group's collectives
// (process_group.cc, collectives.cc).
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "gradlink/collective.h"
#include "gradlink/tensor.h"

namespace gradlink::c10d {

// Reaches Python as RuntimeError with this message.
[[noreturn]] void Fail(const std::string& message);

// The gradlink element type of a torch dtype, if it has one.
std::optional<DataType> Native(at::ScalarType t);

// Defined, strided and on the CPU, else Fail() naming `what`.
void CheckTensor(const at::Tensor& t, const std::string& what);

// The one tensor of a per-process list (checked), else Fail().
const at::Tensor& One(std::vector<at::Tensor>& tensors, const char* what);

// A tensor as gradlink moves it: a contiguous 1-D buffer of a gradlink dtype, a view of the
// caller's tensor where it can be, else a staging copy to write back once the result is in.
struct Buffer {
  at::Tensor flat;
  DataType dtype = DataType::kFloat32;
  at::Tensor back;       // defined: copy `flat` into it when done (a staging copy)
  bool bitwise = false;  // a routing buffer: its bytes are the tensor's (else its values)
  bool widened = false;  // 1-byte elements moved as 2-byte ones (a routing buffer)

  uint64_t count() const { return static_cast<uint64_t>(flat.numel()); }
  void WriteBack() const {
    if (!back.defined()) return;
    back.copy_(Restore(flat, back.scalar_type(), bitwise, widened).view(back.sizes()));
  }
  // `part` of a buffer as the tensor's dtype: its bytes (routing), or its values.
  static at::Tensor Restore(const at::Tensor& part, at::ScalarType t, bool bitwise, bool widened) {
    if (!bitwise) return part;
    if (widened) return part.view(at::kShort).to(at::kByte).view(t);
    return part.view(t);
  }
};

// For a reduction: the values themselves (integers and bools without a gradlink dtype widened
// to int32); Fail() for what cannot be reduced.
Buffer ReduceBuffer(const at::Tensor& t, const std::string& what);

// For routing (broadcast, gathers, scatter, all-to-all): the bytes, moved bit for bit.
Buffer RouteBuffer(const at::Tensor& t);

// Elements of a routing buffer per element of `t`.
uint64_t RouteScale(const at::Tensor& t);

struct OpOf {
  ReduceOp op = ReduceOp::kSum;
  bool average = false;
  const char* name = "sum";
};

// The gradlink reduction of a torch ReduceOp; Fail() for those gradlink has not.
OpOf Reduction(const ::c10d::ReduceOp& op, const std::string& what);

// A count list for a key's name (hashed when long).
std::string Join(const std::vector<uint64_t>& v);

// A tensor's bytes as elements of `d`.
std::span<std::byte> Bytes(const at::Tensor& t, DataType d);

}  // namespace gradlink::c10d
