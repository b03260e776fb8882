/* The filesystem side of checkpoints: directory names, fsync, recursive removal, telling a
 * moetrain checkpoint from another directory (ck_manifest_identity), finding the newest complete
 * checkpoint, keeping the newest few. Above checkpoint_h5.c, below the save and the load. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "checkpoint_fs.h"
#include "checkpoint_h5.h"
#include "common.h"

void ck_path(char *out, size_t cap, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(out, cap, fmt, ap);
    va_end(ap);
    if (n < 0 || (size_t)n >= cap) mt_fatal("checkpoint: path too long (%s...)", out);
}

void ck_step_dir(char *out, size_t cap, const char *root, int step, bool tmp)
{
    int n = snprintf(out, cap, "%s/step_%08d%s", root, step, tmp ? ".tmp" : "");
    if (n < 0 || (size_t)n >= cap) mt_fatal("checkpoint path too long: %s/step_%08d", root, step);
}

void ck_rank_file(char *out, size_t cap, const char *dir, int rank)
{
    int n = snprintf(out, cap, "%s/rank_%05d.h5", dir, rank);
    if (n < 0 || (size_t)n >= cap) mt_fatal("checkpoint path too long: %s/rank_%05d.h5", dir, rank);
}

bool ck_file_exists(const char *path)
{
    struct stat st;
    return stat(path, &st) == 0 && S_ISREG(st.st_mode);
}

static bool is_dir(const char *path)
{
    struct stat st;
    return stat(path, &st) == 0 && S_ISDIR(st.st_mode);
}

bool ck_fsync_path(const char *path)
{
    int fd = open(path, O_RDONLY);
    if (fd < 0) return false;
    int rc = fsync(fd);
    int saved = errno;
    /* some filesystems cannot fsync a directory (EINVAL): nothing more can be done there */
    bool ok = rc == 0 || (saved == EINVAL && is_dir(path));
    if (close(fd) != 0 && ok) return false;
    errno = saved;
    return ok;
}

bool ck_remove_tree(const char *path)
{
    struct stat st;
    if (lstat(path, &st) != 0) return errno == ENOENT;
    if (!S_ISDIR(st.st_mode)) return unlink(path) == 0;
    DIR *d = opendir(path);
    if (!d) return false;
    bool ok = true;
    struct dirent *e;
    while (ok && (e = readdir(d)) != NULL) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        char child[MT_PATH_MAX * 2];
        int n = snprintf(child, sizeof child, "%s/%s", path, e->d_name);
        ok = n > 0 && (size_t)n < sizeof child && ck_remove_tree(child);
    }
    int saved = errno;
    if (closedir(d) != 0) ok = false;
    errno = saved;
    return ok && rmdir(path) == 0;
}

bool ck_manifest_identity(const char *dir, int64_t *save_seq)
{
    char path[MT_PATH_MAX * 2];
    ck_path(path, sizeof path, "%s/%s", dir, CK_MANIFEST);
    if (!ck_file_exists(path)) return false;
    ck_h5_init();
    hid_t fapl = ck_fapl();
    hid_t f = H5Fopen(path, H5F_ACC_RDONLY, fapl);
    CK_H5(H5Pclose(fapl));
    if (f < 0) return false;
    char fmt[64] = "", err[CK_ERR_CAP] = "";
    bool ours = ck_read_attr_str(f, "format", fmt, sizeof fmt, path, err, (int)sizeof err) &&
                !strcmp(fmt, CK_FORMAT_MANIFEST);
    *save_seq = 0;  /* saved before save sequences were recorded */
    if (ours && H5Aexists(f, "save_seq") > 0 &&
        !ck_read_attr_i64(f, "save_seq", save_seq, 1, NULL, path, err, (int)sizeof err))
        ours = false;
    H5Fclose(f);
    return ours;
}

/* The step of a directory entry named step_<digits> or step_<digits>.<anything>.tmp (*tmp set:
 * a save in progress or the leftover of one); -1 for anything else. */
