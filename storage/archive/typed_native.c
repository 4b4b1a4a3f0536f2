/* JSON payloads of a flat schema into typed Arrow columns, in C with the GIL released: the
 * fast path of `TypedSchema.columns_of` (storage/archive/typed.py) for a schema whose fields
 * are all scalars (string, integer, number, boolean).
 *
 * `parse_flat` reads each payload of an Arrow binary array as one JSON object and fills one
 * column per field: Arrow buffers (validity bitmap, values or int32 offsets and UTF-8 data)
 * that Python wraps with `pa.Array.from_buffers`, no Python object per row. A row is taken
 * ("ok") only where its columns are certainly what the per-row path (`json.loads`, then
 * `pa.array` of the field values) gives; every other row is null in every column here and
 * flagged, and the caller decodes those rows by the existing paths, which decide what they
 * hold. So the C parser may refuse more than JSON does, never less, and never read a value
 * differently. It refuses (leaves to the caller):
 *   - a null payload, or one that is not a JSON object (leading/trailing whitespace allowed);
 *   - anything `json.loads` refuses: bad grammar, raw control characters or invalid UTF-8 in a
 *     string, trailing data; and NaN/Infinity, which it accepts;
 *   - a key of the schema given twice (json.loads keeps the last one), a key longer than
 *     MAX_KEY bytes that is not plain ASCII, an object or array nested deeper than MAX_DEPTH
 *     under a key outside the schema;
 *   - a value of another JSON type than its field's (null is a null value: taken);
 *   - a lone surrogate escape in a string field's value (pa.array refuses the text; elsewhere
 *     it is accepted, as json.loads does);
 *   - an integer field holding a fraction or exponent, or more than 18 digits;
 *   - a number field holding an integer of more than 15 digits, or a value of magnitude
 *     2**53 or more (pa.array refuses big integers; kept as typed_layout.py does).
 * Numbers: an integer-looking number field value is the integer converted (so "-0" is 0.0,
 * as json.loads gives the int 0); others are correctly rounded (Clinger's exact fast path,
 * else strtod_l in the C locale), as Python's float().
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <locale.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_FIELDS 256
#define MAX_DEPTH 64
#define MAX_KEY 1024
#define MAX_NUMBER 400

enum kind { KIND_STRING = 's', KIND_INT = 'i', KIND_NUMBER = 'n', KIND_BOOL = 'b' };

typedef struct {
    char kind;
    const char *name;
    Py_ssize_t name_len;
    uint8_t *validity;   /* bitmap, count bits */
    uint8_t *values;     /* int64/float64 values, or the boolean bitmap */
    int32_t *offsets;    /* string: count + 1 offsets */
    char *data;          /* string: UTF-8 bytes */
    int64_t data_used;
    int64_t valid;       /* rows with a value */
} column_t;

static locale_t c_locale = (locale_t)0;

static const double POW10[] = {
    1e0, 1e1, 1e2, 1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9, 1e10, 1e11,
    1e12, 1e13, 1e14, 1e15, 1e16, 1e17, 1e18, 1e19, 1e20, 1e21, 1e22,
};

static inline int is_space(unsigned char c) {
    return c == ' ' || c == '\t' || c == '\n' || c == '\r';
}

static inline const unsigned char *skip_space(const unsigned char *p, const unsigned char *end) {
    while (p < end && is_space(*p)) p++;
    return p;
}

static inline void set_bit(uint8_t *bits, int64_t i) { bits[i >> 3] |= (uint8_t)(1u << (i & 7)); }

