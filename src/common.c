#include "common.h"

#include <math.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <errno.h>
#include <sys/stat.h>
#include <time.h>

static bool mpi_up(void)
{
    int init = 0, fin = 0;
    MPI_Initialized(&init);
    MPI_Finalized(&fin);
    return init && !fin;
}

int mt_rank(void)
{
    int r = 0;
    if (mpi_up()) MPI_Comm_rank(MPI_COMM_WORLD, &r);
    return r;
}

int mt_world(void)
{
    int n = 1;
    if (mpi_up()) MPI_Comm_size(MPI_COMM_WORLD, &n);
    return n;
}

void mt_mpi_error_string(int rc, char *buf, int *len)
{
    if (MPI_Error_string(rc, buf, len) != MPI_SUCCESS) snprintf(buf, 64, "MPI error %d", rc);
}

static void (*g_before_abort)(void);

void mt_set_before_abort(void (*fn)(void)) { g_before_abort = fn; }

void mt_fatal_at(const char *file, int line, const char *fmt, ...)
{
    char msg[2048];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    fprintf(stderr, "moetrain: rank %d: %s:%d: %s\n", mt_rank(), file, line, msg);
    fflush(stderr);
    fflush(stdout);
    if (mpi_up() && mt_world() > 1) {
        if (g_before_abort) g_before_abort();
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    exit(1);
}

bool mt_fail(char *err, int cap, const char *fmt, ...)
{
    if (err && cap > 0) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, (size_t)cap, fmt, ap);
        va_end(ap);
    }
    return false;
}

void mt_user_error(const char *fmt, ...)
{
    if (mt_rank() == 0) {
        char msg[2048];
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(msg, sizeof msg, fmt, ap);
        va_end(ap);
        fprintf(stderr, "moetrain: error: %s\n", msg);
        fflush(stderr);
    }
    fflush(stdout);
    if (mpi_up()) MPI_Finalize();
    exit(1);
}

static void vlog(FILE *f, const char *prefix, const char *fmt, va_list ap)
{
    if (prefix) fputs(prefix, f);
    vfprintf(f, fmt, ap);
    fflush(f);
}

void mt_log0(const char *fmt, ...)
{
    if (mt_rank() != 0) return;
    va_list ap;
    va_start(ap, fmt);
    vlog(stdout, NULL, fmt, ap);
    va_end(ap);
}

void mt_warn0(const char *fmt, ...)
{
    if (mt_rank() != 0) return;
    va_list ap;
    va_start(ap, fmt);
    vlog(stderr, "moetrain: warning: ", fmt, ap);
    va_end(ap);
}

void mt_log(const char *fmt, ...)
{
    char prefix[32];
    snprintf(prefix, sizeof prefix, "[rank %d] ", mt_rank());
    va_list ap;
    va_start(ap, fmt);
    vlog(stdout, prefix, fmt, ap);
    va_end(ap);
}

void *mt_malloc(size_t bytes)
{
    void *p = malloc(bytes ? bytes : 1);
    if (!p) mt_fatal("malloc(%zu bytes): out of host memory", bytes);
    return p;
}

void *mt_calloc(size_t n, size_t size)
{
    void *p = calloc(n ? n : 1, size ? size : 1);
    if (!p) mt_fatal("calloc(%zu x %zu bytes): out of host memory", n, size);
    return p;
}

void *mt_realloc(void *p, size_t bytes)
{
    void *q = realloc(p, bytes ? bytes : 1);
    if (!q) mt_fatal("realloc(%zu bytes): out of host memory", bytes);
    return q;
}

char *mt_strdup(const char *s)
{
    size_t n = strlen(s) + 1;
    char *d = mt_malloc(n);
    memcpy(d, s, n);
    return d;
}

double mt_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

bool mt_strlcpy(char *dst, const char *src, size_t cap)
{
    size_t n = strlen(src);
    if (n >= cap) {
        memcpy(dst, src, cap - 1);
        dst[cap - 1] = 0;
        return false;
    }
    memcpy(dst, src, n + 1);
    return true;
}

static uint64_t splitmix64(uint64_t *x)
{
    uint64_t z = (*x += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

void mt_rng_seed(mt_rng *r, uint64_t seed)
{
    uint64_t x = seed;
    for (int i = 0; i < 4; i++) r->s[i] = splitmix64(&x);
}

static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

uint64_t mt_rng_next(mt_rng *r)
{
    uint64_t *s = r->s;
    uint64_t result = rotl(s[1] * 5, 7) * 9;
    uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return result;
}

double mt_rng_uniform(mt_rng *r) { return (double)(mt_rng_next(r) >> 11) * 0x1.0p-53; }

double mt_rng_normal(mt_rng *r)
{
    double u1 = mt_rng_uniform(r), u2 = mt_rng_uniform(r);
    if (u1 < 1e-300) u1 = 1e-300;
    return sqrt(-2.0 * log(u1)) * cos(2.0 * M_PI * u2);
}

bool mt_mkdir_parent(const char *path)
{
    char buf[MT_PATH_MAX * 2];
    if (!mt_strlcpy(buf, path, sizeof buf)) {
        errno = ENAMETOOLONG;
        return false;
    }
    char *slash = strrchr(buf, '/');
    if (!slash || slash == buf) return true;
    *slash = 0;
    for (char *c = buf + 1;; c++) {
        if (*c != '/' && *c) continue;
        char saved = *c;
        *c = 0;
        struct stat st;
        if (mkdir(buf, 0777) != 0 && errno != EEXIST) return false;
        if (stat(buf, &st) != 0 || !S_ISDIR(st.st_mode)) {
            errno = ENOTDIR;
            return false;
        }
        *c = saved;
        if (!saved) return true;
    }
}
