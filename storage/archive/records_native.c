/* records_native: the message records of an archive row group (the layout of
 * core/records.py, versions 1 and 2) decoded into Arrow column buffers, in C, with the GIL
 * released.
 *
 * `decode_blocks(blocks)` reads the journal's record blocks where they are (each block a
 * buffer plus int64 arrays of record starts, ends and timestamps, and its first offset: no
 * joined copy, no Python object per record) and returns the raw buffers of every column that
 * `decode.decode_spans` returns, plus the rows' offsets and timestamps; `decode.decode_blocks`
 * makes them Arrow arrays. Empty records (offsets the journal skipped) have no row.
 *
 * It vouches for exactly the records `decode_spans` vouches for (same version, flag, length,
 * QoS, payload format and UTF-8 checks) and returns None for anything else, for a record it
 * does not handle (native properties naming a format twice), and for a column past 2**31
 * bytes: the caller then runs the Python path, which names a bad record in its error.
 *
 * Two passes over the records, both without the GIL: the first validates every record and
 * measures every column; the buffers are then allocated with the GIL (by the caller's
 * allocator: Arrow's memory pool, which reuses its pages where fresh memory would fault on
 * each one); the second copies the fields in. Every write of the second pass is checked
 * against what the first measured, so a buffer changed in between cannot overrun one.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#ifndef SOURCE_HASH
#define SOURCE_HASH "unknown"
#endif

enum {
    F_KEY = 1, F_HEADERS = 2, F_CONTENT_TYPE = 4, F_CORRELATION = 8, F_REPLY_TO = 16,
    F_FORMAT = 32, F_EXPIRY = 64, F_NATIVE = 128,
};

#define HEAD_SIZE 12
#define INT32_LIMIT 2147483647LL

/* The columns, in the order of the result tuple. */
enum {
    C_TOPIC, C_KEY, C_PAYLOAD, C_HEADERS, C_CONTENT_TYPE, C_PROTOCOL, C_PRODUCER, C_QOS,
    C_RETAIN, C_CORRELATION, C_REPLY_TO, C_FORMAT, C_EXPIRY, C_NATIVE, C_OFFSET, C_STAMP,
    C_H_NAME, C_H_VALUE, C_N_NAME, C_N_VALUE, N_COLUMNS,
};

typedef enum { K_BINARY, K_MAP, K_BYTE, K_BITS, K_INT64 } Kind;

static const Kind KINDS[N_COLUMNS] = {
    [C_TOPIC] = K_BINARY, [C_KEY] = K_BINARY, [C_PAYLOAD] = K_BINARY, [C_HEADERS] = K_MAP,
    [C_CONTENT_TYPE] = K_BINARY, [C_PROTOCOL] = K_BINARY, [C_PRODUCER] = K_BINARY,
    [C_QOS] = K_BYTE, [C_RETAIN] = K_BITS, [C_CORRELATION] = K_BINARY,
    [C_REPLY_TO] = K_BINARY, [C_FORMAT] = K_BYTE, [C_EXPIRY] = K_INT64, [C_NATIVE] = K_MAP,
    [C_OFFSET] = K_INT64, [C_STAMP] = K_INT64, [C_H_NAME] = K_BINARY, [C_H_VALUE] = K_BINARY,
    [C_N_NAME] = K_BINARY, [C_N_VALUE] = K_BINARY,
};

/* Columns never null, whose values the first pass need not count. */
static int always_present(int col) {
    return col == C_QOS || col == C_RETAIN || col == C_OFFSET || col == C_STAMP;
}

/* A map's keys and values: a row per entry, not per record. */
static int is_child(int col) { return col >= C_H_NAME; }

