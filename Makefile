# gradlink: `make demo` runs the main job, `make test` builds and runs every test.
# Both install what is missing first (Debian 12, as root).

BUILD ?= build
JOBS ?= 2
CMAKE_FLAGS ?=

.PHONY: all setup build test demo bench-reduce clean

all: build

setup:
	@scripts/setup.sh

$(BUILD)/CMakeCache.txt: CMakeLists.txt
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=RelWithDebInfo $(CMAKE_FLAGS)

build: setup $(BUILD)/CMakeCache.txt
	cmake --build $(BUILD) -j$(JOBS)

test: build
	cd $(BUILD) && ctest --output-on-failure --timeout 600 -j$(JOBS)

# The main job: a local job (1 scheduler, 2 servers, 2 workers over UCX) sweeping 4 KiB..64 MiB,
# every element of every result checked.
demo: build
	$(BUILD)/bin/gradlink-bench -w 2 -s 2 -b 4K -e 64M -f 4 -n 10

clean:
	rm -rf $(BUILD)
