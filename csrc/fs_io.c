// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
//
// vllm._kv_offload_fs_io: the fs tier's system calls, each kind made for a whole task of blocks
// with the GIL released once.
//
// The fs tier's I/O threads move one block per file; in Python every system call of a block
// (about ten) releases the GIL and takes it back, and on a small host each take-back waits while
// another thread runs Python. These functions make one kind of system call (directory opens and
// looks, creations, writes and renames, reads) for every block of a task in one call. They
// decide nothing: each returns, per block, what happened, and the caller
// (vllm/v1/kv_offload/tiering/fs/transfers.py) takes every block that left the common path
// through its Python code, so the behaviour on those paths is the Python code's.
//
// Linux only (O_DIRECT, openat). Names are ASCII (hex digests, the tier's own directory names).

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

#define DIR_FLAGS (O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC)
// As block_io._READ_FLAGS: never follow a link, never block on a FIFO planted in the tree.
#define READ_FLAGS (O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC)

// Result of one block in read_files: 0 read whole, else why the Python path must take it.
enum {
  READ_OK = 0,
  READ_NOT_REGULAR = -1,  // not a regular file
  READ_WRONG_SIZE = -2,   // not the expected size
  READ_SHORT = -3,        // fewer bytes than its size (truncated meanwhile)
};

// Moves *at past n bytes of the *iovcnt iovecs it points to (after a short readv/writev).
static void advance(struct iovec** at, int* iovcnt, size_t n) {
  while (*iovcnt > 0 && n >= (*at)->iov_len) {
    n -= (*at)->iov_len;
    (*at)++;
    (*iovcnt)--;
  }
  if (*iovcnt > 0) {
    (*at)->iov_base = (char*)(*at)->iov_base + n;
    (*at)->iov_len -= n;
  }
}

// Opens directory `name` in `dir_fd` (no link followed); with create_mode >= 0 creates it first
// if absent (as block_io.open_dir: a concurrent creator's directory is fine). fd or -errno.
static int open_dir(int dir_fd, const char* name, int create_mode) {
  int fd = openat(dir_fd, name, DIR_FLAGS);
  if (fd >= 0 || errno != ENOENT || create_mode < 0) return fd >= 0 ? fd : -errno;
  if (mkdirat(dir_fd, name, (mode_t)create_mode) != 0 && errno != EEXIST) return -errno;
  fd = openat(dir_fd, name, DIR_FLAGS);
  return fd >= 0 ? fd : -errno;
}

static int open_leaf(int rank_fd, const char* dir1, const char* dir2, int create_mode) {
  int fd1 = open_dir(rank_fd, dir1, create_mode);
  if (fd1 < 0) return fd1;
  int fd2 = open_dir(fd1, dir2, create_mode);
  close(fd1);
  return fd2;
}

// Reads header and payload of one block file; returns a READ_* code or a positive errno.
static int read_one(int rank_fd, const char* dir1, const char* dir2, const char* name,
                    char* header, size_t header_len, char* row, size_t row_len, int o_direct) {
  int leaf = open_leaf(rank_fd, dir1, dir2, -1);
  if (leaf < 0) return -leaf;
  int fd = openat(leaf, name, READ_FLAGS | (o_direct ? O_DIRECT : 0));
  int result = READ_OK;
  if (fd < 0) {
    result = errno;
    close(leaf);
    return result;
  }
  struct stat st;
  if (fstat(fd, &st) != 0) {
    result = errno;
  } else if (!S_ISREG(st.st_mode)) {
    result = READ_NOT_REGULAR;
  } else if ((size_t)st.st_size != header_len + row_len) {
    result = READ_WRONG_SIZE;
  } else {
    struct iovec iov[2] = {{header, header_len}, {row, row_len}};
    int iovcnt = 2;
    struct iovec* at = iov;
    size_t left = header_len + row_len;
    while (left > 0) {
      ssize_t got = readv(fd, at, iovcnt);
      if (got < 0) {
        if (errno == EINTR) continue;
        result = errno;
        break;
      }
      if (got == 0) {
        result = READ_SHORT;
        break;
      }
      left -= (size_t)got;
      advance(&at, &iovcnt, (size_t)got);
    }
  }
  close(fd);
  close(leaf);
  return result;
}

typedef struct {
  const char* dir1;
  const char* dir2;
  const char* name;
  Py_buffer row;
  int has_row;
  int result;
} ReadEntry;