static inline int hex_value(unsigned char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

static int read_hex4(const unsigned char *p, const unsigned char *end, uint32_t *out) {
    if (end - p < 4) return 0;
    uint32_t v = 0;
    for (int k = 0; k < 4; k++) {
        int h = hex_value(p[k]);
        if (h < 0) return 0;
        v = (v << 4) | (uint32_t)h;
    }
    *out = v;
    return 1;
}

/* The length of the valid UTF-8 sequence at p (a byte >= 0x80), or 0: strict, as Python's
 * and Arrow's decoders (no overlong form, no surrogate, nothing above U+10FFFF). */
static int utf8_sequence(const unsigned char *p, const unsigned char *end) {
    unsigned char c = p[0];
    Py_ssize_t left = end - p;
    if (c >= 0xC2 && c <= 0xDF) {
        return (left >= 2 && (p[1] & 0xC0) == 0x80) ? 2 : 0;
    }
    if (c >= 0xE0 && c <= 0xEF) {
        if (left < 3 || (p[1] & 0xC0) != 0x80 || (p[2] & 0xC0) != 0x80) return 0;
        if (c == 0xE0 && p[1] < 0xA0) return 0;  /* overlong */
        if (c == 0xED && p[1] >= 0xA0) return 0; /* surrogate */
        return 3;
    }
    if (c >= 0xF0 && c <= 0xF4) {
        if (left < 4 || (p[1] & 0xC0) != 0x80 || (p[2] & 0xC0) != 0x80 ||
            (p[3] & 0xC0) != 0x80)
            return 0;
        if (c == 0xF0 && p[1] < 0x90) return 0;  /* overlong */
        if (c == 0xF4 && p[1] >= 0x90) return 0; /* above U+10FFFF */
        return 4;
    }
    return 0;
}

static inline char *put_utf8(char *out, uint32_t cp) {
    if (cp < 0x80) {
        *out++ = (char)cp;
    } else if (cp < 0x800) {
        *out++ = (char)(0xC0 | (cp >> 6));
        *out++ = (char)(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
        *out++ = (char)(0xE0 | (cp >> 12));
        *out++ = (char)(0x80 | ((cp >> 6) & 0x3F));
        *out++ = (char)(0x80 | (cp & 0x3F));
    } else {
        *out++ = (char)(0xF0 | (cp >> 18));
        *out++ = (char)(0x80 | ((cp >> 12) & 0x3F));
        *out++ = (char)(0x80 | ((cp >> 6) & 0x3F));
        *out++ = (char)(0x80 | (cp & 0x3F));
    }
    return out;
}

/* A JSON string whose opening quote is at p[-1]: its text, unescaped, written at `out` (when
 * not NULL; never longer than the source). Returns the position after the closing quote, or
 * NULL where the caller must refuse the row. `*written` gets the length written. */
static const unsigned char *read_string(const unsigned char *p, const unsigned char *end,
                                        char *out, int64_t *written) {
    char *start = out;
    for (;;) {
        const unsigned char *run = p;
        while (p < end && *p >= 0x20 && *p != '"' && *p != '\\' && *p < 0x80) p++;
        if (out != NULL && p > run) {
            memcpy(out, run, (size_t)(p - run));
            out += p - run;
        }
        if (p >= end) return NULL;
        unsigned char c = *p;
        if (c == '"') {
            if (written != NULL) *written = out - start;
            return p + 1;
        }
        if (c < 0x20) return NULL;
        if (c >= 0x80) {
            int n = utf8_sequence(p, end);
            if (n == 0) return NULL;
            if (out != NULL) {
                memcpy(out, p, (size_t)n);
                out += n;
            }
            p += n;
            continue;
        }
        /* an escape */
        if (end - p < 2) return NULL;
        unsigned char e = p[1];
        p += 2;
        char plain;
        switch (e) {
        case '"': plain = '"'; break;
        case '\\': plain = '\\'; break;
        case '/': plain = '/'; break;
        case 'b': plain = '\b'; break;
        case 'f': plain = '\f'; break;
        case 'n': plain = '\n'; break;
        case 'r': plain = '\r'; break;
        case 't': plain = '\t'; break;
        case 'u': {
            uint32_t cp;
            if (!read_hex4(p, end, &cp)) return NULL;
            p += 4;
            /* A lone surrogate: json.loads keeps it, pa.array refuses the text, so it is
             * refused in a value kept, accepted where only validated. */
            if (cp >= 0xDC00 && cp <= 0xDFFF) {
                if (out != NULL) return NULL;
                continue;
            }
            if (cp >= 0xD800 && cp <= 0xDBFF) {
                uint32_t low;
                if (end - p < 6 || p[0] != '\\' || p[1] != 'u' || !read_hex4(p + 2, end, &low) ||
                    low < 0xDC00 || low > 0xDFFF) {
                    if (out != NULL) return NULL;
                    continue;
                }
                p += 6;
                cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
            }
            if (out != NULL) out = put_utf8(out, cp);
            continue;
        }
        default:
            return NULL;
        }
        if (out != NULL) *out++ = plain;
    }
}

typedef struct {
    int negative;
    int integer;          /* no fraction, no exponent */
    const unsigned char *digits; /* the integer part's first digit */
    int int_digits;
} number_t;

/* A JSON number at p (its grammar exactly): the position after it, or NULL. */
static const unsigned char *scan_number(const unsigned char *p, const unsigned char *end,
                                        number_t *n) {
    n->negative = 0;
    n->integer = 1;
    if (p < end && *p == '-') {
        n->negative = 1;
        p++;
    }
    if (p >= end) return NULL;
    n->digits = p;
    if (*p == '0') {
        p++;
    } else if (*p >= '1' && *p <= '9') {
        while (p < end && *p >= '0' && *p <= '9') p++;
    } else {
        return NULL;
    }
    n->int_digits = (int)(p - n->digits);
    if (p < end && *p == '.') {
        n->integer = 0;
        p++;
        const unsigned char *f = p;
        while (p < end && *p >= '0' && *p <= '9') p++;
        if (p == f) return NULL;
    }
    if (p < end && (*p == 'e' || *p == 'E')) {
        n->integer = 0;
        p++;
        if (p < end && (*p == '+' || *p == '-')) p++;
        const unsigned char *x = p;
        while (p < end && *p >= '0' && *p <= '9') p++;
        if (p == x) return NULL;
    }
    return p;
}

/* The float64 of the number text [start, stop): Python's float() of it. 0 if unsure. */
static int number_value(const unsigned char *start, const unsigned char *stop, const number_t *n,
                        double *out) {
    if (n->integer) {
        if (n->int_digits > 15) return 0;
        int64_t v = 0;
        for (int k = 0; k < n->int_digits; k++) v = v * 10 + (n->digits[k] - '0');
        *out = n->negative ? -(double)v : (double)v;
        if (v == 0) *out = 0.0; /* json.loads reads -0 as the int 0 */
        return 1;
    }
    /* Clinger: at most 15 significant digits and a power of ten within 22 are exact. */
    const unsigned char *p = n->digits;
    uint64_t mantissa = 0;
    int significant = 0, scale = 0, exp_value = 0, exp_negative = 0;
    for (; p < stop && *p >= '0' && *p <= '9'; p++) {
        if (significant || *p != '0') {
            mantissa = mantissa * 10 + (uint64_t)(*p - '0');
            significant++;
        }
        if (significant > 15) break;
    }
    if (significant <= 15 && p < stop && *p == '.') {
        for (p++; p < stop && *p >= '0' && *p <= '9'; p++) {
            if (significant || *p != '0') {
                mantissa = mantissa * 10 + (uint64_t)(*p - '0');
                significant++;
            }
            scale--;
            if (significant > 15) break;
        }
    }
    int fast = significant <= 15;
    if (fast && p < stop && (*p == 'e' || *p == 'E')) {
        p++;
        if (*p == '+' || *p == '-') exp_negative = *p++ == '-';
        for (; p < stop; p++) {
            exp_value = exp_value * 10 + (*p - '0');
            if (exp_value > 10000) {
                fast = 0;
                break;
            }
        }
    }
    double value;
    if (fast) {
        int e = scale + (exp_negative ? -exp_value : exp_value);
        if (mantissa == 0) {
            value = 0.0;
        } else if (e >= 0 && e <= 22) {
            value = (double)mantissa * POW10[e];
            if (e > 0 && value >= 9007199254740992.0) fast = 0; /* may not be exact */
        } else if (e < 0 && e >= -22) {
            value = (double)mantissa / POW10[-e];
        } else {
            fast = 0;
        }
    }
    if (!fast) {
        char text[MAX_NUMBER + 1];
        const unsigned char *first = n->negative ? n->digits - 1 : n->digits;
        Py_ssize_t len = stop - first;
        if (len > MAX_NUMBER || c_locale == (locale_t)0) return 0;
        memcpy(text, first, (size_t)len);
        text[len] = '\0';
        value = strtod_l(text, NULL, c_locale);
        *out = value;
        return 1;
    }
    *out = n->negative ? -value : value;
    return 1;
}

/* Any JSON value at p (validated, not kept): the position after it, or NULL. */
static const unsigned char *skip_value(const unsigned char *p, const unsigned char *end,
                                       int depth) {
    if (p >= end) return NULL;
    switch (*p) {
    case '"':
        return read_string(p + 1, end, NULL, NULL);
    case 't':
        return (end - p >= 4 && memcmp(p, "true", 4) == 0) ? p + 4 : NULL;
    case 'f':
        return (end - p >= 5 && memcmp(p, "false", 5) == 0) ? p + 5 : NULL;
    case 'n':
        return (end - p >= 4 && memcmp(p, "null", 4) == 0) ? p + 4 : NULL;
    case '[':
    case '{': {
        if (depth >= MAX_DEPTH) return NULL;
        unsigned char close = *p == '[' ? ']' : '}';
        int object = *p == '{';
        p = skip_space(p + 1, end);
        if (p < end && *p == close) return p + 1;
        for (;;) {
            if (object) {
                if (p >= end || *p != '"') return NULL;
                p = read_string(p + 1, end, NULL, NULL);
                if (p == NULL) return NULL;
                p = skip_space(p, end);
                if (p >= end || *p != ':') return NULL;
                p = skip_space(p + 1, end);
            }
            p = skip_value(p, end, depth + 1);
            if (p == NULL) return NULL;
            p = skip_space(p, end);
            if (p >= end) return NULL;
            if (*p == close) return p + 1;
            if (*p != ',') return NULL;
            p = skip_space(p + 1, end);
        }
    }
    default: {
        number_t n;
        return scan_number(p, end, &n);
    }
    }
}

/* One payload into the columns at row `row`; 0 if the row is refused (the columns may then
 * hold values written for it, which the caller's validity bits do not show). */
static int parse_row(const unsigned char *p, const unsigned char *end, column_t *columns,
                     int fields, int64_t row, uint8_t *seen) {
    char key[MAX_KEY];
    memset(seen, 0, (size_t)fields);
    p = skip_space(p, end);
    if (p >= end || *p != '{') return 0;
    p = skip_space(p + 1, end);
    if (p < end && *p == '}') {
        p++;
        goto done;
    }
    for (;;) {
        if (p >= end || *p != '"') return 0;
        /* a key: read in place when plain ASCII, else unescaped into `key` */
        const unsigned char *q = p + 1;
        while (q < end && *q != '"' && *q != '\\' && *q >= 0x20 && *q < 0x80) q++;
        int64_t key_len;
        const char *key_text;
        if (q < end && *q == '"') {
            key_text = (const char *)(p + 1);
            key_len = q - (p + 1);
            p = q + 1;
        } else {
            /* an escape or a non-ASCII byte: validate first, decode when short enough */
            const unsigned char *after = read_string(p + 1, end, NULL, NULL);
            if (after == NULL || after - p - 2 > MAX_KEY) return 0;
            /* a key with a lone surrogate is no field's name (those are UTF-8) */
            key_text = read_string(p + 1, end, key, &key_len) == after ? key : NULL;
            p = after;
        }
        p = skip_space(p, end);
        if (p >= end || *p != ':') return 0;
        p = skip_space(p + 1, end);
        int field = -1;
        if (key_text != NULL) {
            for (int k = 0; k < fields; k++) {
                if (columns[k].name_len == key_len &&
                    memcmp(columns[k].name, key_text, (size_t)key_len) == 0) {
                    field = k;
                    break;
                }
            }
        }
        if (field < 0) {
            p = skip_value(p, end, 0);
            if (p == NULL) return 0;
        } else {
            column_t *c = &columns[field];
            if (seen[field]) return 0;
            seen[field] = 1;
            if (p >= end) return 0;
            if (*p == 'n') {
                if (end - p < 4 || memcmp(p, "null", 4) != 0) return 0;
                p += 4;
            } else if (c->kind == KIND_STRING) {
                if (*p != '"') return 0;
                int64_t len;
                p = read_string(p + 1, end, c->data + c->data_used, &len);
                if (p == NULL) return 0;
                c->data_used += len;
                set_bit(c->validity, row);
            } else if (c->kind == KIND_BOOL) {
                if (end - p >= 4 && memcmp(p, "true", 4) == 0) {
                    set_bit(c->values, row);
                    p += 4;
                } else if (end - p >= 5 && memcmp(p, "false", 5) == 0) {
                    p += 5;
                } else {
                    return 0;
                }
                set_bit(c->validity, row);
            } else {
                number_t n;
                const unsigned char *start = p;
                p = scan_number(p, end, &n);
                if (p == NULL) return 0;
                if (c->kind == KIND_INT) {
                    if (!n.integer || n.int_digits > 18) return 0;
                    int64_t v = 0;
                    for (int k = 0; k < n.int_digits; k++) v = v * 10 + (n.digits[k] - '0');
                    ((int64_t *)c->values)[row] = n.negative ? -v : v;
                } else {
                    double v;
                    if (!number_value(start, p, &n, &v)) return 0;
                    if (!(fabs(v) < 9007199254740992.0)) return 0; /* also inf */
                    ((double *)c->values)[row] = v;
                }
                set_bit(c->validity, row);
            }
        }
        p = skip_space(p, end);
        if (p >= end) return 0;
        if (*p == '}') {
            p++;
            break;
        }
        if (*p != ',') return 0;
        p = skip_space(p + 1, end);
    }
done:
    p = skip_space(p, end);
    return p == end;
}

static void release_views(Py_buffer *views, int n) {
    for (int k = 0; k < n; k++)
        if (views[k].obj != NULL) PyBuffer_Release(&views[k]);
}

PyDoc_STRVAR(parse_flat_doc,
"parse_flat(validity, offsets, data, offset, count, wide, kinds, names)\n"
"--\n\n"
"The typed columns of `count` JSON payloads: an Arrow binary array's buffers (`validity` may\n"
"be None; int32 offsets, int64 when `wide`) from row `offset`. `kinds` holds one letter per\n"
"field (s string, i int64, n float64, b bool), `names` the fields' keys as UTF-8 bytes.\n"
"Returns (taken, columns): `taken` one byte per row (1: read here), and per field a tuple\n"
"(validity bitmap or None when every row has a value, values or offsets, string data or None).");

static PyObject *parse_flat(PyObject *self, PyObject *args) {
    PyObject *validity_obj, *offsets_obj, *data_obj, *names;
    Py_ssize_t offset, count;
    int wide;
    const char *kinds;
    Py_ssize_t fields;
    if (!PyArg_ParseTuple(args, "OOOnnpy#O!", &validity_obj, &offsets_obj, &data_obj, &offset,
                          &count, &wide, &kinds, &fields, &PyTuple_Type, &names))
        return NULL;
    if (fields > MAX_FIELDS || fields != PyTuple_GET_SIZE(names) || count < 0 || offset < 0) {
        PyErr_SetString(PyExc_ValueError, "parse_flat: bad arguments");
        return NULL;
    }
    Py_buffer views[3];
    memset(views, 0, sizeof(views));
    if (validity_obj != Py_None && PyObject_GetBuffer(validity_obj, &views[0], PyBUF_SIMPLE) < 0)
        return NULL;
    if (PyObject_GetBuffer(offsets_obj, &views[1], PyBUF_SIMPLE) < 0 ||
        (data_obj != Py_None && PyObject_GetBuffer(data_obj, &views[2], PyBUF_SIMPLE) < 0)) {
        release_views(views, 3);
        return NULL;
    }
    Py_ssize_t width = wide ? 8 : 4;
    if (views[1].len < (offset + count + (count > 0 ? 1 : 0)) * width ||
        (views[0].obj != NULL && views[0].len * 8 < offset + count)) {
        release_views(views, 3);
        PyErr_SetString(PyExc_ValueError, "parse_flat: buffers shorter than the rows");
        return NULL;
    }
    const uint8_t *valid_in = views[0].obj != NULL ? (const uint8_t *)views[0].buf : NULL;
    const unsigned char *data = views[2].obj != NULL ? (const unsigned char *)views[2].buf
                                                     : (const unsigned char *)"";
    Py_ssize_t data_len = views[2].obj != NULL ? views[2].len : 0;
    int64_t first = 0, last = 0;
    if (count > 0) {
        first = wide ? ((const int64_t *)views[1].buf)[offset]
                     : ((const int32_t *)views[1].buf)[offset];
        last = wide ? ((const int64_t *)views[1].buf)[offset + count]
                    : ((const int32_t *)views[1].buf)[offset + count];
    }
    if (first < 0 || last < first || last > data_len || last - first > INT32_MAX) {
        release_views(views, 3);
        PyErr_SetString(PyExc_ValueError, "parse_flat: offsets outside the data");
        return NULL;
    }

    PyObject *taken = PyBytes_FromStringAndSize(NULL, count);
    PyObject *outputs = PyList_New(fields);
    column_t columns[MAX_FIELDS];
    PyObject *owned[MAX_FIELDS][3];
    memset(owned, 0, sizeof(owned));
    Py_ssize_t bitmap = (count + 7) / 8;
    int failed = taken == NULL || outputs == NULL;
    for (Py_ssize_t k = 0; k < fields && !failed; k++) {
        column_t *c = &columns[k];
        PyObject *name = PyTuple_GET_ITEM(names, k);
        c->kind = kinds[k];
        if (!PyBytes_Check(name) ||
            (c->kind != KIND_STRING && c->kind != KIND_INT && c->kind != KIND_NUMBER &&
             c->kind != KIND_BOOL)) {
            PyErr_SetString(PyExc_ValueError, "parse_flat: bad kinds or names");
            failed = 1;
            break;
        }
        c->name = PyBytes_AS_STRING(name);
        c->name_len = PyBytes_GET_SIZE(name);
        c->data_used = 0;
        c->valid = 0;
        c->offsets = NULL;
        c->data = NULL;
        owned[k][0] = PyBytes_FromStringAndSize(NULL, bitmap);
        Py_ssize_t values = c->kind == KIND_STRING ? (count + 1) * 4
                            : c->kind == KIND_BOOL ? bitmap : count * 8;
        owned[k][1] = PyBytes_FromStringAndSize(NULL, values);
        if (c->kind == KIND_STRING) owned[k][2] = PyBytes_FromStringAndSize(NULL, last - first);
        if (owned[k][0] == NULL || owned[k][1] == NULL ||
            (c->kind == KIND_STRING && owned[k][2] == NULL)) {
            failed = 1;
            break;
        }
        c->validity = (uint8_t *)PyBytes_AS_STRING(owned[k][0]);
        c->values = (uint8_t *)PyBytes_AS_STRING(owned[k][1]);
        memset(c->validity, 0, (size_t)bitmap);
        if (c->kind == KIND_STRING) {
            c->offsets = (int32_t *)c->values;
            c->data = PyBytes_AS_STRING(owned[k][2]);
        } else {
            memset(c->values, 0, (size_t)values);
        }
    }
    if (failed) {
        for (Py_ssize_t k = 0; k < fields; k++)
            for (int b = 0; b < 3; b++) Py_XDECREF(owned[k][b]);
        Py_XDECREF(taken);
        Py_XDECREF(outputs);
        release_views(views, 3);
        return NULL;
    }

    uint8_t *ok = (uint8_t *)PyBytes_AS_STRING(taken);
    uint8_t seen[MAX_FIELDS];
    const void *offsets_in = views[1].buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t row = 0; row < count; row++) {
        Py_ssize_t at = offset + row;
        for (Py_ssize_t k = 0; k < fields; k++)
            if (columns[k].kind == KIND_STRING) columns[k].offsets[row] = (int32_t)columns[k].data_used;
        int present = valid_in == NULL || (valid_in[at >> 3] >> (at & 7)) & 1;
        int64_t start = wide ? ((const int64_t *)offsets_in)[at] : ((const int32_t *)offsets_in)[at];
        int64_t stop = wide ? ((const int64_t *)offsets_in)[at + 1]
                            : ((const int32_t *)offsets_in)[at + 1];
        int good = present && start >= first && stop >= start && stop <= last &&
                   parse_row(data + start, data + stop, columns, (int)fields, row, seen);
        ok[row] = (uint8_t)good;
        if (!good) {
            for (Py_ssize_t k = 0; k < fields; k++) {
                column_t *c = &columns[k];
                c->validity[row >> 3] &= (uint8_t)~(1u << (row & 7));
                if (c->kind == KIND_STRING) c->data_used = c->offsets[row];
                else if (c->kind == KIND_BOOL) c->values[row >> 3] &= (uint8_t)~(1u << (row & 7));
                else ((int64_t *)c->values)[row] = 0;
            }
        }
    }
    for (Py_ssize_t k = 0; k < fields; k++) {
        column_t *c = &columns[k];
        if (c->kind == KIND_STRING) c->offsets[count] = (int32_t)c->data_used;
        int64_t valid = 0;
        for (Py_ssize_t b = 0; b < count / 8; b++) valid += __builtin_popcount(c->validity[b]);
        for (Py_ssize_t row = count / 8 * 8; row < count; row++)
            valid += (c->validity[row >> 3] >> (row & 7)) & 1;
        c->valid = valid;
    }
    Py_END_ALLOW_THREADS
    release_views(views, 3);

    for (Py_ssize_t k = 0; k < fields; k++) {
        column_t *c = &columns[k];
        PyObject *validity = owned[k][0];
        if (c->valid == count) {
            Py_DECREF(validity);
            validity = Py_NewRef(Py_None);
        }
        PyObject *text = owned[k][2];
        if (text != NULL && _PyBytes_Resize(&text, c->data_used) < 0) text = NULL;
        PyObject *entry = (c->kind == KIND_STRING && text == NULL)
                              ? NULL
                              : PyTuple_Pack(3, validity, owned[k][1], text != NULL ? text : Py_None);
        Py_DECREF(validity);
        Py_DECREF(owned[k][1]);
        Py_XDECREF(text);
        if (entry == NULL) {
            for (Py_ssize_t j = k + 1; j < fields; j++)
                for (int b = 0; b < 3; b++) Py_XDECREF(owned[j][b]);
            Py_DECREF(taken);
            Py_DECREF(outputs);
            return NULL;
        }
        PyList_SET_ITEM(outputs, k, entry);
    }
    PyObject *result = PyTuple_Pack(2, taken, outputs);
    Py_DECREF(taken);
    Py_DECREF(outputs);
    return result;
}

static PyMethodDef methods[] = {
    {"parse_flat", parse_flat, METH_VARARGS, parse_flat_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "typed_native",
    "JSON payloads of a flat schema into typed Arrow columns (see typed_native.c).", -1, methods,
};

PyMODINIT_FUNC PyInit_typed_native(void) {
    if (c_locale == (locale_t)0) c_locale = newlocale(LC_ALL_MASK, "C", (locale_t)0);
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddStringConstant(m, "SOURCE_HASH", SOURCE_HASH) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
