#include "route_replay.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "router_opts.h"

struct route_replay {
    int n_moe;
    int moe_of[MT_MAX_LAYERS];    /* MoE layer number of model layer l, -1 for dense */
    int n_slots;                  /* the model's micro-batch slots (1F1B keeps several in flight) */
    int32_t **idx;                /* [n_slots][n_moe] dev [T, k], the stage's layers only (else NULL):
                                   * (a) saved or (b) loaded per slot */
    float **w;                    /* [n_slots][n_moe] dev [T, k] */
    bool *saved;                  /* [n_slots][n_moe] (a): the slot's forward saved layer's routing */
    bool paused;                  /* (b) off: a validation pass routes on the model's router */
    /* (b) */
    FILE *file;
    char path[MT_PATH_MAX];
    struct route_file_header h;
    int32_t *idx_h;               /* [n_moe, T, k] the loaded micro-batch */
    float *w_h;                   /* [n_moe, T, k] the file's weights, if any */
    void *rec;                    /* one sequence's record */
};

static size_t record_bytes(const struct route_file_header *h)
{
    size_t n = (size_t)h->layers * h->seq_len * h->top_k;
    return n * h->index_width + (h->flags & ROUTE_FILE_HAS_WEIGHTS ? n * sizeof(float) : 0);
}

static uint32_t u32_at(const unsigned char *p) { uint32_t v; memcpy(&v, p, 4); return v; }

bool route_file_read_header(const char *path, struct route_file_header *h, char *err, size_t cap)
{
    unsigned char b[ROUTE_FILE_HEADER];
    FILE *f = fopen(path, "rb");
    if (!f) {
        snprintf(err, cap, "%s: cannot open the routing file: %s", path, strerror(errno));
        return false;
    }
    size_t got = fread(b, 1, sizeof b, f);
    struct stat st;
    bool sized = fstat(fileno(f), &st) == 0;
    fclose(f);
    if (got < sizeof b || memcmp(b, ROUTE_FILE_MAGIC, 8) != 0) {
        snprintf(err, cap, "%s: not a routing file (no %s header)", path, ROUTE_FILE_MAGIC);
        return false;
    }
    h->version = u32_at(b + 8);
    h->layers = u32_at(b + 12);
    h->top_k = u32_at(b + 16);
    h->seq_len = u32_at(b + 20);
    memcpy(&h->sequences, b + 24, 8);
    h->index_width = u32_at(b + 32);
    h->flags = u32_at(b + 36);
    h->num_experts = u32_at(b + 40);
    if (h->version != ROUTE_FILE_VERSION) {
        snprintf(err, cap, "%s: routing file version %u (this moetrain reads %u)", path, h->version,
                 ROUTE_FILE_VERSION);
        return false;
    }
    if ((h->index_width != 2 && h->index_width != 4) || (h->flags & ~ROUTE_FILE_HAS_WEIGHTS) ||
        !h->layers || !h->top_k || !h->seq_len || !h->num_experts) {
        snprintf(err, cap, "%s: bad routing header (index width %u, flags %#x, %u layers, top-%u, %u "
                 "tokens, %u experts)", path, h->index_width, h->flags, h->layers, h->top_k,
                 h->seq_len, h->num_experts);
        return false;
    }
    const double want = ROUTE_FILE_HEADER + (double)h->sequences * (double)record_bytes(h);
    if (!sized || (double)st.st_size != want) {
        snprintf(err, cap, "%s: %lld bytes, but its header describes %.0f (%llu sequences)", path,
                 sized ? (long long)st.st_size : -1LL, want, (unsigned long long)h->sequences);
        return false;
    }
    return true;
}

bool route_file_write_header(FILE *f, const struct route_file_header *h)
{
    unsigned char b[ROUTE_FILE_HEADER] = {0};
    memcpy(b, ROUTE_FILE_MAGIC, 8);
    uint32_t v[4] = {h->version, h->layers, h->top_k, h->seq_len};
    memcpy(b + 8, v, 16);
    memcpy(b + 24, &h->sequences, 8);
    uint32_t w[3] = {h->index_width, h->flags, h->num_experts};
    memcpy(b + 32, w, 12);
    return fwrite(b, 1, sizeof b, f) == sizeof b;
}

static bool on_stage(const struct model *m, int l) { return l >= m->st.layer0 && l < m->st.layer1; }