static const char* ascii_of(PyObject* obj, const char* what) {
  const char* s = PyUnicode_Check(obj) ? PyUnicode_AsUTF8(obj) : NULL;
  if (s == NULL && !PyErr_Occurred()) PyErr_Format(PyExc_TypeError, "%s must be a str", what);
  return s;
}

// Reads a (dir1, dir2, name) tuple of str; 0 on success, -1 with an exception.
static int parse_path(PyObject* path, const char** dir1, const char** dir2, const char** name) {
  if (!PyTuple_Check(path) || PyTuple_GET_SIZE(path) != 3) {
    PyErr_SetString(PyExc_TypeError, "each path must be a (dir1, dir2, name) tuple");
    return -1;
  }
  if ((*dir1 = ascii_of(PyTuple_GET_ITEM(path, 0), "dir1")) == NULL ||
      (*dir2 = ascii_of(PyTuple_GET_ITEM(path, 1), "dir2")) == NULL ||
      (*name = ascii_of(PyTuple_GET_ITEM(path, 2), "name")) == NULL)
    return -1;
  return 0;
}

PyDoc_STRVAR(read_files_doc,
             "read_files(rank_fd, paths, headers, rows, o_direct) -> list[int]\n\n"
             "For each (dir1, dir2, name) of paths: open rank_fd/dir1/dir2/name (no link "
             "followed), and if it is a regular file of len(header) + len(row) bytes read it "
             "into its header (consecutive HEADER_SIZE slices of headers) and its row. Per "
             "file: 0 if read whole, a positive errno, or -1 (not a regular file), -2 (wrong "
             "size), -3 (short read). The GIL is released once for all files.");

static PyObject* read_files(PyObject* self, PyObject* args) {
  (void)self;
  int rank_fd, o_direct;
  PyObject *paths, *rows;
  Py_buffer headers;
  if (!PyArg_ParseTuple(args, "iOw*Op", &rank_fd, &paths, &headers, &rows, &o_direct))
    return NULL;
  PyObject* result = NULL;
  ReadEntry* entries = NULL;
  Py_ssize_t n = 0;
  if (!PyList_Check(paths) || !PyList_Check(rows) ||
      PyList_GET_SIZE(paths) != PyList_GET_SIZE(rows)) {
    PyErr_SetString(PyExc_TypeError, "paths and rows must be lists of the same length");
    goto done;
  }
  n = PyList_GET_SIZE(paths);
  if (n == 0 || headers.len % n != 0) {
    PyErr_SetString(PyExc_ValueError, "headers must hold one equal slice per file");
    goto done;
  }
  entries = PyMem_Calloc((size_t)n, sizeof(ReadEntry));
  if (entries == NULL) {
    PyErr_NoMemory();
    goto done;
  }
  size_t header_len = (size_t)(headers.len / n);
  for (Py_ssize_t i = 0; i < n; i++) {
    ReadEntry* e = &entries[i];
    if (parse_path(PyList_GET_ITEM(paths, i), &e->dir1, &e->dir2, &e->name) != 0) goto done;
    int flags = PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS;
    if (PyObject_GetBuffer(PyList_GET_ITEM(rows, i), &e->row, flags) != 0) goto done;
    e->has_row = 1;
  }
  Py_BEGIN_ALLOW_THREADS;
  for (Py_ssize_t i = 0; i < n; i++) {
    ReadEntry* e = &entries[i];
    char* header = (char*)headers.buf + (size_t)i * header_len;
    e->result = read_one(rank_fd, e->dir1, e->dir2, e->name, header, header_len, (char*)e->row.buf,
                         (size_t)e->row.len, o_direct);
  }
  Py_END_ALLOW_THREADS;
  result = PyList_New(n);
  if (result == NULL) goto done;
  for (Py_ssize_t i = 0; i < n; i++) {
    PyObject* code = PyLong_FromLong(entries[i].result);
    if (code == NULL) {
      Py_CLEAR(result);
      goto done;
    }
    PyList_SET_ITEM(result, i, code);
  }
done:
  if (entries != NULL) {
    for (Py_ssize_t i = 0; i < n; i++)
      if (entries[i].has_row) PyBuffer_Release(&entries[i].row);
    PyMem_Free(entries);
  }
  PyBuffer_Release(&headers);
  return result;
}

typedef struct {
  const char* dir1;
  const char* dir2;
  const char* name;
  int leaf_fd;  // or -errno
  int exists;   // 0 absent, 1 something there, or -errno of the stat
} OpenEntry;

