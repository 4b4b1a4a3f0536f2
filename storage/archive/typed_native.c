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
#ifdef __SSE2__
#include <emmintrin.h>
#endif

#define MAX_FIELDS 256
#define MAX_DEPTH 64
#define MAX_KEY 1024
#define MAX_NUMBER 400

/* Column kinds: the letters `parse_flat` and `parse_avro` take (Arrow type in brackets). */
enum kind {
    KIND_STRING = 's', /* string */
    KIND_INT = 'i',    /* int64 (JSON integer, Avro long) */
    KIND_NUMBER = 'n', /* float64 (JSON number, Avro double) */
    KIND_BOOL = 'b',   /* bool */
    KIND_INT32 = 'I',  /* int32 (Avro int) */
    KIND_FLOAT32 = 'f',/* float32 (Avro float) */
    KIND_BYTES = 'y',  /* binary (Avro bytes) */
    KIND_ENUM = 'e',   /* string: an Avro enum's symbol */
};

typedef struct {
    char kind;
    const char *name;    /* JSON: the key */
    Py_ssize_t name_len;
    int null_branch;     /* Avro: the union branch that is null (0 or 1), or -1 */
    PyObject *symbols;   /* Avro enum: a tuple of bytes (borrowed) */
    uint8_t *validity;   /* bitmap, count bits */
    uint8_t *values;     /* fixed-width values, or the boolean bitmap */
    int32_t *offsets;    /* variable width: count + 1 offsets */
    char *data;          /* variable width: the bytes */
    int64_t data_used;
    int64_t valid;       /* rows with a value */
} column_t;

static inline int variable_width(char kind) {
    return kind == KIND_STRING || kind == KIND_BYTES || kind == KIND_ENUM;
}

static inline Py_ssize_t value_width(char kind) {
    return (kind == KIND_INT32 || kind == KIND_FLOAT32) ? 4 : 8;
}

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

/* Whether n bytes at a and b are equal: inline, eight bytes at a time (keys are short; a
 * libc memcmp call per key was a tenth of the parse). */
