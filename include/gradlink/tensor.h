// Element types that gradlink can sum, and their sizes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

#include "gradlink/export.h"

namespace gradlink {

// Values are stable: they travel on the wire.
enum class DataType : uint8_t {
  kFloat32 = 1,
  kFloat64 = 2,
  kFloat16 = 3,   // IEEE binary16; summed in fp32, returned as fp16
  kBFloat16 = 4,  // bfloat16; summed in fp32, returned as bf16
  kInt32 = 5,
  kInt64 = 6,
};

// Bytes per element; 0 for a value that is not a DataType.
constexpr size_t DataTypeSize(DataType t) {
  switch (t) {
    case DataType::kFloat32: return 4;
    case DataType::kFloat64: return 8;
    case DataType::kFloat16: return 2;
    case DataType::kBFloat16: return 2;
    case DataType::kInt32: return 4;
    case DataType::kInt64: return 8;
  }
  return 0;
}

constexpr bool IsValidDataType(uint8_t raw) { return raw >= 1 && raw <= 6; }

// "fp32", "fp64", "fp16", "bf16", "int32", "int64".
GRADLINK_EXPORT std::string_view DataTypeName(DataType t);
GRADLINK_EXPORT std::optional<DataType> ParseDataType(std::string_view name);

// fp16 / bf16 <-> fp32, exactly as the servers convert (round to nearest even; NaN stays NaN),
// for filling and checking 16-bit tensors.
GRADLINK_EXPORT float HalfToFloat(uint16_t h);
GRADLINK_EXPORT uint16_t FloatToHalf(float f);
GRADLINK_EXPORT float BFloat16ToFloat(uint16_t b);
GRADLINK_EXPORT uint16_t FloatToBFloat16(float f);

}  // namespace gradlink
