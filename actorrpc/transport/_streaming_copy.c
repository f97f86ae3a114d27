/* A copy into shared memory with non-temporal (streaming) stores.
 *
 * Built with the package where a C compiler is present (setup.py, optional: without it
 * the segments are filled by the plain copy alone; see _segment_copy.py, which decides
 * when this copy is used).
 *
 * Why: a plain copy (glibc's memcpy, which for a copy of a few MiB writes through the
 * cache) into a segment whose lines another core has just read must take each line back
 * from that core first. Where the two cores share no cache (two vCPUs on different
 * core complexes of an AMD host), that costs up to ten times the copy itself, for
 * whole sessions. Streaming stores write around the cache: they cost more than a copy
 * into lines this core owns, and far less than one into lines another core holds.
 *
 * copy(destination, source, release_gil) copies all of ``source`` (any buffer) into the
 * start of ``destination`` (a writable buffer at least as long): 16-byte streaming
 * stores (SSE2, part of every x86-64 CPU) over the 64-byte-aligned middle of the
 * destination, an ordinary memcpy for the ends, and a store fence before returning,
 * so the bytes are visible to other cores in the order of every later store (the
 * message that names the segment is sent after this returns). Without the GIL when
 * ``release_gil`` is true. STREAMING_STORES is 0 where the CPU lacks them (not x86-64):
 * copy() is then a plain memcpy.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define HAVE_STREAMING_STORES 1
#else
#define HAVE_STREAMING_STORES 0
#endif

static void
streaming_copy(char *dst, const char *src, size_t n)
{
#if HAVE_STREAMING_STORES
    size_t head = (size_t)((64 - ((uintptr_t)dst & 63)) & 63);
    if (head > n) {
        head = n;
    }
    memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    while (n >= 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)src);
        __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
        _mm_stream_si128((__m128i *)dst, a);
        _mm_stream_si128((__m128i *)(dst + 16), b);
        _mm_stream_si128((__m128i *)(dst + 32), c);
        _mm_stream_si128((__m128i *)(dst + 48), d);
        dst += 64;
        src += 64;
        n -= 64;
    }
    memcpy(dst, src, n);
    _mm_sfence();
#else
    memcpy(dst, src, n);
#endif
}

static PyObject *
copy(PyObject *module, PyObject *args)
{
    Py_buffer destination, source;
    int release_gil = 0;
    (void)module;
    if (!PyArg_ParseTuple(args, "w*y*p", &destination, &source, &release_gil)) {
        return NULL;
    }
    if (source.len > destination.len) {
        PyErr_Format(PyExc_ValueError,
                     "cannot copy %zd bytes into a buffer of %zd bytes",
                     source.len, destination.len);
        PyBuffer_Release(&destination);
        PyBuffer_Release(&source);
        return NULL;
    }
    if (release_gil) {
        Py_BEGIN_ALLOW_THREADS
        streaming_copy((char *)destination.buf, (const char *)source.buf, (size_t)source.len);
        Py_END_ALLOW_THREADS
    }
    else {
        streaming_copy((char *)destination.buf, (const char *)source.buf, (size_t)source.len);
    }
    PyBuffer_Release(&destination);
    PyBuffer_Release(&source);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"copy", copy, METH_VARARGS,
     "copy(destination, source, release_gil): all of source into the start of "
     "destination, with streaming stores."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_definition = {
    PyModuleDef_HEAD_INIT, "_streaming_copy",
    "A copy into shared memory with non-temporal (streaming) stores.", -1, methods,
};

PyMODINIT_FUNC
PyInit__streaming_copy(void)
{
    PyObject *module = PyModule_Create(&module_definition);
    if (module == NULL) {
        return NULL;
    }
    if (PyModule_AddIntConstant(module, "STREAMING_STORES", HAVE_STREAMING_STORES) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
