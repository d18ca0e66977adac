#include "gradlink/tensor.h"

namespace gradlink {

std::string_view DataTypeName(DataType t) {
  switch (t) {
    case DataType::kFloat32: return "fp32";
    case DataType::kFloat64: return "fp64";
    case DataType::kFloat16: return "fp16";
    case DataType::kBFloat16: return "bf16";
    case DataType::kInt32: return "int32";
    case DataType::kInt64: return "int64";
  }
  return "invalid";
}

std::optional<DataType> ParseDataType(std::string_view name) {
  for (uint8_t raw = 1; raw <= 6; ++raw) {
    auto t = static_cast<DataType>(raw);
    if (DataTypeName(t) == name) return t;
  }
  if (name == "float32" || name == "float") return DataType::kFloat32;
  if (name == "float64" || name == "double") return DataType::kFloat64;
  if (name == "float16" || name == "half") return DataType::kFloat16;
  if (name == "bfloat16") return DataType::kBFloat16;
  return std::nullopt;
}

}  // namespace gradlink