/* Buffers for the stage's MoE layers only: a pipeline stage never routes another stage's layers. */
static struct route_replay *create(struct model *m)
{
    struct route_replay *r = mt_calloc(1, sizeof *r);
    m->replay_free = route_replay_free;
    const size_t tk = (size_t)m->T * m->K;
    for (int l = 0; l < m->L; l++)
        r->moe_of[l] = config_layer_is_moe(&m->cfg, l) && m->E > 0 ? r->n_moe++ : -1;
    r->n_slots = MT_MAX(m->st.n_slots, 1);
    const size_t n = (size_t)MT_MAX(r->n_moe, 1) * r->n_slots;
    r->idx = mt_calloc(n, sizeof(int32_t *));
    r->w = mt_calloc(n, sizeof(float *));
    r->saved = mt_calloc(n, sizeof(bool));
    for (int l = 0; l < m->L; l++) {
        if (r->moe_of[l] < 0 || !on_stage(m, l)) continue;
        for (int s = 0; s < r->n_slots; s++) {
            const int k = r->moe_of[l] + r->n_moe * s;
            r->idx[k] = m->be->alloc(tk * sizeof(int32_t));
            r->w[k] = m->be->alloc(tk * sizeof(float));
        }
    }
    return r;
}

/* Reads sequence q's record into r->rec; the file was checked at open, so a failure is broken state. */
static void read_record(struct route_replay *r, int64_t q)
{
    const size_t rb = record_bytes(&r->h);
    MT_CHECK(fseeko(r->file, (off_t)(ROUTE_FILE_HEADER + (double)q * rb), SEEK_SET) == 0 &&
                 fread(r->rec, 1, rb, r->file) == rb,
             "%s: reading the routing of sequence %lld failed", r->path, (long long)q);
}

static int32_t id_at(const struct route_replay *r, size_t i)
{
    if (r->h.index_width == 2) {
        int16_t v;
        memcpy(&v, (const char *)r->rec + 2 * i, 2);
        return v;
    }
    int32_t v;
    memcpy(&v, (const char *)r->rec + 4 * i, 4);
    return v;
}

bool route_replay_open(struct model *m, const char *path, int64_t needed, char *err, size_t cap)
{
    struct route_file_header h;
    if (!route_file_read_header(path, &h, err, cap)) return false;
    if ((int)h.layers != m->n_moe_layers || (int)h.top_k != m->K || (int)h.seq_len != m->S ||
        (int)h.num_experts != m->E) {
        snprintf(err, cap, "%s: routing of %u MoE layers, top-%u, %u tokens per sequence, %u experts; "
                 "the model and train.seq_len need %d, %d, %d, %d", path, h.layers, h.top_k, h.seq_len,
                 h.num_experts, m->n_moe_layers, m->K, m->S, m->E);
        return false;
    }
    if ((int64_t)h.sequences < needed) {
        snprintf(err, cap, "%s: holds the routing of %llu sequences, the run trains on %lld", path,
                 (unsigned long long)h.sequences, (long long)needed);
        return false;
    }
    if (!m->replay) m->replay = create(m);
    struct route_replay *r = m->replay;
    r->h = h;
    mt_strlcpy(r->path, path, sizeof r->path);
    r->file = fopen(path, "rb");
    if (!r->file) {
        snprintf(err, cap, "%s: %s", path, strerror(errno));
        return false;
    }
    r->rec = mt_malloc(record_bytes(&h));
    /* every id of the sequences the run uses: a bad one is a one-line error now, not mid-run */
    const size_t per_tok = h.top_k, n = (size_t)h.layers * h.seq_len * per_tok;
    for (int64_t q = 0; q < needed; q++) {
        read_record(r, q);
        for (size_t t = 0; t < n; t += per_tok)
            for (size_t j = 0; j < per_tok; j++) {
                int32_t e = id_at(r, t + j);
                bool dup = false;
                for (size_t i = 0; i < j; i++) dup |= id_at(r, t + i) == e;
                if (e < 0 || e >= m->E || dup) {
                    snprintf(err, cap, "%s: sequence %lld, MoE layer %zu, token %zu: expert id %d is %s",
                             path, (long long)q, t / (per_tok * h.seq_len), (t / per_tok) % h.seq_len,
                             (int)e, dup ? "repeated" : "outside [0, num_experts)");
                    return false;
                }
            }
        if (h.flags & ROUTE_FILE_HAS_WEIGHTS) {
            const float *w = (const float *)((const char *)r->rec + n * h.index_width);
            for (size_t i = 0; i < n; i++)
                if (!isfinite(w[i])) {
                    snprintf(err, cap, "%s: sequence %lld has a non-finite routing weight", path, (long long)q);
                    return false;
                }
        }
    }
    const size_t tk = (size_t)m->T * m->K;
    r->idx_h = mt_malloc((size_t)MT_MAX(r->n_moe, 1) * tk * sizeof(int32_t));
    r->w_h = mt_malloc((size_t)MT_MAX(r->n_moe, 1) * tk * sizeof(float));
    return true;
}

