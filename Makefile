# moetrain build. `make` builds build/moetrain (CUDA objects too when nvcc exists);
# `make test` runs the CPU test suite (installing missing system packages first);
# `make run` trains configs/tiny.yaml; `make test-gpu` / `make bench` run on a GPU machine.
#
# Variables a user may set: BUILD (output dir), NVCC (empty disables CUDA), CUDA_ARCH, NP (ranks
# for `make run`), CONFIG (config for `make run`), UNIT_SRCS (subset of unit tests to build).

BUILD     ?= build
CC        := mpicc
NVCC      ?= $(shell command -v nvcc 2>/dev/null || ls /usr/local/cuda/bin/nvcc 2>/dev/null)
CUDA_HOME ?= $(patsubst %/bin/nvcc,%,$(NVCC))
# sm_80 (A100) and sm_90a (H100/H200) machine code in one binary, plus compute_80 PTX (what a newer
# GPU, or CUDA_FORCE_PTX_JIT=1 in `make test-gpu`'s sm_80 pass, compiles at load time). The
# Hopper-only kernels are a trap in the sm_80 code; the host picks the path at run time
# (docs/gpu.md, "Build notes").
CUDA_ARCH ?= -gencode=arch=compute_80,code=[sm_80,compute_80] -gencode=arch=compute_90a,code=sm_90a
CONFIG    ?= configs/tiny.yaml
NP        ?= 4

export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1
# Open MPI on a laptop, a CI box or a container: shared memory + loopback only, no warnings about
# missing high-speed networks.
export OMPI_MCA_btl := self,vader,tcp
export OMPI_MCA_btl_tcp_if_include := lo
export OMPI_MCA_oob_tcp_if_include := lo
export OMPI_MCA_btl_base_warn_component_unused := 0
export OMPI_MCA_rmaps_base_oversubscribe := 1
export PRTE_MCA_rmaps_default_mapping_policy := :oversubscribe
MPIRUN    := mpirun --oversubscribe

PKGS      := yaml-0.1 jansson
PKG_CFLAGS := $(shell pkg-config --cflags $(PKGS) 2>/dev/null)
PKG_LIBS   := $(shell pkg-config --libs $(PKGS) 2>/dev/null)
HDF5_CFLAGS := $(shell pkg-config --cflags hdf5 2>/dev/null || echo -I/usr/include/hdf5/serial)
HDF5_LIBS   := $(shell pkg-config --libs hdf5 2>/dev/null || echo -L/usr/lib/x86_64-linux-gnu/hdf5/serial -lhdf5)

CFLAGS    ?= -O2 -g
CFLAGS    += -std=gnu11 -Wall -Wextra -Wno-unused-parameter -Wshadow -Isrc $(PKG_CFLAGS) $(HDF5_CFLAGS)
LDLIBS    := $(PKG_LIBS) $(HDF5_LIBS) -lm

