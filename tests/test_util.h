/* Small helpers shared by the Criterion tests: where the build is, how to launch MPI, running a
 * command with its output captured. Header-only so each test file stays self-contained. */
#ifndef MT_TEST_UTIL_H
#define MT_TEST_UTIL_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>

static inline const char *tu_env(const char *name, const char *dflt)
{
    const char *v = getenv(name);
    return v && *v ? v : dflt;
}

static inline const char *tu_build(void) { return tu_env("MT_BUILD", "build"); }
static inline const char *tu_mpirun(void) { return tu_env("MT_MPIRUN", "mpirun --oversubscribe"); }

/* Runs `cmd` through the shell with stdout+stderr captured into a malloc'd string (*out, may be
 * NULL to discard). Returns the exit status (-1 if it did not exit normally). */
static inline int tu_run(const char *cmd, char **out)
{
    char full[8192];
    snprintf(full, sizeof full, "%s 2>&1", cmd);
    FILE *p = popen(full, "r");
    if (!p) return -1;
    size_t cap = 1 << 16, len = 0;
    char *buf = malloc(cap);
    size_t n;
    while ((n = fread(buf + len, 1, cap - len - 1, p)) > 0) {
        len += n;
        if (cap - len < 4096) buf = realloc(buf, cap *= 2);
    }
    buf[len] = 0;
    int st = pclose(p);
    if (out) *out = buf;
    else free(buf);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

/* One numeric field ("loss", "grad_norm", ...) of every line of a metrics JSONL file: fills
 * vals[] (up to cap), returns the count. */
static inline int tu_read_metric(const char *path, const char *field, double *vals, int cap)
{
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    static char line[1 << 20];
    char key[64];
    snprintf(key, sizeof key, "\"%s\": ", field);
    int n = 0;
    while (n < cap && fgets(line, sizeof line, f)) {
        const char *k = strstr(line, key);
        if (!k) continue;
        k += strlen(key);
        vals[n++] = strtod(k + (*k == '['), NULL); /* an array (per layer): its first value */
    }
    fclose(f);
    return n;
}

static inline int tu_read_losses(const char *path, double *losses, int cap)
{
    return tu_read_metric(path, "loss", losses, cap);
}

/* Writes `text` to `path` as an executable (a stand-in program for a script under test).
 * Returns 0, or -1 when the file cannot be written. */
static inline int tu_write_exec(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    if (!f) return -1;
    const int put = fputs(text, f);
    if (fclose(f) != 0 || put < 0) return -1;
    return chmod(path, 0755) == 0 ? 0 : -1;
}

#endif
