/* For the GPU unit tests: the CUDA backend, or the test skipped when there is none -- failed
 * instead when MT_REQUIRE_GPU is set (non-empty, not "0"), so a GPU machine cannot report the
 * GPU tests as skipped. */
#ifndef MT_TESTS_GPU_BACKEND_H
#define MT_TESTS_GPU_BACKEND_H

#include <criterion/criterion.h>

#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "ops.h"

static inline const struct backend *gpu_backend_or_skip(bool fp32)
{
    const struct backend *g = backend_cuda(fp32, 0);
    if (!g) {
        const char *req = getenv("MT_REQUIRE_GPU");
        if (req && *req && strcmp(req, "0"))
            cr_assert_fail("MT_REQUIRE_GPU is set but backend_cuda() returned NULL (no usable GPU)");
        cr_skip_test("no CUDA device: backend_cuda() returned NULL");
    }
    return g;
}

#endif