typedef struct {
    /* measured by the first pass: the capacities of the second */
    int64_t count;     /* values that are not null */
    int64_t size;      /* their bytes (binary) or entries (map) */
    int64_t rows;      /* the records (a child column: its values) */
    int absent;        /* every value null: no buffers (the caller makes a null array) */
    /* the second pass: how far it wrote */
    int64_t at_count, at_size;
    int64_t filled;    /* rows whose end offset is written */
    int32_t *offsets;  /* binary and map columns: rows + 1 */
    uint8_t *data;     /* binary: the bytes; byte/int64: the values; bits: the bitmap */
    uint8_t *valid;    /* NULL when no value is null */
    PyObject *objects[3];  /* the buffers behind valid, offsets, data */
    Py_buffer views[3];
    int viewed[3];
} Column;

typedef struct {
    Column c[N_COLUMNS];
    int64_t row;       /* the row of the record being decoded */
    int64_t rows;      /* the second pass: the rows the first counted */
    int writing;
    int overflow;      /* the second pass found more than the first measured */
} Out;

typedef struct {
    Py_buffer data, starts, ends, stamps;
    int held;  /* how many of the four views are held */
    int64_t first_offset;
    Py_ssize_t count;
} Block;

#define INLINE static inline __attribute__((always_inline))

/* ---- reading ---- */

INLINE uint32_t u16_at(const uint8_t *p) { return (uint32_t)p[0] | ((uint32_t)p[1] << 8); }

INLINE uint32_t u32_at(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

INLINE int64_t i64_at(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = (v << 8) | p[i];
    return (int64_t)v;
}

/* Well-formed UTF-8 (Unicode's table 3-7), as Python's and Arrow's decoders require: no
 * overlong forms, no surrogates, nothing above U+10FFFF. */
static int utf8_valid(const uint8_t *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        if (i + 8 <= n) {
            uint64_t word;
            memcpy(&word, s + i, 8);
            if (!(word & 0x8080808080808080ULL)) {
                i += 8;
                continue;
            }
        }
        uint8_t c = s[i];
        if (c < 0x80) {
            i++;
        } else if (c < 0xC2) {
            return 0;
        } else if (c < 0xE0) {
            if (i + 1 >= n || (s[i + 1] & 0xC0) != 0x80)
                return 0;
            i += 2;
        } else if (c < 0xF0) {
            if (i + 2 >= n)
                return 0;
            uint8_t c1 = s[i + 1], c2 = s[i + 2];
            if ((c1 & 0xC0) != 0x80 || (c2 & 0xC0) != 0x80)
                return 0;
            if ((c == 0xE0 && c1 < 0xA0) || (c == 0xED && c1 > 0x9F))
                return 0;
            i += 3;
        } else if (c < 0xF5) {
            if (i + 3 >= n)
                return 0;
            uint8_t c1 = s[i + 1], c2 = s[i + 2], c3 = s[i + 3];
            if ((c1 & 0xC0) != 0x80 || (c2 & 0xC0) != 0x80 || (c3 & 0xC0) != 0x80)
                return 0;
            if ((c == 0xF0 && c1 < 0x90) || (c == 0xF4 && c1 > 0x8F))
                return 0;
            i += 4;
        } else {
            return 0;
        }
    }
    return 1;
}

static int ascii_valid(const uint8_t *s, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (s[i] & 0x80)
            return 0;
    return 1;
}

/* ---- writing (the first pass only counts) ---- */

INLINE void set_bit(uint8_t *bits, int64_t i) { bits[i >> 3] |= (uint8_t)(1u << (i & 7)); }

/* memcpy, without a call for the short fields (topics, names) that most are. */
INLINE void copy_bytes(uint8_t *dst, const uint8_t *src, size_t n) {
    if (n > 16) {
        memcpy(dst, src, n);
    } else if (n >= 8) {
        uint64_t a, b;
        memcpy(&a, src, 8);
        memcpy(&b, src + n - 8, 8);
        memcpy(dst, &a, 8);
        memcpy(dst + n - 8, &b, 8);
    } else if (n >= 4) {
        uint32_t a, b;
        memcpy(&a, src, 4);
        memcpy(&b, src + n - 4, 4);
        memcpy(dst, &a, 4);
        memcpy(dst + n - 4, &b, 4);
    } else if (n) {
        dst[0] = src[0];
        dst[n / 2] = src[n / 2];
        dst[n - 1] = src[n - 1];
    }
}

