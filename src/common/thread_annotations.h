// Clang's thread-safety analysis attributes (https://clang.llvm.org/docs/ThreadSafetyAnalysis.html),
// spelled as macros so that GCC, which has no such attributes, sees nothing.
//
// What they say, and what clang -Wthread-safety then checks at compile time:
//   GUARDED_BY(mu)        a field read or written only with `mu` held
//   PT_GUARDED_BY(mu)     what a pointer field points to, only with `mu` held
//   REQUIRES(mu)          a function called only with `mu` held (the `*Locked` functions)
//   REQUIRES_SHARED(mu)   ... with `mu` held at least shared
//   EXCLUDES(mu)          a function never called with `mu` held (it takes `mu` itself)
//   ACQUIRE / RELEASE     a function that takes / lets go of a capability (a lock's own lock())
//   TRY_ACQUIRE(ok)       takes it when it returns `ok`
//   ASSERT_CAPABILITY(mu) a check that `mu` is held, from which the analysis assumes it is
//   CAPABILITY("mutex")   a class that is a lock; SCOPED_CAPABILITY a class that holds one (RAII)
//   ACQUIRED_BEFORE/AFTER the lock order, checked with -Wthread-safety-beta only
//   NO_THREAD_SAFETY_ANALYSIS  a function the analysis skips: each use says why
//
// The build checks src/ with them: tests/thread_safety/check.py (ctest thread_safety_check).
// The locks that carry them are in common/mutex.h and worker/state_mutex.h.
#pragma once

#if defined(__clang__)
#define GRADLINK_THREAD_ANNOTATION(x) __attribute__((x))
#else
#define GRADLINK_THREAD_ANNOTATION(x)
#endif

#define CAPABILITY(x) GRADLINK_THREAD_ANNOTATION(capability(x))
#define SCOPED_CAPABILITY GRADLINK_THREAD_ANNOTATION(scoped_lockable)
#define GUARDED_BY(x) GRADLINK_THREAD_ANNOTATION(guarded_by(x))
#define PT_GUARDED_BY(x) GRADLINK_THREAD_ANNOTATION(pt_guarded_by(x))
#define ACQUIRED_BEFORE(...) GRADLINK_THREAD_ANNOTATION(acquired_before(__VA_ARGS__))
#define ACQUIRED_AFTER(...) GRADLINK_THREAD_ANNOTATION(acquired_after(__VA_ARGS__))
#define REQUIRES(...) GRADLINK_THREAD_ANNOTATION(requires_capability(__VA_ARGS__))
#define REQUIRES_SHARED(...) GRADLINK_THREAD_ANNOTATION(requires_shared_capability(__VA_ARGS__))
#define ACQUIRE(...) GRADLINK_THREAD_ANNOTATION(acquire_capability(__VA_ARGS__))
#define ACQUIRE_SHARED(...) GRADLINK_THREAD_ANNOTATION(acquire_shared_capability(__VA_ARGS__))
#define RELEASE(...) GRADLINK_THREAD_ANNOTATION(release_capability(__VA_ARGS__))
#define RELEASE_SHARED(...) GRADLINK_THREAD_ANNOTATION(release_shared_capability(__VA_ARGS__))
#define RELEASE_GENERIC(...) GRADLINK_THREAD_ANNOTATION(release_generic_capability(__VA_ARGS__))
#define TRY_ACQUIRE(...) GRADLINK_THREAD_ANNOTATION(try_acquire_capability(__VA_ARGS__))
#define TRY_ACQUIRE_SHARED(...) \
  GRADLINK_THREAD_ANNOTATION(try_acquire_shared_capability(__VA_ARGS__))
#define EXCLUDES(...) GRADLINK_THREAD_ANNOTATION(locks_excluded(__VA_ARGS__))
#define ASSERT_CAPABILITY(x) GRADLINK_THREAD_ANNOTATION(assert_capability(x))
#define ASSERT_SHARED_CAPABILITY(x) GRADLINK_THREAD_ANNOTATION(assert_shared_capability(x))
#define RETURN_CAPABILITY(x) GRADLINK_THREAD_ANNOTATION(lock_returned(x))
#define NO_THREAD_SAFETY_ANALYSIS GRADLINK_THREAD_ANNOTATION(no_thread_safety_analysis)