static int step_of_name(const char *name, bool *tmp)
{
    if (strncmp(name, "step_", 5) != 0) return -1;
    const char *d = name + 5;
    size_t nd = strspn(d, "0123456789"), rest = strlen(d + nd);
    if (nd == 0 || nd > 9) return -1;
    *tmp = d[nd] == '.' && rest >= 4 && !strcmp(d + nd + rest - 4, ".tmp");
    if (d[nd] && !*tmp) return -1;
    return atoi(d);
}

static bool is_complete(const char *root, const char *name)
{
    char p[MT_PATH_MAX * 2];
    ck_path(p, sizeof p, "%s/%s/%s", root, name, CK_COMPLETE);
    return ck_file_exists(p);
}

/* A complete checkpoint under a root, with the save sequence its manifest records. */
struct ck_entry {
    int step;
    int64_t seq;
};

static int cmp_newest_first(const void *a, const void *b)
{
    const struct ck_entry *x = a, *y = b;
    if (x->seq != y->seq) return (x->seq < y->seq) - (x->seq > y->seq);
    return (x->step < y->step) - (x->step > y->step);
}

/* The complete moetrain checkpoints under root, newest first (highest save sequence, then step);
 * NULL with *n = 0 when root cannot be listed. */
static struct ck_entry *list_checkpoints(const char *root, int *n)
{
    *n = 0;
    DIR *d = root && *root ? opendir(root) : NULL;
    if (!d) return NULL;
    int cap = 16;
    struct ck_entry *v = mt_malloc((size_t)cap * sizeof *v);
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        bool tmp = false;
        int s = step_of_name(e->d_name, &tmp);
        if (s < 0 || tmp || !is_complete(root, e->d_name)) continue;
        char p[MT_PATH_MAX * 2];
        ck_path(p, sizeof p, "%s/%s", root, e->d_name);
        int64_t seq;
        if (!ck_manifest_identity(p, &seq)) continue;
        if (*n == cap) v = mt_realloc(v, (size_t)(cap *= 2) * sizeof *v);
        v[(*n)++] = (struct ck_entry){s, seq};
    }
    if (closedir(d) != 0) mt_fatal("closedir(%s): %s", root, strerror(errno));
    qsort(v, (size_t)*n, sizeof *v, cmp_newest_first);
    return v;
}

int ckpt_latest(const char *root, char *dir_out, int cap)
{
    int n;
    struct ck_entry *v = list_checkpoints(root, &n);
    int best = n > 0 ? v[0].step : -1;
    free(v);
    if (best >= 0 && dir_out) {
        char p[MT_PATH_MAX * 2];
        ck_step_dir(p, sizeof p, root, best, false);
        if (!mt_strlcpy(dir_out, p, (size_t)cap)) mt_fatal("checkpoint path too long: %s", p);
    }
    return best;
}

int64_t ck_next_save_seq(const char *root)
{
    int n;
    struct ck_entry *v = list_checkpoints(root, &n);
    int64_t next = n > 0 ? v[0].seq + 1 : 1;
    free(v);
    return next;
}

bool ckpt_is_checkpoint(const char *dir)
{
    char p[MT_PATH_MAX * 2];
    ck_path(p, sizeof p, "%s/%s", dir, CK_MANIFEST);
    return ck_file_exists(p);
}

bool ckpt_due(const struct config *c, int step)
{
    const struct ckpt_config *k = &c->checkpoint;
    if (!*k->dir) return false;
    return step == c->train.steps || (k->interval > 0 && step % k->interval == 0);
}

bool ck_mkdir_p(const char *path)
{
    char buf[MT_PATH_MAX * 2];
    if (!mt_strlcpy(buf, path, sizeof buf)) {
        errno = ENAMETOOLONG;
        return false;
    }
    for (char *c = buf + 1;; c++) {
        if (*c != '/' && *c) continue;
        char saved = *c;
        *c = 0;
        if (mkdir(buf, 0777) != 0 && errno != EEXIST) return false;
        if (!is_dir(buf)) {
            errno = ENOTDIR;
            return false;
        }
        *c = saved;
        if (!saved) return true;
    }
}