/* A value of a binary column (`len` bytes from `src`) or of a map column (`len` entries,
 * `src` NULL: its entries go to the child columns), at `row` (a child column: its next). The
 * rows skipped since the column's last value are null. */
INLINE void put_value(Out *o, int col, const uint8_t *src, int64_t len) {
    Column *c = &o->c[col];
    if (!o->writing) {
        c->count++;
        c->size += len;
        return;
    }
    int64_t row = is_child(col) ? c->at_count : o->row;
    if (c->absent || c->at_count >= c->count || c->at_size + len > c->size || row >= c->rows
            || row < c->filled || (row > c->filled && !c->valid)) {
        o->overflow = 1;
        return;
    }
    int32_t *offsets = c->offsets;
    while (c->filled < row)
        offsets[++c->filled] = (int32_t)c->at_size;
    if (src)
        copy_bytes(c->data + c->at_size, src, (size_t)len);
    c->at_size += len;
    c->at_count++;
    offsets[++c->filled] = (int32_t)c->at_size;
    if (c->valid)
        set_bit(c->valid, row);
}

/* A value of a nullable fixed-size column (payload format, expiry). */
INLINE void put_fixed(Out *o, int col, int64_t value) {
    Column *c = &o->c[col];
    if (!o->writing) {
        c->count++;
        return;
    }
    int64_t row = o->row;
    if (c->absent || c->at_count >= c->count || row >= c->rows) {
        o->overflow = 1;
        return;
    }
    if (KINDS[col] == K_BYTE)
        c->data[row] = (uint8_t)value;
    else
        memcpy(c->data + 8 * row, &value, 8);
    if (c->valid)
        set_bit(c->valid, row);
    c->at_count++;
}

/* ---- one record ---- */

enum { OK = 0, MALFORMED = -1, UNSUPPORTED = -2 };

/* The field of `width` (2 or 4) length bytes at *pos, then its bytes, into column `col`
 * (checked as UTF-8 if `text`): MALFORMED when it overruns the record. */
INLINE int field(Out *o, int col, const uint8_t *p, size_t size, size_t *pos, int width,
                 int text) {
    if (*pos + (size_t)width > size)
        return MALFORMED;
    size_t len = width == 2 ? u16_at(p + *pos) : u32_at(p + *pos);
    size_t at = *pos + (size_t)width;
    if (at + len > size)
        return MALFORMED;
    if (text && !o->writing && !utf8_valid(p + at, len))
        return MALFORMED;
    put_value(o, col, p + at, (int64_t)len);
    *pos = at + len;
    return OK;
}

static int headers(Out *o, const uint8_t *p, size_t size, size_t *pos) {
    if (*pos + 2 > size)
        return MALFORMED;
    size_t count = u16_at(p + *pos);
    *pos += 2;
    for (size_t j = 0; j < count; j++) {
        if (field(o, C_H_NAME, p, size, pos, 2, 1) || field(o, C_H_VALUE, p, size, pos, 4, 1))
            return MALFORMED;
    }
    put_value(o, C_HEADERS, NULL, (int64_t)count);
    return OK;
}

/* The native properties section (`native_properties_at`): a dict by format name, so a name
 * given twice (no encoder writes it) would keep its first place with its last value; the
 * Python path handles that. A section of no entries reads as none (null). */
static int native(Out *o, const uint8_t *p, size_t size, size_t pos) {
    if (pos + 1 > size)
        return MALFORMED;
    size_t count = p[pos++];
    const uint8_t *names[256];
    size_t name_sizes[256];
    for (size_t j = 0; j < count; j++) {
        if (pos + 1 > size)
            return MALFORMED;
        size_t name_size = p[pos];
        const uint8_t *name = p + pos + 1;
        pos += 1 + name_size;
        if (pos + 4 > size)
            return MALFORMED;
        size_t value_size = u32_at(p + pos);
        pos += 4;
        if (pos + value_size > size)
            return MALFORMED;
        if (!o->writing) {
            if (!ascii_valid(name, name_size))
                return MALFORMED;
            for (size_t k = 0; k < j; k++)
                if (name_sizes[k] == name_size && !memcmp(names[k], name, name_size))
                    return UNSUPPORTED;
            names[j] = name;
            name_sizes[j] = name_size;
        }
        put_value(o, C_N_NAME, name, (int64_t)name_size);
        put_value(o, C_N_VALUE, p + pos, (int64_t)value_size);
        pos += value_size;
    }
    if (count)
        put_value(o, C_NATIVE, NULL, (int64_t)count);
    return OK;
}

