/* Token embedding on the CPU: a row gather forward, a scatter-add in token order backward. */
#include "cpu/cpu_ops.h"
#include "common.h"

#include <string.h>

void cpu_embedding_forward(float *out, const int32_t *ids, const float *wte, int T, int H)
{
    for (int t = 0; t < T; t++) {
        MT_CHECK(ids[t] >= 0, "embedding: negative token id %d at position %d", (int)ids[t], t);
        memcpy(out + (size_t)t * H, wte + (size_t)ids[t] * H, (size_t)H * sizeof(float));
    }
}

void cpu_embedding_backward(float *dwte, const float *dout, const int32_t *ids, int T, int H)
{
    for (int t = 0; t < T; t++) {
        MT_CHECK(ids[t] >= 0, "embedding backward: negative token id %d at position %d", (int)ids[t],
                 t);
        float *d = dwte + (size_t)ids[t] * H;
        const float *g = dout + (size_t)t * H;
        for (int h = 0; h < H; h++) d[h] += g[h];
    }
}