static inline int same_bytes(const char *a, const char *b, Py_ssize_t n) {
    for (; n >= 8; a += 8, b += 8, n -= 8) {
        uint64_t x, y;
        memcpy(&x, a, 8);
        memcpy(&y, b, 8);
        if (x != y) return 0;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        if (a[i] != b[i]) return 0;
    return 1;
}

/* Copy n bytes, inline for the short runs of a JSON string (a libc memcpy call each was a
 * tenth of the parse); the stores stay within out[0:n]. */
static inline void copy_run(char *out, const unsigned char *in, size_t n) {
    if (n >= 8 && n <= 16) {
        uint64_t head, tail;
        memcpy(&head, in, 8);
        memcpy(&tail, in + n - 8, 8);
        memcpy(out, &head, 8);
        memcpy(out + n - 8, &tail, 8);
    } else if (n >= 4 && n < 8) {
        uint32_t head, tail;
        memcpy(&head, in, 4);
        memcpy(&tail, in + n - 4, 4);
        memcpy(out, &head, 4);
        memcpy(out + n - 4, &tail, 4);
    } else if (n < 4) {
        for (size_t i = 0; i < n; i++) out[i] = (char)in[i];
    } else {
        memcpy(out, in, n);
    }
}

/* The end of the run of plain string bytes at p (not a quote, backslash, control character
 * or non-ASCII byte), sixteen bytes at a time where SSE2 is there (x86-64 always). */
static inline const unsigned char *plain_run(const unsigned char *p, const unsigned char *end) {
#ifdef __SSE2__
    const __m128i quote = _mm_set1_epi8('"'), backslash = _mm_set1_epi8('\\'),
                  space = _mm_set1_epi8(0x20);
    while (end - p >= 16) {
        __m128i v = _mm_loadu_si128((const __m128i *)p);
        /* signed compare: below 0x20 are the control characters and the bytes >= 0x80 */
        __m128i special = _mm_or_si128(_mm_or_si128(_mm_cmpeq_epi8(v, quote),
                                                    _mm_cmpeq_epi8(v, backslash)),
                                       _mm_cmplt_epi8(v, space));
        int mask = _mm_movemask_epi8(special);
        if (mask != 0) return p + __builtin_ctz((unsigned)mask);
        p += 16;
    }
#endif
    while (p < end && *p >= 0x20 && *p != '"' && *p != '\\' && *p < 0x80) p++;
    return p;
}

static inline int is_word(const unsigned char *p, const unsigned char *end, const char *word,
                          int n) {
    return end - p >= n && same_bytes((const char *)p, word, n);
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
        p = plain_run(p, end);
        if (out != NULL && p > run) {
            copy_run(out, run, (size_t)(p - run));
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
static int number_value(const unsigned char *stop, const number_t *n, double *out) {
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

/* The commonest number field value in one pass: -?(0|[1-9][0-9]*)(.[0-9]+)? with at most 15
 * significant digits and 22 fraction digits, no exponent, followed by a byte that cannot
 * continue a number. Its value is what number_value gives (an integer converted, else
 * Clinger's exact quotient), and always below 2**53. NULL for anything else, which the
 * caller reads by scan_number and number_value: this decides nothing they would not. */
static const unsigned char *short_decimal(const unsigned char *p, const unsigned char *end,
                                          double *out) {
    int negative = p < end && *p == '-';
    p += negative;
    if (p >= end || *p < '0' || *p > '9') return NULL;
    uint64_t mantissa = 0;
    int significant = 0, fraction = 0;
    if (*p == '0') {
        p++;
    } else {
        for (; p < end && *p >= '0' && *p <= '9'; p++) {
            mantissa = mantissa * 10 + (uint64_t)(*p - '0');
            if (++significant > 15) return NULL;
        }
    }
    if (p < end && *p == '.') {
        p++;
        const unsigned char *first = p;
        for (; p < end && *p >= '0' && *p <= '9'; p++) {
            mantissa = mantissa * 10 + (uint64_t)(*p - '0');
            if (mantissa != 0 && ++significant > 15) return NULL;
            if (++fraction > 22) return NULL;
        }
        if (p == first) return NULL;
    }
    if (p < end && (*p == 'e' || *p == 'E' || *p == '.' || (*p >= '0' && *p <= '9')))
        return NULL;
    double value = fraction ? (double)mantissa / POW10[fraction] : (double)mantissa;
    if (mantissa == 0) value = 0.0;
    /* json.loads reads -0 as the int 0; -0.0 is the float -0.0 */
    *out = negative && (fraction || mantissa != 0) ? -value : value;
    return p;
}

/* Any JSON value at p (validated, not kept): the position after it, or NULL. */
static const unsigned char *skip_value(const unsigned char *p, const unsigned char *end,
                                       int depth) {
    if (p >= end) return NULL;
    switch (*p) {
    case '"':
        return read_string(p + 1, end, NULL, NULL);
    case 't':
        return is_word(p, end, "true", 4) ? p + 4 : NULL;
    case 'f':
        return is_word(p, end, "false", 5) ? p + 5 : NULL;
    case 'n':
        return is_word(p, end, "null", 4) ? p + 4 : NULL;
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

static void clear_row(column_t *columns, Py_ssize_t fields, Py_ssize_t row);

/* A value of field column `c` at p (null, or its kind's JSON type) into row `row`: the
 * position after it, or NULL where the row is refused. */
static const unsigned char *parse_value(column_t *c, const unsigned char *p,
                                        const unsigned char *end, int64_t row) {
    if (p >= end) return NULL;
    if (*p == 'n') return is_word(p, end, "null", 4) ? p + 4 : NULL;
    if (c->kind == KIND_STRING) {
        if (*p != '"') return NULL;
        int64_t len;
        p = read_string(p + 1, end, c->data + c->data_used, &len);
        if (p == NULL) return NULL;
        c->data_used += len;
    } else if (c->kind == KIND_BOOL) {
        if (is_word(p, end, "true", 4)) {
            set_bit(c->values, row);
            p += 4;
        } else if (is_word(p, end, "false", 5)) {
            p += 5;
        } else {
            return NULL;
        }
    } else {
        if (c->kind == KIND_NUMBER) {
            double v;
            const unsigned char *after = short_decimal(p, end, &v);
            if (after != NULL) {
                ((double *)c->values)[row] = v;
                set_bit(c->validity, row);
                return after;
            }
        }
        number_t n;
        p = scan_number(p, end, &n);
        if (p == NULL) return NULL;
        if (c->kind == KIND_INT) {
            if (!n.integer || n.int_digits > 18) return NULL;
            int64_t v = 0;
            for (int k = 0; k < n.int_digits; k++) v = v * 10 + (n.digits[k] - '0');
            ((int64_t *)c->values)[row] = n.negative ? -v : v;
        } else {
            double v;
            if (!number_value(p, &n, &v)) return NULL;
            if (!(fabs(v) < 9007199254740992.0)) return NULL; /* also inf */
            ((double *)c->values)[row] = v;
        }
    }
    set_bit(c->validity, row);
    return p;
}

/* A row layout: the bytes between the values of one serializer's rows (`{"device": "`,
 * `, "temp": `, `}` ...: whitespace, keys, colons, commas), learned from a row the full
 * parser read whose keys were all fields. A row with the very same bytes there is read by
 * checking them and parsing the values alone (`parse_by_layout`); the full parser would read
 * it the same way, the structure being the same bytes. Any other row goes to the full
 * parser. */
#define MAX_LAYOUT 4096
typedef struct {
    int ready;
    int count;                    /* values */
    int fields[MAX_FIELDS];       /* the field of value k */
    int start[MAX_FIELDS + 1];    /* literal k: bytes[start[k]:start[k] + length[k]] */
    int length[MAX_FIELDS + 1];   /* literal k precedes value k; the last one ends the row */
    unsigned char bytes[MAX_LAYOUT];
} layout_t;

/* What parse_object notes of a row for learning its layout (spans of the row's bytes). */
typedef struct {
    int valid;
    int count;
    int fields[MAX_FIELDS];
    const unsigned char *from[MAX_FIELDS + 1];
    const unsigned char *to[MAX_FIELDS + 1];
} spans_t;

static int parse_by_layout(const layout_t *layout, const unsigned char *p,
                           const unsigned char *end, column_t *columns, int64_t row) {
    for (int k = 0; k < layout->count; k++) {
        int length = layout->length[k];
        if (end - p < length ||
            !same_bytes((const char *)p, (const char *)layout->bytes + layout->start[k], length))
            return 0;
        p = parse_value(&columns[layout->fields[k]], p + length, end, row);
        if (p == NULL) return 0;
    }
    int length = layout->length[layout->count];
    return end - p == length &&
           same_bytes((const char *)p, (const char *)layout->bytes + layout->start[layout->count],
                      length);
}

/* One payload into the columns at row `row`; 0 if the row is refused (the columns may then
 * hold values written for it, which the caller clears). With `spans`, notes the bytes
 * between the values (spans->valid stays 0 when a key is not a field's). */
static int parse_object(const unsigned char *p, const unsigned char *end, column_t *columns,
                        int fields, int64_t row, uint8_t *seen, spans_t *spans) {
    char key[MAX_KEY];
    int next_field = 0;
    const unsigned char *mark = p;
    if (spans != NULL) {
        spans->valid = 1;
        spans->count = 0;
    }
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
            /* the field after the last one matched first: a serializer writes them in order */
            for (int step = 0; step < fields; step++) {
                int k = next_field + step < fields ? next_field + step : next_field + step - fields;
                if (columns[k].name_len == key_len &&
                    same_bytes(columns[k].name, key_text, key_len)) {
                    field = k;
                    next_field = k + 1 < fields ? k + 1 : 0;
                    break;
                }
            }
        }
        if (field < 0) {
            if (spans != NULL) spans->valid = 0;
            p = skip_value(p, end, 0);
            if (p == NULL) return 0;
        } else {
            if (seen[field]) return 0;
            seen[field] = 1;
            if (spans != NULL && spans->valid) {
                spans->fields[spans->count] = field;
                spans->from[spans->count] = mark;
                spans->to[spans->count] = p;
                spans->count++;
            }
            p = parse_value(&columns[field], p, end, row);
            if (p == NULL) return 0;
            mark = p;
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
    if (p != end) return 0;
    if (spans != NULL && spans->valid) {
        spans->from[spans->count] = mark;
        spans->to[spans->count] = end;
    }
    return 1;
}

typedef struct {
    uint8_t seen[MAX_FIELDS];
    spans_t spans;
    layout_t layout;
} json_context_t;

static void learn_layout(layout_t *layout, const spans_t *spans) {
    int used = 0;
    for (int k = 0; k <= spans->count; k++) {
        int length = (int)(spans->to[k] - spans->from[k]);
        if (used + length > MAX_LAYOUT) return;
        memcpy(layout->bytes + used, spans->from[k], (size_t)length);
        layout->start[k] = used;
        layout->length[k] = length;
        if (k < spans->count) layout->fields[k] = spans->fields[k];
        used += length;
    }
    layout->count = spans->count;
    layout->ready = 1;
}

static int parse_row(const unsigned char *p, const unsigned char *end, column_t *columns,
                     int fields, int64_t row, void *context) {
    json_context_t *json = context;
    if (json->layout.ready) {
        if (parse_by_layout(&json->layout, p, end, columns, row)) return 1;
        clear_row(columns, fields, row);
        return parse_object(p, end, columns, fields, row, json->seen, NULL);
    }
    if (!parse_object(p, end, columns, fields, row, json->seen, &json->spans)) return 0;
    if (json->spans.valid) learn_layout(&json->layout, &json->spans);
    return 1;
}

static void release_views(Py_buffer *views, int n) {
    for (int k = 0; k < n; k++)
        if (views[k].obj != NULL) PyBuffer_Release(&views[k]);
}

/* The payloads: an Arrow binary array's buffers, held while the GIL is released. */
typedef struct {
    Py_buffer views[3]; /* validity (may be empty), offsets, data */
    const uint8_t *validity;
    const void *offsets;
    const unsigned char *data;
    int wide;
    Py_ssize_t offset, count;
    int64_t first, last; /* the rows' bytes: data[first:last] */
} payloads_t;

static int open_payloads(payloads_t *in, PyObject *validity, PyObject *offsets, PyObject *data,
                         Py_ssize_t offset, Py_ssize_t count, int wide) {
    memset(in, 0, sizeof(*in));
    in->offset = offset;
    in->count = count;
    in->wide = wide;
    if (count < 0 || offset < 0) {
        PyErr_SetString(PyExc_ValueError, "typed_native: negative offset or count");
        return 0;
    }
    if ((validity != Py_None && PyObject_GetBuffer(validity, &in->views[0], PyBUF_SIMPLE) < 0) ||
        PyObject_GetBuffer(offsets, &in->views[1], PyBUF_SIMPLE) < 0 ||
        (data != Py_None && PyObject_GetBuffer(data, &in->views[2], PyBUF_SIMPLE) < 0)) {
        release_views(in->views, 3);
        return 0;
    }
    Py_ssize_t width = wide ? 8 : 4;
    if (in->views[1].len < (offset + count + (count > 0 ? 1 : 0)) * width ||
        (in->views[0].obj != NULL && in->views[0].len * 8 < offset + count)) {
        release_views(in->views, 3);
        PyErr_SetString(PyExc_ValueError, "typed_native: buffers shorter than the rows");
        return 0;
    }
    in->validity = in->views[0].obj != NULL ? (const uint8_t *)in->views[0].buf : NULL;
    in->offsets = in->views[1].buf;
    in->data = in->views[2].obj != NULL ? (const unsigned char *)in->views[2].buf
                                        : (const unsigned char *)"";
    Py_ssize_t data_len = in->views[2].obj != NULL ? in->views[2].len : 0;
    if (count > 0) {
        in->first = wide ? ((const int64_t *)in->offsets)[offset]
                         : ((const int32_t *)in->offsets)[offset];
        in->last = wide ? ((const int64_t *)in->offsets)[offset + count]
                        : ((const int32_t *)in->offsets)[offset + count];
    }
    if (in->first < 0 || in->last < in->first || in->last > data_len ||
        in->last - in->first > INT32_MAX) {
        release_views(in->views, 3);
        PyErr_SetString(PyExc_ValueError, "typed_native: offsets outside the data");
        return 0;
    }
    return 1;
}

/* Row `row`'s bytes, or 0 when it is null or its offsets are out of order. */
static inline int payload_at(const payloads_t *in, Py_ssize_t row, const unsigned char **start,
                             const unsigned char **stop) {
    Py_ssize_t at = in->offset + row;
    if (in->validity != NULL && !((in->validity[at >> 3] >> (at & 7)) & 1)) return 0;
    int64_t a = in->wide ? ((const int64_t *)in->offsets)[at] : ((const int32_t *)in->offsets)[at];
    int64_t b = in->wide ? ((const int64_t *)in->offsets)[at + 1]
                         : ((const int32_t *)in->offsets)[at + 1];
    if (a < in->first || b < a || b > in->last) return 0;
    *start = in->data + a;
    *stop = in->data + b;
    return 1;
}

/* The columns' output buffers: per field its validity, values (or offsets) and data, made by
 * the caller's `allocate(size)` (Arrow's pool: it hands back pages freed earlier, where a fresh
 * `bytes` costs a page fault per 4 KiB touched) or, without one, as bytes objects. The views
 * of allocated buffers are held until the GIL is back. */
typedef struct {
    PyObject *allocate; /* borrowed; NULL: bytes */
    PyObject *objects[MAX_FIELDS][3];
    Py_buffer views[MAX_FIELDS][3];
} outputs_t;

static outputs_t *new_outputs(PyObject *allocate) {
    outputs_t *out = PyMem_Calloc(1, sizeof(outputs_t));
    if (out == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    out->allocate = allocate == Py_None ? NULL : allocate;
    return out;
}

static void release_output_views(outputs_t *out, Py_ssize_t fields) {
    for (Py_ssize_t k = 0; k < fields; k++)
        for (int b = 0; b < 3; b++)
            if (out->views[k][b].obj != NULL) PyBuffer_Release(&out->views[k][b]);
}

static void drop_outputs(outputs_t *out, Py_ssize_t fields) {
    release_output_views(out, fields);
    for (Py_ssize_t k = 0; k < fields; k++)
        for (int b = 0; b < 3; b++) Py_CLEAR(out->objects[k][b]);
    PyMem_Free(out);
}

/* Output buffer `b` of field `k`, `size` bytes; its memory, or NULL with an exception set. */
static char *output_buffer(outputs_t *out, Py_ssize_t k, int b, Py_ssize_t size) {
    if (out->allocate == NULL) {
        out->objects[k][b] = PyBytes_FromStringAndSize(NULL, size);
        return out->objects[k][b] == NULL ? NULL : PyBytes_AS_STRING(out->objects[k][b]);
    }
    out->objects[k][b] = PyObject_CallFunction(out->allocate, "n", size);
    if (out->objects[k][b] == NULL ||
        PyObject_GetBuffer(out->objects[k][b], &out->views[k][b], PyBUF_WRITABLE) < 0)
        return NULL;
    if (out->views[k][b].len < size) {
        PyErr_SetString(PyExc_ValueError, "typed_native: an allocated buffer is too small");
        return NULL;
    }
    return out->views[k][b].buf;
}

/* The output buffers of `fields` columns of `count` rows; the variable-width ones get
 * `data_bound[k]` bytes. 0 with an exception set on failure. */
static int allocate_columns(column_t *columns, outputs_t *out, Py_ssize_t fields,
                            Py_ssize_t count, const int64_t *data_bound) {
    Py_ssize_t bitmap = (count + 7) / 8;
    for (Py_ssize_t k = 0; k < fields; k++) {
        column_t *c = &columns[k];
        c->data_used = 0;
        c->valid = 0;
        c->offsets = NULL;
        c->data = NULL;
        Py_ssize_t values = variable_width(c->kind) ? (count + 1) * 4
                            : c->kind == KIND_BOOL  ? bitmap
                                                    : count * value_width(c->kind);
        c->validity = (uint8_t *)output_buffer(out, k, 0, bitmap);
        if (c->validity == NULL) return 0;
        c->values = (uint8_t *)output_buffer(out, k, 1, values);
        if (c->values == NULL) return 0;
        memset(c->validity, 0, (size_t)bitmap);
        if (variable_width(c->kind)) {
            c->offsets = (int32_t *)c->values;
            c->data = output_buffer(out, k, 2, data_bound[k]);
            if (c->data == NULL) return 0;
        } else {
            memset(c->values, 0, (size_t)values);
        }
    }
    return 1;
}

/* Row `row` refused: nothing of it stays in the columns. */
static void clear_row(column_t *columns, Py_ssize_t fields, Py_ssize_t row) {
    for (Py_ssize_t k = 0; k < fields; k++) {
        column_t *c = &columns[k];
        c->validity[row >> 3] &= (uint8_t)~(1u << (row & 7));
        if (variable_width(c->kind)) c->data_used = c->offsets[row];
        else if (c->kind == KIND_BOOL) c->values[row >> 3] &= (uint8_t)~(1u << (row & 7));
        else memset(c->values + row * value_width(c->kind), 0, (size_t)value_width(c->kind));
    }
}

static void count_valid(column_t *columns, Py_ssize_t fields, Py_ssize_t count) {
    for (Py_ssize_t k = 0; k < fields; k++) {
        column_t *c = &columns[k];
        if (variable_width(c->kind)) c->offsets[count] = (int32_t)c->data_used;
        int64_t valid = 0;
        for (Py_ssize_t b = 0; b < count / 8; b++) valid += __builtin_popcount(c->validity[b]);
        for (Py_ssize_t row = count / 8 * 8; row < count; row++)
            valid += (c->validity[row >> 3] >> (row & 7)) & 1;
        c->valid = valid;
    }
}

/* (taken, [(validity or None, values, data or None) per field]); frees `out`. A bytes data
 * buffer is cut to its length; an allocated one keeps its size (the offsets say what is used). */
static PyObject *columns_result(column_t *columns, outputs_t *out, Py_ssize_t fields,
                                Py_ssize_t count, PyObject *taken) {
    release_output_views(out, fields);
    PyObject *outputs = PyList_New(fields);
    if (outputs == NULL) {
        drop_outputs(out, fields);
        return NULL;
    }
    for (Py_ssize_t k = 0; k < fields; k++) {
        column_t *c = &columns[k];
        PyObject **objects = out->objects[k];
        if (c->valid == count) Py_SETREF(objects[0], Py_NewRef(Py_None));
        if (objects[2] != NULL && PyBytes_CheckExact(objects[2]) &&
            _PyBytes_Resize(&objects[2], c->data_used) < 0) {
            Py_DECREF(outputs);
            drop_outputs(out, fields);
            return NULL;
        }
        PyObject *entry = PyTuple_Pack(3, objects[0], objects[1],
                                       objects[2] != NULL ? objects[2] : Py_None);
        if (entry == NULL) {
            Py_DECREF(outputs);
            drop_outputs(out, fields);
            return NULL;
        }
        PyList_SET_ITEM(outputs, k, entry);
    }
    drop_outputs(out, fields);
    PyObject *result = PyTuple_Pack(2, taken, outputs);
    Py_DECREF(outputs);
    return result;
}

typedef int (*row_parser)(const unsigned char *p, const unsigned char *end, column_t *columns,
                          int fields, int64_t row, void *context);

/* Every row through `parse` with the GIL released; the rows refused are cleared. */
static PyObject *parse_rows(payloads_t *in, column_t *columns, outputs_t *out,
                            Py_ssize_t fields, row_parser parse, void *context) {
    Py_ssize_t count = in->count;
    PyObject *taken = PyBytes_FromStringAndSize(NULL, count);
    if (taken == NULL) {
        drop_outputs(out, fields);
        release_views(in->views, 3);
        return NULL;
    }
    uint8_t *ok = (uint8_t *)PyBytes_AS_STRING(taken);
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t row = 0; row < count; row++) {
        for (Py_ssize_t k = 0; k < fields; k++)
            if (variable_width(columns[k].kind))
                columns[k].offsets[row] = (int32_t)columns[k].data_used;
        const unsigned char *start, *stop;
        int good = payload_at(in, row, &start, &stop) &&
                   parse(start, stop, columns, (int)fields, row, context);
        ok[row] = (uint8_t)good;
        if (!good) clear_row(columns, fields, row);
    }
    count_valid(columns, fields, count);
    Py_END_ALLOW_THREADS
    release_views(in->views, 3);
    PyObject *result = columns_result(columns, out, fields, count, taken);
    Py_DECREF(taken);
    return result;
}

PyDoc_STRVAR(parse_flat_doc,
"parse_flat(validity, offsets, data, offset, count, wide, kinds, names, allocate=None)\n"
"--\n\n"
"The typed columns of `count` JSON payloads: an Arrow binary array's buffers (`validity` may\n"
"be None; int32 offsets, int64 when `wide`) from row `offset`. `kinds` holds one letter per\n"
"field (s string, i int64, n float64, b bool), `names` the fields' keys as UTF-8 bytes.\n"
"Returns (taken, columns): `taken` one byte per row (1: read here), and per field a tuple\n"
"(validity bitmap or None when every row has a value, values or offsets, string data or None).\n"
"The buffers come from `allocate(size)` (a writable buffer, such as Arrow's allocate_buffer;\n"
"string data then keeps its size, the offsets saying what is used), else they are bytes.");

static PyObject *parse_flat(PyObject *self, PyObject *args) {
    PyObject *validity, *offsets, *data, *names, *allocate = Py_None;
    Py_ssize_t offset, count, fields;
    int wide;
    const char *kinds;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOOnnpy#O!|O", &validity, &offsets, &data, &offset, &count,
                          &wide, &kinds, &fields, &PyTuple_Type, &names, &allocate))
        return NULL;
    if (fields > MAX_FIELDS || fields != PyTuple_GET_SIZE(names)) {
        PyErr_SetString(PyExc_ValueError, "parse_flat: kinds and names differ, or too many");
        return NULL;
    }
    column_t columns[MAX_FIELDS];
    int64_t bound[MAX_FIELDS];
    for (Py_ssize_t k = 0; k < fields; k++) {
        PyObject *name = PyTuple_GET_ITEM(names, k);
        char kind = kinds[k];
        if (!PyBytes_Check(name) || (kind != KIND_STRING && kind != KIND_INT &&
                                     kind != KIND_NUMBER && kind != KIND_BOOL)) {
            PyErr_SetString(PyExc_ValueError, "parse_flat: bad kinds or names");
            return NULL;
        }
        columns[k].kind = kind;
        columns[k].name = PyBytes_AS_STRING(name);
        columns[k].name_len = PyBytes_GET_SIZE(name);
        columns[k].null_branch = -1;
        columns[k].symbols = NULL;
    }
    payloads_t in;
    if (!open_payloads(&in, validity, offsets, data, offset, count, wide)) return NULL;
    /* a string's text is never longer than its JSON */
    for (Py_ssize_t k = 0; k < fields; k++) bound[k] = in.last - in.first;
    outputs_t *out = new_outputs(allocate);
    if (out == NULL || !allocate_columns(columns, out, fields, count, bound)) {
        if (out != NULL) drop_outputs(out, fields);
        release_views(in.views, 3);
        return NULL;
    }
    json_context_t *context = PyMem_Calloc(1, sizeof(json_context_t));
    if (context == NULL) {
        drop_outputs(out, fields);
        release_views(in.views, 3);
        return PyErr_NoMemory();
    }
    PyObject *result = parse_rows(&in, columns, out, fields, parse_row, context);
    PyMem_Free(context);
    return result;
}

/* -- Avro -------------------------------------------------------------------------------- */

/* A zigzag varint long (at most 10 bytes, as an encoder writes it): the position after it,
 * or NULL. */
static inline const unsigned char *read_long(const unsigned char *p, const unsigned char *end,
                                             int64_t *out) {
    uint64_t v = 0;
    for (int i = 0; i < 10; i++) {
        if (p >= end) return NULL;
        unsigned char b = *p++;
        if (i == 9 && b > 1) return NULL;
        v |= (uint64_t)(b & 0x7F) << (7 * i);
        if (!(b & 0x80)) {
            *out = (int64_t)((v >> 1) ^ (~(v & 1) + 1));
            return p;
        }
    }
    return NULL;
}

static int valid_utf8(const unsigned char *p, const unsigned char *end) {
    while (p < end) {
        if (*p < 0x80) {
            p++;
            continue;
        }
        int n = utf8_sequence(p, end);
        if (n == 0) return 0;
        p += n;
    }
    return 1;
}

/* One Avro datum (a record of the columns' fields in order, or one value) into row `row`;
 * 0 where the caller must decide (see the file's comment). */
static int parse_avro_row(const unsigned char *p, const unsigned char *end, column_t *columns,
                          int fields, int64_t row, void *context) {
    (void)context;
    for (int k = 0; k < fields; k++) {
        column_t *c = &columns[k];
        int64_t n;
        if (c->null_branch >= 0) {
            p = read_long(p, end, &n);
            if (p == NULL || (n != 0 && n != 1)) return 0;
            if (n == c->null_branch) continue;
        }
        switch (c->kind) {
        case KIND_BOOL:
            if (p >= end) return 0;
            if (*p++) set_bit(c->values, row);
            break;
        case KIND_INT32:
            p = read_long(p, end, &n);
            if (p == NULL || n < INT32_MIN || n > INT32_MAX) return 0;
            ((int32_t *)c->values)[row] = (int32_t)n;
            break;
        case KIND_INT:
            p = read_long(p, end, &n);
            if (p == NULL) return 0;
            ((int64_t *)c->values)[row] = n;
            break;
        case KIND_FLOAT32: {
            float f;
            if (end - p < 4) return 0;
            memcpy(&f, p, 4);
            if (isnan(f)) return 0;
            ((float *)c->values)[row] = f;
            p += 4;
            break;
        }
        case KIND_NUMBER: {
            double d;
            if (end - p < 8) return 0;
            memcpy(&d, p, 8);
            if (isnan(d)) return 0;
            ((double *)c->values)[row] = d;
            p += 8;
            break;
        }
        case KIND_STRING:
        case KIND_BYTES:
            p = read_long(p, end, &n);
            if (p == NULL || n < 0 || n > end - p) return 0;
            if (c->kind == KIND_STRING && !valid_utf8(p, p + n)) return 0;
            memcpy(c->data + c->data_used, p, (size_t)n);
            c->data_used += n;
            p += n;
            break;
        case KIND_ENUM: {
            p = read_long(p, end, &n);
            if (p == NULL || n < 0 || n >= PyTuple_GET_SIZE(c->symbols)) return 0;
            PyObject *symbol = PyTuple_GET_ITEM(c->symbols, n); /* immutable: no GIL needed */
            memcpy(c->data + c->data_used, PyBytes_AS_STRING(symbol),
                   (size_t)PyBytes_GET_SIZE(symbol));
            c->data_used += PyBytes_GET_SIZE(symbol);
            break;
        }
        default:
            return 0;
        }
        set_bit(c->validity, row);
    }
    return p == end;
}

PyDoc_STRVAR(parse_avro_doc,
"parse_avro(validity, offsets, data, offset, count, wide, kinds, null_branches, symbols,\n"
"           allocate=None)\n"
"--\n\n"
"The typed columns of `count` Avro payloads (binary datums of one writer schema: a record of\n"
"scalar fields, or one scalar), from an Arrow binary array's buffers as `parse_flat` takes\n"
"them. `kinds`: one letter per field (s string, y bytes, i long, I int, n double, f float,\n"
"b boolean, e enum); `null_branches`: per field the union branch that is null (0 or 1), or -1\n"
"for a field that is not a union with null; `symbols`: per field a tuple of an enum's symbols\n"
"as UTF-8 bytes, else None. Returns what `parse_flat` returns.");

static PyObject *parse_avro(PyObject *self, PyObject *args) {
    PyObject *validity, *offsets, *data, *nulls, *symbols, *allocate = Py_None;
    Py_ssize_t offset, count, fields;
    int wide;
    const char *kinds;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOOnnpy#O!O!|O", &validity, &offsets, &data, &offset, &count,
                          &wide, &kinds, &fields, &PyTuple_Type, &nulls, &PyTuple_Type, &symbols,
                          &allocate))
        return NULL;
    if (fields > MAX_FIELDS || fields != PyTuple_GET_SIZE(nulls) ||
        fields != PyTuple_GET_SIZE(symbols)) {
        PyErr_SetString(PyExc_ValueError, "parse_avro: kinds, nulls and symbols differ");
        return NULL;
    }
    column_t columns[MAX_FIELDS];
    int64_t bound[MAX_FIELDS];
    Py_ssize_t longest_symbol[MAX_FIELDS];
    for (Py_ssize_t k = 0; k < fields; k++) {
        column_t *c = &columns[k];
        c->kind = kinds[k];
        c->name = NULL;
        c->name_len = 0;
        c->symbols = NULL;
        longest_symbol[k] = 0;
        long branch = PyLong_AsLong(PyTuple_GET_ITEM(nulls, k));
        if (branch == -1 && PyErr_Occurred()) return NULL;
        c->null_branch = (int)branch;
        PyObject *names = PyTuple_GET_ITEM(symbols, k);
        int known = strchr("syiInfbe", c->kind) != NULL && c->kind != '\0';
        if (!known || branch < -1 || branch > 1 || (c->kind == KIND_ENUM) != (names != Py_None) ||
            (names != Py_None && !PyTuple_Check(names))) {
            PyErr_SetString(PyExc_ValueError, "parse_avro: bad kinds, nulls or symbols");
            return NULL;
        }
        if (c->kind == KIND_ENUM) {
            c->symbols = names;
            for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(names); j++) {
                PyObject *symbol = PyTuple_GET_ITEM(names, j);
                if (!PyBytes_Check(symbol)) {
                    PyErr_SetString(PyExc_ValueError, "parse_avro: a symbol is not bytes");
                    return NULL;
                }
                if (PyBytes_GET_SIZE(symbol) > longest_symbol[k])
                    longest_symbol[k] = PyBytes_GET_SIZE(symbol);
            }
        }
    }
    payloads_t in;
    if (!open_payloads(&in, validity, offsets, data, offset, count, wide)) return NULL;
    for (Py_ssize_t k = 0; k < fields; k++) /* a row holds one symbol at most */
        bound[k] = columns[k].kind == KIND_ENUM ? (int64_t)count * longest_symbol[k]
                                                : in.last - in.first;
    for (Py_ssize_t k = 0; k < fields; k++) {
        if (bound[k] > INT32_MAX) { /* int32 offsets: the caller decodes it otherwise */
            release_views(in.views, 3);
            PyErr_SetString(PyExc_OverflowError, "parse_avro: the column would pass 2 GiB");
            return NULL;
        }
    }
    outputs_t *out = new_outputs(allocate);
    if (out == NULL || !allocate_columns(columns, out, fields, count, bound)) {
        if (out != NULL) drop_outputs(out, fields);
        release_views(in.views, 3);
        return NULL;
    }
    return parse_rows(&in, columns, out, fields, parse_avro_row, NULL);
}

static PyMethodDef methods[] = {
    {"parse_flat", parse_flat, METH_VARARGS, parse_flat_doc},
    {"parse_avro", parse_avro, METH_VARARGS, parse_avro_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "typed_native",
    "JSON and Avro payloads of a flat schema into typed Arrow columns (see typed_native.c).",
    -1, methods, NULL, NULL, NULL, NULL,
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