PyDoc_STRVAR(open_leaves_doc,
             "open_leaves(rank_fd, paths, create_mode) -> list[tuple[int, int]]\n\n"
             "For each (dir1, dir2, name) of paths: open directory rank_fd/dir1/dir2 (no link "
             "followed; with create_mode >= 0 each directory missing is made with that mode, "
             "which the umask narrows) and look for name in it (not followed). Per path: (the "
             "directory's fd, or -errno), and 0 if name is absent, 1 if something is there, "
             "-errno if the look failed (0 when the directory did not open). The caller owns "
             "the fds. The GIL is released once for all paths.");

static PyObject* open_leaves(PyObject* self, PyObject* args) {
  (void)self;
  int rank_fd, create_mode;
  PyObject* paths;
  if (!PyArg_ParseTuple(args, "iO!i", &rank_fd, &PyList_Type, &paths, &create_mode)) return NULL;
  Py_ssize_t n = PyList_GET_SIZE(paths);
  OpenEntry* entries = PyMem_Calloc((size_t)(n ? n : 1), sizeof(OpenEntry));
  if (entries == NULL) return PyErr_NoMemory();
  PyObject* result = NULL;
  for (Py_ssize_t i = 0; i < n; i++) {
    OpenEntry* e = &entries[i];
    if (parse_path(PyList_GET_ITEM(paths, i), &e->dir1, &e->dir2, &e->name) != 0) goto done;
  }
  Py_BEGIN_ALLOW_THREADS;
  for (Py_ssize_t i = 0; i < n; i++) {
    OpenEntry* e = &entries[i];
    e->leaf_fd = open_leaf(rank_fd, e->dir1, e->dir2, create_mode);
    if (e->leaf_fd < 0) continue;
    struct stat st;
    if (fstatat(e->leaf_fd, e->name, &st, AT_SYMLINK_NOFOLLOW) == 0)
      e->exists = 1;
    else
      e->exists = errno == ENOENT ? 0 : -errno;
  }
  Py_END_ALLOW_THREADS;
  result = PyList_New(n);
  if (result == NULL) goto fail_fds;
  for (Py_ssize_t i = 0; i < n; i++) {
    PyObject* item = Py_BuildValue("(ii)", entries[i].leaf_fd, entries[i].exists);
    if (item == NULL) {
      Py_CLEAR(result);
      goto fail_fds;
    }
    PyList_SET_ITEM(result, i, item);
  }
  goto done;
fail_fds:
  // Nobody will own them.
  for (Py_ssize_t i = 0; i < n; i++)
    if (entries[i].leaf_fd >= 0) close(entries[i].leaf_fd);
done:
  PyMem_Free(entries);
  return result;
}

// Fills out[i] with the C ints of list `obj` (n of them); 0 on success, -1 with an exception.
static int int_list(PyObject* obj, Py_ssize_t n, int* out, const char* what) {
  if (!PyList_Check(obj) || PyList_GET_SIZE(obj) != n) {
    PyErr_Format(PyExc_TypeError, "%s must be a list of %zd ints", what, n);
    return -1;
  }
  for (Py_ssize_t i = 0; i < n; i++) {
    long v = PyLong_AsLong(PyList_GET_ITEM(obj, i));
    if (v == -1 && PyErr_Occurred()) return -1;
    out[i] = (int)v;
  }
  return 0;
}

// Fills out[i] with the strings of list `obj` (n of them); 0 on success, -1 with an exception.
static int str_list(PyObject* obj, Py_ssize_t n, const char** out, const char* what) {
  if (!PyList_Check(obj) || PyList_GET_SIZE(obj) != n) {
    PyErr_Format(PyExc_TypeError, "%s must be a list of %zd str", what, n);
    return -1;
  }
  for (Py_ssize_t i = 0; i < n; i++)
    if ((out[i] = ascii_of(PyList_GET_ITEM(obj, i), what)) == NULL) return -1;
  return 0;
}

PyDoc_STRVAR(create_files_doc,
             "create_files(dir_fds, names, flags, mode) -> list[tuple[int, int]]\n\n"
             "For each i: openat(dir_fds[i], names[i], flags, mode) (the caller's flags: "
             "O_CREAT | O_EXCL | ...), then fstat it. Per file: (its fd, its inode), or "
             "(-errno, 0) if either failed (a file created whose fstat failed is closed and "
             "unlinked). The caller owns the fds. The GIL is released once for all files.");