/* The fields after the payload that a flag announces, in the record's order. */
static int flagged(Out *o, unsigned flags, const uint8_t *p, size_t size, size_t *pos) {
    if ((flags & F_KEY) && field(o, C_KEY, p, size, pos, 4, 0))
        return MALFORMED;
    if ((flags & F_HEADERS) && headers(o, p, size, pos))
        return MALFORMED;
    if ((flags & F_CONTENT_TYPE) && field(o, C_CONTENT_TYPE, p, size, pos, 2, 1))
        return MALFORMED;
    if ((flags & F_CORRELATION) && field(o, C_CORRELATION, p, size, pos, 4, 0))
        return MALFORMED;
    if ((flags & F_REPLY_TO) && field(o, C_REPLY_TO, p, size, pos, 2, 1))
        return MALFORMED;
    if (flags & F_FORMAT) {
        if (*pos + 1 > size || p[*pos] > 127)
            return MALFORMED;
        put_fixed(o, C_FORMAT, p[*pos]);
        *pos += 1;
    }
    if (flags & F_EXPIRY) {
        if (*pos + 8 > size)
            return MALFORMED;
        put_fixed(o, C_EXPIRY, i64_at(p + *pos));
        *pos += 8;
    }
    return OK;
}

INLINE int record(Out *o, const uint8_t *p, size_t size, int64_t offset, int64_t stamp) {
    if (size < HEAD_SIZE)
        return MALFORMED;
    unsigned version = p[0], flags = p[1], qos = p[2], retain = p[3];
    if ((version != 1 && version != 2) || (version == 1 && (flags & F_NATIVE)) || qos > 127)
        return MALFORMED;
    size_t pos = HEAD_SIZE;
    if (field(o, C_TOPIC, p, size, &pos, 4, 1) || field(o, C_PAYLOAD, p, size, &pos, 4, 0))
        return MALFORMED;
    if ((flags & ~(unsigned)F_NATIVE) && flagged(o, flags, p, size, &pos))
        return MALFORMED;
    if (field(o, C_PROTOCOL, p, size, &pos, 2, 1) || field(o, C_PRODUCER, p, size, &pos, 2, 1))
        return MALFORMED;
    if (flags & F_NATIVE) {
        int result = native(o, p, size, pos);
        if (result != OK)
            return result;
    }
    if (o->writing) {
        int64_t row = o->row;
        if (row >= o->rows) {
            o->overflow = 1;
            return OK;
        }
        o->c[C_QOS].data[row] = (uint8_t)qos;
        if (retain)
            set_bit(o->c[C_RETAIN].data, row);
        memcpy(o->c[C_OFFSET].data + 8 * row, &offset, 8);
        memcpy(o->c[C_STAMP].data + 8 * row, &stamp, 8);
    }
    o->row++;
    return OK;
}

/* One pass over every record of every block: OK, MALFORMED or UNSUPPORTED. */
static int pass(Out *o, Block *blocks, Py_ssize_t nblocks) {
    for (Py_ssize_t b = 0; b < nblocks; b++) {
        const uint8_t *buffer = blocks[b].data.buf;
        int64_t length = (int64_t)blocks[b].data.len;
        const int64_t *starts = blocks[b].starts.buf, *ends = blocks[b].ends.buf;
        const int64_t *stamps = blocks[b].stamps.buf;
        for (Py_ssize_t i = 0; i < blocks[b].count; i++) {
            int64_t start = starts[i], end = ends[i];
            if (end <= start)
                continue;  /* an offset the journal skipped: no row */
            if (start < 0 || end > length)
                return UNSUPPORTED;
            int result = record(o, buffer + start, (size_t)(end - start),
                                blocks[b].first_offset + i, stamps[i]);
            if (result != OK)
                return result;
            if (o->overflow)
                return UNSUPPORTED;
        }
    }
    return OK;
}

