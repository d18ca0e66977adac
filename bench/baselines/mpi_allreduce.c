/* mpi_allreduce: MPI_Allreduce (fp32 sum, in place) timed like gradlink-bench, every element of
 * every result checked against the exact expected sum. A baseline for bench/compare and for any
 * other launcher (e.g. ranks in network namespaces).
 *
 * Usage:
 *   mpirun -np N [mpirun flags] mpi_allreduce [-b MINBYTES] [-e MAXBYTES] [-f FACTOR]
 *                                           [-n ITERS] [--warmup W] [--corrupt]
 *     -b, --minbytes   smallest size in bytes, K/M/G suffixes (default 4K)
 *     -e, --maxbytes   largest size (default 64M)
 *     -f, --stepfactor size multiplier between rows, > 1 (default 4)
 *     -n, --iters      timed iterations per size (default 20)
 *     --warmup         untimed iterations per size (default 3)
 *     --corrupt        self-test of the checker: rank 0 changes one element of its result after
 *                      the collective, so the check must report it (and the exit status is 3)
 *   One host, shared memory, as root (Debian 12, Open MPI 4.1):
 *     mpirun --allow-run-as-root --oversubscribe -np 2 --mca pml ob1 --mca btl self,vader \
 *            build/bin/mpi_allreduce -b 4K -e 64M -f 4
 *   TCP instead: --mca btl self,tcp --mca btl_tcp_if_include lo (or the namespace's interface).
 *
 * Sizes run like gradlink-bench: bytes = max(b, 4), then bytes = max(bytes + 4, bytes * f) while
 * bytes <= e; count = bytes / 4 fp32 elements.
 *
 * Each iteration: refill the buffer with rank r's values v(i, r) = ((7i + 3r) mod 13) - 6 (small
 * integers: every sum is exact in fp32), MPI_Barrier, time MPI_Allreduce(MPI_IN_PLACE, SUM) on
 * each rank (CLOCK_MONOTONIC), then compare every element with sum over r of v(i, r) (computed
 * once per size by a scalar loop). The reported time of an iteration is rank 0's, as in
 * gradlink-bench.
 *
 * Output (stdout of rank 0): comment lines starting with '#', and one JSON object per size:
 *   {"system": "mpi", "ranks": N, "bytes": B, "count": C, "dtype": "fp32", "iters": I,
 *    "warmup": W, "time_us": MEAN, "min_us": MIN, "max_us": MAX, "algbw": GB/s, "busbw": GB/s,
 *    "wrong": WRONG_ELEMENTS_ALL_RANKS, "check": "OK" | "WRONG:n", "times_us": [each iteration]}
 * algbw = bytes / mean time, busbw = algbw * 2(N-1)/N (nccl-tests' all-reduce definitions).
 * Exit status: 0 when every element of every iteration on every rank was right, 3 when any was
 * wrong, 2 on bad arguments, 1 on any other error.
 */
#include <errno.h>
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now_us(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec / 1e3;
}

/* Parses "4096", "4K", "64M", "1G" (binary units). Returns 0 on a malformed value. */
static int parse_size(const char* s, uint64_t* out) {
  char* end = NULL;
  errno = 0;
  double v = strtod(s, &end);
  if (errno != 0 || end == s || v < 0) return 0;
  switch (*end | 0x20) {
    case 'k': v *= 1024.0; ++end; break;
    case 'm': v *= 1024.0 * 1024.0; ++end; break;
    case 'g': v *= 1024.0 * 1024.0 * 1024.0; ++end; break;
    default: break;
  }
  if (*end != '\0' && !((*end | 0x20) == 'b' && end[1] == '\0')) return 0;
  *out = (uint64_t)v;
  return 1;
}

static int parse_int(const char* s, int* out) {
  char* end = NULL;
  errno = 0;
  long v = strtol(s, &end, 10);
  if (errno != 0 || end == s || *end != '\0' || v < 0 || v > 1000000000L) return 0;
  *out = (int)v;
  return 1;
}

