/* GPU side of the sharded-memory work: the bf16-moment AdamW against the CPU op on fresh random
 * inputs (skipped without a GPU; failed under MT_REQUIRE_GPU). */
#include <criterion/criterion.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "common.h"
#include "gpu_backend.h"
#include "ops.h"

Test(gpu, adamw_bf16_moments)
{
    const struct backend *g = gpu_backend_or_skip(false), *c = backend_cpu();
    enum { N = 100000 };
    mt_rng rng;
    mt_rng_seed(&rng, 4242);
    float *master = mt_malloc(N * sizeof(float)), *grad = mt_malloc(N * sizeof(float));
    uint16_t *m = mt_malloc(N * 2), *v = mt_malloc(N * 2);
    for (int j = 0; j < N; j++) {
        master[j] = (float)mt_rng_normal(&rng);
        grad[j] = 0.1f * (float)mt_rng_normal(&rng);
        float mm = 0.01f * (float)mt_rng_normal(&rng), vv = 1e-4f * (float)fabs(mt_rng_normal(&rng));
        uint32_t um, uv;
        memcpy(&um, &mm, 4);
        memcpy(&uv, &vv, 4);
        m[j] = (uint16_t)(um >> 16);   /* truncation: any bf16 value will do as a start */
        v[j] = (uint16_t)(uv >> 16);
    }
    float *d_master = g->alloc(N * 4), *d_grad = g->alloc(N * 4);
    void *d_m = g->alloc(N * 2), *d_v = g->alloc(N * 2), *d_param = g->alloc(N * 2);
    g->upload(d_master, master, N * 4);
    g->upload(d_grad, grad, N * 4);
    g->upload(d_m, m, N * 2);
    g->upload(d_v, v, N * 2);
    g->adamw_update_m16(d_master, d_param, d_grad, d_m, d_v, N, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 2, 0.7f);
    c->adamw_update_m16(master, NULL, grad, m, v, N, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 2, 0.7f);
    float *gm = mt_malloc(N * 4);
    uint16_t *g1 = mt_malloc(N * 2), *g2 = mt_malloc(N * 2);
    g->download(gm, d_master, N * 4);
    g->download(g1, d_m, N * 2);
    g->download(g2, d_v, N * 2);
    /* fp32 element maths may differ by an ulp (fused multiply-adds): the master to 1e-6 relative,
     * the bf16 moments equal or one bf16 step apart */
    int far = 0;
    for (int j = 0; j < N; j++) {
        cr_assert(fabsf(gm[j] - master[j]) <= 1e-6f * fmaxf(1.0f, fabsf(master[j])), "master %d: %g vs %g", j,
                  (double)gm[j], (double)master[j]);
        far += abs((int)g1[j] - (int)m[j]) > 1 || abs((int)g2[j] - (int)v[j]) > 1;
    }
    cr_expect_eq(far, 0, "%d moments more than one bf16 step from the CPU's", far);
    g->free(d_master), g->free(d_grad), g->free(d_m), g->free(d_v), g->free(d_param);
    free(master), free(grad), free(m), free(v), free(gm), free(g1), free(g2);
}
