/* ranklens.collector._lines: count the newlines of a byte range, fast and without the GIL.
 *
 * `ranklens logs classify` numbers every kept line, so it counts the newlines of every chunk it
 * reads: with bytes.count (~2.4 GB/s, holding the GIL) that was the largest serial part of a
 * one-shot run left (issue 18: ~55 ms of a 128 MB file, beside ~180 ms of everything else). Here
 * 16 bytes are compared at a time (SSE2, part of every x86-64 processor), ~9 GB/s, and a large
 * range is counted with the GIL released, so the search lanes and the read-ahead thread go on.
 *
 * The extension is optional: where it is not built (no compiler at install time, another
 * processor), ranklens counts with bytes.count, with the same results. An editable install builds
 * it in place (collector/_lines.*.so, not in git): after editing this file, `pip install -e .` again.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#if defined(__SSE2__) || defined(_M_X64)
#include <emmintrin.h>
#define RANKLENS_SSE2 1
#endif

/* a range this long or longer is counted without the GIL (below it, the switch costs more) */
#define NOGIL_BYTES (64 * 1024)

static Py_ssize_t count_newlines(const unsigned char *p, Py_ssize_t n) {
    Py_ssize_t c = 0;
#ifdef RANKLENS_SSE2
    const __m128i nl = _mm_set1_epi8('\n');
    const __m128i zero = _mm_setzero_si128();
    while (n >= 16) {
        /* byte counters: at most 255 blocks before they are summed, so none overflows */
        Py_ssize_t blocks = n / 16;
        if (blocks > 255) {
            blocks = 255;
        }
        __m128i acc = _mm_setzero_si128();
        for (Py_ssize_t i = 0; i < blocks; i++) {
            __m128i v = _mm_loadu_si128((const __m128i *)p);
            acc = _mm_sub_epi8(acc, _mm_cmpeq_epi8(v, nl)); /* a match is -1: subtracting adds 1 */
            p += 16;
        }
        n -= blocks * 16;
        __m128i s = _mm_sad_epu8(acc, zero); /* two 64-bit sums of eight bytes each */
        c += (Py_ssize_t)_mm_cvtsi128_si32(s) + (Py_ssize_t)_mm_extract_epi16(s, 4);
    }
#endif
    for (Py_ssize_t i = 0; i < n; i++) {
        c += p[i] == '\n';
    }
    return c;
}

static PyObject *lines_count(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer view;
    Py_ssize_t start = 0, end = PY_SSIZE_T_MAX;
    if (!PyArg_ParseTuple(args, "y*|nn:count", &view, &start, &end)) {
        return NULL;
    }
    /* the slice rules of bytes.count(b"\n", start, end) */
    Py_ssize_t len = view.len;
    if (start < 0) {
        start += len;
        if (start < 0) {
            start = 0;
        }
    }
    if (end < 0) {
        end += len;
        if (end < 0) {
            end = 0;
        }
    }
    if (end > len) {
        end = len;
    }
    Py_ssize_t c = 0;
    if (end > start) {
        const unsigned char *p = (const unsigned char *)view.buf + start;
        Py_ssize_t n = end - start;
        if (n >= NOGIL_BYTES) {
            /* the buffer is held by `view`: a bytearray cannot be resized meanwhile */
            Py_BEGIN_ALLOW_THREADS
            c = count_newlines(p, n);
            Py_END_ALLOW_THREADS
        } else {
            c = count_newlines(p, n);
        }
    }
    PyBuffer_Release(&view);
    return PyLong_FromSsize_t(c);
}

static PyMethodDef lines_methods[] = {
    {"count", lines_count, METH_VARARGS,
     "count(buffer, start=0, end=len) -> int\n\n"
     "The newlines of buffer[start:end] (slice rules as bytes.count(b'\\n', start, end)), counted\n"
     "without the GIL for a range of 64 KiB or more."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef lines_module = {
    PyModuleDef_HEAD_INIT, "_lines", "Newline counting for the log filter (optional accelerator).", -1, lines_methods,
};

PyMODINIT_FUNC PyInit__lines(void) { return PyModule_Create(&lines_module); }
