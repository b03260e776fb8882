/* data.path / data.sources path lists: comma-separated files, directories and globs, expanded once
 * at open in a fixed order so every rank sees the same file list. */
#include <dirent.h>
#include <errno.h>
#include <glob.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "common.h"
#include "data_internal.h"

struct list {
    char **v;
    int n, cap;
};

static void push(struct list *l, const char *s)
{
    if (l->n == l->cap) {
        l->cap = l->cap ? 2 * l->cap : 8;
        l->v = mt_realloc(l->v, (size_t)l->cap * sizeof *l->v);
    }
    l->v[l->n++] = mt_strdup(s);
}

static int cmp_str(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

static bool ends_with(const char *s, const char *suffix)
{
    size_t n = strlen(s), k = strlen(suffix);
    return n >= k && !strcmp(s + n - k, suffix);
}

/* The *.bin regular files of a directory, sorted (prepare_data writes shard-00000.bin ...). */
static bool expand_dir(const char *dir, struct list *out, const char *key, char *err, int errcap)
{
    DIR *d = opendir(dir);
    if (!d) {
        snprintf(err, errcap, "%s: %s: cannot read directory: %s", key, dir, strerror(errno));
        return false;
    }
    int first = out->n;
    struct dirent *e;
    char path[MT_PATH_MAX];
    while ((e = readdir(d))) {
        if (e->d_name[0] == '.' || !ends_with(e->d_name, ".bin")) continue;
        if (snprintf(path, sizeof path, "%s/%s", dir, e->d_name) >= (int)sizeof path) continue;
        struct stat st;
        if (stat(path, &st) == 0 && S_ISREG(st.st_mode)) push(out, path);
    }
    closedir(d);
    if (out->n == first) {
        snprintf(err, errcap, "%s: directory %s has no *.bin token files", key, dir);
        return false;
    }
    qsort(out->v + first, (size_t)(out->n - first), sizeof *out->v, cmp_str);
    return true;
}

char **data_paths_expand(const char *spec, const char *key, int *n, char *err, int errcap)
{
    struct list out = {0};
    char item[MT_PATH_MAX];
    const char *p = spec;
    bool ok = true;
    while (ok) {
        const char *comma = strchr(p, ',');
        size_t len = comma ? (size_t)(comma - p) : strlen(p);
        while (len && (*p == ' ' || *p == '\t')) p++, len--;
        while (len && (p[len - 1] == ' ' || p[len - 1] == '\t')) len--;
        if (len == 0 || len >= sizeof item) {
            snprintf(err, errcap, "%s: %s in '%s'", key,
                     len ? "a path is too long" : "empty item (two commas, or a comma at an end)", spec);
            ok = false;
            break;
        }
        memcpy(item, p, len);
        item[len] = 0;
        struct stat st;
        if (stat(item, &st) == 0) {
            if (S_ISDIR(st.st_mode)) ok = expand_dir(item, &out, key, err, errcap);
            else push(&out, item);
        } else if (strpbrk(item, "*?[")) {
            glob_t g;
            int rc = glob(item, 0, NULL, &g);
            if (rc != 0) {
                snprintf(err, errcap, "%s: no file matches %s", key, item);
                ok = false;
            } else {
                for (size_t i = 0; i < g.gl_pathc; i++) push(&out, g.gl_pathv[i]);   /* sorted */
            }
            if (rc == 0) globfree(&g);
        } else {
            push(&out, item);   /* the reader reports why it cannot open it */
        }
        if (!comma) break;
        p = comma + 1;
    }
    for (int i = 0; ok && i < out.n; i++)
        for (int j = 0; j < i; j++)
            if (!strcmp(out.v[i], out.v[j])) {
                snprintf(err, errcap, "%s: %s is listed twice", key, out.v[i]);
                ok = false;
                break;
            }
    if (!ok) {
        data_paths_free(out.v, out.n);
        return NULL;
    }
    *n = out.n;
    return out.v;
}

void data_paths_free(char **paths, int n)
{
    for (int i = 0; i < n; i++) free(paths[i]);
    free(paths);
}
