/*
 * shm_core._native: the thin C layer under shm_core.
 *
 * One wrapper per system call that Python's os module lacks or gets wrong
 * for us (memfd_create with our flags, posix_fallocate whose *return value*
 * carries the error, futex wait/wake on shared words), the GIL released
 * around each and EINTR retried; plus what Python cannot do:
 *
 *   - Mapping: an mmap'ed region with the buffer protocol that does not keep
 *     the file descriptor (Python's mmap keeps a dup of it, which makes a
 *     process holding many shared arrays run out of descriptors). The buffer
 *     starts `data_offset` bytes into the mapping so the segment header is
 *     not part of any array. The mapping lives while any export lives;
 *     close() with live exports raises BufferError as mmap does.
 *   - atomics on 64-bit words inside a Mapping (sequentially consistent).
 *   - a numpy data-memory handler (NEP 49) that asks a Python policy for a
 *     segment for each allocation of `threshold` bytes or more and gives it
 *     back on free; smaller ones go to numpy's default handler (see
 *     mp_reductions Note [shared allocation]).
 *
 * recv_many wraps recvmmsg (which Python's socket module lacks): several
 * datagrams of a socket in one system call, for readers of many small messages;
 * file_id is fstat for (st_dev, st_ino) alone (os.fstat builds a whole result);
 * send_fds is sendmsg with SCM_RIGHTS (socket.sendmsg builds them from Python
 * tuples, a microsecond of every message that carries an array's descriptor).
 *
 * pack_array / array_from lay out and read back the header of a message that is
 * one array alone (mp_reductions Note [bare arrays]): in Python, packing and
 * checking it cost more than the system calls that carry the message. They
 * check that a received header names an array inside its buffer; which arrays
 * go bare, and how their memory is counted, is mp_reductions'.
 *
 * No policy lives here: names, headers, validation and errors with remedies
 * are in shm_core/_segment.py.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define NPY_NO_DEPRECATED_API NPY_1_22_API_VERSION
#define NPY_TARGET_VERSION NPY_1_22_API_VERSION /* NEP 49 handlers: numpy >= 1.22 */
#include <numpy/arrayobject.h>

#ifndef MFD_CLOEXEC
#define MFD_CLOEXEC 0x0001U
#endif
#ifndef MFD_ALLOW_SEALING
#define MFD_ALLOW_SEALING 0x0002U
#endif

/* ------------------------------------------------------------------ calls */

static PyObject *
native_memfd_create(PyObject *mod, PyObject *args)
{
    const char *name;
    int fd;
    if (!PyArg_ParseTuple(args, "s:memfd_create", &name))
        return NULL;
    do {
        Py_BEGIN_ALLOW_THREADS
#ifdef SYS_memfd_create
        fd = (int)syscall(SYS_memfd_create, name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
#else
        fd = -1;
        errno = ENOSYS;
#endif
        Py_END_ALLOW_THREADS
    } while (fd < 0 && errno == EINTR && !PyErr_CheckSignals());
    if (PyErr_Occurred())
        return NULL;
    if (fd < 0)
        return PyErr_SetFromErrnoWithFilename(PyExc_OSError, name);
    return PyLong_FromLong(fd);
}

static PyObject *
native_fallocate(PyObject *mod, PyObject *args)
{
    int fd, rc;
    long long length;
    PyObject *path;
    if (!PyArg_ParseTuple(args, "iLO:fallocate", &fd, &length, &path))
        return NULL;
    do {
        /* posix_fallocate returns the error; it does not set errno. */
        Py_BEGIN_ALLOW_THREADS
        rc = posix_fallocate(fd, 0, (off_t)length);
        Py_END_ALLOW_THREADS
    } while (rc == EINTR && !PyErr_CheckSignals());
    if (PyErr_Occurred())
        return NULL;
    if (rc != 0) {
        errno = rc;
        return PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, path);
    }
    Py_RETURN_NONE;
}

/* ---------------------------------------------------------------- Mapping */

typedef struct {
    PyObject_HEAD
    char *addr;
    Py_ssize_t length;
    Py_ssize_t data_offset;
    Py_ssize_t views_offset; /* word counting processes with live exports, or -1 */
    Py_ssize_t exports;
    int readonly;
    PyObject *weakreflist;
    PyObject *dict;
} Mapping;

static int
mapping_init(Mapping *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"fd", "length", "data_offset", "populate",
                             "readonly", "views_offset", NULL};
    int fd, populate = 0, readonly = 0;
    Py_ssize_t length, data_offset = 0, views_offset = -1;
    void *addr;
    int flags = MAP_SHARED;

    if (self->addr != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Mapping is already initialised");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "in|$nppn:Mapping", kwlist,
                                     &fd, &length, &data_offset, &populate,
                                     &readonly, &views_offset))
        return -1;
    if (length <= 0 || data_offset < 0 || data_offset > length) {
        PyErr_Format(PyExc_ValueError,
                     "cannot map %zd bytes with data at offset %zd",
                     length, data_offset);
        return -1;
    }
    if (views_offset != -1 &&
        (views_offset < 0 || views_offset % 8 || views_offset + 8 > data_offset)) {
        PyErr_Format(PyExc_ValueError, "bad views_offset %zd", views_offset);
        return -1;
    }
    if (populate)
        flags |= MAP_POPULATE;
    Py_BEGIN_ALLOW_THREADS
    addr = mmap(NULL, (size_t)length,
                readonly ? PROT_READ : PROT_READ | PROT_WRITE, flags, fd, 0);
    Py_END_ALLOW_THREADS
    if (addr == MAP_FAILED) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    self->addr = addr;
    self->length = length;
    self->data_offset = data_offset;
    self->views_offset = views_offset;
    self->readonly = readonly;
    return 0;
}

static void
mapping_unmap(Mapping *self)
{
    if (self->addr != NULL) {
        munmap(self->addr, (size_t)self->length);
        self->addr = NULL;
    }
}