/* ---- the module function ---- */

static void release_blocks(Block *blocks, Py_ssize_t n) {
    for (Py_ssize_t b = 0; b < n; b++) {
        Py_buffer *views[4] = {&blocks[b].data, &blocks[b].starts, &blocks[b].ends,
                               &blocks[b].stamps};
        for (int k = 0; k < blocks[b].held; k++)
            PyBuffer_Release(views[k]);
    }
    PyMem_Free(blocks);
}

static void release_columns(Out *o) {
    for (int col = 0; col < N_COLUMNS; col++) {
        Column *c = &o->c[col];
        for (int k = 0; k < 3; k++) {
            if (c->viewed[k])
                PyBuffer_Release(&c->views[k]);
            c->viewed[k] = 0;
            Py_CLEAR(c->objects[k]);
        }
    }
}

/* An int64 array view: contiguous, 8-byte items of format q or l. */
static int int64_view(PyObject *obj, Py_buffer *view, Py_ssize_t *count) {
    if (PyObject_GetBuffer(obj, view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    const char *f = view->format ? view->format : "B";
    if (*f == '<' || *f == '=' || *f == '@')
        f++;
    if (view->itemsize != 8 || (strcmp(f, "q") && strcmp(f, "l"))) {
        PyErr_SetString(PyExc_TypeError, "record positions must be int64 arrays");
        PyBuffer_Release(view);
        return -1;
    }
    *count = view->len / 8;
    return 0;
}

/* Take the views of (buffer, starts, ends, timestamps, first_offset) of each block. */
static Block *hold_blocks(PyObject *list, Py_ssize_t *nblocks) {
    PyObject *seq = PySequence_Fast(list, "blocks must be a sequence");
    if (!seq)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    Block *blocks = PyMem_Calloc(n ? (size_t)n : 1, sizeof(Block));
    if (!blocks) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t b = 0; b < n; b++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, b);
        PyObject *buffer, *starts, *ends, *stamps;
        long long first;
        Py_ssize_t counts[3];
        Block *block = &blocks[b];
        if (!PyArg_ParseTuple(item, "OOOOL", &buffer, &starts, &ends, &stamps, &first))
            goto fail;
        block->first_offset = first;
        if (PyObject_GetBuffer(buffer, &block->data, PyBUF_SIMPLE) < 0)
            goto fail;
        block->held = 1;
        if (int64_view(starts, &block->starts, &counts[0]) < 0)
            goto fail;
        block->held = 2;
        if (int64_view(ends, &block->ends, &counts[1]) < 0)
            goto fail;
        block->held = 3;
        if (int64_view(stamps, &block->stamps, &counts[2]) < 0)
            goto fail;
        block->held = 4;
        if (counts[0] != counts[1] || counts[0] != counts[2]) {
            PyErr_SetString(PyExc_ValueError, "a block's position arrays differ in length");
            goto fail;
        }
        block->count = counts[0];
    }
    Py_DECREF(seq);
    *nblocks = n;
    return blocks;
fail:
    Py_DECREF(seq);
    release_blocks(blocks, n);
    return NULL;
}

/* A buffer of `size` bytes, as `allocate(size)` returns it (writable), or a bytes object
 * when `allocate` is NULL; `c->objects[k]` holds it. */
