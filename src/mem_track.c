#include "mem_track.h"

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

/* Open addressing on the pointer; deleted slots keep probing chains intact. */
struct entry {
    const void *p;        /* NULL = empty, (void *)1 = deleted */
    size_t bytes;
    enum mem_cat cat;
};

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static struct entry *tab;
static size_t cap, used;
static enum mem_cat current = MEM_BUFFERS;
static size_t now[MEM_N], total, peak;
static double at_peak[MEM_N];
#define DELETED ((const void *)1)

static size_t slot_of(const void *p, size_t n)
{
    uint64_t h = (uint64_t)(uintptr_t)p * 0x9e3779b97f4a7c15ULL;
    return (size_t)(h >> 17) & (n - 1);
}

static void insert(struct entry *t, size_t n, struct entry e)
{
    for (size_t i = slot_of(e.p, n);; i = (i + 1) & (n - 1))
        if (!t[i].p || t[i].p == DELETED) {
            t[i] = e;
            return;
        }
}

static void grow(void)
{
    size_t n = cap ? 2 * cap : 4096;
    struct entry *t = mt_calloc(n, sizeof *t);
    for (size_t i = 0; i < cap; i++)
        if (tab[i].p && tab[i].p != DELETED) insert(t, n, tab[i]);
    free(tab);
    tab = t;
    cap = n;
}

enum mem_cat mem_track_set(enum mem_cat c)
{
    pthread_mutex_lock(&lock);
    enum mem_cat old = current;
    current = c;
    pthread_mutex_unlock(&lock);
    return old;
}

void mem_track_alloc(const void *p, size_t bytes)
{
    if (!p) return;
    pthread_mutex_lock(&lock);
    if (2 * (used + 1) > cap) grow();
    insert(tab, cap, (struct entry){p, bytes, current});
    used++;
    now[current] += bytes;
    total += bytes;
    if (total > peak) {
        peak = total;
        for (int k = 0; k < MEM_N; k++) at_peak[k] = (double)now[k];
    }
    pthread_mutex_unlock(&lock);
}

void mem_track_free(const void *p)
{
    if (!p) return;
    pthread_mutex_lock(&lock);
    for (size_t i = cap ? slot_of(p, cap) : 0, probes = 0; probes < cap; i = (i + 1) & (cap - 1), probes++) {
        if (!tab[i].p) break;  /* not ours (allocated before tracking, or elsewhere) */
        if (tab[i].p == p) {
            now[tab[i].cat] -= tab[i].bytes;
            total -= tab[i].bytes;
            tab[i].p = DELETED;
            used--;
            break;
        }
    }
    pthread_mutex_unlock(&lock);
}

size_t mem_track_current(void) { return total; }

size_t mem_track_peak(double by_cat[MEM_N])
{
    pthread_mutex_lock(&lock);
    size_t pk = peak;
    if (by_cat) memcpy(by_cat, at_peak, sizeof at_peak);
    pthread_mutex_unlock(&lock);
    return pk;
}

const char *mem_cat_name(enum mem_cat c)
{
    static const char *const names[MEM_N] = {"params", "grads", "master", "adam", "acts", "buffers"};
    return c < MEM_N ? names[c] : "?";
}
