/* The HDF5 layer of the checkpoints: checked calls, attribute helpers, the error stack as one
 * line; and the loader's collective error agreement. The lowest checkpoint layer: it uses no other
 * checkpoint*.c file. */
#include <errno.h>
#include <mpi.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "checkpoint_h5.h"
#include "common.h"

const char *const ck_buf_group[CK_N_BUFS] = {"master", "adam_m", "adam_v"};

static const char *context_path;

void ck_h5_init(void)
{
    static bool done;
    if (done) return;
    /* no library clean-up at exit: after a failed write (a full disk) it would crash while closing
     * the broken file, turning the one-line error into a segfault (fails harmlessly when the
     * library was already started) */
    H5dont_atexit();
    /* H5open before H5Eset_auto2 so the library's own start-up does not reset the handler */
    if (H5open() < 0) mt_fatal("H5open: the HDF5 library failed to initialise");
    if (H5Eset_auto2(H5E_DEFAULT, NULL, NULL) < 0) mt_fatal("H5Eset_auto2: cannot silence HDF5 errors");
    done = true;
}

struct walk {
    char first[256], last[256];
    int n;
};

static herr_t walk_cb(unsigned n, const H5E_error2_t *e, void *data)
{
    struct walk *w = data;
    (void)n;
    const char *d = e->desc && *e->desc ? e->desc : e->func_name;
    if (!d) return 0;
    if (w->n++ == 0) mt_strlcpy(w->first, d, sizeof w->first);
    mt_strlcpy(w->last, d, sizeof w->last);
    return 0;
}

void ck_h5_message(char *buf, size_t cap)
{
    struct walk w = {.n = 0};
    /* downward: from the API call to the innermost function, where the real reason is */
    if (H5Ewalk2(H5E_DEFAULT, H5E_WALK_DOWNWARD, walk_cb, &w) < 0 || w.n == 0) {
        snprintf(buf, cap, "no HDF5 error details");
        return;
    }
    if (w.n == 1 || !strcmp(w.first, w.last)) snprintf(buf, cap, "%s", w.first);
    else snprintf(buf, cap, "%s: %s", w.first, w.last);
    for (char *c = buf; *c; c++)
        if (*c == '\n' || *c == '\r') *c = ' ';
}

void ck_h5_context(const char *path) { context_path = path; }

int64_t ck_h5_check(int64_t rc, const char *call, const char *file, int line)
{
    if (rc >= 0) return rc;
    const int saved = errno;
    char msg[512];
    ck_h5_message(msg, sizeof msg);
    const bool full = saved == ENOSPC || saved == EFBIG || saved == EDQUOT;
    mt_fatal_at(file, line, "%s failed%s%s: %s%s", call, context_path ? " on " : "",
                context_path ? context_path : "", msg,
                full ? " (out of disk space or quota: the unfinished save is ignored, earlier checkpoints "
                       "are untouched)" : "");
}

hid_t ck_fapl(void)
{
    hid_t fapl = CK_H5(H5Pcreate(H5P_FILE_ACCESS));
#if H5_VERSION_GE(1, 10, 7)
    CK_H5(H5Pset_file_locking(fapl, false, true));
#endif
    return fapl;
}

void ck_write_attr_i64(hid_t obj, const char *name, const int64_t *v, int n)
{
    hsize_t dims[1] = {(hsize_t)n};
    hid_t sp = CK_H5(H5Screate_simple(1, dims, NULL));
    hid_t a = CK_H5(H5Acreate2(obj, name, H5T_STD_I64LE, sp, H5P_DEFAULT, H5P_DEFAULT));
    CK_H5(H5Awrite(a, H5T_NATIVE_INT64, v));
    CK_H5(H5Aclose(a));
    CK_H5(H5Sclose(sp));
}

static hid_t string_type(size_t len)
{
    hid_t t = CK_H5(H5Tcopy(H5T_C_S1));
    CK_H5(H5Tset_size(t, len > 0 ? len : 1));
    CK_H5(H5Tset_strpad(t, H5T_STR_NULLPAD));
    return t;
}

