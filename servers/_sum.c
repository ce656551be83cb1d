/* Sums of two arrays into a third, written with non-temporal stores.
 *
 * The server's sum of two gRPC payloads must go into a third buffer (the
 * payloads are read-only). With ordinary stores every line of that buffer
 * is first read into the cache (read for ownership): 4 memory streams
 * where an in-place add has 3. Streaming stores skip that read. SSE2, which
 * every x86-64 CPU has; elsewhere a plain loop (NONTEMPORAL is then 0).
 * The GIL is released while summing.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define JAXPS_SSE2 1
#else
#define JAXPS_SSE2 0
#endif

/* out[i] = a[i] + b[i]: a scalar head until `out` is 16-byte aligned, then
 * 16 bytes at a time with streaming stores, then a scalar tail. Integers
 * are added as unsigned, so they wrap around as numpy's do. */
#define ONE(type, utype) (type)((utype)a[i] + (utype)b[i])
#define SCALAR(type, utype) \
  for (; i < n; i++) out[i] = ONE(type, utype);

#if JAXPS_SSE2
#define DEFINE_ADD(name, type, utype, vec, load, add, stream)              \
  static void name(const type *a, const type *b, type *out, Py_ssize_t n) { \
    Py_ssize_t i = 0;                                                      \
    const Py_ssize_t lanes = 16 / (Py_ssize_t)sizeof(type);                \
    while (i < n && ((uintptr_t)(out + i) & 15)) {                         \
      out[i] = ONE(type, utype);                                           \
      i++;                                                                 \
    }                                                                      \
    for (; i + lanes <= n; i += lanes) {                                   \
      vec x = load((const void *)(a + i));                                 \
      vec y = load((const void *)(b + i));                                 \
      stream((void *)(out + i), add(x, y));                                \
    }                                                                      \
    SCALAR(type, utype)                                                    \
    _mm_sfence();                                                          \
  }

static __m128 load_ps(const void *p) { return _mm_loadu_ps((const float *)p); }
static void stream_ps(void *p, __m128 v) { _mm_stream_ps((float *)p, v); }
static __m128d load_pd(const void *p) {
  return _mm_loadu_pd((const double *)p);
}
static void stream_pd(void *p, __m128d v) { _mm_stream_pd((double *)p, v); }
static __m128i load_si(const void *p) {
  return _mm_loadu_si128((const __m128i *)p);
}
static void stream_si(void *p, __m128i v) {
  _mm_stream_si128((__m128i *)p, v);
}

DEFINE_ADD(add_f32, float, float, __m128, load_ps, _mm_add_ps, stream_ps)
DEFINE_ADD(add_f64, double, double, __m128d, load_pd, _mm_add_pd, stream_pd)
DEFINE_ADD(add_i32, int32_t, uint32_t, __m128i, load_si, _mm_add_epi32,
           stream_si)
DEFINE_ADD(add_i64, int64_t, uint64_t, __m128i, load_si, _mm_add_epi64,
           stream_si)
#else
#define DEFINE_ADD(name, type, utype)                                      \
  static void name(const type *a, const type *b, type *out, Py_ssize_t n) { \
    Py_ssize_t i = 0;                                                      \
    SCALAR(type, utype)                                                    \
  }
DEFINE_ADD(add_f32, float, float)
DEFINE_ADD(add_f64, double, double)
DEFINE_ADD(add_i32, int32_t, uint32_t)
DEFINE_ADD(add_i64, int64_t, uint64_t)
#endif

typedef void (*add_fn)(const void *, const void *, void *, Py_ssize_t);

/* add(kind, a, b, out): kind is "f4", "f8", "i4" or "i8"; a, b and out
 * are contiguous buffers of the same size in bytes, out writable. */
static PyObject *py_add(PyObject *self, PyObject *args) {
  const char *kind;
  Py_buffer a, b, out;
  add_fn fn;
  Py_ssize_t itemsize;
  (void)self;
  if (!PyArg_ParseTuple(args, "sy*y*w*", &kind, &a, &b, &out)) return NULL;
  if (strcmp(kind, "f4") == 0) {
    fn = (add_fn)add_f32, itemsize = 4;
  } else if (strcmp(kind, "f8") == 0) {
    fn = (add_fn)add_f64, itemsize = 8;
  } else if (strcmp(kind, "i4") == 0) {
    fn = (add_fn)add_i32, itemsize = 4;
  } else if (strcmp(kind, "i8") == 0) {
    fn = (add_fn)add_i64, itemsize = 8;
  } else {
    PyErr_Format(PyExc_ValueError,
                 "add: kind must be f4, f8, i4 or i8, got %s", kind);
    goto fail;
  }
  if (a.len != b.len || a.len != out.len || a.len % itemsize != 0) {
    PyErr_Format(PyExc_ValueError,
                 "add: buffers of %zd, %zd and %zd bytes; need one size, a "
                 "multiple of %zd",
                 a.len, b.len, out.len, itemsize);
    goto fail;
  }
  Py_BEGIN_ALLOW_THREADS
  fn(a.buf, b.buf, out.buf, a.len / itemsize);
  Py_END_ALLOW_THREADS
  PyBuffer_Release(&a);
  PyBuffer_Release(&b);
  PyBuffer_Release(&out);
  Py_RETURN_NONE;
fail:
  PyBuffer_Release(&a);
  PyBuffer_Release(&b);
  PyBuffer_Release(&out);
  return NULL;
}

static PyMethodDef methods[] = {
    {"add", py_add, METH_VARARGS,
     "add(kind, a, b, out): out = a + b, written with streaming stores."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_sum", "Non-temporal sums for the server.", -1,
    methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__sum(void) {
  PyObject *m = PyModule_Create(&module);
  if (m != NULL && PyModule_AddIntConstant(m, "NONTEMPORAL", JAXPS_SSE2)) {
    Py_DECREF(m);
    return NULL;
  }
  return m;
}
