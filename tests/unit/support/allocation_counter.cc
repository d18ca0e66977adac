// The counting allocator of allocation_counter.h: this binary's global operator new and delete.
#include "unit/support/allocation_counter.h"

#include <cstdlib>
#include <new>

namespace {
thread_local bool t_counting = false;
thread_local gradlink::test::Allocations t_seen;

void* Allocate(std::size_t n) {
  if (t_counting) {
    ++t_seen.count;
    if (n > t_seen.largest) t_seen.largest = n;
  }
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
}  // namespace

void* operator new(std::size_t n) { return Allocate(n); }
void* operator new[](std::size_t n) { return Allocate(n); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }

namespace gradlink::test {

void StartCountingAllocations() {
  t_seen = Allocations{};
  t_counting = true;
}

Allocations StopCountingAllocations() {
  t_counting = false;
  return t_seen;
}

}  // namespace gradlink::test
