/* scan_native: the journal's bulk record scan (`framing.scan_block`) in C, with the GIL
 * released while it runs.
 *
 * `Segment.read_block` reads a chunk of a segment file and walks the framed records in it
 * (layout in record.py: `length u32 | crc u32 | offset u64 | timestamp_ms i64 | data`, the
 * checksum over everything after the crc), verifying the checksum of each record it takes.
 * This module does that walk without the interpreter: the checksums (CRC-32C with SSE4.2
 * where the CPU has it, else slicing-by-8 tables; CRC-32 as zlib computes it, for journals
 * made without the `crc32c` package) and the records' data positions and timestamps, written
 * straight into machine-integer arrays. The archiver's worker threads run meanwhile.
 *
 * scan_block(buf, from_offset, want, end_offset, checksum)
 *     -> (status, p, a, b, starts, ends, timestamps)
 * has the semantics of `framing.scan_block` (same statuses, same p/a/b), except that instead
 * of appending data lengths to a list it returns three array('q') of the records taken (data
 * start, data end, timestamp; None when none was taken). `checksum` is "crc32c" or "crc32";
 * another name raises LookupError (the caller then runs the Python scan).
 *
 * Every header is checked against the buffer's end before it is read: corrupt bytes give the
 * statuses the Python scan gives, never a read out of bounds.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <nmmintrin.h>
#define HAVE_SSE42_PATH 1
#else
#define HAVE_SSE42_PATH 0
#endif

#define HEADER_SIZE 24
#define CRC_START 8
/* Below this many bytes the scan runs with the GIL held: it takes microseconds, less than
 * handing the GIL to another thread and waiting to get it back may cost. */
#define RELEASE_GIL_BYTES (64 * 1024)

enum { SCAN_OK = 0, SCAN_BAD_OFFSET = 1, SCAN_BAD_CRC = 2 };
enum { CHECKSUM_CRC32C = 0, CHECKSUM_CRC32 = 1 };

typedef __int128 wide;  /* offsets compare as Python ints: offset + 1 may pass INT64_MAX */

static uint32_t crc32c_table[8][256];
static uint32_t crc32_table[8][256];
static int use_sse42;
static PyObject *array_type;  /* array.array */

/* -- checksums ----------------------------------------------------------------------------- */

static void make_table(uint32_t table[8][256], uint32_t polynomial)
{
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t crc = i;
        for (int bit = 0; bit < 8; bit++)
            crc = (crc >> 1) ^ (polynomial & (0u - (crc & 1)));
        table[0][i] = crc;
    }
    for (int k = 1; k < 8; k++)
        for (int i = 0; i < 256; i++)
            table[k][i] = (table[k - 1][i] >> 8) ^ table[0][table[k - 1][i] & 0xff];
}

static uint64_t load_le64(const uint8_t *p)
{
    return (uint64_t)p[0] | ((uint64_t)p[1] << 8) | ((uint64_t)p[2] << 16)
        | ((uint64_t)p[3] << 24) | ((uint64_t)p[4] << 32) | ((uint64_t)p[5] << 40)
        | ((uint64_t)p[6] << 48) | ((uint64_t)p[7] << 56);
}

static uint32_t load_le32(const uint8_t *p)
{
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16)
        | ((uint32_t)p[3] << 24);
}

/* A reflected CRC (init and final xor all ones) with slicing-by-8 tables. */
static uint32_t crc_tables(const uint32_t table[8][256], const uint8_t *p, size_t n)
{
    uint32_t crc = 0xffffffffu;
    while (n >= 8) {
        uint64_t word = load_le64(p) ^ crc;
        crc = table[7][word & 0xff] ^ table[6][(word >> 8) & 0xff]
            ^ table[5][(word >> 16) & 0xff] ^ table[4][(word >> 24) & 0xff]
            ^ table[3][(word >> 32) & 0xff] ^ table[2][(word >> 40) & 0xff]
            ^ table[1][(word >> 48) & 0xff] ^ table[0][word >> 56];
        p += 8;
        n -= 8;
    }
    while (n--)
        crc = table[0][(crc ^ *p++) & 0xff] ^ (crc >> 8);
    return ~crc;
}

#if HAVE_SSE42_PATH
__attribute__((target("sse4.2")))
static uint32_t crc32c_sse42(const uint8_t *p, size_t n)
{
    uint64_t crc = 0xffffffffu;
    while (n >= 8) {
        uint64_t word;
        memcpy(&word, p, 8);
        crc = _mm_crc32_u64(crc, word);
        p += 8;
        n -= 8;
    }
    uint32_t crc32 = (uint32_t)crc;
    if (n >= 4) {
        uint32_t word;
        memcpy(&word, p, 4);
        crc32 = _mm_crc32_u32(crc32, word);
        p += 4;
        n -= 4;
    }
    while (n--)
        crc32 = _mm_crc32_u8(crc32, *p++);
    return ~crc32;
}
#endif