bool ck_every_rank_sees(const struct mesh *mesh, const char *path, const char *what, char *err, int cap)
{
    for (int tries = 0; !is_dir(path) && tries < 50; tries++) usleep(100 * 1000);
    if (!is_dir(path))
        ck_errf(err, cap, "%s '%s' was created by rank 0 but rank %d does not see it: checkpoints need a "
                "directory on a filesystem shared by every rank", what, path, mesh->rank);
    return ck_agree(mesh, err, cap);
}

/* Whether moetrain may write checkpoints into root: it is new or empty, carries the marker of an
 * earlier run, or holds a moetrain checkpoint. `other` names an entry that says otherwise. */
static bool root_is_ours(const char *root, char *other, size_t cap)
{
    DIR *d = opendir(root);
    if (!d) return true;  /* created below */
    bool empty = true, marked = false, has_ckpt = false;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        const char *n = e->d_name;
        if (!strcmp(n, ".") || !strcmp(n, "..")) continue;
        if (!strcmp(n, CK_ROOT_MARKER)) {
            marked = true;
            continue;
        }
        bool tmp = false;
        char p[MT_PATH_MAX * 2];
        int64_t seq;
        ck_path(p, sizeof p, "%s/%s", root, n);
        if (step_of_name(n, &tmp) >= 0 && !tmp && ck_manifest_identity(p, &seq)) has_ckpt = true;
        else if (step_of_name(n, &tmp) >= 0 && ck_holds_only_checkpoint_files(p)) continue;  /* a crashed save */
        else if (empty) mt_strlcpy(other, n, cap);
        empty = false;
    }
    closedir(d);
    return empty || marked || has_ckpt;
}

void ckpt_check_dir(const struct config *c, const struct mesh *mesh, bool force)
{
    const char *root = c->checkpoint.dir;
    if (!*root) return;
    char err[CK_ERR_CAP] = "";
    if (mesh->rank == 0) {
        char marker[MT_PATH_MAX * 2], other[256] = "";
        ck_path(marker, sizeof marker, "%s/%s", root, CK_ROOT_MARKER);
        FILE *f = NULL;
        if (!force && !root_is_ours(root, other, sizeof other))
            ck_errf(err, sizeof err, "checkpoint.dir '%s' already holds files moetrain did not write (e.g. "
                    "'%s'); use a new or empty directory, or pass --force to write checkpoints there",
                    root, other);
        else if (!ck_mkdir_p(root))
            ck_errf(err, sizeof err, "checkpoint.dir '%s': cannot create the directory: %s", root, strerror(errno));
        else if (!(f = fopen(marker, "w")))
            ck_errf(err, sizeof err, "checkpoint.dir '%s': cannot write there: %s", root, strerror(errno));
        if (f && (fputs("moetrain writes checkpoints here (step_* directories)\n", f) < 0 || fclose(f) != 0))
            ck_errf(err, sizeof err, "checkpoint.dir '%s': cannot write there: %s", root, strerror(errno));
    }
    if (!ck_agree(mesh, err, sizeof err) || !ck_every_rank_sees(mesh, root, "checkpoint.dir", err, sizeof err))
        mt_user_error("%s", err);
}