void route_replay_load(struct model *m, int slot, int64_t first)
{
    struct route_replay *r = m->replay;
    if (!r || !r->file) return;
    MT_CHECK(slot >= 0 && slot < r->n_slots, "routing replay: slot %d of %d", slot, r->n_slots);
    const int S = m->S, K = m->K;
    const size_t n = (size_t)r->h.layers * S * K, tk = (size_t)m->T * K;
    const bool has_w = r->h.flags & ROUTE_FILE_HAS_WEIGHTS;
    for (int b = 0; b < m->B; b++) {
        read_record(r, first + b);
        const float *w = (const float *)((const char *)r->rec + n * r->h.index_width);
        for (int l = m->st.layer0; l < m->st.layer1; l++) {
            const int k = r->moe_of[l];
            if (k < 0) continue;
            for (int s = 0; s < S * K; s++) {
                const size_t from = (size_t)k * S * K + s, to = (size_t)k * tk + (size_t)b * S * K + s;
                r->idx_h[to] = id_at(r, from);
                if (has_w) memcpy(&r->w_h[to], &w[from], sizeof(float));
            }
        }
    }
    for (int l = m->st.layer0; l < m->st.layer1; l++) {
        const int k = r->moe_of[l], ks = k + r->n_moe * slot;
        if (k < 0) continue;
        m->be->upload(r->idx[ks], r->idx_h + (size_t)k * tk, tk * sizeof(int32_t));
        if (has_w) m->be->upload(r->w[ks], r->w_h + (size_t)k * tk, tk * sizeof(float));
    }
}

void route_replay_pause(struct model *m, bool paused)
{
    if (m->replay) m->replay->paused = paused;
}

void route_replay_apply(struct model *m, int l, int32_t *topk_idx, float *topk_w, const float *probs)
{
    if (!m->replay && !m->recompute) return;
    if (!m->replay) m->replay = create(m);
    struct route_replay *r = m->replay;
    const int k = r->moe_of[l];
    MT_CHECK(k >= 0 && on_stage(m, l), "routing replay: layer %d is not an MoE layer of this stage", l);
    const size_t tk = (size_t)m->T * m->K;
    /* the micro-batch's own slot: another one's forward may run between this one's and its
     * backward (1F1B) */
    const int ks = k + r->n_moe * m->slot;
    if (r->file && !r->paused) {
        /* the recompute gathers the same weights again: same probabilities, same experts */
        if (!(r->h.flags & ROUTE_FILE_HAS_WEIGHTS)) {
            const struct router_opts o = router_opts_of(&m->cfg);
            m->be->router_gather_weights(r->w[ks], probs, r->idx[ks], m->T, m->E, m->K, &o);
        }
        m->be->copy(topk_idx, r->idx[ks], tk * sizeof(int32_t));
        m->be->copy(topk_w, r->w[ks], tk * sizeof(float));
        return;
    }
    if (!m->recompute) return;
    if (m->recomputing) {
        MT_CHECK(r->saved[ks], "recompute of layer %d: its forward saved no routing", l);
        m->be->copy(topk_idx, r->idx[ks], tk * sizeof(int32_t));
        m->be->copy(topk_w, r->w[ks], tk * sizeof(float));
        r->saved[ks] = false;
    } else {
        m->be->copy(r->idx[ks], topk_idx, tk * sizeof(int32_t));
        m->be->copy(r->w[ks], topk_w, tk * sizeof(float));
        r->saved[ks] = true;
    }
}

bool route_replay_weights_fixed(const struct model *m)
{
    return m->replay && m->replay->file && (m->replay->h.flags & ROUTE_FILE_HAS_WEIGHTS);
}

size_t route_replay_bytes(const struct model *m)
{
    size_t n_moe = 0;
    for (int l = m->st.layer0; l < m->st.layer1; l++) n_moe += m->E > 0 && config_layer_is_moe(&m->cfg, l);
    return n_moe * MT_MAX(m->st.n_slots, 1) * m->T * m->K * (sizeof(int32_t) + sizeof(float));
}

void route_replay_free(struct model *m)
{
    struct route_replay *r = m->replay;
    if (!r) return;
    for (int k = 0; k < r->n_moe * r->n_slots; k++) {
        if (r->idx[k]) m->be->free(r->idx[k]);
        if (r->w[k]) m->be->free(r->w[k]);
    }
    if (r->file) fclose(r->file);
    free(r->idx), free(r->w), free(r->saved), free(r->idx_h), free(r->w_h);
    free(r->rec);
    free(r);
    m->replay = NULL;
}
