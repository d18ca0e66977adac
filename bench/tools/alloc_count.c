// LD_PRELOAD=alloc_count.so: counts this process's malloc/calloc/realloc/aligned allocations
// (operator new goes through malloc in libstdc++). With $ALLOC_COUNT_FILE set, each SIGUSR1
// appends the count so far to that file, one line each. bench/server_path.py runs each server
// under it and signals it twice while the workers' rounds run: the difference is the steady
// state's allocations over that window.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>

static atomic_ulong count;
static void* (*real_malloc)(size_t);
static void* (*real_calloc)(size_t, size_t);
static void* (*real_realloc)(void*, size_t);
static int (*real_memalign)(void**, size_t, size_t);

// dlsym may call calloc before real_calloc is known: serve it from a small static arena.
static char early[4096];
static size_t early_used;

static void init(void) {
  if (real_malloc) return;
  real_malloc = dlsym(RTLD_NEXT, "malloc");
  real_calloc = dlsym(RTLD_NEXT, "calloc");
  real_realloc = dlsym(RTLD_NEXT, "realloc");
  real_memalign = dlsym(RTLD_NEXT, "posix_memalign");
}

void* malloc(size_t n) {
  init();
  atomic_fetch_add_explicit(&count, 1, memory_order_relaxed);
  return real_malloc(n);
}

void* calloc(size_t a, size_t b) {
  if (!real_calloc) {
    if (real_malloc == NULL && early_used + a * b <= sizeof(early)) {
      void* p = early + early_used;
      early_used += (a * b + 15) & ~(size_t)15;
      return p;
    }
    init();
  }
  atomic_fetch_add_explicit(&count, 1, memory_order_relaxed);
  return real_calloc(a, b);
}

void* realloc(void* p, size_t n) {
  init();
  atomic_fetch_add_explicit(&count, 1, memory_order_relaxed);
  return real_realloc(p, n);
}

int posix_memalign(void** out, size_t align, size_t n) {
  init();
  atomic_fetch_add_explicit(&count, 1, memory_order_relaxed);
  return real_memalign(out, align, n);
}

void* aligned_alloc(size_t align, size_t n) {
  void* p = NULL;
  return posix_memalign(&p, align < sizeof(void*) ? sizeof(void*) : align, n) == 0 ? p : NULL;
}

static int out_fd = -1;

static void on_usr1(int sig) {
  (void)sig;
  char buf[32];
  unsigned long v = atomic_load(&count);
  int i = sizeof(buf);
  buf[--i] = '\n';
  do {
    buf[--i] = (char)('0' + v % 10);
    v /= 10;
  } while (v != 0 && i > 0);
  if (out_fd >= 0) (void)!write(out_fd, buf + i, sizeof(buf) - i);
}

__attribute__((constructor)) static void setup(void) {
  const char* path = getenv("ALLOC_COUNT_FILE");
  if (!path) return;
  out_fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_APPEND | O_CLOEXEC, 0644);
  struct sigaction sa = {0};
  sa.sa_handler = on_usr1;
  sa.sa_flags = SA_RESTART;
  sigaction(SIGUSR1, &sa, NULL);
}