static PyObject* create_files(PyObject* self, PyObject* args) {
  (void)self;
  PyObject *dir_obj, *name_obj;
  int flags, mode;
  if (!PyArg_ParseTuple(args, "O!O!ii", &PyList_Type, &dir_obj, &PyList_Type, &name_obj, &flags,
                        &mode))
    return NULL;
  Py_ssize_t n = PyList_GET_SIZE(dir_obj);
  int* dirs = PyMem_Calloc((size_t)(n ? n : 1), sizeof(int));
  int* fds = PyMem_Calloc((size_t)(n ? n : 1), sizeof(int));
  unsigned long long* inos = PyMem_Calloc((size_t)(n ? n : 1), sizeof(unsigned long long));
  const char** names = PyMem_Calloc((size_t)(n ? n : 1), sizeof(char*));
  PyObject* result = NULL;
  int ran = 0;
  if (dirs == NULL || fds == NULL || inos == NULL || names == NULL) {
    PyErr_NoMemory();
    goto done;
  }
  if (int_list(dir_obj, n, dirs, "dir_fds") != 0 || str_list(name_obj, n, names, "names") != 0)
    goto done;
  Py_BEGIN_ALLOW_THREADS;
  for (Py_ssize_t i = 0; i < n; i++) {
    int fd = openat(dirs[i], names[i], flags, (mode_t)mode);
    if (fd < 0) {
      fds[i] = -errno;
      continue;
    }
    struct stat st;
    if (fstat(fd, &st) != 0) {
      fds[i] = -errno;
      close(fd);
      unlinkat(dirs[i], names[i], 0);
      continue;
    }
    fds[i] = fd;
    inos[i] = (unsigned long long)st.st_ino;
  }
  Py_END_ALLOW_THREADS;
  ran = 1;
  result = PyList_New(n);
  if (result == NULL) goto done;
  for (Py_ssize_t i = 0; i < n; i++) {
    PyObject* item = Py_BuildValue("(iK)", fds[i], inos[i]);
    if (item == NULL) {
      Py_CLEAR(result);
      goto done;
    }
    PyList_SET_ITEM(result, i, item);
  }
done:
  if (result == NULL && ran) {
    // Nobody will own them: close and remove what was created.
    for (Py_ssize_t i = 0; i < n; i++) {
      if (fds[i] >= 0) {
        close(fds[i]);
        unlinkat(dirs[i], names[i], 0);
      }
    }
  }
  PyMem_Free(dirs);
  PyMem_Free(fds);
  PyMem_Free(inos);
  PyMem_Free(names);
  return result;
}

// Stages of publish_files' result: where a file's publication stopped.
enum { PUB_OK = 0, PUB_WRITE = 1, PUB_FSYNC = 2, PUB_CLOSE = 3, PUB_RENAME = 4 };

