# gradlink: `make demo` runs the main job, `make test` builds and runs every test.
# Both install what is missing first (Debian 12, as root).

BUILD ?= build
JOBS ?= 2
CMAKE_FLAGS ?=

.PHONY: all setup build test test-install test-arm test-torch2 demo bench bench-scale compare bench-reduce netcluster train-cluster fuzz soak test-asan test-tsan clean

all: build

# Where scripts/ucx/build.sh installs the UCX gradlink links (Debian's, with its wireup fixes).
GRADLINK_UCX_PREFIX ?= $(HOME)/.cache/gradlink/ucx-1.13.1-gl1
export GRADLINK_UCX_PREFIX

setup:
	@scripts/setup.sh

$(BUILD)/CMakeCache.txt: CMakeLists.txt | setup
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=RelWithDebInfo -DGRADLINK_UCX_PREFIX=$(GRADLINK_UCX_PREFIX) $(CMAKE_FLAGS)

build: setup $(BUILD)/CMakeCache.txt
	cmake --build $(BUILD) -j$(JOBS)

test: build
	cd $(BUILD) && ctest --output-on-failure --timeout 600 -j$(JOBS)

# The pip routes (README, "Installing"): `pip install .` into a fresh venv, the job run with the
# checkout and ~/.cache/gradlink hidden, then `pip wheel .` installed into another venv. Builds
# gradlink again in build-pip/ (minutes); needs root (unshare). tests/install/pip_test.sh.
# With ccache (make setup installs it) the pip build reuses what build/ compiled: the same
# sources and flags; the debug information's directory, which it then misnames, is stripped.
test-install: setup
	CMAKE_CXX_COMPILER_LAUNCHER=$$(command -v ccache || true) CCACHE_NOHASHDIR=true \
	  tests/install/pip_test.sh

# The main job: a small transformer language model trained by 2 workers through 2 aggregation
# servers (gradlink-run starts the scheduler, servers and workers), then a check that the
# distributed parameters equal single-process training on the global batch.
DEMO_STEPS ?= 60
demo: build
	$(BUILD)/bin/gradlink-run -n 2 -s 2 -- .venv/bin/python examples/train_lm.py --steps $(DEMO_STEPS) --check

# push_pull bandwidth sweep like nccl-tests (2 workers, 2 servers), every element checked.
bench: build
	$(BUILD)/bin/gradlink-bench -w 2 -s 2 -b 4K -e 64M -f 4 -n 10

# Scale: one job of 256 gradlink-bench workers x 4 servers as processes (every element checked),
# then the scheduler's control plane alone with 1,000 and 4,000 members (join, 100 key plans,
# 10 barriers, shutdown); bench/RESULTS.md, "Scale".
bench-scale: build
	bench/scale_job.sh $(BUILD)/bin 256 4
	$(BUILD)/bin/control_plane_bench 1000 4000

# gradlink (shm and TCP modes, 1 and 2 servers) against Open MPI's MPI_Allreduce and Gloo's
# all_reduce, 2 ranks on this host, 3 interleaved repeats
# (its section of bench/RESULTS.md is rewritten, the run appended to bench/history/), plots
# bench/compare.png. COMPARE_ARGS adds options (bench/compare --help).
COMPARE_ARGS ?=
compare: build
	bench/compare --bin $(BUILD)/bin $(COMPARE_ARGS)

# Emulated cluster (needs root, iproute2): 4 worker hosts, 4/2 server hosts, mixed placement and
# lanes, beside Gloo and Open MPI, on network namespaces with 1 Gbit/s tbf-shaped links; every
# element checked; its sections of bench/RESULTS.md rewritten, each run appended to
# bench/history/ (about 35 minutes on the 2-core VM).
# NETCLUSTER_ARGS replaces the options (bench/netcluster --help).
NETCLUSTER_ARGS ?= --scenario all
netcluster: build
	bench/netcluster --bin $(BUILD)/bin $(NETCLUSTER_ARGS)

# End-to-end training on the same emulated cluster (needs root): DDP over Gloo, gradlink's
# DistributedOptimizer and DDP hook with no tuning flags, and hand-tuned; steps/s, parameters
# checked across ranks and methods; its section of bench/RESULTS.md rewritten (about 5 minutes).
TRAIN_CLUSTER_ARGS ?= -n 4 -k 4
train-cluster: build
	bench/train_cluster --bin $(BUILD)/bin $(TRAIN_CLUSTER_ARGS)

# libFuzzer targets under ASan+UBSan (clang), each run for FUZZ_SECONDS.
FUZZ_SECONDS ?= 60
FUZZ_TARGETS ?= frame messages handshake server
fuzz: setup
	cmake -S . -B $(BUILD)-fuzz -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
	  -DGRADLINK_FUZZ=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo \
	  -DCMAKE_CXX_FLAGS="-fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=undefined"
	cmake --build $(BUILD)-fuzz -j$(JOBS) --target $(addsuffix _fuzz,$(FUZZ_TARGETS))
	fail=0; for t in $(FUZZ_TARGETS); do \
	  mkdir -p $(BUILD)-fuzz/corpus/$$t && \
	  $(BUILD)-fuzz/bin/$${t}_fuzz -max_total_time=$(FUZZ_SECONDS) -print_final_stats=1 \
	    -artifact_prefix=$(BUILD)-fuzz/$${t}- \
	    $(BUILD)-fuzz/corpus/$$t tests/fuzz/corpus/$$t || fail=1; \
	done; exit $$fail

