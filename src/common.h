/* Error policy, logging and small helpers shared by every host module.
 *
 * Two kinds of failure:
 *  - mt_fatal / MT_CHECK*: something broke (a library call failed, a file is bad on this rank only).
 *    Prints "moetrain: rank R: file:line: CALL: reason" and MPI_Aborts, so no rank is left hanging.
 *  - mt_user_error: a problem every rank detects identically (config, mesh). Rank 0 prints one line,
 *    every rank exits non-zero after MPI_Finalize, so the user sees one clean message.
 * Both work before MPI_Init and in single-process commands (plan), where they just exit(1). */
#ifndef MT_COMMON_H
#define MT_COMMON_H

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define MT_PATH_MAX 1024

int mt_rank(void);      /* world rank, 0 before MPI_Init or without MPI */
int mt_world(void);     /* world size, 1 before MPI_Init */

/* Prints a one-line error with the rank and source location, then aborts every rank. */
_Noreturn void mt_fatal_at(const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
#define mt_fatal(...) mt_fatal_at(__FILE__, __LINE__, __VA_ARGS__)

/* What mt_fatal_at runs before MPI_Abort, which runs no atexit handler (one; NULL: none). For
 * files this rank would otherwise leave behind, such as the watchdog's heartbeat. */
void mt_set_before_abort(void (*fn)(void));

/* The error return of functions that report through the caller's buffer: writes the message into
 * err[cap] (when err is not NULL and cap > 0) and returns false. */
bool mt_fail(char *err, int cap, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

/* For errors every rank sees the same way: rank 0 prints "moetrain: error: <msg>", all exit(1). */
_Noreturn void mt_user_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* Rank-0 printing to stdout (flushed), and per-rank printing with a "[rank R] " prefix. */
void mt_log0(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void mt_log(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void mt_warn0(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* Checked calls. Each names the call, the file:line and the library's reason. */
#define MT_CHECK(cond, ...) \
    do { if (!(cond)) mt_fatal_at(__FILE__, __LINE__, __VA_ARGS__); } while (0)

#define MT_CHECK_MPI(call)                                                          \
    do {                                                                            \
        int mt_rc_ = (call);                                                        \
        if (mt_rc_ != 0) {                                                          \
            char mt_msg_[512]; int mt_len_ = 0;                                     \
            mt_mpi_error_string(mt_rc_, mt_msg_, &mt_len_);                         \
            mt_fatal_at(__FILE__, __LINE__, "%s: %s", #call, mt_msg_);              \
        }                                                                           \
    } while (0)
void mt_mpi_error_string(int rc, char *buf, int *len);

/* Allocation that never returns NULL (aborts with the size asked for). */
void *mt_malloc(size_t bytes);
void *mt_calloc(size_t n, size_t size);
void *mt_realloc(void *p, size_t bytes);
char *mt_strdup(const char *s);

/* Wall clock in seconds (monotonic). */
double mt_now(void);

/* Bounded string copy that always terminates; returns false if truncated. */
bool mt_strlcpy(char *dst, const char *src, size_t cap);
/* mkdir -p of the directory part of `path` (nothing for a bare file name); false with errno set */
bool mt_mkdir_parent(const char *path);

/* Deterministic RNG (splitmix64 seeding + xoshiro256**), identical on every platform. */
typedef struct { uint64_t s[4]; } mt_rng;
void mt_rng_seed(mt_rng *r, uint64_t seed);
uint64_t mt_rng_next(mt_rng *r);
double mt_rng_uniform(mt_rng *r);            /* [0, 1) */
double mt_rng_normal(mt_rng *r);             /* N(0, 1), Box-Muller, no cached second value */

#define MT_MIN(a, b) ((a) < (b) ? (a) : (b))
#define MT_MAX(a, b) ((a) > (b) ? (a) : (b))
#define MT_CEIL_DIV(a, b) (((a) + (b) - 1) / (b))

#endif
