// Counts the allocations (operator new) a thread makes while asked to. A test binary that uses
// it links allocation_counter.cc, which replaces the global operator new and delete with ones
// that count (malloc underneath): only in such binaries, never in a library.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>

namespace gradlink::test {

struct Allocations {
  uint64_t count = 0;   // how many
  size_t largest = 0;   // the largest one, in bytes
};

void StartCountingAllocations();       // this thread's, from now
Allocations StopCountingAllocations();  // what this thread allocated since the start

// What fn() allocates on the calling thread.
template <typename Fn>
Allocations AllocationsBy(Fn&& fn) {
  StartCountingAllocations();
  std::forward<Fn>(fn)();
  return StopCountingAllocations();
}

}  // namespace gradlink::test