static float value(uint64_t i, int rank) { return (float)((int)((i * 7 + (uint64_t)rank * 3) % 13) - 6); }

typedef struct {
  uint64_t begin, end;
  double factor;
  int iters, warmup, corrupt;
} Config;

/* Returns NULL on success, else a message naming what was wrong. */
static const char* parse_args(int argc, char** argv, Config* c, char* err, size_t errlen) {
  for (int i = 1; i < argc; ++i) {
    const char* a = argv[i];
    const char* v = i + 1 < argc ? argv[i + 1] : NULL;
    int ok = 1;
    if (strcmp(a, "--corrupt") == 0) { c->corrupt = 1; continue; }
    if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) {
      snprintf(err, errlen, "usage: mpi_allreduce [-b MINBYTES] [-e MAXBYTES] [-f FACTOR] [-n ITERS] "
               "[--warmup W] [--corrupt]");
      return err;
    }
    if (v == NULL) {
      snprintf(err, errlen, "mpi_allreduce: unknown option or missing value: '%s'", a);
      return err;
    }
    if (strcmp(a, "-b") == 0 || strcmp(a, "--minbytes") == 0) ok = parse_size(v, &c->begin);
    else if (strcmp(a, "-e") == 0 || strcmp(a, "--maxbytes") == 0) ok = parse_size(v, &c->end);
    else if (strcmp(a, "-f") == 0 || strcmp(a, "--stepfactor") == 0) {
      char* end = NULL;
      c->factor = strtod(v, &end);
      ok = end != v && *end == '\0' && c->factor > 1.0;
    } else if (strcmp(a, "-n") == 0 || strcmp(a, "--iters") == 0) ok = parse_int(v, &c->iters) && c->iters > 0;
    else if (strcmp(a, "--warmup") == 0) ok = parse_int(v, &c->warmup);
    else {
      snprintf(err, errlen, "mpi_allreduce: unknown option '%s'", a);
      return err;
    }
    if (!ok) {
      snprintf(err, errlen, "mpi_allreduce: bad value '%s' for %s", v, a);
      return err;
    }
    ++i;
  }
  if (c->end < c->begin) {
    snprintf(err, errlen, "mpi_allreduce: -e (%llu) is smaller than -b (%llu)",
             (unsigned long long)c->end, (unsigned long long)c->begin);
    return err;
  }
  if (c->end > ((uint64_t)1 << 34)) {
    snprintf(err, errlen, "mpi_allreduce: -e %llu is over 16 GiB", (unsigned long long)c->end);
    return err;
  }
  return NULL;
}

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, n = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &n);

  Config c = {4096, 64u << 20, 4.0, 20, 3, 0};
  char err[256];
  if (parse_args(argc, argv, &c, err, sizeof(err)) != NULL) {
    if (rank == 0) fprintf(stderr, "%s\n", err);
    MPI_Finalize();
    return 2;
  }

  if (rank == 0) {
    printf("# mpi_allreduce: %d ranks, fp32 sum in place, %d iters, %d warmup\n", n, c.iters, c.warmup);
    printf("# busbw = algbw * 2(n-1)/n, as nccl-tests reports all-reduce\n");
    fflush(stdout);
  }
  double* times = malloc(sizeof(double) * (size_t)c.iters);
  if (times == NULL) {
    fprintf(stderr, "mpi_allreduce rank %d: out of memory\n", rank);
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  int all_ok = 1;
  uint64_t bytes = c.begin < 4 ? 4 : c.begin;
  while (bytes <= c.end) {
    const uint64_t count = bytes / 4;
    if (count > (uint64_t)INT32_MAX) {
      if (rank == 0) fprintf(stderr, "mpi_allreduce: %llu elements exceed MPI's int count\n", (unsigned long long)count);
      MPI_Abort(MPI_COMM_WORLD, 2);
    }
    float* buf = malloc(count * sizeof(float));
    float* mine = malloc(count * sizeof(float));
    float* expected = malloc(count * sizeof(float));
    if (buf == NULL || mine == NULL || expected == NULL) {
      fprintf(stderr, "mpi_allreduce rank %d: out of memory at %llu bytes\n", rank, (unsigned long long)bytes);
      MPI_Abort(MPI_COMM_WORLD, 1);
    }
    for (uint64_t i = 0; i < count; ++i) {
      mine[i] = value(i, rank);
      int sum = 0;
      for (int r = 0; r < n; ++r) sum += (int)((i * 7 + (uint64_t)r * 3) % 13) - 6;
      expected[i] = (float)sum;
    }
    unsigned long long wrong = 0;
    for (int it = 0; it < c.warmup + c.iters; ++it) {
      memcpy(buf, mine, count * sizeof(float));
      MPI_Barrier(MPI_COMM_WORLD);
      const double t0 = now_us();
      const int rc = MPI_Allreduce(MPI_IN_PLACE, buf, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      const double us = now_us() - t0;
      if (rc != MPI_SUCCESS) {
        fprintf(stderr, "mpi_allreduce rank %d: MPI_Allreduce of %llu bytes failed (%d)\n", rank,
                (unsigned long long)bytes, rc);
        MPI_Abort(MPI_COMM_WORLD, 1);
      }
      if (c.corrupt && rank == 0 && it == c.warmup) buf[count / 2] += 1.0f;
      for (uint64_t i = 0; i < count; ++i) wrong += buf[i] != expected[i];
      if (it >= c.warmup) times[it - c.warmup] = us;
    }
    unsigned long long wrong_all = 0;
    MPI_Reduce(&wrong, &wrong_all, 1, MPI_UNSIGNED_LONG_LONG, MPI_SUM, 0, MPI_COMM_WORLD);
    if (wrong != 0) {
      fprintf(stderr, "mpi_allreduce rank %d: %llu wrong elements at %llu bytes\n", rank, wrong,
              (unsigned long long)bytes);
    }
    if (rank == 0) {
      double total = 0, mn = 1e300, mx = 0;
      for (int i = 0; i < c.iters; ++i) {
        total += times[i];
        if (times[i] < mn) mn = times[i];
        if (times[i] > mx) mx = times[i];
      }
      const double mean = total / c.iters;
      const double algbw = (double)(count * 4) / (mean * 1e3);
      const double busbw = algbw * 2.0 * (n - 1) / n;
      char check[32];
      if (wrong_all == 0) snprintf(check, sizeof(check), "OK");
      else snprintf(check, sizeof(check), "WRONG:%llu", wrong_all);
      printf("{\"system\": \"mpi\", \"ranks\": %d, \"bytes\": %llu, \"count\": %llu, \"dtype\": \"fp32\", "
             "\"iters\": %d, \"warmup\": %d, \"time_us\": %.3f, \"min_us\": %.3f, \"max_us\": %.3f, "
             "\"algbw\": %.6f, \"busbw\": %.6f, \"wrong\": %llu, \"check\": \"%s\", \"times_us\": [",
             n, (unsigned long long)(count * 4), (unsigned long long)count, c.iters, c.warmup, mean, mn, mx,
             algbw, busbw, wrong_all, check);
      for (int i = 0; i < c.iters; ++i) printf("%s%.3f", i ? ", " : "", times[i]);
      printf("]}\n");
      fflush(stdout);
      if (wrong_all != 0) all_ok = 0;
    }
    free(buf);
    free(mine);
    free(expected);
    uint64_t next = (uint64_t)((double)bytes * c.factor);
    bytes = next > bytes + 4 ? next : bytes + 4;
  }
  free(times);
  /* Every rank exits with the same status. */
  MPI_Bcast(&all_ok, 1, MPI_INT, 0, MPI_COMM_WORLD);
  MPI_Finalize();
  return all_ok ? 0 : 3;
}