void ck_write_attr_str(hid_t obj, const char *name, const char *s)
{
    hid_t t = string_type(strlen(s));
    hid_t sp = CK_H5(H5Screate(H5S_SCALAR));
    hid_t a = CK_H5(H5Acreate2(obj, name, t, sp, H5P_DEFAULT, H5P_DEFAULT));
    CK_H5(H5Awrite(a, t, *s ? s : ""));
    CK_H5(H5Aclose(a));
    CK_H5(H5Sclose(sp));
    CK_H5(H5Tclose(t));
}

void ck_write_string_dataset(hid_t loc, const char *name, const char *s, size_t len)
{
    hid_t t = string_type(len);
    hid_t sp = CK_H5(H5Screate(H5S_SCALAR));
    hid_t d = CK_H5(H5Dcreate2(loc, name, t, sp, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT));
    char *buf = mt_calloc(len + 1, 1);
    memcpy(buf, s, len);
    CK_H5(H5Dwrite(d, t, H5S_ALL, H5S_ALL, H5P_DEFAULT, buf));
    free(buf);
    CK_H5(H5Dclose(d));
    CK_H5(H5Sclose(sp));
    CK_H5(H5Tclose(t));
}

bool ck_flat_io(hid_t dset, int ndim, const hsize_t *dims, int64_t start, int64_t n, float *buf,
                bool write, char *msg, size_t msgcap)
{
    if (ndim != 1 && ndim != 3) mt_fatal("checkpoint: datasets of rank %d are not supported", ndim);
    hid_t fs = CK_H5(H5Dget_space(dset));
    herr_t rc = 0;
    for (int64_t done = 0; done < n && rc >= 0;) {
        const int64_t f = start + done, left = n - done;
        hsize_t off[3] = {(hsize_t)f, 0, 0}, cnt[3] = {(hsize_t)left, 1, 1};
        int64_t len = left;
        if (ndim == 3) {
            const int64_t d2 = (int64_t)dims[2], nr = (int64_t)dims[1];
            const int64_t c = f % d2, r = (f / d2) % nr, e = f / (d2 * nr);
            if (c != 0 || left < d2) {     /* part of one row */
                len = MT_MIN(left, d2 - c);
                off[0] = (hsize_t)e, off[1] = (hsize_t)r, off[2] = (hsize_t)c;
                cnt[0] = 1, cnt[1] = 1, cnt[2] = (hsize_t)len;
            } else {                       /* whole rows of one expert */
                const int64_t k = MT_MIN(left / d2, nr - r);
                len = k * d2;
                off[0] = (hsize_t)e, off[1] = (hsize_t)r, off[2] = 0;
                cnt[0] = 1, cnt[1] = (hsize_t)k, cnt[2] = (hsize_t)d2;
            }
        }
        CK_H5(H5Sselect_hyperslab(fs, H5S_SELECT_SET, off, NULL, cnt, NULL));
        hsize_t mdims[1] = {(hsize_t)len};
        hid_t ms = CK_H5(H5Screate_simple(1, mdims, NULL));
        rc = write ? H5Dwrite(dset, H5T_NATIVE_FLOAT, ms, fs, H5P_DEFAULT, buf + done)
                   : H5Dread(dset, H5T_NATIVE_FLOAT, ms, fs, H5P_DEFAULT, buf + done);
        if (rc < 0) ck_h5_message(msg, msgcap);   /* before the next call clears the stack */
        CK_H5(H5Sclose(ms));
        done += len;
    }
    CK_H5(H5Sclose(fs));
    return rc >= 0;
}

bool ck_errf(char *err, int cap, const char *fmt, ...)
{
    if (err[0]) return false;   /* the first problem is the one reported */
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, (size_t)cap, fmt, ap);
    va_end(ap);
    return false;
}

/* Opens attribute `name` of obj after checking it exists: < 0 with err set otherwise. */
static hid_t open_attr(hid_t obj, const char *name, const char *what, char *err, int cap)
{
    htri_t ex = H5Aexists(obj, name);
    if (ex <= 0) {
        ck_errf(err, cap, "%s: attribute '%s' is missing", what, name);
        return -1;
    }
    hid_t a = H5Aopen(obj, name, H5P_DEFAULT);
    if (a < 0) {
        char m[512];
        ck_h5_message(m, sizeof m);
        ck_errf(err, cap, "%s: cannot open attribute '%s' (%s)", what, name, m);
    }
    return a;
}

