// GRADLINK_EXPORT: marks what libgradlink.so exports. gradlink's own code is compiled with
// -fvisibility=hidden (CMakeLists.txt), so a class or function of include/gradlink/ without it
// stays inside the library; tests/install/check_exports.py checks that the library exports the
// names these headers declare and nothing else.
//
// As LevelDB's LEVELDB_EXPORT: a user may define GRADLINK_EXPORT to override it. On ELF the
// attribute is the same for the library and its users (default visibility), so users need
// define nothing. The standard attribute syntax, so that it goes beside [[nodiscard]] and
// [[noreturn]] (GCC takes no __attribute__ between those and the name).
#pragma once

#if !defined(GRADLINK_EXPORT)
#if defined(__GNUC__) || defined(__clang__)
#define GRADLINK_EXPORT [[gnu::visibility("default")]]
#else
#define GRADLINK_EXPORT
#endif
#endif  // !defined(GRADLINK_EXPORT)