static int write_all(int fd, char* header, size_t header_len, char* row, size_t row_len) {
  struct iovec iov[2] = {{header, header_len}, {row, row_len}};
  int iovcnt = 2;
  struct iovec* at = iov;
  while (iovcnt > 0) {
    ssize_t done = writev(fd, at, iovcnt);
    if (done < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (done == 0) return EIO;  // as block_io._write_all: "writev wrote no byte"
    advance(&at, &iovcnt, (size_t)done);
  }
  return 0;
}

PyDoc_STRVAR(publish_files_doc,
             "publish_files(fds, headers, rows, dir_fds, tmps, finals, fsync) -> list[int]\n\n"
             "For each i: write header i (consecutive equal slices of headers) and rows[i] to "
             "fds[i], fsync it if asked, close it (always), and if all that succeeded rename "
             "tmps[i] over finals[i] in dir_fds[i]. Returns two ints per file, flat: 0, 0 if "
             "published, else the stage that failed (1 write, 2 fsync, 3 close, 4 rename) and "
             "its errno; an unpublished temporary file is left for the caller to remove. "
             "Raises only before touching any file (bad arguments; the fds are then still "
             "open). The GIL is released once for all files.");

static PyObject* publish_files(PyObject* self, PyObject* args) {
  (void)self;
  PyObject *fd_obj, *rows_obj, *dir_obj, *tmp_obj, *final_obj;
  Py_buffer headers;
  int do_fsync;
  if (!PyArg_ParseTuple(args, "O!w*O!O!O!O!p", &PyList_Type, &fd_obj, &headers, &PyList_Type,
                        &rows_obj, &PyList_Type, &dir_obj, &PyList_Type, &tmp_obj, &PyList_Type,
                        &final_obj, &do_fsync))
    return NULL;
  Py_ssize_t n = PyList_GET_SIZE(fd_obj);
  size_t alloc = (size_t)(n ? n : 1);
  int* fds = PyMem_Calloc(alloc, sizeof(int));
  int* dirs = PyMem_Calloc(alloc, sizeof(int));
  const char** tmps = PyMem_Calloc(alloc, sizeof(char*));
  const char** finals = PyMem_Calloc(alloc, sizeof(char*));
  Py_buffer* rows = PyMem_Calloc(alloc, sizeof(Py_buffer));
  int* stage = PyMem_Calloc(alloc, sizeof(int));
  int* err = PyMem_Calloc(alloc, sizeof(int));
  Py_ssize_t held = 0;  // rows[0:held] are held buffers
  PyObject* result = NULL;
  if (fds == NULL || dirs == NULL || tmps == NULL || finals == NULL || rows == NULL ||
      stage == NULL || err == NULL) {
    PyErr_NoMemory();
    goto done;
  }
  if (n == 0 || headers.len % n != 0) {
    PyErr_SetString(PyExc_ValueError, "headers must hold one equal slice per file");
    goto done;
  }
  if (int_list(fd_obj, n, fds, "fds") != 0 || int_list(dir_obj, n, dirs, "dir_fds") != 0 ||
      str_list(tmp_obj, n, tmps, "tmps") != 0 || str_list(final_obj, n, finals, "finals") != 0)
    goto done;
  if (PyList_GET_SIZE(rows_obj) != n) {
    PyErr_SetString(PyExc_TypeError, "rows must be a list of one buffer per file");
    goto done;
  }
  for (; held < n; held++)
    if (PyObject_GetBuffer(PyList_GET_ITEM(rows_obj, held), &rows[held], PyBUF_C_CONTIGUOUS) != 0)
      goto done;
  size_t header_len = (size_t)(headers.len / n);
  // Made before any file is touched: once they are, the call must return what happened.
  result = PyList_New(2 * n);
  if (result == NULL) goto done;
  Py_BEGIN_ALLOW_THREADS;
  for (Py_ssize_t i = 0; i < n; i++) {
    int e = write_all(fds[i], (char*)headers.buf + (size_t)i * header_len, header_len,
                      (char*)rows[i].buf, (size_t)rows[i].len);
    int s = e ? PUB_WRITE : PUB_OK;
    if (!e && do_fsync && fsync(fds[i]) != 0) {
      e = errno;
      s = PUB_FSYNC;
    }
    if (close(fds[i]) != 0 && !e) {
      e = errno;
      s = PUB_CLOSE;
    }
    if (!e && renameat(dirs[i], tmps[i], dirs[i], finals[i]) != 0) {
      e = errno;
      s = PUB_RENAME;
    }
    stage[i] = s;
    err[i] = e;
  }
  Py_END_ALLOW_THREADS;
  for (Py_ssize_t i = 0; i < n; i++) {
    // Stages and errnos are small ints, which CPython keeps preallocated: no failure here.
    PyList_SET_ITEM(result, 2 * i, PyLong_FromLong(stage[i]));
    PyList_SET_ITEM(result, 2 * i + 1, PyLong_FromLong(err[i]));
  }
done:
  for (Py_ssize_t i = 0; i < held; i++) PyBuffer_Release(&rows[i]);
  PyMem_Free(fds);
  PyMem_Free(dirs);
  PyMem_Free(tmps);
  PyMem_Free(finals);
  PyMem_Free(rows);
  PyMem_Free(stage);
  PyMem_Free(err);
  PyBuffer_Release(&headers);
  return result;
}

static PyMethodDef methods[] = {
    {"read_files", read_files, METH_VARARGS, read_files_doc},
    {"open_leaves", open_leaves, METH_VARARGS, open_leaves_doc},
    {"create_files", create_files, METH_VARARGS, create_files_doc},
    {"publish_files", publish_files, METH_VARARGS, publish_files_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_kv_offload_fs_io",
    "The fs tier's per-job system calls, made with the GIL released once per job.", -1, methods,
};

PyMODINIT_FUNC PyInit__kv_offload_fs_io(void) {
  PyObject* m = PyModule_Create(&module);
  if (m != NULL && PyModule_AddIntConstant(m, "ABI_VERSION", 3) != 0) Py_CLEAR(m);
  return m;
}
