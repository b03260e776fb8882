#include <string.h>

#include "backend_select.h"
#include "common.h"

const struct backend *backend_select(enum mt_backend_choice want, enum mt_precision precision,
                                     int local_rank)
{
    const struct backend *cuda =
        want == MT_BACKEND_CPU ? NULL : backend_cuda(precision == MT_PREC_FP32, local_rank);
    if (want == MT_BACKEND_CUDA && !cuda)
        mt_user_error("parallel.backend is cuda, but no CUDA device is usable here "
                      "(built without nvcc, or no GPU visible)");
    return cuda ? cuda : backend_cpu();
}

enum mt_backend_choice backend_choice_from_cli(const char *s, enum mt_backend_choice dflt)
{
    if (!s || !strcmp(s, "auto")) return dflt;
    return !strcmp(s, "cpu") ? MT_BACKEND_CPU : MT_BACKEND_CUDA;
}