LIB_SRCS  := $(filter-out src/main.c,$(wildcard src/*.c src/cpu/*.c))
LIB_OBJS  := $(LIB_SRCS:%.c=$(BUILD)/%.o)
CU_SRCS   := $(wildcard cuda/*.cu)

ifneq ($(NVCC),)
CU_OBJS   := $(CU_SRCS:%.cu=$(BUILD)/%.o)
CFLAGS    += -DMT_HAVE_CUDA -I$(CUDA_HOME)/include
LDLIBS    += -L$(CUDA_HOME)/lib64 -Wl,-rpath,$(CUDA_HOME)/lib64 -lcudart -lcublas -lcublasLt -lnccl -lstdc++
ifneq ($(wildcard cuda/comm_nccl.cu),)
CFLAGS    += -DMT_HAVE_NCCL
endif
NVFLAGS   ?= -O3 -lineinfo
NVFLAGS   += -std=c++17 $(CUDA_ARCH) -Isrc -Icuda -Xcompiler -Wall,-Wno-unused-parameter \
             -I$(dir $(shell command -v mpicc))/../include $(shell mpicc --showme:compile 2>/dev/null)
endif

UNIT_SRCS ?= $(wildcard tests/unit/test_*.c)
# helpers shared by several test files (tests/unit/*_util.c), linked whatever UNIT_SRCS holds
UNIT_UTIL_SRCS := $(wildcard tests/unit/*_util.c)
UNIT_OBJS := $(UNIT_SRCS:%.c=$(BUILD)/%.o) $(UNIT_UTIL_SRCS:%.c=$(BUILD)/%.o)
MPI_TEST_SRCS := $(wildcard tests/mpi/*.c)
MPI_TEST_BINS := $(MPI_TEST_SRCS:tests/mpi/%.c=$(BUILD)/tests/mpi/%)
TOOL_SRCS := $(filter-out tools/kernel_trace.c,$(wildcard tools/*.c))
TOOL_BINS := $(TOOL_SRCS:tools/%.c=$(BUILD)/tools/%)
# the kernel timeline library (tools/kernel_trace.c, LD_PRELOAD) where CUPTI is installed
ifneq ($(NVCC),)
ifneq ($(wildcard $(CUDA_HOME)/include/cupti.h),)
TRACE_LIB := $(BUILD)/tools/libmt_trace.so
TOOL_BINS += $(TRACE_LIB)
endif
endif

.PHONY: all deps data-deps test test-unit test-slurm test-gpu run bench bench-scaling bench-sweep clean check-deps tools fuzz
all: $(BUILD)/moetrain tools

tools: $(TOOL_BINS)

# rebuilt from scratch: `ar r` never drops a member, so a source file split or removed would leave
# its old object (and its old symbols) in the archive
$(BUILD)/libmoetrain.a: $(LIB_OBJS) $(CU_OBJS)
	@mkdir -p $(dir $@)
	@rm -f $@
	ar rcs $@ $^

$(BUILD)/moetrain: $(BUILD)/src/main.o $(BUILD)/libmoetrain.a
	$(CC) -o $@ $^ $(LDLIBS)

$(BUILD)/%.o: %.c $(wildcard src/*.h src/cpu/*.h)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -c -o $@ $<

# nvcc's messages are also kept beside the object ($(BUILD)/cuda/X.nvcc.log): tests/unit/
# test_ptxas_remarks.c fails on ptxas's wgmma advisories there (MMAs serialised or fenced)
$(BUILD)/cuda/%.o: cuda/%.cu $(wildcard cuda/*.cuh src/*.h)
	@mkdir -p $(dir $@)
	$(NVCC) $(NVFLAGS) -c -o $@ $< 2> $(@:.o=.nvcc.log); s=$$?; cat $(@:.o=.nvcc.log) >&2; exit $$s

$(BUILD)/tests/unit_tests: $(UNIT_OBJS) $(BUILD)/libmoetrain.a
	$(CC) -o $@ $^ $(LDLIBS) -lcriterion

$(BUILD)/tests/mpi/%: tests/mpi/%.c $(BUILD)/libmoetrain.a
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -Itests -o $@ $^ $(LDLIBS)

$(BUILD)/tools/libmt_trace.so: tools/kernel_trace.c
	@mkdir -p $(dir $@)
	$(CC) -O2 -Wall -Wextra -shared -fPIC -I$(CUDA_HOME)/include -o $@ $< \
	    -L$(CUDA_HOME)/lib64 -Wl,-rpath,$(CUDA_HOME)/lib64 -lcupti

$(BUILD)/tools/%: tools/%.c $(BUILD)/libmoetrain.a
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -o $@ $^ $(LDLIBS)

# Installs whatever system packages are missing (Debian/Ubuntu, as root or through sudo).
deps:
	@scripts/install-deps.sh

# The pinned Python packages of the tools (also installed by `make deps`); parquet input to
# tools/prepare_data.py also needs tools/requirements-parquet.txt.
data-deps:
	python3 -m pip install -r tools/requirements.txt

# Criterion runs every unit and integration test in one binary; integration tests launch
# build/moetrain and tests/mpi programs under `mpirun --oversubscribe`.
test:
	@scripts/install-deps.sh --transformers
	@$(MAKE) --no-print-directory test-unit

test-unit: $(BUILD)/moetrain $(BUILD)/tests/unit_tests $(MPI_TEST_BINS) $(TOOL_BINS)
	MT_BUILD=$(BUILD) MT_MPIRUN="$(MPIRUN)" MT_REF_PYTHON=.venv-ref/bin/python $(BUILD)/tests/unit_tests --jobs 2 $(TEST_ARGS)

# Under a real one-node Slurm started by ../shared/slurm/local-slurm.sh (root; skipped with a
# message where the machine cannot run it): sbatch of scripts/launch-slurm.sh, requeue, the
# time-limit signal, a killed and a stopped rank (tests/slurm/run.sh, about a minute).
test-slurm: $(BUILD)/moetrain
	BUILD=$(BUILD) tests/slurm/run.sh

# The parser fuzzers of `make test` (tests/unit/test_fuzz.c) with FUZZ_ITERS inputs per parser.
FUZZ_ITERS ?= 1000000
fuzz: $(BUILD)/tests/unit_tests
	MT_FUZZ_ITERS=$(FUZZ_ITERS) $(BUILD)/tests/unit_tests --filter 'fuzz/*' --jobs 2

run: deps
	@$(MAKE) --no-print-directory $(BUILD)/moetrain
	@scripts/run-demo.sh $(BUILD)/moetrain $(CONFIG) $(NP)

test-gpu: $(BUILD)/moetrain
	@scripts/test-gpu.sh $(BUILD)

bench: $(BUILD)/moetrain $(TRACE_LIB)
	@scripts/bench.sh $(BUILD)

bench-scaling: $(BUILD)/moetrain
	@scripts/bench-scaling.sh $(BUILD)

bench-sweep: $(BUILD)/moetrain
	@scripts/bench-sweep.sh $(BUILD)

clean:
	rm -rf $(BUILD)