static void
mapping_dealloc(Mapping *self)
{
    PyObject_GC_UnTrack(self);
    if (self->weakreflist != NULL)
        PyObject_ClearWeakRefs((PyObject *)self);
    Py_CLEAR(self->dict);
    mapping_unmap(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int
mapping_traverse(Mapping *self, visitproc visit, void *arg)
{
    Py_VISIT(self->dict);
    Py_VISIT(Py_TYPE(self));
    return 0;
}

static int
mapping_clear(Mapping *self)
{
    Py_CLEAR(self->dict);
    return 0;
}

static int
check_open(Mapping *self)
{
    if (self->addr == NULL) {
        PyErr_SetString(PyExc_ValueError, "mapping closed or not initialised");
        return -1;
    }
    return 0;
}

static int
mapping_getbuffer(Mapping *self, Py_buffer *view, int flags)
{
    if (check_open(self) < 0)
        return -1;
    if (PyBuffer_FillInfo(view, (PyObject *)self, self->addr + self->data_offset,
                          self->length - self->data_offset, self->readonly,
                          flags) < 0)
        return -1;
    if (self->exports++ == 0 && self->views_offset >= 0)
        __atomic_fetch_add((int64_t *)(self->addr + self->views_offset), 1,
                           __ATOMIC_SEQ_CST);
    return 0;
}

static void
mapping_releasebuffer(Mapping *self, Py_buffer *view)
{
    if (--self->exports == 0 && self->views_offset >= 0 && self->addr != NULL)
        __atomic_fetch_sub((int64_t *)(self->addr + self->views_offset), 1,
                           __ATOMIC_SEQ_CST);
}

static PyBufferProcs mapping_as_buffer = {
    (getbufferproc)mapping_getbuffer,
    (releasebufferproc)mapping_releasebuffer,
};

static PyObject *
mapping_close(Mapping *self, PyObject *unused)
{
    if (self->exports > 0) {
        PyErr_SetString(PyExc_BufferError,
                        "cannot close exported pointers exist");
        return NULL;
    }
    mapping_unmap(self);
    Py_RETURN_NONE;
}

/* Stop counting this process in the views word: give back its count now if it
   has live exports, and never count again (a process about to exit whose views
   outlive its last Python code, see mp_reductions Note [fork]). */
static PyObject *
mapping_disown(Mapping *self, PyObject *unused)
{
    int had = self->views_offset >= 0 && self->addr != NULL && self->exports > 0;
    if (had)
        __atomic_fetch_sub((int64_t *)(self->addr + self->views_offset), 1,
                           __ATOMIC_SEQ_CST);
    self->views_offset = -1;
    return PyBool_FromLong(had);
}

/* Replace the mapping, at the same address, by private anonymous memory holding
   a copy of it (header included), after giving back this process's views
   count: from then on a fork child gets it copy-on-write, as any memory of
   numpy's, and the file is no longer written here (mp_reductions Note
   [shared allocation]). mremap moves the copy over the old mapping at once. */
static PyObject *
mapping_privatize(Mapping *self, PyObject *unused)
{
    void *copy, *moved;
    int counted;
    if (check_open(self) < 0)
        return NULL;
    copy = mmap(NULL, (size_t)self->length, PROT_READ | PROT_WRITE,
                MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (copy == MAP_FAILED)
        return PyErr_SetFromErrno(PyExc_OSError);
    memcpy(copy, self->addr, (size_t)self->length);
    counted = self->views_offset >= 0 && self->exports > 0;
    if (counted) /* the file's word, while it is still mapped here */
        __atomic_fetch_sub((int64_t *)(self->addr + self->views_offset), 1, __ATOMIC_SEQ_CST);
    moved = mremap(copy, (size_t)self->length, (size_t)self->length,
                   MREMAP_MAYMOVE | MREMAP_FIXED, self->addr);
    if (moved == MAP_FAILED) {
        int err = errno;
        if (counted)
            __atomic_fetch_add((int64_t *)(self->addr + self->views_offset), 1, __ATOMIC_SEQ_CST);
        munmap(copy, (size_t)self->length);
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    self->views_offset = -1; /* counts no more: the memory is this process's alone */
    Py_RETURN_NONE;
}

/* Parse (offset) and check it names an aligned 8-byte word in the mapping. */
static int64_t *
word_at(Mapping *self, Py_ssize_t offset)
{
    if (check_open(self) < 0)
        return NULL;
    if (offset < 0 || offset % 8 || offset + 8 > self->length) {
        PyErr_Format(PyExc_ValueError,
                     "offset %zd is not an aligned 8-byte word inside %zd bytes",
                     offset, self->length);
        return NULL;
    }
    if (self->readonly) {
        PyErr_SetString(PyExc_TypeError, "atomics need a writable mapping");
        return NULL;
    }
    return (int64_t *)(self->addr + offset);
}

static PyObject *
mapping_fetch_add(Mapping *self, PyObject *args)
{
    Py_ssize_t offset;
    long long delta;
    int64_t *w;
    if (!PyArg_ParseTuple(args, "nL:fetch_add", &offset, &delta))
        return NULL;
    if ((w = word_at(self, offset)) == NULL)
        return NULL;
    return PyLong_FromLongLong(__atomic_fetch_add(w, (int64_t)delta, __ATOMIC_SEQ_CST));
}

static PyObject *
mapping_load(Mapping *self, PyObject *args)
{
    Py_ssize_t offset;
    int64_t *w;
    if (!PyArg_ParseTuple(args, "n:load", &offset))
        return NULL;
    if ((w = word_at(self, offset)) == NULL)
        return NULL;
    return PyLong_FromLongLong(__atomic_load_n(w, __ATOMIC_SEQ_CST));
}

static PyObject *
mapping_store(Mapping *self, PyObject *args)
{
    Py_ssize_t offset;
    long long value;
    int64_t *w;
    if (!PyArg_ParseTuple(args, "nL:store", &offset, &value))
        return NULL;
    if ((w = word_at(self, offset)) == NULL)
        return NULL;
    __atomic_store_n(w, (int64_t)value, __ATOMIC_SEQ_CST);
    Py_RETURN_NONE;
}

static PyObject *
mapping_compare_exchange(Mapping *self, PyObject *args)
{
    Py_ssize_t offset;
    long long expected, desired;
    int64_t *w, exp;
    int ok;
    if (!PyArg_ParseTuple(args, "nLL:compare_exchange", &offset, &expected, &desired))
        return NULL;
    if ((w = word_at(self, offset)) == NULL)
        return NULL;
    exp = (int64_t)expected;
    ok = __atomic_compare_exchange_n(w, &exp, (int64_t)desired, 0,
                                     __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    return Py_BuildValue("(OL)", ok ? Py_True : Py_False, (long long)exp);
}

/* futex on the low 32 bits of a 64-bit word (little-endian x86-64/aarch64). */
static PyObject *
mapping_futex_wait(Mapping *self, PyObject *args)
{
    Py_ssize_t offset;
    long long expected;
    double timeout = -1.0;
    int64_t *w;
    long rc;
    int err;
    struct timespec ts, *tsp = NULL;
    if (!PyArg_ParseTuple(args, "nL|d:futex_wait", &offset, &expected, &timeout))
        return NULL;
    if ((w = word_at(self, offset)) == NULL)
        return NULL;
    if (timeout >= 0) {
        ts.tv_sec = (time_t)timeout;
        ts.tv_nsec = (long)((timeout - (double)ts.tv_sec) * 1e9);
        tsp = &ts;
    }
    Py_BEGIN_ALLOW_THREADS
    rc = syscall(SYS_futex, (uint32_t *)w, FUTEX_WAIT, (uint32_t)expected, tsp,
                 NULL, 0);
    err = errno;
    Py_END_ALLOW_THREADS
    /* EINTR and EAGAIN return to Python, which re-checks its condition. */
    if (rc < 0 && err == EINTR && PyErr_CheckSignals())
        return NULL;
    if (rc < 0 && err != EAGAIN && err != EINTR && err != ETIMEDOUT) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyBool_FromLong(!(rc < 0 && err == ETIMEDOUT));
}

static PyObject *
mapping_futex_wake(Mapping *self, PyObject *args)
{
    Py_ssize_t offset;
    int n = INT32_MAX;
    int64_t *w;
    long rc;
    if (!PyArg_ParseTuple(args, "n|i:futex_wake", &offset, &n))
        return NULL;
    if ((w = word_at(self, offset)) == NULL)
        return NULL;
    rc = syscall(SYS_futex, (uint32_t *)w, FUTEX_WAKE, n, NULL, NULL, 0);
    if (rc < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    return PyLong_FromLong(rc);
}

static PyObject *
mapping_read(Mapping *self, PyObject *args)
{
    Py_ssize_t offset, n;
    if (!PyArg_ParseTuple(args, "nn:read", &offset, &n))
        return NULL;
    if (check_open(self) < 0)
        return NULL;
    if (offset < 0 || n < 0 || offset + n > self->length) {
        PyErr_SetString(PyExc_ValueError, "read outside the mapping");
        return NULL;
    }
    return PyBytes_FromStringAndSize(self->addr + offset, n);
}

static PyObject *
mapping_write(Mapping *self, PyObject *args)
{
    Py_ssize_t offset;
    Py_buffer data;
    if (!PyArg_ParseTuple(args, "ny*:write", &offset, &data))
        return NULL;
    if (check_open(self) < 0 || self->readonly) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "mapping is read-only");
        PyBuffer_Release(&data);
        return NULL;
    }
    if (offset < 0 || offset + data.len > self->length) {
        PyBuffer_Release(&data);
        PyErr_SetString(PyExc_ValueError, "write outside the mapping");
        return NULL;
    }
    memcpy(self->addr + offset, data.buf, (size_t)data.len);
    PyBuffer_Release(&data);
    Py_RETURN_NONE;
}

static PyObject *
mapping_get_closed(Mapping *self, void *c)
{
    return PyBool_FromLong(self->addr == NULL);
}

static PyObject *
mapping_get_address(Mapping *self, void *c)
{
    if (check_open(self) < 0)
        return NULL;
    return PyLong_FromVoidPtr(self->addr);
}

static PyObject *
mapping_get_length(Mapping *self, void *c)
{
    return PyLong_FromSsize_t(self->length);
}

static PyObject *
mapping_get_exports(Mapping *self, void *c)
{
    return PyLong_FromSsize_t(self->exports);
}

static PyObject *
mapping_get_readonly(Mapping *self, void *c)
{
    return PyBool_FromLong(self->readonly);
}

static PyMethodDef mapping_methods[] = {
    {"close", (PyCFunction)mapping_close, METH_NOARGS,
     "Unmap now; BufferError while exports (views) exist."},
    {"disown", (PyCFunction)mapping_disown, METH_NOARGS,
     "Give back this process's views count (if it has exports); count no more."},
    {"privatize", (PyCFunction)mapping_privatize, METH_NOARGS,
     "Move the mapping into private memory at the same address (fork copies it on write)."},
    {"fetch_add", (PyCFunction)mapping_fetch_add, METH_VARARGS,
     "fetch_add(offset, delta) -> previous value of the 64-bit word."},
    {"load", (PyCFunction)mapping_load, METH_VARARGS, "load(offset) -> value."},
    {"store", (PyCFunction)mapping_store, METH_VARARGS, "store(offset, value)."},
    {"compare_exchange", (PyCFunction)mapping_compare_exchange, METH_VARARGS,
     "compare_exchange(offset, expected, desired) -> (swapped, value seen)."},
    {"futex_wait", (PyCFunction)mapping_futex_wait, METH_VARARGS,
     "futex_wait(offset, expected, timeout=-1) -> False on timeout."},
    {"futex_wake", (PyCFunction)mapping_futex_wake, METH_VARARGS,
     "futex_wake(offset, n=all) -> number woken."},
    {"read", (PyCFunction)mapping_read, METH_VARARGS, "read(offset, n) -> bytes."},
    {"write", (PyCFunction)mapping_write, METH_VARARGS, "write(offset, data)."},
    {NULL}
};

static PyGetSetDef mapping_getset[] = {
    {"closed", (getter)mapping_get_closed, NULL, "True once unmapped.", NULL},
    {"address", (getter)mapping_get_address, NULL, "Start address.", NULL},
    {"length", (getter)mapping_get_length, NULL, "Mapped bytes.", NULL},
    {"exports", (getter)mapping_get_exports, NULL, "Live buffer exports.", NULL},
    {"readonly", (getter)mapping_get_readonly, NULL, "Mapped read-only.", NULL},
    {NULL}
};

static PyTypeObject MappingType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shm_core._native.Mapping",
    .tp_basicsize = sizeof(Mapping),
    .tp_dealloc = (destructor)mapping_dealloc,
    .tp_as_buffer = &mapping_as_buffer,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Mapping(fd, length, *, data_offset=0, populate=False, "
              "readonly=False, views_offset=-1): a shared mapping whose buffer "
              "is [data_offset, length); it does not keep fd.",
    .tp_traverse = (traverseproc)mapping_traverse,
    .tp_clear = (inquiry)mapping_clear,
    .tp_weaklistoffset = offsetof(Mapping, weakreflist),
    .tp_methods = mapping_methods,
    .tp_getset = mapping_getset,
    .tp_dictoffset = offsetof(Mapping, dict),
    .tp_init = (initproc)mapping_init,
    .tp_new = PyType_GenericNew,
};

/* The address of the first element of any strided buffer (a numpy array). */
static PyObject *
native_address(PyObject *mod, PyObject *obj)
{
    Py_buffer view;
    PyObject *res;
    if (PyObject_GetBuffer(obj, &view, PyBUF_STRIDES) < 0)
        return NULL;
    res = PyLong_FromVoidPtr(view.buf);
    PyBuffer_Release(&view);
    return res;
}

/* file_id(fd) -> (st_dev, st_ino): which file a descriptor opens (os.fstat builds a 20-field result with
 * float times, a tenth of a shared array's receive). */
static PyObject *
native_file_id(PyObject *mod, PyObject *args)
{
    struct stat st;
    int fd, r;
    if (!PyArg_ParseTuple(args, "i:file_id", &fd))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    r = fstat(fd, &st);
    Py_END_ALLOW_THREADS
    if (r < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    return Py_BuildValue("(KK)", (unsigned long long)st.st_dev, (unsigned long long)st.st_ino);
}

#define RECV_MANY_MAX 64

/* recv_many(fd, buffer, size, flags) -> [(length, msg_flags), ...]: up to len(buffer) // size (at most
 * RECV_MANY_MAX) messages, the k-th into buffer[k * size:], without ancillary data (descriptors sent along
 * are dropped by the kernel, MSG_CTRUNC set); [] when none is queued and flags hold MSG_DONTWAIT. */
static PyObject *
native_recv_many(PyObject *mod, PyObject *args)
{
    int fd, flags, n, i;
    Py_ssize_t size;
    Py_buffer buf;
    struct mmsghdr msgs[RECV_MANY_MAX];
    struct iovec iov[RECV_MANY_MAX];
    PyObject *res;
    if (!PyArg_ParseTuple(args, "iw*ni", &fd, &buf, &size, &flags))
        return NULL;
    if (size <= 0 || size > buf.len) {
        PyBuffer_Release(&buf);
        PyErr_SetString(PyExc_ValueError, "size must be positive and at most the buffer's length");
        return NULL;
    }
    n = (int)(buf.len / size < RECV_MANY_MAX ? buf.len / size : RECV_MANY_MAX);
    memset(msgs, 0, sizeof(msgs[0]) * n);
    for (i = 0; i < n; i++) {
        iov[i].iov_base = (char *)buf.buf + i * size;
        iov[i].iov_len = (size_t)size;
        msgs[i].msg_hdr.msg_iov = &iov[i];
        msgs[i].msg_hdr.msg_iovlen = 1;
    }
    do {
        Py_BEGIN_ALLOW_THREADS
        n = recvmmsg(fd, msgs, (unsigned int)n, flags, NULL);
        Py_END_ALLOW_THREADS
    } while (n < 0 && errno == EINTR && !PyErr_CheckSignals());
    PyBuffer_Release(&buf);
    if (n < 0) {
        if (PyErr_Occurred())
            return NULL;
        if (errno == EAGAIN || errno == EWOULDBLOCK)
            return PyList_New(0);
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    res = PyList_New(n);
    if (res == NULL)
        return NULL;
    for (i = 0; i < n; i++) {
        PyObject *item = Py_BuildValue("(ni)", (Py_ssize_t)msgs[i].msg_len, msgs[i].msg_hdr.msg_flags);
        if (item == NULL) {
            Py_DECREF(res);
            return NULL;
        }
        PyList_SET_ITEM(res, i, item);
    }
    return res;
}

/* Close the descriptors of a received control buffer; store how many it held in *n. */
static void
close_rights(struct msghdr *msg, Py_ssize_t *n)
{
    struct cmsghdr *c;
    *n = 0;
    for (c = CMSG_FIRSTHDR(msg); c != NULL; c = CMSG_NXTHDR(msg, c)) {
        if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
            Py_ssize_t k, m = (Py_ssize_t)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
            int *fds = (int *)CMSG_DATA(c);
            for (k = 0; k < m; k++)
                close(fds[k]);
            *n += m;
        }
    }
}

/* recvmsg with EINTR retried (signals checked) and the GIL released: -1 with a Python error set on failure. */
static ssize_t
recvmsg_retry(int fd, struct msghdr *msg, int flags)
{
    ssize_t r;
    do {
        Py_BEGIN_ALLOW_THREADS
        r = recvmsg(fd, msg, flags | MSG_CMSG_CLOEXEC);
        Py_END_ALLOW_THREADS
    } while (r < 0 && errno == EINTR && !PyErr_CheckSignals());
    if (r < 0 && !PyErr_Occurred())
        PyErr_SetFromErrno(PyExc_OSError); /* EAGAIN: BlockingIOError */
    return r;
}

#define RECV_FDS_MAX 1024

/* msg set to receive into buf[0:len] with the control buffer control[0:space]. */
static void
set_msg(struct msghdr *msg, struct iovec *iov, void *buf, size_t len, void *control, size_t space)
{
    iov->iov_base = buf;
    iov->iov_len = len;
    memset(msg, 0, sizeof(*msg));
    msg->msg_iov = iov;
    msg->msg_iovlen = 1;
    msg->msg_control = control;
    msg->msg_controllen = space;
}

/* recv_fds(fd, bufsize, maxfds, flags) -> (data, [fd, ...], msg_flags): one message, received as
 * shm_core._fds Note [descriptor headroom] says: a peek (its descriptors closed at once), then the
 * receive (MSG_DONTWAIT; peeked again when another reader took the message meanwhile). The peek
 * truncated with at most maxfds descriptors (this process is short of numbers): (None, [], msg_flags),
 * the message left queued. The caller checks msg_flags (MSG_TRUNC, MSG_CTRUNC). */
static PyObject *
native_recv_fds(PyObject *mod, PyObject *args)
{
    int fd, flags, maxfds;
    Py_ssize_t bufsize, n, k;
    char peek_byte;
    union { /* aligned for cmsghdr; one more descriptor: too many told from too few numbers */
        struct cmsghdr align;
        char buf[CMSG_SPACE((RECV_FDS_MAX + 1) * sizeof(int))];
    } control;
    size_t space;
    struct iovec iov;
    struct msghdr msg;
    ssize_t r;
    struct cmsghdr *c;
    PyObject *data = NULL, *fds;
    if (!PyArg_ParseTuple(args, "inii", &fd, &bufsize, &maxfds, &flags))
        return NULL;
    if (bufsize <= 0 || maxfds < 0 || maxfds > RECV_FDS_MAX) {
        PyErr_SetString(PyExc_ValueError, "bufsize must be positive and maxfds in [0, 1024]");
        return NULL;
    }
    space = CMSG_SPACE((size_t)(maxfds + 1) * sizeof(int));
    for (;;) {
        set_msg(&msg, &iov, &peek_byte, 1, control.buf, space);
        if (recvmsg_retry(fd, &msg, flags | MSG_PEEK) < 0)
            goto fail;
        close_rights(&msg, &n);
        if ((msg.msg_flags & MSG_CTRUNC) && n <= maxfds) {
            Py_XDECREF(data);
            return Py_BuildValue("(O[]i)", Py_None, msg.msg_flags);
        }
        /* the buffer once a message is there: a reader that finds none (MSG_DONTWAIT) allocates nothing */
        if (data == NULL && (data = PyBytes_FromStringAndSize(NULL, bufsize)) == NULL)
            return NULL;
        set_msg(&msg, &iov, PyBytes_AS_STRING(data), (size_t)bufsize, control.buf, space);
        r = recvmsg_retry(fd, &msg, flags | MSG_DONTWAIT);
        if (r >= 0)
            break;
        if (!(flags & MSG_DONTWAIT) && PyErr_ExceptionMatches(PyExc_BlockingIOError)) {
            PyErr_Clear(); /* another reader took the message we peeked */
            continue;
        }
        goto fail;
    }
    if (r < bufsize && _PyBytes_Resize(&data, r) < 0) { /* (data freed, set to NULL) */
        close_rights(&msg, &n); /* out of memory: the message is gone, its descriptors too (none may leak) */
        return NULL;
    }
    fds = PyList_New(0);
    for (c = CMSG_FIRSTHDR(&msg); fds != NULL && c != NULL; c = CMSG_NXTHDR(&msg, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
            continue;
        n = (Py_ssize_t)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
        for (k = 0; fds != NULL && k < n; k++) {
            PyObject *v = PyLong_FromLong(((int *)CMSG_DATA(c))[k]);
            if (v == NULL || PyList_Append(fds, v) < 0)
                Py_CLEAR(fds);
            Py_XDECREF(v);
        }
    }
    if (fds == NULL) { /* out of memory, as above */
        close_rights(&msg, &n);
        goto fail;
    }
    return Py_BuildValue("(NNi)", data, fds, msg.msg_flags & ~MSG_CMSG_CLOEXEC); /* (the kernel echoes it) */
fail:
    Py_XDECREF(data);
    return NULL;
}

#define SEND_BUFFERS_ON_STACK 16

/* send_fds(fd, buffers, fds, flags) -> bytes sent: one sendmsg of the bytes-like objects of the sequence
 * `buffers` (a Pool's batch is a hundred or more; the kernel takes IOV_MAX) with the descriptors of the
 * sequence `fds` as SCM_RIGHTS (at most RECV_FDS_MAX here; the kernel takes SCM_MAX_FD), the GIL released,
 * EINTR retried (signals checked), MSG_NOSIGNAL (a peer gone: BrokenPipeError, never SIGPIPE).
 * socket.sendmsg builds its ancillary data from Python tuples: a microsecond a message. */
static PyObject *
native_send_fds(PyObject *mod, PyObject *args)
{
    int fd, flags;
    PyObject *bufs_arg, *fds_arg, *bufs = NULL, *fdseq = NULL, *res = NULL;
    Py_buffer stack_views[SEND_BUFFERS_ON_STACK], *views = stack_views;
    struct iovec stack_iov[SEND_BUFFERS_ON_STACK], *iov = stack_iov;
    union {
        struct cmsghdr align;
        char buf[CMSG_SPACE(RECV_FDS_MAX * sizeof(int))];
    } control;
    struct msghdr msg;
    Py_ssize_t nbufs, nfds, got = 0, i;
    ssize_t r;
    if (!PyArg_ParseTuple(args, "iOOi:send_fds", &fd, &bufs_arg, &fds_arg, &flags))
        return NULL;
    bufs = PySequence_Fast(bufs_arg, "buffers must be a sequence of bytes-like objects");
    fdseq = bufs == NULL ? NULL : PySequence_Fast(fds_arg, "fds must be a sequence of descriptors");
    if (fdseq == NULL)
        goto done;
    nbufs = PySequence_Fast_GET_SIZE(bufs);
    nfds = PySequence_Fast_GET_SIZE(fdseq);
    if (nfds > RECV_FDS_MAX) {
        PyErr_Format(PyExc_ValueError, "at most %d descriptors in one message", RECV_FDS_MAX);
        goto done;
    }
    if (nbufs > SEND_BUFFERS_ON_STACK) {
        views = PyMem_New(Py_buffer, nbufs);
        iov = PyMem_New(struct iovec, nbufs);
        if (views == NULL || iov == NULL) {
            PyErr_NoMemory();
            goto done;
        }
    }
    memset(&msg, 0, sizeof(msg));
    for (got = 0; got < nbufs; got++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(bufs, got), &views[got], PyBUF_SIMPLE) < 0)
            goto done;
        iov[got].iov_base = views[got].buf;
        iov[got].iov_len = (size_t)views[got].len;
    }
    msg.msg_iov = iov;
    msg.msg_iovlen = (size_t)nbufs;
    if (nfds > 0) {
        struct cmsghdr *c;
        int *out;
        msg.msg_control = control.buf;
        msg.msg_controllen = CMSG_SPACE((size_t)nfds * sizeof(int));
        memset(control.buf, 0, msg.msg_controllen);
        c = CMSG_FIRSTHDR(&msg);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN((size_t)nfds * sizeof(int));
        out = (int *)CMSG_DATA(c);
        for (i = 0; i < nfds; i++) {
            long v = PyLong_AsLong(PySequence_Fast_GET_ITEM(fdseq, i));
            if (v == -1 && PyErr_Occurred())
                goto done;
            if (v < 0 || v > INT_MAX) {
                PyErr_Format(PyExc_ValueError, "%ld is not a descriptor", v);
                goto done;
            }
            out[i] = (int)v;
        }
    }
    do {
        Py_BEGIN_ALLOW_THREADS
        r = sendmsg(fd, &msg, flags | MSG_NOSIGNAL);
        Py_END_ALLOW_THREADS
    } while (r < 0 && errno == EINTR && !PyErr_CheckSignals());
    if (r >= 0)
        res = PyLong_FromSsize_t(r);
    else if (!PyErr_Occurred())
        PyErr_SetFromErrno(PyExc_OSError); /* EAGAIN: BlockingIOError, EPIPE: BrokenPipeError */
done:
    for (i = 0; i < got; i++)
        PyBuffer_Release(&views[i]);
    if (views != stack_views)
        PyMem_Free(views);
    if (iov != stack_iov)
        PyMem_Free(iov);
    Py_XDECREF(bufs);
    Py_XDECREF(fdseq);
    return res;
}

/* ------------------------------------------------------- numpy allocator */

/* The policy (mp_reductions Note [shared allocation]): `owned` maps the address
   of each allocation it served to a tuple whose first item is its size;
   `take(nbytes, zero)` returns the address of a segment's data (0: use the
   default), `give(address)` takes one back. Held here for good, so what the
   registry maps stays mapped through the interpreter's shutdown. */
static size_t alloc_threshold = SIZE_MAX;
static PyObject *alloc_owned, *alloc_take, *alloc_give;
static PyDataMem_Handler *numpy_default;
static _Thread_local int in_take; /* a numpy allocation made by `take` itself */
static uintptr_t page_mask;
#define SEGMENT_DATA 64 /* a segment's data starts 64 bytes (its header) into a page */

static int
finalizing(void)
{
#if PY_VERSION_HEX >= 0x030D0000
    return Py_IsFinalizing();
#else
    return _Py_IsFinalizing();
#endif
}

/* An error of the policy cannot reach numpy's caller: it is reported, and a
   Ctrl-C that arrived meanwhile is raised again at the next check. */
static void
report(PyObject *where)
{
    if (PyErr_ExceptionMatches(PyExc_KeyboardInterrupt)) {
        PyErr_Clear();
        PyErr_SetInterrupt();
    }
    else
        PyErr_WriteUnraisable(where);
}

static void *
take_segment(size_t nbytes, int zero)
{
    PyGILState_STATE gil;
    PyObject *type, *value, *tb, *r;
    void *p = NULL;
    if (alloc_take == NULL || in_take || nbytes > PY_SSIZE_T_MAX || finalizing())
        return NULL;
    gil = PyGILState_Ensure();
    PyErr_Fetch(&type, &value, &tb); /* numpy may allocate while an exception is set */
    in_take = 1;
    r = PyObject_CallFunction(alloc_take, "nO", (Py_ssize_t)nbytes, zero ? Py_True : Py_False);
    in_take = 0;
    if (r != NULL) {
        p = PyLong_AsVoidPtr(r);
        Py_DECREF(r);
    }
    if (PyErr_Occurred()) {
        report(alloc_take);
        p = NULL;
    }
    PyErr_Restore(type, value, tb);
    PyGILState_Release(gil);
    return p;
}

/* The size of the segment allocation at `p` (-1: not one), GIL held. */
static Py_ssize_t
owned_size(void *p)
{
    PyObject *key = PyLong_FromVoidPtr(p), *entry;
    Py_ssize_t size = -1;
    if (key == NULL)
        return -1;
    entry = PyDict_GetItemWithError(alloc_owned, key);
    Py_DECREF(key);
    if (entry != NULL && PyTuple_Check(entry) && PyTuple_GET_SIZE(entry) > 0)
        size = PyLong_AsSsize_t(PyTuple_GET_ITEM(entry, 0));
    return size;
}

/* Give `p` back to the policy if it is a segment's; 0 when it is not (free it
   as numpy's). During shutdown a segment is left mapped: the process is
   ending, and an anonymous segment has no name to leak. */
static int
give_segment(void *p)
{
    PyGILState_STATE gil;
    PyObject *type, *value, *tb, *r;
    int fin, ours;
    if (alloc_owned == NULL || ((uintptr_t)p & page_mask) != SEGMENT_DATA)
        return 0;
    fin = finalizing();
    if (fin && !PyGILState_Check())
        return 1; /* cannot look it up without the GIL now: keep it, whatever it is */
    gil = PyGILState_Ensure();
    PyErr_Fetch(&type, &value, &tb);
    ours = owned_size(p) >= 0;
    if (ours && !fin) {
        r = PyObject_CallFunction(alloc_give, "N", PyLong_FromVoidPtr(p));
        Py_XDECREF(r);
    }
    if (PyErr_Occurred())
        report(alloc_give);
    PyErr_Restore(type, value, tb);
    PyGILState_Release(gil);
    return ours || fin;
}

static void *
handler_malloc(void *ctx, size_t size)
{
    void *p = size >= alloc_threshold ? take_segment(size, 0) : NULL;
    return p ? p : numpy_default->allocator.malloc(numpy_default->allocator.ctx, size);
}

static void *
handler_calloc(void *ctx, size_t nelem, size_t elsize)
{
    void *p = NULL;
    if (elsize == 0 || nelem <= SIZE_MAX / elsize)
        p = nelem * elsize >= alloc_threshold ? take_segment(nelem * elsize, 1) : NULL;
    return p ? p : numpy_default->allocator.calloc(numpy_default->allocator.ctx, nelem, elsize);
}

static void
handler_free(void *ctx, void *p, size_t size)
{
    if (!give_segment(p))
        numpy_default->allocator.free(numpy_default->allocator.ctx, p, size);
}

/* A segment's data moves to a new allocation (a segment or numpy's, by size;
   numpy's while shutting down); anything else is numpy's realloc. */
static void *
handler_realloc(void *ctx, void *p, size_t size)
{
    PyGILState_STATE gil;
    PyObject *type, *value, *tb;
    Py_ssize_t old;
    void *q = NULL;
    if (alloc_owned != NULL && ((uintptr_t)p & page_mask) == SEGMENT_DATA) {
        if (finalizing() && !PyGILState_Check())
            return NULL; /* cannot look it up now: numpy raises MemoryError */
        gil = PyGILState_Ensure();
        PyErr_Fetch(&type, &value, &tb);
        old = owned_size(p);
        PyErr_Clear();
        if (old >= 0 && (q = handler_malloc(ctx, size)) != NULL) {
            memcpy(q, p, (size_t)old < size ? (size_t)old : size);
            handler_free(ctx, p, (size_t)old);
        }
        PyErr_Restore(type, value, tb);
        PyGILState_Release(gil);
        if (old >= 0)
            return q;
    }
    return numpy_default->allocator.realloc(numpy_default->allocator.ctx, p, size);
}

static PyDataMem_Handler shared_handler = {
    "arraymp_shared", 1,
    {NULL, handler_malloc, handler_calloc, handler_realloc, handler_free},
};

static int
numpy_ready(void)
{
    if (numpy_default != NULL)
        return 0;
    if (_import_array() < 0)
        return -1;
    numpy_default = PyCapsule_GetPointer(PyDataMem_DefaultHandler, "mem_handler");
    return numpy_default == NULL ? -1 : 0;
}

static PyObject *
native_set_allocator(PyObject *mod, PyObject *args)
{
    Py_ssize_t threshold;
    PyObject *owned, *take, *give;
    if (!PyArg_ParseTuple(args, "nO!OO:set_allocator", &threshold, &PyDict_Type, &owned,
                          &take, &give))
        return NULL;
    if (threshold < 1 || !PyCallable_Check(take) || !PyCallable_Check(give)) {
        PyErr_SetString(PyExc_ValueError, "set_allocator needs a threshold >= 1 and two callables");
        return NULL;
    }
    if (alloc_owned != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "the allocator's policy is set once per process");
        return NULL;
    }
    if (numpy_ready() < 0)
        return NULL;
    /* kept for good (see above) */
    Py_INCREF(owned);
    Py_INCREF(take);
    Py_INCREF(give);
    alloc_owned = owned;
    alloc_take = take;
    alloc_give = give;
    alloc_threshold = (size_t)threshold;
    Py_RETURN_NONE;
}

static PyObject *
native_swap_handler(PyObject *mod, PyObject *handler)
{
    if (numpy_ready() < 0)
        return NULL;
    return PyDataMem_SetHandler(handler == Py_None ? NULL : handler);
}

/* ------------------------------------------------------- bare arrays */
/* A message that is one array alone travels with no pickle (mp_reductions Note [bare arrays]):
 *
 *     <BBB flags, len(code), ndim> code, int64 shape[ndim], [int64 strides[ndim]: flags & 4], [its bytes]
 *
 * code: the dtype's string; flags: read-only 1, Fortran order 2 (its bytes follow), strides 4 (a view).
 * Packed and unpacked in Python, the header cost more than the system calls that carry the message; here
 * is only its layout and the checks that a received one names an array (it comes from another process).
 * Which arrays go bare, and how their memory is counted, is mp_reductions._bare's. */

#define BARE_READONLY 1
#define BARE_FORTRAN 2
#define BARE_STRIDES 4

static void
put_i64(char *p, int64_t v)
{
    int i;
    for (i = 0; i < 8; i++)
        p[i] = (char)((uint64_t)v >> (8 * i));
}

static int64_t
get_i64(const unsigned char *p)
{
    uint64_t v = 0;
    int i;
    for (i = 7; i >= 0; i--)
        v = v << 8 | p[i];
    return (int64_t)v;
}

/* pack_array(prefix, arr, code, flags, data) -> prefix + header (+ arr's bytes in C, or with flags & 2
 * Fortran, order: data) */
static PyObject *
native_pack_array(PyObject *mod, PyObject *args)
{
    Py_buffer prefix, code;
    PyArrayObject *arr;
    int flags, data, nd, i;
    Py_ssize_t nbytes, size;
    PyObject *res = NULL;
    char *p;
    if (numpy_ready() < 0)
        return NULL;
    if (!PyArg_ParseTuple(args, "y*O!y*ip:pack_array", &prefix, &PyArray_Type, &arr, &code, &flags, &data))
        return NULL;
    nd = PyArray_NDIM(arr);
    if (code.len > 255 || (flags & ~(BARE_READONLY | BARE_FORTRAN | BARE_STRIDES)) != 0) {
        PyErr_SetString(PyExc_ValueError, "pack_array: a code of at most 255 bytes and flags in [0, 7]");
        goto done;
    }
    nbytes = data ? PyArray_NBYTES(arr) : 0;
    size = prefix.len + 3 + code.len + 8 * (Py_ssize_t)nd * (flags & BARE_STRIDES ? 2 : 1) + nbytes;
    if ((res = PyBytes_FromStringAndSize(NULL, size)) == NULL)
        goto done;
    p = PyBytes_AS_STRING(res);
    memcpy(p, prefix.buf, (size_t)prefix.len);
    p += prefix.len;
    *p++ = (char)flags;
    *p++ = (char)code.len;
    *p++ = (char)nd;
    memcpy(p, code.buf, (size_t)code.len);
    p += code.len;
    for (i = 0; i < nd; i++, p += 8)
        put_i64(p, PyArray_DIM(arr, i));
    for (i = 0; (flags & BARE_STRIDES) && i < nd; i++, p += 8)
        put_i64(p, PyArray_STRIDE(arr, i));
    if (nbytes == 0)
        goto done;
    if (flags & BARE_FORTRAN ? PyArray_IS_F_CONTIGUOUS(arr) : PyArray_IS_C_CONTIGUOUS(arr)) {
        memcpy(p, PyArray_DATA(arr), (size_t)nbytes);
    } else { /* a strided view: numpy copies it into the message */
        PyArray_Descr *descr = PyArray_DESCR(arr);
        PyObject *dst;
        Py_INCREF(descr);
        dst = PyArray_NewFromDescr(&PyArray_Type, descr, nd, PyArray_DIMS(arr), NULL, p,
                                   NPY_ARRAY_WRITEABLE | (flags & BARE_FORTRAN ? NPY_ARRAY_F_CONTIGUOUS : 0), NULL);
        if (dst == NULL || PyArray_CopyInto((PyArrayObject *)dst, arr) < 0)
            Py_CLEAR(res);
        Py_XDECREF(dst);
    }
done:
    PyBuffer_Release(&prefix);
    PyBuffer_Release(&code);
    return res;
}

static PyObject *
bare_error(const char *what)
{
    PyErr_Format(PyExc_ValueError, "bare array header: %s", what);
    return NULL;
}

/* The dtype a received code names, if an array of it may travel bare (no Python objects, fields or
 * subarray; sized, or V0); else NULL with ValueError set. The last one is kept: a stream has one dtype. */
static PyArray_Descr *
bare_dtype(const unsigned char *code, Py_ssize_t n)
{
    static char last_code[256];
    static Py_ssize_t last_n = -1;
    static PyArray_Descr *last;
    PyObject *str;
    PyArray_Descr *descr = NULL, *old;
    if (last != NULL && n == last_n && memcmp(code, last_code, (size_t)n) == 0) {
        Py_INCREF(last);
        return last;
    }
    if ((str = PyUnicode_DecodeASCII((const char *)code, n, "strict")) == NULL) {
        PyErr_Clear();
        bare_error("its dtype string is not ASCII");
        return NULL;
    }
    if (!PyArray_DescrConverter(str, &descr))
        descr = NULL;
    Py_DECREF(str);
    if (descr == NULL) { /* whatever numpy raised for the string (TypeError, a warning made an error, ...) */
        if (!PyErr_ExceptionMatches(PyExc_MemoryError)) {
            PyErr_Clear();
            bare_error("its dtype string names no dtype");
        }
        return NULL;
    }
    if (descr->type_num < 0 || descr->type_num >= NPY_NTYPES_LEGACY || PyDataType_REFCHK(descr)
        || PyDataType_HASFIELDS(descr) || PyDataType_HASSUBARRAY(descr)
        || (PyDataType_ELSIZE(descr) == 0 && descr->type_num != NPY_VOID)) {
        Py_DECREF(descr);
        bare_error("its dtype holds Python objects, fields or a subarray, or is unsized");
        return NULL;
    }
    old = last; /* the cache whole before the old one goes (its deallocation may run another thread) */
    Py_INCREF(descr);
    last = descr;
    memcpy(last_code, code, (size_t)n);
    last_n = n;
    Py_XDECREF(old);
    return descr;
}

/* array_from(data, at, buffer, offset) -> the array whose header starts at data[at]:
 *   buffer None: a new array, its bytes the rest of data;
 *   else a view of buffer (a memoryview or an ndarray, kept as its base) at byte offset `offset`, strides
 *   from the header (C order when none), every byte it spans inside buffer.
 * A header that names no such array raises ValueError, before anything is made. */
static PyObject *
native_array_from(PyObject *mod, PyObject *args)
{
    Py_buffer data, view;
    Py_ssize_t at, offset;
    PyObject *buffer, *res = NULL;
    const unsigned char *p, *end;
    int flags, nd, i;
    Py_ssize_t n, itemsize;
    npy_intp dims[NPY_MAXDIMS], strides[NPY_MAXDIMS];
    int64_t items = 1, cells = 1;
    PyArray_Descr *descr = NULL;
    if (numpy_ready() < 0)
        return NULL;
    if (!PyArg_ParseTuple(args, "y*nOn:array_from", &data, &at, &buffer, &offset))
        return NULL;
    if (at < 0 || at > data.len || data.len - at < 3) {
        bare_error("cut short");
        goto done;
    }
    p = (const unsigned char *)data.buf + at;
    end = (const unsigned char *)data.buf + data.len;
    flags = p[0];
    n = p[1];
    nd = p[2];
    p += 3;
    if (nd > NPY_MAXDIMS || end - p < n + 8 * (Py_ssize_t)nd
        || (flags & ~(buffer == Py_None ? BARE_READONLY | BARE_FORTRAN : BARE_READONLY | BARE_STRIDES))) {
        bare_error("bad flags, too many dimensions or cut short");
        goto done;
    }
    if ((descr = bare_dtype(p, n)) == NULL)
        goto done;
    p += n;
    itemsize = PyDataType_ELSIZE(descr);
    for (i = 0; i < nd; i++, p += 8) {
        int64_t d = get_i64(p);
        if (d < 0 || __builtin_mul_overflow(items, d, &items) || __builtin_mul_overflow(cells, d ? d : 1, &cells)
            || __builtin_mul_overflow(cells, itemsize ? itemsize : 1, &(int64_t){0})) {
            bare_error("a negative dimension, or more items than an array can hold");
            goto done;
        }
        dims[i] = (npy_intp)d;
    }
    if (buffer == Py_None) {
        if (end - p != items * itemsize) {
            bare_error("its bytes are not the array's");
            goto done;
        }
        res = PyArray_NewFromDescr(&PyArray_Type, descr, nd, dims, NULL, NULL,
                                   flags & BARE_FORTRAN ? NPY_ARRAY_F_CONTIGUOUS : 0, NULL);
        descr = NULL; /* (stolen) */
        if (res == NULL)
            goto done;
        if (end > p)
            memcpy(PyArray_DATA((PyArrayObject *)res), p, (size_t)(end - p));
        if (flags & BARE_READONLY)
            PyArray_CLEARFLAGS((PyArrayObject *)res, NPY_ARRAY_WRITEABLE);
        goto done;
    }
    if (flags & BARE_STRIDES) {
        if (end - p != 8 * (Py_ssize_t)nd) {
            bare_error("cut short or too long");
            goto done;
        }
        for (i = 0; i < nd; i++, p += 8) {
            int64_t st = get_i64(p);
            if (st == INT64_MIN) {
                bare_error("a stride out of range");
                goto done;
            }
            strides[i] = (npy_intp)st;
        }
    } else {
        int64_t step = itemsize;
        if (p != end) {
            bare_error("too long");
            goto done;
        }
        for (i = nd - 1; i >= 0; i--) {
            strides[i] = (npy_intp)step;
            step *= dims[i] ? dims[i] : 1; /* (no overflow: checked above) */
        }
    }
    if (!PyMemoryView_Check(buffer) && !PyArray_Check(buffer)) {
        PyErr_SetString(PyExc_TypeError, "array_from: buffer must be None, a memoryview or an ndarray");
        goto done;
    }
    if (PyObject_GetBuffer(buffer, &view, PyBUF_SIMPLE) < 0)
        goto done;
    {
        __int128 lo = offset, hi = offset;
        if (items > 0) {
            for (i = 0; i < nd; i++) {
                __int128 span = (__int128)strides[i] * (dims[i] - 1);
                if (span < 0)
                    lo += span;
                else
                    hi += span;
            }
            hi += itemsize;
        }
        if (offset < 0 || lo < 0 || hi > view.len) {
            PyBuffer_Release(&view);
            PyErr_Format(PyExc_ValueError, "array handle out of bounds: offset %zd, its bytes past the %zd of "
                         "its buffer", offset, view.len);
            goto done;
        }
    }
    res = PyArray_NewFromDescr(&PyArray_Type, descr, nd, dims, strides, (char *)view.buf + offset,
                               view.readonly || (flags & BARE_READONLY) ? 0 : NPY_ARRAY_WRITEABLE, NULL);
    descr = NULL; /* (stolen) */
    PyBuffer_Release(&view); /* buffer, the array's base, keeps the memory */
    if (res != NULL) {
        Py_INCREF(buffer);
        if (PyArray_SetBaseObject((PyArrayObject *)res, buffer) < 0)
            Py_CLEAR(res);
    }
done:
    Py_XDECREF(descr);
    PyBuffer_Release(&data);
    return res;
}

static PyMethodDef native_methods[] = {
    {"recv_fds", native_recv_fds, METH_VARARGS,
     "recv_fds(fd, bufsize, maxfds, flags) -> (data, [fd, ...], msg_flags): peek, then receive one message "
     "with its descriptors; (None, [], msg_flags) when the peek's were truncated (the message stays queued)"},
    {"send_fds", native_send_fds, METH_VARARGS,
     "send_fds(fd, buffers, fds, flags) -> bytes sent: one sendmsg, the descriptors as SCM_RIGHTS."},
    {"recv_many", native_recv_many, METH_VARARGS,
     "recv_many(fd, buffer, size, flags) -> [(length, msg_flags), ...]: recvmmsg, message k in "
     "buffer[k * size:], no ancillary data."},
    {"file_id", native_file_id, METH_VARARGS, "file_id(fd) -> (st_dev, st_ino) (fstat)."},
    {"address", native_address, METH_O,
     "address(buffer) -> address of its first byte (any strides, any dtype)."},
    {"memfd_create", native_memfd_create, METH_VARARGS,
     "memfd_create(name) -> fd (close-on-exec, sealing allowed)."},
    {"fallocate", native_fallocate, METH_VARARGS,
     "fallocate(fd, length, path): reserve the pages (posix_fallocate)."},
    {"set_allocator", native_set_allocator, METH_VARARGS,
     "set_allocator(threshold, owned, take, give): the policy of the shared numpy handler."},
    {"swap_handler", native_swap_handler, METH_O,
     "swap_handler(capsule or None) -> the previous numpy data-memory handler of this context."},
    {"pack_array", native_pack_array, METH_VARARGS,
     "pack_array(prefix, arr, code, flags, data) -> bytes: prefix, a bare array's header (and its bytes)."},
    {"array_from", native_array_from, METH_VARARGS,
     "array_from(data, at, buffer, offset) -> ndarray: the array a bare header at data[at] names, a copy "
     "of the bytes after it (buffer None) or a view of buffer."},
    {NULL}
};

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT, "_native", "Thin system-call layer of shm_core.", -1,
    native_methods,
};

PyMODINIT_FUNC
PyInit__native(void)
{
    PyObject *m, *handler;
    if (PyType_Ready(&MappingType) < 0)
        return NULL;
    m = PyModule_Create(&native_module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&MappingType);
    if (PyModule_AddObject(m, "Mapping", (PyObject *)&MappingType) < 0) {
        Py_DECREF(&MappingType);
        Py_DECREF(m);
        return NULL;
    }
    page_mask = (uintptr_t)sysconf(_SC_PAGESIZE) - 1;
    handler = PyCapsule_New(&shared_handler, "mem_handler", NULL);
    if (handler == NULL || PyModule_AddObject(m, "shared_handler", handler) < 0) {
        Py_XDECREF(handler);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