static uint32_t checksum(int kind, const uint8_t *p, size_t n)
{
    if (kind == CHECKSUM_CRC32)
        return crc_tables(crc32_table, p, n);
#if HAVE_SSE42_PATH
    if (use_sse42)
        return crc32c_sse42(p, n);
#endif
    return crc_tables(crc32c_table, p, n);
}

static int checksum_kind(const char *name)
{
    if (strcmp(name, "crc32c") == 0)
        return CHECKSUM_CRC32C;
    if (strcmp(name, "crc32") == 0)
        return CHECKSUM_CRC32;
    return -1;
}

/* -- the scan ------------------------------------------------------------------------------ */

typedef struct {
    /* in */
    const uint8_t *buf;
    Py_ssize_t have;
    wide from_offset, end_offset;
    long long want;
    int kind;
    int64_t *starts, *ends, *stamps;  /* room for every record that can be taken */
    /* out */
    int status;
    Py_ssize_t p;
    wide a, b;
    Py_ssize_t taken;
} Scan;

/* `framing._scan_indexed`, line for line; touches no Python object (runs without the GIL). */
static void run_scan(Scan *s)
{
    const uint8_t *buf = s->buf;
    Py_ssize_t have = s->have, p = 0, first = -1, taken = 0;
    uint32_t length = 0;
    wide expected = -1;
    while (p + HEADER_SIZE <= have) {
        length = load_le32(buf + p);
        Py_ssize_t end = p + HEADER_SIZE + (Py_ssize_t)length;
        if (end > have)
            break;
        wide offset = (int64_t)load_le64(buf + p + 8);
        if (offset != expected && expected >= 0) {
            s->status = SCAN_BAD_OFFSET;
            s->p = p;
            s->a = offset;
            s->b = expected;
            s->taken = taken;
            return;
        }
        expected = offset + 1;
        if (offset >= s->from_offset) {
            if (checksum(s->kind, buf + p + CRC_START, (size_t)(end - p - CRC_START))
                    != load_le32(buf + p + 4)) {
                s->status = SCAN_BAD_CRC;
                s->p = p;
                s->a = offset;
                s->b = 0;
                s->taken = taken;
                return;
            }
            if (first < 0)
                first = p;
            s->starts[taken] = p + HEADER_SIZE;
            s->ends[taken] = end;
            s->stamps[taken] = (int64_t)load_le64(buf + p + 16);
            taken++;
            if (taken >= s->want || expected >= s->end_offset) {
                s->status = SCAN_OK;
                s->p = first;
                s->a = expected;
                s->b = 0;
                s->taken = taken;
                return;
            }
        }
        p = end;
    }
    s->status = SCAN_OK;
    s->p = first < 0 ? p : first;
    s->a = expected;
    s->b = length;
    s->taken = taken;
}

/* -- Python glue --------------------------------------------------------------------------- */

/* A Python int as a wide, clamped to [INT64_MIN - 2, INT64_MAX + 2]: enough to compare it
 * with any int64 or int64 + 1 as Python would. */
static int wide_arg(PyObject *value, wide *out)
{
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(value, &overflow);
    if (v == -1 && PyErr_Occurred())
        return -1;
    if (overflow > 0)
        *out = (wide)INT64_MAX + 2;
    else if (overflow < 0)
        *out = (wide)INT64_MIN - 2;
    else
        *out = v;
    return 0;
}

static PyObject *wide_to_int(wide value)
{
    if (value >= INT64_MIN && value <= INT64_MAX)
        return PyLong_FromLongLong((long long)value);
    return PyLong_FromUnsignedLongLong((unsigned long long)value);  /* only INT64_MAX + 1 */
}

static PyObject *int64_array(const int64_t *values, Py_ssize_t count)
{
    PyObject *array = PyObject_CallFunction(array_type, "s", "q");
    if (array == NULL)
        return NULL;
    PyObject *view = PyMemoryView_FromMemory((char *)values, count * 8, PyBUF_READ);
    if (view == NULL) {
        Py_DECREF(array);
        return NULL;
    }
    PyObject *done = PyObject_CallMethod(array, "frombytes", "O", view);
    Py_DECREF(view);
    if (done == NULL) {
        Py_DECREF(array);
        return NULL;
    }
    Py_DECREF(done);
    return array;
}

