// The process environment: the one place gradlink calls getenv. Every GRADLINK_* variable is
// read through here, once per use site's first need, and mapped to options by ApplyEnvironment
// (include/gradlink/env.h, src/control/environment.cc); the variables and what they set:
// docs/operations.md, "Environment".
//
// Threads: any, but for SetIfUnset (setenv), which runs once per process before UCX starts.
// Errors: the parsers return kInvalidArgument naming the variable and its value.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "gradlink/status.h"

namespace gradlink::env {

// The variable's value; nullopt when it is unset or empty.
std::optional<std::string> Get(const char* name);
// The variable's value, empty included; nullopt only when it is unset.
std::optional<std::string> GetSet(const char* name);

// "NAME='value'" for every variable whose name starts with `prefix` (for errors that can only
// say which of them might be wrong: UCX's refusal of its configuration), sorted by name.
std::vector<std::string> Listed(std::string_view prefix);

// Sets the variable to `value` unless it is set (even to empty: the user's choice); true if
// this call set it. For the settings gradlink needs from a library it starts (UCX).
bool SetIfUnset(const char* name, const char* value);

// The parsers below take a set but empty variable for a malformed value (not for an unset one).

// A byte count: digits, optionally K/M/G (binary: 4K = 4096). nullopt when unset.
Result<std::optional<uint64_t>> Bytes(const char* name);
// The same syntax for a value from elsewhere (a flag); `what` names it in the error.
Result<uint64_t> ParseBytes(const std::string& what, const std::string& value);
// A whole number (may be negative). nullopt when unset.
Result<std::optional<int64_t>> Int(const char* name);
// A finite number. nullopt when unset.
Result<std::optional<double>> Number(const char* name);
// 1/true/yes/on or 0/false/no/off. nullopt when unset.
Result<std::optional<bool>> Flag(const char* name);
// Seconds (a number) as milliseconds. nullopt when unset.
Result<std::optional<std::chrono::milliseconds>> Seconds(const char* name);

}  // namespace gradlink::env
