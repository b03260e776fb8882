/* The chunked MoE exchange's timeline (moe_timeline.h). */
#include "moe_timeline.h"

#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "env_flag.h"

static void *host_record(void *stream)
{
    (void)stream;
    double *t = mt_malloc(sizeof *t);
    *t = mt_now();
    return t;
}
static double host_ms(void *from, void *to) { return (*(double *)to - *(double *)from) * 1e3; }
static void host_release(void *p) { free(p); }
static const struct moe_timeline_clock host_clock = {0, host_record, host_ms, host_release};

enum { MAX_SPANS = 512 };

struct span {
    const char *what;   /* a string literal of moe_exchange.c */
    int64_t chunk;
    int comm;           /* 0: compute stream, 1: a transfer */
    void *t0, *t1;      /* the clock's points; NULL until recorded */
};

struct pass {
    const char *name;
    int layer, n;
    void *origin;       /* the pass's first point: times are from here */
    struct span s[MAX_SPANS];
};

static struct {
    const struct moe_timeline_clock *clock;
    int on;             /* -1: MT_MOE_TIMELINE not read yet */
    int layer;          /* the MoE layer recorded (the first one seen), -1 before */
    struct pass pass[2];   /* forward, backward */
    struct pass *cur;   /* the pass being recorded, or NULL */
    int comm_open;      /* the span of the transfer being started, -1 if none */
} g = {&host_clock, -1, -1, {{0}}, NULL, -1};

void moe_timeline_set_clock(const struct moe_timeline_clock *c) { g.clock = c ? c : &host_clock; }

static void release(void **p)
{
    if (*p) g.clock->release(*p);
    *p = NULL;
}

static void clear(struct pass *p)
{
    release(&p->origin);
    for (int i = 0; i < p->n; i++) {
        release(&p->s[i].t0);
        release(&p->s[i].t1);
    }
    p->n = 0;
}

int moe_timeline_enabled(void)
{
    if (g.on < 0) g.on = mt_env_flag("MT_MOE_TIMELINE");
    return g.on;
}

void moe_timeline_begin(const struct model *m, int l, const char *pass)
{
    (void)m;
    if (!moe_timeline_enabled()) return;
    if (g.layer < 0) g.layer = l;
    if (l != g.layer) return;
    struct pass *p = &g.pass[strcmp(pass, "forward") != 0];
    clear(p);   /* a later step replaces an earlier one: the last step is printed */
    p->name = pass;
    p->layer = l;
    p->origin = g.clock->record(NULL);
    g.cur = p;
    g.comm_open = -1;
}

void moe_timeline_end(const struct model *m)
{
    (void)m;
    g.cur = NULL;
    g.comm_open = -1;
}

static struct span *add(const char *what, int64_t chunk, int comm)
{
    struct pass *p = g.cur;
    if (!p || p->n == MAX_SPANS) return NULL;
    struct span *s = &p->s[p->n++];
    *s = (struct span){what, chunk, comm, NULL, NULL};
    return s;
}

/* the latest span of (what, chunk, comm) still without its end */
static struct span *open_span(const char *what, int64_t chunk, int comm)
{
    struct pass *p = g.cur;
    for (int i = p ? p->n - 1 : -1; i >= 0; i--) {
        struct span *s = &p->s[i];
        if (s->comm == comm && s->chunk == chunk && !s->t1 && !strcmp(s->what, what)) return s;
    }
    return NULL;
}

void moe_timeline_mark(const char *what, int64_t chunk, int end)
{
    if (!g.cur) return;
    struct span *s = end ? open_span(what, chunk, 0) : add(what, chunk, 0);
    if (s) *(end ? &s->t1 : &s->t0) = g.clock->record(NULL);
}

void moe_timeline_comm(const char *what, int64_t chunk)
{
    if (!g.cur) return;
    struct span *s = add(what, chunk, 1);
    g.comm_open = s ? (int)(s - g.cur->s) : -1;
    if (s && !g.clock->device) s->t0 = g.clock->record(NULL);
}

void moe_timeline_comm_mark(void *stream, int end)
{
    if (!g.cur || !g.clock->device || g.comm_open < 0) return;
    struct span *s = &g.cur->s[g.comm_open];
    release(end ? &s->t1 : &s->t0);
    *(end ? &s->t1 : &s->t0) = g.clock->record(stream);
}

void moe_timeline_comm_done(const char *what, int64_t chunk)
{
    if (!g.cur || g.clock->device) return;
    struct span *s = open_span(what, chunk, 1);
    if (s) s->t1 = g.clock->record(NULL);
}

static double overlap(double a0, double a1, double b0, double b1)
{
    const double lo = a0 > b0 ? a0 : b0, hi = a1 < b1 ? a1 : b1;
    return hi > lo ? hi - lo : 0;
}

void moe_timeline_print(FILE *f)
{
    if (moe_timeline_enabled() && !g.pass[0].n && !g.pass[1].n)
        fprintf(f, "moe timeline: nothing recorded (MT_MOE_TIMELINE covers the chunked exchange: set "
                "parallel.moe_chunks > 1)\n");
    for (int k = 0; k < 2; k++) {
        struct pass *p = &g.pass[k];
        if (!p->n) continue;
        double t0[MAX_SPANS], t1[MAX_SPANS];
        int ok[MAX_SPANS];
        fprintf(f, "moe timeline: layer %d %s, ms from the layer's first exchange call (%s clock)\n",
                p->layer, p->name, g.clock->device ? "device-event" : "host wall");
        fprintf(f, "moe timeline:   chunk stream  what          start      end\n");
        for (int i = 0; i < p->n; i++) {
            const struct span *s = &p->s[i];
            ok[i] = s->t0 && s->t1;
            if (!ok[i]) continue;   /* a transfer with nothing to move records no edges */
            t0[i] = g.clock->ms(p->origin, s->t0);
            t1[i] = g.clock->ms(p->origin, s->t1);
            fprintf(f, "moe timeline:   %5lld %-7s %-12s %8.3f %8.3f\n", (long long)s->chunk,
                    s->comm ? "comm" : "compute", s->what, t0[i], t1[i]);
        }
        /* compute spans run one after another on one stream: a transfer's hidden time is the sum
         * of its overlaps with each of them */
        double comm = 0, hidden = 0, gemm = 0, last = 0;
        for (int i = 0; i < p->n; i++) {
            if (!ok[i]) continue;
            last = t1[i] > last ? t1[i] : last;
            if (!p->s[i].comm) {
                gemm += t1[i] - t0[i];
                continue;
            }
            comm += t1[i] - t0[i];
            for (int j = 0; j < p->n; j++)
                if (ok[j] && !p->s[j].comm) hidden += overlap(t0[i], t1[i], t0[j], t1[j]);
        }
        fprintf(f, "moe timeline: %s: transfers %.3f ms, %.3f ms of it (%.0f%%) under expert GEMMs "
                "(%.3f ms); pass %.3f ms%s\n", p->name, comm, hidden, comm > 0 ? 100.0 * hidden / comm : 0.0,
                gemm, last, g.clock->device ? "" : " (host clock: a transfer spans its start call to its "
                "wait, not its time on the wire)");
        clear(p);
    }
}