static int new_buffer(PyObject *allocate, Column *c, int k, Py_ssize_t size, uint8_t **where) {
    if (!allocate) {
        if (!(c->objects[k] = PyBytes_FromStringAndSize(NULL, size)))
            return -1;
        *where = (uint8_t *)PyBytes_AS_STRING(c->objects[k]);
        return 0;
    }
    if (!(c->objects[k] = PyObject_CallFunction(allocate, "n", size)))
        return -1;
    if (PyObject_GetBuffer(c->objects[k], &c->views[k], PyBUF_WRITABLE) < 0)
        return -1;
    c->viewed[k] = 1;
    if (c->views[k].len < size) {
        PyErr_SetString(PyExc_ValueError, "the allocated buffer is too small");
        return -1;
    }
    *where = c->views[k].buf;
    return 0;
}

/* After the first pass: each column's rows, then its buffers, as measured (with the GIL;
 * filled after without it). */
static int allocate(Out *o, PyObject *allocator) {
    int64_t rows = o->row;
    o->rows = rows;
    for (int col = 0; col < N_COLUMNS; col++) {
        Column *c = &o->c[col];
        Kind kind = KINDS[col];
        c->rows = is_child(col) ? c->count : rows;
        if (always_present(col))
            c->count = rows;
        if (c->rows && !c->count) {
            c->absent = 1;  /* all null: the caller makes a null array */
            continue;
        }
        if (c->count < c->rows && new_buffer(allocator, c, 0, (c->rows + 7) / 8, &c->valid) < 0)
            return -1;
        if (kind == K_BINARY || kind == K_MAP) {
            uint8_t *offsets;
            if (new_buffer(allocator, c, 1, (c->rows + 1) * 4, &offsets) < 0)
                return -1;
            c->offsets = (int32_t *)offsets;
        }
        Py_ssize_t size = kind == K_BINARY ? c->size : kind == K_BYTE ? c->rows
            : kind == K_BITS ? (c->rows + 7) / 8 : kind == K_INT64 ? 8 * c->rows : -1;
        if (size >= 0 && new_buffer(allocator, c, 2, size, &c->data) < 0)
            return -1;
    }
    return 0;
}

/* Zero the bitmaps (and the values under nulls) and start the offsets (the second pass,
 * without the GIL). */
static void prepare(Out *o) {
    for (int col = 0; col < N_COLUMNS; col++) {
        Column *c = &o->c[col];
        Kind kind = KINDS[col];
        if (c->absent)
            continue;
        if (c->valid)
            memset(c->valid, 0, (size_t)(c->rows + 7) / 8);
        if (kind == K_BITS)
            memset(c->data, 0, (size_t)(c->rows + 7) / 8);
        if (c->valid && kind == K_BYTE)
            memset(c->data, 0, (size_t)c->rows);
        if (c->valid && kind == K_INT64)
            memset(c->data, 0, (size_t)(8 * c->rows));
        if (c->offsets)
            c->offsets[0] = 0;
    }
}

/* After the second pass: the offsets of the last null rows; whether every column got what
 * the first pass measured (not so only if a buffer changed in between). */
static int finish(Out *o) {
    if (o->row != o->rows)
        return UNSUPPORTED;
    for (int col = 0; col < N_COLUMNS; col++) {
        Column *c = &o->c[col];
        if (c->absent || always_present(col))
            continue;
        if (c->at_count != c->count || c->at_size != c->size)
            return UNSUPPORTED;
        if (c->offsets) {
            if (c->filled < c->rows && !c->valid)
                return UNSUPPORTED;
            while (c->filled < c->rows)
                c->offsets[++c->filled] = (int32_t)c->at_size;
        }
    }
    return OK;
}

static PyObject *column_tuple(Out *o, int col) {
    Column *c = &o->c[col];
    if (c->absent)
        Py_RETURN_NONE;
    PyObject *parts[3];
    for (int k = 0; k < 3; k++)
        parts[k] = c->objects[k] ? c->objects[k] : Py_None;
    return PyTuple_Pack(3, parts[0], parts[1], parts[2]);
}