bool ck_read_attr_i64(hid_t obj, const char *name, int64_t *v, int n, int *n_out, const char *what,
                      char *err, int cap)
{
    hid_t a = open_attr(obj, name, what, err, cap);
    if (a < 0) return false;
    hid_t t = CK_H5(H5Aget_type(a)), sp = CK_H5(H5Aget_space(a));
    hssize_t np = H5Sget_simple_extent_npoints(sp);
    bool ok = H5Tget_class(t) == H5T_INTEGER && (n_out ? np >= 1 && np <= n : np == n);
    if (!ok) ck_errf(err, cap, "%s: attribute '%s' is not %s%d integer%s", what, name, n_out ? "up to " : "",
                   n, n == 1 ? "" : "s");
    if (ok && n_out) *n_out = (int)np;
    if (ok && H5Aread(a, H5T_NATIVE_INT64, v) < 0) {
        char m[512];
        ck_h5_message(m, sizeof m);
        ok = ck_errf(err, cap, "%s: cannot read attribute '%s' (%s)", what, name, m);
    }
    CK_H5(H5Tclose(t));
    CK_H5(H5Sclose(sp));
    CK_H5(H5Aclose(a));
    return ok;
}

bool ck_read_attr_str(hid_t obj, const char *name, char *s, size_t cap_s, const char *what,
                      char *err, int cap)
{
    hid_t a = open_attr(obj, name, what, err, cap);
    if (a < 0) return false;
    hid_t t = CK_H5(H5Aget_type(a)), sp = CK_H5(H5Aget_space(a));
    size_t len = H5Tget_size(t);
    bool ok = H5Tget_class(t) == H5T_STRING && !H5Tis_variable_str(t) &&
              H5Sget_simple_extent_npoints(sp) == 1 && len < cap_s;
    if (!ok) ck_errf(err, cap, "%s: attribute '%s' is not a short fixed-length string", what, name);
    if (ok) {
        hid_t mt = string_type(len);
        memset(s, 0, cap_s);
        if (H5Aread(a, mt, s) < 0) {
            char m[512];
            ck_h5_message(m, sizeof m);
            ok = ck_errf(err, cap, "%s: cannot read attribute '%s' (%s)", what, name, m);
        }
        CK_H5(H5Tclose(mt));
    }
    CK_H5(H5Tclose(t));
    CK_H5(H5Sclose(sp));
    CK_H5(H5Aclose(a));
    return ok;
}

/* H5Fopen read-only with HDF5's reason in err on failure. */
hid_t ck_open_ro(const char *path, const char *what, char *err, int cap)
{
    hid_t fapl = ck_fapl();
    hid_t f = H5Fopen(path, H5F_ACC_RDONLY, fapl);
    if (f < 0) {
        char m[512];
        ck_h5_message(m, sizeof m);
        ck_errf(err, cap, "%s: cannot open %s (truncated or not an HDF5 file?): %s", path, what, m);
    }
    CK_H5(H5Pclose(fapl));
    return f;
}

bool ck_link_exists(hid_t loc, const char *name)
{
    htri_t ex = H5Lexists(loc, name, H5P_DEFAULT);
    return ex > 0;
}

bool ck_use_mpi(const struct mesh *mesh) { return mesh->world_comm != MPI_COMM_NULL && mesh->d.world > 1; }

bool ck_agree(const struct mesh *mesh, char *err, int cap)
{
    if (!ck_use_mpi(mesh)) return err[0] == 0;
    int world = mesh->d.world, mine = err[0] ? mesh->rank : world, first = world;
    MT_CHECK_MPI(MPI_Allreduce(&mine, &first, 1, MPI_INT, MPI_MIN, mesh->world_comm));
    if (first == world) return true;
    MT_CHECK_MPI(MPI_Bcast(err, cap, MPI_CHAR, first, mesh->world_comm));
    err[cap - 1] = 0;
    return false;
}
