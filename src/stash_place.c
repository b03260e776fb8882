/* The placement of parked expert rows in lower layers' expert gradients (stash_place.h). */
#include <stdlib.h>

#include "common.h"
#include "stash_place.h"

static int by_layer(const void *a, const void *b)
{
    const struct stash_buf *x = *(const struct stash_buf *const *)a, *y = *(const struct stash_buf *const *)b;
    return x->layer != y->layer ? (x->layer < y->layer ? -1 : 1) : (x < y ? -1 : x > y);
}

int64_t stash_place(const struct stash_host *hosts, int n_hosts, struct stash_buf *bufs, int n_bufs)
{
    int64_t *used = mt_calloc((size_t)MT_MAX(n_hosts, 1), sizeof *used);
    struct stash_buf **order = mt_malloc((size_t)MT_MAX(n_bufs, 1) * sizeof *order);
    for (int b = 0; b < n_bufs; b++) order[b] = &bufs[b];
    qsort(order, (size_t)n_bufs, sizeof *order, by_layer); /* ties keep the caller's order */
    int64_t placed = 0;
    for (int b = 0; b < n_bufs; b++) {
        struct stash_buf *s = order[b];
        s->host = -1;
        s->off = 0;
        int best = -1;
        for (int h = 0; h < n_hosts; h++) {
            const int64_t at = MT_CEIL_DIV(used[h], MT_STASH_PLACE_ALIGN) * MT_STASH_PLACE_ALIGN;
            if (hosts[h].layer >= s->layer || at + s->bytes > hosts[h].bytes) continue;
            if (best < 0 || hosts[h].layer < hosts[best].layer) best = h;
        }
        if (best < 0) continue;
        s->host = best;
        s->off = MT_CEIL_DIV(used[best], MT_STASH_PLACE_ALIGN) * MT_STASH_PLACE_ALIGN;
        used[best] = s->off + s->bytes;
        placed += s->bytes;
    }
    free(order);
    free(used);
    return placed;
}

void stash_slot_bytes(int64_t R, int64_t T, int64_t H, int64_t I, int64_t Id, int64_t x_size, int64_t out[4])
{
    out[0] = R * H * x_size;
    out[1] = MT_MAX(R * I, T * Id) * x_size;
    out[2] = MT_MAX(R * 2 * I, T * 2 * Id) * x_size;
    out[3] = R * H * x_size;
}

int stash_layer_slots(int n, int n_layers, int n_group, int group, int n_big, int big_group)
{
    if (n >= n_layers) return 0;
    return n < n_group && n < n_big ? big_group - 1 : n < n_group ? group - 1 : 1;
}