PyDoc_STRVAR(decode_blocks_doc,
"decode_blocks(blocks, allocate=None) -> tuple | None\n\n"
"The records of `blocks`, a sequence of (buffer, starts, ends, timestamps, first_offset)\n"
"(int64 arrays: record i of a block is buffer[starts[i]:ends[i]], at offset first_offset + i),\n"
"decoded into column buffers: (rows, then for each of topic, key, payload, headers,\n"
"content_type, producer_protocol, producer_id, qos, retain, correlation_data, reply_to,\n"
"payload_format, expires_at, native_properties, offset, timestamp, header names, header\n"
"values, native names, native values: None when every value is null, else (validity or\n"
"None, offsets or None, data or None)). Each buffer is `allocate(size)` (a writable\n"
"buffer, e.g. pyarrow.allocate_buffer), or a bytes object without it. None when some record\n"
"is not one that `decode.decode_spans` vouches for, or a column would pass 2**31 bytes.");

static PyObject *decode_blocks(PyObject *module, PyObject *args) {
    PyObject *list, *allocator = Py_None;
    if (!PyArg_ParseTuple(args, "O|O:decode_blocks", &list, &allocator))
        return NULL;
    Py_ssize_t nblocks = 0;
    Block *blocks = hold_blocks(list, &nblocks);
    if (!blocks)
        return NULL;
    Out out;
    memset(&out, 0, sizeof out);
    int result;
    Py_BEGIN_ALLOW_THREADS
    result = pass(&out, blocks, nblocks);
    Py_END_ALLOW_THREADS
    if (result == OK) {
        for (int col = 0; col < N_COLUMNS; col++)
            if (out.c[col].size > INT32_LIMIT || out.c[col].count > INT32_LIMIT)
                result = UNSUPPORTED;
        if (out.row > INT32_LIMIT)
            result = UNSUPPORTED;
    }
    if (result != OK) {
        release_blocks(blocks, nblocks);
        Py_RETURN_NONE;
    }
    if (allocate(&out, allocator == Py_None ? NULL : allocator) < 0) {
        release_columns(&out);
        release_blocks(blocks, nblocks);
        return NULL;
    }
    int64_t rows = out.row;
    out.writing = 1;
    out.row = 0;
    Py_BEGIN_ALLOW_THREADS
    prepare(&out);
    result = pass(&out, blocks, nblocks);
    if (result == OK && !out.overflow)
        result = finish(&out);
    Py_END_ALLOW_THREADS
    release_blocks(blocks, nblocks);
    if (result != OK || out.overflow) {  /* a buffer changed between the passes */
        release_columns(&out);
        Py_RETURN_NONE;
    }
    PyObject *tuple = PyTuple_New(1 + N_COLUMNS);
    PyObject *count = PyLong_FromLongLong(rows);
    if (!tuple || !count) {
        Py_XDECREF(tuple);
        Py_XDECREF(count);
        release_columns(&out);
        return NULL;
    }
    PyTuple_SET_ITEM(tuple, 0, count);
    for (int col = 0; col < N_COLUMNS; col++) {
        PyObject *item = column_tuple(&out, col);
        if (!item) {
            Py_DECREF(tuple);
            release_columns(&out);
            return NULL;
        }
        PyTuple_SET_ITEM(tuple, 1 + col, item);
    }
    release_columns(&out);
    return tuple;
}

static PyObject *utf8_check(PyObject *module, PyObject *arg) {
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    int valid = utf8_valid(view.buf, (size_t)view.len);
    PyBuffer_Release(&view);
    return PyBool_FromLong(valid);
}

static PyMethodDef methods[] = {
    {"decode_blocks", decode_blocks, METH_VARARGS, decode_blocks_doc},
    {"utf8_valid", utf8_check, METH_O,
     "utf8_valid(data) -> bool: whether `data` is well-formed UTF-8 (the record decoder's check)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "records_native",
    "The message records of an archive row group decoded into Arrow column buffers, in C "
    "(see storage/archive/records_native.c).",
    -1, methods,
};

PyMODINIT_FUNC PyInit_records_native(void) {
    PyObject *m = PyModule_Create(&module_def);
    if (!m)
        return NULL;
    if (PyModule_AddStringConstant(m, "SOURCE_HASH", SOURCE_HASH) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