bool ckpt_resume_dir(const char *resume, const struct config *c, const struct mesh *mesh,
                     char *dir_out, int cap)
{
    if (!resume) return false;
    if (strcmp(resume, "auto") != 0) {
        if (!mt_strlcpy(dir_out, resume, (size_t)cap)) mt_user_error("--resume %s: path too long", resume);
        return true;
    }
    if (!*c->checkpoint.dir)
        mt_user_error("--resume auto needs checkpoint.dir (the directory the checkpoints are in)");
    char dir[MT_PATH_MAX * 2] = "";
    int step = mesh->rank == 0 ? ckpt_latest(c->checkpoint.dir, dir, (int)sizeof dir) : -1;
    if (ck_use_mpi(mesh)) {
        MT_CHECK_MPI(MPI_Bcast(&step, 1, MPI_INT, 0, mesh->world_comm));
        MT_CHECK_MPI(MPI_Bcast(dir, (int)sizeof dir, MPI_CHAR, 0, mesh->world_comm));
    }
    if (step < 0) {
        mt_log0("--resume auto: no complete checkpoint under %s, starting from step 0\n", c->checkpoint.dir);
        return false;
    }
    if (!mt_strlcpy(dir_out, dir, (size_t)cap)) mt_fatal("checkpoint path too long: %s", dir);
    return true;
}

static void remove_or_warn(const char *root, const char *name, const char *why)
{
    char p[MT_PATH_MAX * 2];
    ck_path(p, sizeof p, "%s/%s", root, name);
    if (!ck_remove_tree(p)) mt_warn0("checkpoint: cannot remove %s %s: %s\n", why, p, strerror(errno));
}

/* An unfinished save (step_N.tmp, step_N.replaced.tmp, or step_N without COMPLETE) may be removed
 * only when it holds nothing but checkpoint files: a directory someone else put there is kept. */
bool ck_holds_only_checkpoint_files(const char *p)
{
    DIR *d = opendir(p);
    if (!d) return false;
    bool ours = true;
    struct dirent *e;
    while (ours && (e = readdir(d)) != NULL) {
        const char *f = e->d_name;
        size_t len = strlen(f);
        ours = !strcmp(f, ".") || !strcmp(f, "..") || !strcmp(f, CK_MANIFEST) || !strcmp(f, CK_COMPLETE) ||
               (!strncmp(f, "rank_", 5) && len == 13 && !strcmp(f + 10, ".h5") &&
                strspn(f + 5, "0123456789") == 5);
    }
    closedir(d);
    return ours;
}

void ck_cleanup(const char *root, int keep, int current)
{
    DIR *d = opendir(root);
    if (!d) {
        mt_warn0("checkpoint: cannot list %s to remove old checkpoints: %s\n", root, strerror(errno));
        return;
    }
    int n_stale = 0, cap_stale = 4;
    char **stale = mt_malloc((size_t)cap_stale * sizeof(char *));
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        bool tmp = false;
        int s = step_of_name(e->d_name, &tmp);
        if (s < 0 || (!tmp && is_complete(root, e->d_name))) continue;
        char p[MT_PATH_MAX * 2];
        ck_path(p, sizeof p, "%s/%s", root, e->d_name);
        if (!ck_holds_only_checkpoint_files(p)) {
            mt_warn0("checkpoint: leaving %s/%s alone: it holds files moetrain did not write\n", root,
                     e->d_name);
            continue;
        }
        if (n_stale == cap_stale) stale = mt_realloc(stale, (size_t)(cap_stale *= 2) * sizeof(char *));
        stale[n_stale++] = mt_strdup(e->d_name);
    }
    if (closedir(d) != 0) mt_fatal("closedir(%s): %s", root, strerror(errno));
    for (int i = 0; i < n_stale; i++) {
        remove_or_warn(root, stale[i], "the unfinished checkpoint");
        free(stale[i]);
    }
    free(stale);
    if (keep <= 0) return;
    /* newest first by save sequence: after a rewind the new run's checkpoints are the ones kept,
     * whatever their step numbers; `current` is counted among them but never removed */
    int n;
    struct ck_entry *v = list_checkpoints(root, &n);
    for (int i = keep; i < n; i++) {
        if (v[i].step == current) continue;
        char name[64];
        snprintf(name, sizeof name, "step_%08d", v[i].step);
        remove_or_warn(root, name, "the old checkpoint");
    }
    free(v);
}