static PyObject *scan_block(PyObject *module, PyObject *args)
{
    Py_buffer view;
    PyObject *from_obj, *want_obj, *end_obj;
    const char *name;
    Scan s;
    if (!PyArg_ParseTuple(args, "y*OOOs:scan_block", &view, &from_obj, &want_obj, &end_obj,
                          &name))
        return NULL;
    PyObject *result = NULL;
    int64_t *room = NULL;
    int overflow = 0;
    s.kind = checksum_kind(name);
    if (s.kind < 0) {
        PyErr_Format(PyExc_LookupError, "no C scan for record checksum '%s'", name);
        goto done;
    }
    if (wide_arg(from_obj, &s.from_offset) < 0 || wide_arg(end_obj, &s.end_offset) < 0)
        goto done;
    s.want = PyLong_AsLongLongAndOverflow(want_obj, &overflow);
    if (s.want == -1 && PyErr_Occurred())
        goto done;
    if (overflow)
        s.want = overflow > 0 ? INT64_MAX : INT64_MIN;
    s.buf = view.buf;
    s.have = view.len;
    /* Each record takes HEADER_SIZE bytes at least, and the scan stops at `want` taken (at
     * the first when `want` < 1). */
    Py_ssize_t room_count = s.have / HEADER_SIZE;
    if (s.want < room_count)
        room_count = s.want < 1 ? 1 : (Py_ssize_t)s.want;
    if (room_count < 1)
        room_count = 1;
    room = PyMem_RawMalloc((size_t)room_count * 3 * sizeof(int64_t));
    if (room == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    s.starts = room;
    s.ends = room + room_count;
    s.stamps = room + 2 * room_count;
    if (s.have >= RELEASE_GIL_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        run_scan(&s);
        Py_END_ALLOW_THREADS
    } else {
        run_scan(&s);
    }
    PyObject *starts = NULL, *ends = NULL, *stamps = NULL;
    if (s.status == SCAN_OK && s.taken > 0) {
        starts = int64_array(s.starts, s.taken);
        ends = starts == NULL ? NULL : int64_array(s.ends, s.taken);
        stamps = ends == NULL ? NULL : int64_array(s.stamps, s.taken);
        if (stamps == NULL) {
            Py_XDECREF(starts);
            Py_XDECREF(ends);
            goto done;
        }
    } else {
        starts = (Py_INCREF(Py_None), Py_None);
        ends = (Py_INCREF(Py_None), Py_None);
        stamps = (Py_INCREF(Py_None), Py_None);
    }
    PyObject *a = wide_to_int(s.a), *b = a == NULL ? NULL : wide_to_int(s.b);
    if (b == NULL) {
        Py_XDECREF(a);
        Py_DECREF(starts);
        Py_DECREF(ends);
        Py_DECREF(stamps);
        goto done;
    }
    result = Py_BuildValue("(inNNNNN)", s.status, s.p, a, b, starts, ends, stamps);
done:
    PyMem_RawFree(room);
    PyBuffer_Release(&view);
    return result;
}

/* checksum(data, name): the record checksum `name` of `data` (for tests: it must equal the
 * `crc32c` package's and zlib's). */
static PyObject *checksum_of(PyObject *module, PyObject *args)
{
    Py_buffer view;
    const char *name;
    if (!PyArg_ParseTuple(args, "y*s:checksum", &view, &name))
        return NULL;
    int kind = checksum_kind(name);
    if (kind < 0) {
        PyBuffer_Release(&view);
        PyErr_Format(PyExc_LookupError, "no C scan for record checksum '%s'", name);
        return NULL;
    }
    uint32_t crc;
    Py_BEGIN_ALLOW_THREADS
    crc = checksum(kind, view.buf, (size_t)view.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLong(crc);
}

/* software_crc32c(data): CRC-32C by the tables even where SSE4.2 is there (for tests). */
static PyObject *software_crc32c(PyObject *module, PyObject *args)
{
    Py_buffer view;
    if (!PyArg_ParseTuple(args, "y*:software_crc32c", &view))
        return NULL;
    uint32_t crc = crc_tables(crc32c_table, view.buf, (size_t)view.len);
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLong(crc);
}

static PyMethodDef methods[] = {
    {"scan_block", scan_block, METH_VARARGS,
     "scan_block(buf, from_offset, want, end_offset, checksum) -> (status, p, a, b, starts, "
     "ends, timestamps): framing.scan_block without the GIL, the records taken as array('q')."},
    {"checksum", checksum_of, METH_VARARGS,
     "checksum(data, name) -> int: the record checksum 'crc32c' or 'crc32' of data."},
    {"software_crc32c", software_crc32c, METH_VARARGS,
     "software_crc32c(data) -> int: CRC-32C by tables, whatever the CPU has."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "scan_native",
    "The journal's bulk record scan in C (see scan_native.c).", -1, methods,
};

PyMODINIT_FUNC PyInit_scan_native(void)
{
    make_table(crc32c_table, 0x82f63b78u);
    make_table(crc32_table, 0xedb88320u);
#if HAVE_SSE42_PATH
    __builtin_cpu_init();
    use_sse42 = __builtin_cpu_supports("sse4.2") != 0;
#endif
    PyObject *array_module = PyImport_ImportModule("array");
    if (array_module == NULL)
        return NULL;
    array_type = PyObject_GetAttrString(array_module, "array");
    Py_DECREF(array_module);
    if (array_type == NULL)
        return NULL;
    PyObject *m = PyModule_Create(&module_def);
    if (m == NULL)
        return NULL;
    if (PyModule_AddStringConstant(m, "SOURCE_HASH", SOURCE_HASH) < 0
            || PyModule_AddIntConstant(m, "HARDWARE_CRC32C", use_sse42) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