# The unit tests under sanitizers (UCX's memory hooks must be off under TSan).
# Failover soak: 120 seeded trials (a server killed or hung at declaration, push, pull or between
# rounds, over 2-4 servers), each checking every round's sums and every survivor's exit, then the
# scheduler killed and restarted in 40 more, and a new server joining the running job in 40 more
# (half with a server killed after it); tests/fault/run_failover.py. About 18 minutes here.
SOAK_TRIALS ?= 120
soak: build
	/usr/bin/python3 tests/fault/run_failover.py --bin-dir $(BUILD)/bin \
	  --fault-worker $(BUILD)/tests/fault/gl_fault_worker --seed 20261203 \
	  --trials $(SOAK_TRIALS) --budget 3000 trials
	/usr/bin/python3 tests/fault/run_failover.py --bin-dir $(BUILD)/bin \
	  --fault-worker $(BUILD)/tests/fault/gl_fault_worker --seed 20261203 \
	  --trials 40 --budget 600 restarts
	/usr/bin/python3 tests/fault/run_failover.py --bin-dir $(BUILD)/bin \
	  --fault-worker $(BUILD)/tests/fault/gl_fault_worker --seed 20261203 \
	  --trials 40 --budget 600 joins

test-asan: setup
	cmake -S . -B $(BUILD)-asan -DCMAKE_BUILD_TYPE=Debug -DGRADLINK_BUILD_PYTHON=OFF \
	  -DCMAKE_CXX_FLAGS="-fsanitize=address,undefined -fno-omit-frame-pointer"
	cmake --build $(BUILD)-asan -j$(JOBS)
	cd $(BUILD)-asan && ctest --output-on-failure -j$(JOBS) -LE "integration|fault"

test-tsan: setup
	cmake -S . -B $(BUILD)-tsan -DCMAKE_BUILD_TYPE=Debug -DGRADLINK_BUILD_PYTHON=OFF \
	  -DCMAKE_CXX_FLAGS="-fsanitize=thread"
	cmake --build $(BUILD)-tsan -j$(JOBS)
	cd $(BUILD)-tsan && UCX_MEM_EVENTS=no UCX_MEM_MALLOC_HOOKS=no UCX_MEM_MMAP_RELOC=no \
	  ctest --output-on-failure -j$(JOBS) -LE "integration|fault"

# The reducers' NEON kernels: cross-built for aarch64 (just the reducers and their unit test) and
# run under qemu-user. Installs the cross compiler, qemu-user and googletest's sources when missing.
# ARM_BENCH=1 also builds reduce_bench and runs it once under qemu (a smoke check, not a timing).
ARM_BENCH ?= 0
test-arm:
	BUILD_ARM=$(BUILD)-arm JOBS=$(JOBS) ARM_BENCH=$(ARM_BENCH) scripts/test-arm.sh

# The torch.distributed backend on torch 2.6 (Debian 13's), in a chroot made by
# scripts/torch2_chroot.sh (root; about 2.3 GB and 5 minutes the first time): its build and
# tests/python/test_c10d.py, FSDP included. make test only compiles the torch 2.x variant.
test-torch2: setup
	JOBS=$(JOBS) GRADLINK_UCX_PREFIX=$(GRADLINK_UCX_PREFIX) scripts/torch2_chroot.sh

# BytePS's own PyTorch scripts (example/pytorch/, and tests/torch/ where a branch has them) from a
# fetched bytedance/byteps checkout, their byteps.torch imports made gradlink.byteps.torch, each in
# a gradlink-run job with 2 and 3 workers (scripts/byteps/run_tests.py; docs/byteps_api.md).
# Not part of make test: `make test-byteps BYTEPS_TESTS=~/byteps`.
.PHONY: test-byteps
test-byteps: build
	@test -n "$(BYTEPS_TESTS)" || { echo "make test-byteps BYTEPS_TESTS=<a byteps checkout>"; exit 2; }
	GRADLINK_BUILD_DIR=$(abspath $(BUILD)) .venv/bin/python scripts/byteps/run_tests.py \
	  "$(BYTEPS_TESTS)" -n 2 3

# Horovod's own PyTorch test file (test/parallel/test_torch.py of a fetched horovod/horovod) on
# gradlink.torch, one test per job and the whole file in one job, at 2, 3 and 4 workers
# (docs/horovod_api.md). Not part of make test: `make test-horovod HOROVOD_TESTS=<its test/parallel>`.
.PHONY: test-horovod
test-horovod: build
	@test -n "$(HOROVOD_TESTS)" || { echo "make test-horovod HOROVOD_TESTS=<horovod checkout>/test/parallel"; exit 2; }
	GRADLINK_BUILD_DIR=$(abspath $(BUILD)) .venv/bin/python scripts/horovod/run_suite.py \
	  --tests "$(HOROVOD_TESTS)" -n 2 3 4 --mode both

# Reducer throughput against memcpy (Google Benchmark).
bench-reduce: build
	$(BUILD)/bin/reduce_bench --benchmark_repetitions=3 --benchmark_report_aggregates_only=true

clean:
	rm -rf $(BUILD)
