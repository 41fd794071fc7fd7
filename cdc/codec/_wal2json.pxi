# Included by _native.pyx (it shares the Encoder's buffer and its value encoding): wal2json's
# format-version 2 ``I``/``U``/``D`` messages, the JSON the reader asks for
# (cdc.codec.wal2json.BASE_OPTIONS), straight to their events, without msgspec's Message, the Col
# objects and the row dicts.
#
# The Python reference is cdc.codec.wal2json.decode, then EventBuilder.change; the two give the same
# bytes (tests/unit/test_native_wal2json.py). This code reads every message whole and strictly (JSON
# as msgspec takes it, UTF-8, every field of wal2json's its type): whatever it is not sure to encode
# exactly as the reference does it declines, and the Python path takes the message -- a column
# unknown, of another type, left out (TOAST) or named with escapes, a key change, an UPDATE without
# its identity, a table with a held non-finite value, a message it cannot read. A value whose JSON
# this code cannot turn into the reference's (a float, an array, a number not in its canonical
# text) goes through the column's Python converter (msgspec, then orjson): Encoder.py_values.

import msgspec

#: a value as the reference decodes it (Col.value: Any, floats as their text)
cdef object _wdecode = msgspec.json.Decoder(float_hook=str).decode

# a value's JSON token
DEF T_NULL = 0
DEF T_STR = 1      # a string without escapes
DEF T_ESC = 2      # a string with escapes
DEF T_INT = 3      # a number without fraction or exponent
DEF T_NUM = 4      # a number with one
DEF T_TRUE = 5
DEF T_FALSE = 6
DEF T_OTHER = 7    # an array or an object

# how a column's numbers become its JSON (WPlan)
DEF N_COPY = 0     # a canonical integer: its text (ints; numeric_as_string ints)
DEF N_STRING = 1   # a JSON string of its text (numeric: exact, as the float hook keeps it)
DEF N_PY = 2       # the Python converter (floats, and anything else)

NUM_COPY = N_COPY
NUM_STRING = N_STRING
NUM_PY = N_PY

DEF MAX_DEPTH = 64

# what a JSON string holds (_jstr)
DEF F_ESC = 1      # escapes
DEF F_XESC = 2     # an escape orjson does not write (``\/``, ``\uXXXX``)
DEF F_HI = 4       # bytes >= 0x80 (checked UTF-8)

# 1: the byte stops the scan of a JSON string (a quote, a backslash, a control or non-ASCII byte)
cdef unsigned char _JSTOP[256]
for _i in range(256):
    _JSTOP[_i] = 1 if (_i < 0x20 or _i == 34 or _i == 92 or _i >= 0x80) else 0


cdef struct WCell:
    Py_ssize_t nstart   # the name, inside its quotes
    Py_ssize_t nsize
    Py_ssize_t tstart   # the type
    Py_ssize_t tsize
    Py_ssize_t vstart   # the value's token (a string with its quotes)
    Py_ssize_t vend
    int vtok
    int vflags          # a string value's F_* flags
    Py_ssize_t vnesc    # its escapes (each two bytes that stand for one)
    int col             # its column (by _map; _cols sets it when the plan's layout matched)
    bint bad            # a name or type with escapes


cdef struct WMsg:
    unsigned char action
    long long lsn
    Py_ssize_t sstart   # schema (-1: absent or null)
    Py_ssize_t ssize
    Py_ssize_t tstart   # table
    Py_ssize_t tsize
    Py_ssize_t nnew     # columns (-1: absent or null)
    Py_ssize_t nold     # identity


cdef class WPlan:
    """A table's compiled plan for wal2json (:func:`cdc.codec.fastpath.build_wal2json_plan`): the
    :class:`Plan` of its columns (kinds: how a *string* value becomes its JSON), each column's name
    and type as wal2json sends them (inside the JSON string's quotes), how its numbers become JSON
    (``NUM_*``) and whether ``true``/``false`` is its JSON as it is (no converter)."""

    cdef Plan plan
    cdef list raw_names
    cdef list raw_types
    cdef list pats     # a column's cell as wal2json writes it, up to its value (None: not looked for)
    cdef int *nmode
    cdef char *bcopy

    def __cinit__(self):
        self.nmode = NULL
        self.bcopy = NULL

    def __init__(self, Plan plan, list raw_names, list raw_types, list nmodes, list bcopy):
        cdef int n = plan.ncols, i
        if len(raw_names) != n or len(raw_types) != n or len(nmodes) != n or len(bcopy) != n:
            raise ValueError("a WPlan needs a name, type, number mode and bool flag per column")
        self.plan = plan
        self.raw_names = list(raw_names)
        self.raw_types = list(raw_types)
        # b'{"name":"id","type":"bigint","value":': when a message's i-th cell starts with the i-th
        # column's, its name and type are that column's (a name or type with escapes: the general
        # path, which declines them)
        self.pats = [
            None if b"\\" in nm or b"\\" in ty else b'{"name":"' + nm + b'","type":"' + ty + b'","value":'
            for nm, ty in zip(self.raw_names, self.raw_types)
        ]
        self.nmode = <int *>malloc(max(n, 1) * sizeof(int))
        self.bcopy = <char *>malloc(max(n, 1))
        if self.nmode == NULL or self.bcopy == NULL:
            raise MemoryError()
        for i in range(n):
            self.nmode[i] = nmodes[i]
            self.bcopy[i] = 1 if bcopy[i] else 0

    def __dealloc__(self):
        free(self.nmode)
        free(self.bcopy)


# -- JSON, strictly -------------------------------------------------------------------------------
cdef extern from *:
    """
    static Py_ssize_t cdc_ws_scan(const unsigned char *d, Py_ssize_t size, Py_ssize_t pos) {
        while (pos < size && (d[pos] == 32 || d[pos] == 9 || d[pos] == 10 || d[pos] == 13))
            pos++;
        return pos;
    }
    /* past JSON whitespace: no call where there is none (wal2json writes none) */
    #define CDC_WS(d, size, pos) \
        (((pos) < (size) && (d)[(pos)] > 32) ? (pos) : cdc_ws_scan((d), (size), (pos)))
    """
    Py_ssize_t _ws "CDC_WS"(const unsigned char *d, Py_ssize_t size, Py_ssize_t pos) noexcept nogil


cdef extern from *:
    """
    #include <stdint.h>
    /* Past the bytes of a JSON string that need no look (not a quote, a backslash, a control or a
       non-ASCII byte), eight at a time: a position at or before the first that does (the byte loop
       after it finds it exactly). SWAR: a byte's high bit set in t when it is one of them; t has no
       false negatives, and its lowest set byte is a true one (a borrow only runs upwards). */
    static inline Py_ssize_t cdc_jscan(const unsigned char *d, Py_ssize_t i, Py_ssize_t size) {
    #if defined(__GNUC__) && defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
        const uint64_t ones = 0x0101010101010101ULL, high = 0x8080808080808080ULL;
        while (i + 8 <= size) {
            uint64_t x, q, b, t;
            memcpy(&x, d + i, 8);
            q = x ^ (ones * 0x22);
            b = x ^ (ones * 0x5C);
            t = (((q - ones) & ~q) | ((b - ones) & ~b) | ((x - ones * 0x20) & ~x) | x) & high;
            if (t)
                return i + (__builtin_ctzll(t) >> 3);
            i += 8;
        }
    #endif
        return i;
    }
    """
    Py_ssize_t _jscan "cdc_jscan"(const unsigned char *d, Py_ssize_t i, Py_ssize_t size) noexcept nogil


cdef extern from *:
    """
    /* The length of the key at pos when it is one of wal2json's, as wal2json writes it: its
       quotes and the colon right after (e.g. 9 for "action":), else 0 (then read as any key). */
    static inline Py_ssize_t cdc_wkey(const unsigned char *d, Py_ssize_t size, Py_ssize_t pos) {
        const char *k;
        Py_ssize_t n;
        if (pos + 6 > size || d[pos] != 34)
            return 0;
        switch (d[pos + 1]) {
        case 'a': k = "action"; break;
        case 'x': k = "xid"; break;
        case 'l': k = "lsn"; break;
        case 's': k = "schema"; break;
        case 'c': k = "columns"; break;
        case 'i': k = "identity"; break;
        case 'p': k = "pk"; break;
        case 't': k = d[pos + 2] == 'i' ? "timestamp" : "table"; break;
        default: return 0;
        }
        n = (Py_ssize_t)strlen(k);
        if (pos + n + 3 > size || memcmp(d + pos + 1, k, n) != 0 || d[pos + n + 1] != 34 || d[pos + n + 2] != 58)
            return 0;
        return n + 3;
    }
    """
    Py_ssize_t _wkey "cdc_wkey"(const unsigned char *d, Py_ssize_t size, Py_ssize_t pos) noexcept nogil


cdef inline int _hex4(const unsigned char *d) noexcept:
    cdef int v = 0, h, i
    for i in range(4):
        h = _hexval(d[i])
        if h < 0:
            return -1
        v = (v << 4) | h
    return v


cdef inline Py_ssize_t _jstring(const unsigned char *d, Py_ssize_t size, Py_ssize_t pos, int *esc) noexcept:
    """:func:`_jstr`; ``esc``: 1 when the string holds escapes."""
    cdef int flags
    cdef Py_ssize_t nesc
    cdef Py_ssize_t end = _jstr(d, size, pos, &flags, &nesc)
    esc[0] = flags & F_ESC
    return end


cdef Py_ssize_t _jstr(const unsigned char *d, Py_ssize_t size, Py_ssize_t pos, int *flags,
                      Py_ssize_t *nesc) noexcept:
    """The JSON string at ``pos`` (its opening quote): the position after its closing quote, or -1
    when it is not one msgspec takes (an escape it does not know, a control byte, a lone surrogate,
    bytes that are not UTF-8). ``flags``: what it holds (F_*); ``nesc``: its escapes but those
    flagged F_XESC."""
    cdef Py_ssize_t i = pos + 1, start = pos + 1
    cdef unsigned char c
    cdef int u, u2
    cdef bint hi = False
    flags[0] = 0
    nesc[0] = 0
    while True:
        i = _jscan(d, i, size)
        while i < size and not _JSTOP[d[i]]:
            i += 1
        if i >= size:
            return -1
        c = d[i]
        if c == 34:
            break
        if c == 92:
            flags[0] |= F_ESC
            if i + 1 >= size:
                return -1
            c = d[i + 1]
            if c == 117:  # \uXXXX
                if i + 6 > size:
                    return -1
                u = _hex4(d + i + 2)
                if u < 0:
                    return -1
                flags[0] |= F_XESC
                if 0xD800 <= u <= 0xDBFF:
                    if i + 12 > size or d[i + 6] != 92 or d[i + 7] != 117:
                        return -1
                    u2 = _hex4(d + i + 8)
                    if u2 < 0xDC00 or u2 > 0xDFFF:
                        return -1
                    i += 12
                elif 0xDC00 <= u <= 0xDFFF:
                    return -1
                else:
                    i += 6
            elif c == 34 or c == 92 or c == 98 or c == 102 or c == 110 or c == 114 or c == 116:
                nesc[0] += 1  # as orjson writes it
                i += 2
            elif c == 47:
                flags[0] |= F_XESC
                i += 2
            else:
                return -1
        elif c < 0x20:
            return -1
        else:
            hi = True
            i += 1
    if hi:
        flags[0] |= F_HI
        if _utf8_chars(d + start, i - start) < 0:
            return -1
    return i + 1


cdef Py_ssize_t _jnumber(const unsigned char *d, Py_ssize_t size, Py_ssize_t pos, int *isint) noexcept:
    """The JSON number at ``pos``: its end, or -1; ``isint``: 1 without a fraction or exponent."""
    cdef Py_ssize_t i = pos, k
    isint[0] = 1
    if i < size and d[i] == 45:
        i += 1
    if i >= size:
        return -1
    if d[i] == 48:
        i += 1
    elif 49 <= d[i] <= 57:
        while i < size and 48 <= d[i] <= 57:
            i += 1
    else:
        return -1
    if i < size and d[i] == 46:
        isint[0] = 0
        i += 1
        k = i
        while i < size and 48 <= d[i] <= 57:
            i += 1
        if i == k:
            return -1
    if i < size and (d[i] == 101 or d[i] == 69):
        isint[0] = 0
        i += 1
        if i < size and (d[i] == 43 or d[i] == 45):
            i += 1
        k = i
        while i < size and 48 <= d[i] <= 57:
            i += 1
        if i == k:
            return -1
    return i


cdef inline Py_ssize_t _jlit(const unsigned char *d, Py_ssize_t size, Py_ssize_t pos, const char *lit,
                             Py_ssize_t n) noexcept:
    if pos + n > size or memcmp(d + pos, lit, n) != 0:
        return -1
    return pos + n


cdef Py_ssize_t _jskip(const unsigned char *d, Py_ssize_t size, Py_ssize_t pos, int depth) noexcept:
    """Past the JSON value at ``pos`` (checked as strictly as the rest), or -1."""
    cdef int esc, isint
    cdef unsigned char c, close
    if pos >= size:
        return -1
    c = d[pos]
    if c == 34:
        return _jstring(d, size, pos, &esc)
    if c == 45 or 48 <= c <= 57:
        return _jnumber(d, size, pos, &isint)
    if c == 116:
        return _jlit(d, size, pos, "true", 4)
    if c == 102:
        return _jlit(d, size, pos, "false", 5)
    if c == 110:
        return _jlit(d, size, pos, "null", 4)
    if c != 123 and c != 91:
        return -1
    if depth >= MAX_DEPTH:
        return -1
    close = 125 if c == 123 else 93
    pos = _ws(d, size, pos + 1)
    if pos < size and d[pos] == close:
        return pos + 1
    while True:
        if c == 123:
            if pos >= size or d[pos] != 34:
                return -1
            pos = _jstring(d, size, pos, &esc)
            if pos < 0:
                return -1
            pos = _ws(d, size, pos)
            if pos >= size or d[pos] != 58:
                return -1
            pos = _ws(d, size, pos + 1)
        pos = _jskip(d, size, pos, depth + 1)
        if pos < 0:
            return -1
        pos = _ws(d, size, pos)
        if pos >= size:
            return -1
        if d[pos] == close:
            return pos + 1
        if d[pos] != 44:
            return -1
        pos = _ws(d, size, pos + 1)


cdef Py_ssize_t _jvalue(const unsigned char *d, Py_ssize_t size, Py_ssize_t pos, WCell *cell) noexcept:
    """The column value at ``pos`` into ``cell`` (its token and kind): its end, or -1."""
    cdef int isint
    cdef Py_ssize_t end
    cdef unsigned char c
    if pos >= size:
        return -1
    c = d[pos]
    if c == 34:
        end = _jstr(d, size, pos, &cell.vflags, &cell.vnesc)
        cell.vtok = T_ESC if cell.vflags & F_ESC else T_STR
    elif c == 45 or 48 <= c <= 57:
        end = _jnumber(d, size, pos, &isint)
        cell.vtok = T_INT if isint else T_NUM
    elif c == 116:
        end = _jlit(d, size, pos, "true", 4)
        cell.vtok = T_TRUE
    elif c == 102:
        end = _jlit(d, size, pos, "false", 5)
        cell.vtok = T_FALSE
    elif c == 110:
        end = _jlit(d, size, pos, "null", 4)
        cell.vtok = T_NULL
    else:
        end = _jskip(d, size, pos, 1)
        cell.vtok = T_OTHER
    cell.vstart = pos
    cell.vend = end
    return end


cdef inline bint _is(const unsigned char *d, Py_ssize_t start, Py_ssize_t size, const char *word,
                     Py_ssize_t n) noexcept:
    return size == n and memcmp(d + start, word, n) == 0


cdef int _wlsn(const unsigned char *s, Py_ssize_t size, long long *out) noexcept:
    """``X/Y`` of at most 8 hex digits each (what lsn_to_int gives the same for): 0, or -1."""
    cdef Py_ssize_t i = 0, k
    cdef unsigned long long hi = 0, lo = 0
    cdef int h
    k = i
    while i < size and i - k < 9 and _hexval(s[i]) >= 0:
        hi = (hi << 4) | _hexval(s[i])
        i += 1
    if i == k or i - k > 8 or i >= size or s[i] != 47:
        return -1
    i += 1
    k = i
    while i < size and i - k < 9 and _hexval(s[i]) >= 0:
        lo = (lo << 4) | _hexval(s[i])
        i += 1
    if i == k or i - k > 8 or i != size:
        return -1
    out[0] = <long long>((hi << 32) | lo)
    return 0


# -- values ---------------------------------------------------------------------------------------
cdef Py_ssize_t _unescape(Encoder e, const unsigned char *s, Py_ssize_t size) except -2:
    """The JSON string's contents ``s`` (checked by _jstring) unescaped into ``e.tmp``: its length."""
    cdef Py_ssize_t i = 0, n = 0
    cdef unsigned char c
    cdef unsigned int u, u2
    cdef unsigned char *p
    if size + 4 > e.tmpcap:
        p = <unsigned char *>realloc(e.tmp, size + 64)
        if p == NULL:
            raise MemoryError()
        e.tmp = p
        e.tmpcap = size + 64
    p = e.tmp
    while i < size:
        c = s[i]
        if c != 92:
            p[n] = c
            n += 1
            i += 1
            continue
        c = s[i + 1]
        if c == 117:
            u = <unsigned int>_hex4(s + i + 2)
            i += 6
            if 0xD800 <= u <= 0xDBFF:
                u2 = <unsigned int>_hex4(s + i + 2)
                u = 0x10000 + ((u - 0xD800) << 10) + (u2 - 0xDC00)
                i += 6
            if u < 0x80:
                p[n] = <unsigned char>u
                n += 1
            elif u < 0x800:
                p[n] = <unsigned char>(0xC0 | (u >> 6))
                p[n + 1] = <unsigned char>(0x80 | (u & 0x3F))
                n += 2
            elif u < 0x10000:
                p[n] = <unsigned char>(0xE0 | (u >> 12))
                p[n + 1] = <unsigned char>(0x80 | ((u >> 6) & 0x3F))
                p[n + 2] = <unsigned char>(0x80 | (u & 0x3F))
                n += 3
            else:
                p[n] = <unsigned char>(0xF0 | (u >> 18))
                p[n + 1] = <unsigned char>(0x80 | ((u >> 12) & 0x3F))
                p[n + 2] = <unsigned char>(0x80 | ((u >> 6) & 0x3F))
                p[n + 3] = <unsigned char>(0x80 | (u & 0x3F))
                n += 4
            continue
        i += 2
        if c == 98:
            p[n] = 8
        elif c == 102:
            p[n] = 12
        elif c == 110:
            p[n] = 10
        elif c == 114:
            p[n] = 13
        elif c == 116:
            p[n] = 9
        else:  # " \ /
            p[n] = c
        n += 1
    return n


cdef int _wpy(Encoder e, WPlan wp, const unsigned char *d, WCell *c, bint bound) except -1:
    """The value through the reference's own steps: msgspec, the column's converter, orjson."""
    cdef Plan plan = wp.plan
    cdef int col = c.col
    cdef object value, conv = plan.convs[col]
    cdef bytes out
    try:
        value = _wdecode(PyBytes_FromStringAndSize(<const char *>(d + c.vstart), c.vend - c.vstart))
        if conv is not None and value is not None:
            value = conv(value)
        out = _dumps(value)
    except Exception as exc:
        e.error = exc
        raise _Declined()  # the reference raises it, with its context
    e.py_values += 1
    e._putb(out)
    if bound and plan.dyn_factor[col] >= 0 and value is not None:
        if isinstance(value, str):
            e.total += plan.dyn_factor[col] * (
                len(<str>value) if (<str>value).isascii() else 4 * len(<str>value)
            ) + plan.dyn_extra[col]
        else:
            e.total += plan.dyn_factor[col] * PyBytes_GET_SIZE(out) + plan.dyn_extra[col]
    return 0


cdef int _wvalue(Encoder e, WPlan wp, const unsigned char *d, WCell *c, bint bound) except -1:
    """Append the JSON of the column value ``c`` as the reference encodes it."""
    cdef Plan plan = wp.plan
    cdef int col = c.col, tok = c.vtok, mode
    cdef Py_ssize_t size
    if tok == T_NULL:
        e._putb(_NULL)
        return 0
    if (tok == T_STR or tok == T_ESC) and plan.kinds[col] == K_TEXT and not (c.vflags & (F_XESC | F_HI)):
        # ASCII whose escapes are the ones orjson writes: the token is the JSON the encoder would
        # write of its text (Encoder._string), byte for byte
        size = c.vend - c.vstart
        e._put(<const char *>(d + c.vstart), size)
        if bound and plan.dyn_factor[col] >= 0:
            e.total += plan.dyn_factor[col] * (size - 2 - c.vnesc) + plan.dyn_extra[col]
        return 0
    if tok == T_STR:
        return e._value(plan, col, d + c.vstart + 1, c.vend - c.vstart - 2, bound)
    if tok == T_ESC:
        size = _unescape(e, d + c.vstart + 1, c.vend - c.vstart - 2)
        return e._value(plan, col, e.tmp, size, bound)
    size = c.vend - c.vstart
    if tok == T_INT or tok == T_NUM:
        mode = wp.nmode[col]
        if mode == N_COPY and tok == T_INT and _canonical_int(d + c.vstart, size):
            e._put(<const char *>(d + c.vstart), size)
        elif mode == N_STRING and (tok == T_NUM or _canonical_int(d + c.vstart, size)):
            e._reserve(size + 2)
            e.buf[e.n] = 34
            memcpy(e.buf + e.n + 1, d + c.vstart, size)
            e.buf[e.n + size + 1] = 34
            e.n += size + 2
        else:
            return _wpy(e, wp, d, c, bound)
    elif (tok == T_TRUE or tok == T_FALSE) and wp.bcopy[col]:
        e._put(<const char *>(d + c.vstart), size)
    else:
        return _wpy(e, wp, d, c, bound)
    # the JSON's length (an int, a bool), or the string's (numeric text: ASCII)
    if bound and plan.dyn_factor[col] >= 0:
        e.total += plan.dyn_factor[col] * size + plan.dyn_extra[col]
    return 0


cdef int _wobject(Encoder e, WPlan wp, const unsigned char *d, WCell *cells, Py_ssize_t count,
                  Py_ssize_t *fs, Py_ssize_t *fe, bint bound, bint after) except -1:
    """Append the row object of ``cells`` in their order (excluded columns left out), each
    column's fragment noted in ``fs``/``fe`` (-1: absent). ``after``: the change's new row, whose
    excluded values the reference converts too (TableCodec.fast_row), so their errors are its."""
    cdef Plan plan = wp.plan
    cdef Py_ssize_t k, save
    cdef int i, col
    cdef bint first = True
    cdef WCell *c
    for i in range(plan.ncols):
        fs[i] = -1
    for k in range(count):
        c = &cells[k]
        col = c.col
        if plan.excluded[col]:
            if after and c.vtok != T_NULL and plan.convs[col] is not None:
                save = e.n
                _wpy(e, wp, d, c, False)
                e.n = save
            continue
        e._putc(123 if first else 44)
        first = False
        e._putb(<bytes>plan.names[col])
        fs[col] = e.n
        _wvalue(e, wp, d, c, bound)
        fe[col] = e.n
    if first:
        e._putc(123)
    e._putc(125)
    return 0


cdef class Wal2JsonChanges(Changes):
    """One stream session's compiled path for wal2json (cdc.codec.fastpath.native_changes builds
    it): called with a wal2json message (``I``/``U``/``D``), returns what
    ``EventBuilder.change(wal2json.decode(data))`` returns, or ``python``; ``pump`` as
    :class:`Changes`'. ``plan_for(codec)``: the table's :class:`WPlan` (None: never compiled)."""

    cdef WCell *wnew
    cdef WCell *wold
    cdef Py_ssize_t newcap
    cdef Py_ssize_t oldcap
    cdef long long *stamp
    cdef int stampcap
    cdef long long gen
    cdef bytes last_schema
    cdef bytes last_table
    cdef tuple last_key
    cdef WPlan hint            # the plan of the last table: its columns' cells looked for first
    cdef WPlan pre             # the plan whose cells _cols matched in the message parsed last
    cdef bytes last_pk         # the last "pk" array read (checked): the same bytes need no reading

    def __cinit__(self):
        self.wnew = self.wold = NULL
        self.newcap = self.oldcap = 0
        self.stamp = NULL
        self.stampcap = 0
        self.gen = 0

    def __init__(self, builder, tuple skip, plan_for, record, python):
        Changes.__init__(self, None, builder, skip, plan_for, record, python)
        self.last_schema = self.last_table = None
        self.last_key = None

    def __dealloc__(self):
        free(self.wnew)
        free(self.wold)
        free(self.stamp)

    cdef bint _takes(self, const unsigned char *d, Py_ssize_t size):
        return (size > 13 and memcmp(d, b'{"action":"', 11) == 0 and d[12] == 34
                and (d[11] == 73 or d[11] == 85 or d[11] == 68))

    cdef Py_ssize_t _cols(self, const unsigned char *d, Py_ssize_t size, Py_ssize_t pos, bint new,
                          Py_ssize_t *count) except -2:
        """The array of columns at ``pos`` into ``wnew`` (``new``) or ``wold``: its end, or -1."""
        cdef WCell *cells
        cdef WCell *grown
        cdef Py_ssize_t n = 0, cap, end
        cdef int got, esc, which
        cdef Py_ssize_t kstart, ksize, plen
        cdef WPlan hint = self.pre
        cdef object pat
        pos = _ws(d, size, pos + 1)
        if pos < size and d[pos] == 93:
            count[0] = 0
            return pos + 1
        while True:
            if pos >= size or d[pos] != 123:
                return -1
            cells = self.wnew if new else self.wold
            cap = self.newcap if new else self.oldcap
            if n >= cap:
                cap = max(16, 2 * cap)
                grown = <WCell *>realloc(cells, cap * sizeof(WCell))
                if grown == NULL:
                    raise MemoryError()
                cells = grown
                if new:
                    self.wnew = grown
                    self.newcap = cap
                else:
                    self.wold = grown
                    self.oldcap = cap
            cells[n].bad = False
            cells[n].col = -1
            got = 0
            plen = 0
            if hint is not None and n < hint.plan.ncols:
                pat = hint.pats[n]
                if pat is not None:
                    plen = PyBytes_GET_SIZE(<bytes>pat)
                    if pos + plen > size or memcmp(d + pos, PyBytes_AS_STRING(<bytes>pat), plen) != 0:
                        plen = 0
            if plen:  # the plan's n-th column, as wal2json writes it: its value next
                cells[n].nstart = pos + 9  # {"name":"
                cells[n].nsize = PyBytes_GET_SIZE(<bytes>hint.raw_names[n])
                cells[n].tstart = cells[n].nstart + cells[n].nsize + 10  # ","type":"
                cells[n].tsize = PyBytes_GET_SIZE(<bytes>hint.raw_types[n])
                cells[n].col = <int>n
                got = 7
                end = _jvalue(d, size, _ws(d, size, pos + plen), &cells[n])
                if end < 0:
                    return -1
                pos = _ws(d, size, end)
                if pos >= size or (d[pos] != 125 and d[pos] != 44):
                    return -1
                if d[pos] == 44:
                    pos = _ws(d, size, pos + 1)
            else:
                pos = _ws(d, size, pos + 1)
            while plen == 0 or d[pos] != 125:
                which = 0
                if pos + 8 <= size and memcmp(d + pos, b'"name":', 7) == 0:
                    which = 1  # wal2json's own layout: no scan for the key's end
                    pos = _ws(d, size, pos + 7)
                elif pos + 8 <= size and memcmp(d + pos, b'"type":', 7) == 0:
                    which = 2
                    pos = _ws(d, size, pos + 7)
                elif pos + 9 <= size and memcmp(d + pos, b'"value":', 8) == 0:
                    which = 3
                    pos = _ws(d, size, pos + 8)
                else:
                    if pos >= size or d[pos] != 34:
                        return -1
                    end = _jstring(d, size, pos, &esc)
                    if end < 0 or esc:
                        return -1
                    kstart = pos + 1
                    ksize = end - pos - 2
                    pos = _ws(d, size, end)
                    if pos >= size or d[pos] != 58:
                        return -1
                    pos = _ws(d, size, pos + 1)
                    which = (1 if _is(d, kstart, ksize, "name", 4) else 2 if _is(d, kstart, ksize, "type", 4)
                             else 3 if _is(d, kstart, ksize, "value", 5) else 0)
                if which == 1 or which == 2:
                    if pos >= size or d[pos] != 34:
                        return -1
                    end = _jstring(d, size, pos, &esc)
                    if end < 0:
                        return -1
                    if which == 1:
                        if got & 1:
                            return -1
                        got |= 1
                        cells[n].nstart = pos + 1
                        cells[n].nsize = end - pos - 2
                    else:
                        if got & 2:
                            return -1
                        got |= 2
                        cells[n].tstart = pos + 1
                        cells[n].tsize = end - pos - 2
                    if esc:
                        cells[n].bad = True
                elif which == 3:
                    if got & 4:
                        return -1
                    got |= 4
                    end = _jvalue(d, size, pos, &cells[n])
                else:
                    end = _jskip(d, size, pos, 2)
                if end < 0:
                    return -1
                pos = _ws(d, size, end)
                if pos >= size:
                    return -1
                if d[pos] == 125:
                    break
                if d[pos] != 44:
                    return -1
                pos = _ws(d, size, pos + 1)
            if (got & 3) != 3:
                return -1
            if not got & 4:
                cells[n].vtok = T_NULL
                cells[n].vstart = cells[n].vend = 0
            n += 1
            pos = _ws(d, size, pos + 1)
            if pos >= size:
                return -1
            if d[pos] == 93:
                count[0] = n
                return pos + 1
            if d[pos] != 44:
                return -1
            pos = _ws(d, size, pos + 1)

    cdef int _parse(self, const unsigned char *d, Py_ssize_t size, WMsg *m) except -2:
        """The message into ``m`` (and its columns into ``wnew``/``wold``): 0, or -1 when it is
        not one msgspec reads as a wal2json message, or not an I/U/D this path takes."""
        cdef Py_ssize_t pos, end, kstart, ksize, klen
        cdef int seen = 0, bit, esc, isint
        m.action = 0
        m.lsn = 0
        m.sstart = m.tstart = -1
        m.ssize = m.tsize = 0
        m.nnew = m.nold = -1
        self.pre = self.hint
        pos = _ws(d, size, 0)
        if pos >= size or d[pos] != 123:
            return -1
        pos = _ws(d, size, pos + 1)
        while True:
            klen = _wkey(d, size, pos)
            if klen:  # one of wal2json's keys as it writes them
                kstart = pos + 1
                ksize = klen - 3
                pos = _ws(d, size, pos + klen)
            else:
                if pos >= size or d[pos] != 34:
                    return -1
                end = _jstring(d, size, pos, &esc)
                if end < 0 or esc:
                    return -1
                kstart = pos + 1
                ksize = end - pos - 2
                pos = _ws(d, size, end)
                if pos >= size or d[pos] != 58:
                    return -1
                pos = _ws(d, size, pos + 1)
            if pos >= size:
                return -1
            bit = 0
            if _is(d, kstart, ksize, "action", 6):
                bit = 1
                end = _jstring(d, size, pos, &esc) if d[pos] == 34 else -1
                if end != pos + 3:
                    return -1
                m.action = d[pos + 1]
                if m.action != 73 and m.action != 85 and m.action != 68:
                    return -1
            elif _is(d, kstart, ksize, "xid", 3):
                bit = 2
                if d[pos] == 110:
                    end = _jlit(d, size, pos, "null", 4)
                else:
                    end = _jnumber(d, size, pos, &isint)
                    if not isint or end - pos > 18:
                        return -1
            elif _is(d, kstart, ksize, "lsn", 3):
                bit = 4
                if d[pos] == 110:
                    end = _jlit(d, size, pos, "null", 4)
                else:
                    end = _jstring(d, size, pos, &esc) if d[pos] == 34 else -1
                    if end < 0 or esc or _wlsn(d + pos + 1, end - pos - 2, &m.lsn) < 0:
                        return -1
            elif _is(d, kstart, ksize, "schema", 6) or _is(d, kstart, ksize, "table", 5):
                bit = 8 if ksize == 6 else 16
                end = _jstring(d, size, pos, &esc) if d[pos] == 34 else -1
                if end < 0 or esc:
                    return -1
                if bit == 8:
                    m.sstart = pos + 1
                    m.ssize = end - pos - 2
                else:
                    m.tstart = pos + 1
                    m.tsize = end - pos - 2
            elif _is(d, kstart, ksize, "columns", 7) or _is(d, kstart, ksize, "identity", 8):
                bit = 32 if ksize == 7 else 64
                if d[pos] == 110:
                    end = _jlit(d, size, pos, "null", 4)
                elif d[pos] == 91:
                    end = self._cols(d, size, pos, bit == 32, &m.nnew if bit == 32 else &m.nold)
                else:
                    return -1
            elif (_is(d, kstart, ksize, "timestamp", 9) or _is(d, kstart, ksize, "nextlsn", 7)
                  or _is(d, kstart, ksize, "prefix", 6) or _is(d, kstart, ksize, "content", 7)):
                bit = 128 << (0 if ksize == 9 else 1 if d[kstart] == 110 else 2 if d[kstart] == 112 else 3)
                if d[pos] == 110:
                    end = _jlit(d, size, pos, "null", 4)
                else:
                    end = _jstring(d, size, pos, &esc) if d[pos] == 34 else -1
            elif _is(d, kstart, ksize, "transactional", 13):
                bit = 2048
                if d[pos] == 110:
                    end = _jlit(d, size, pos, "null", 4)
                elif d[pos] == 116:
                    end = _jlit(d, size, pos, "true", 4)
                else:
                    end = _jlit(d, size, pos, "false", 5)
            elif _is(d, kstart, ksize, "pk", 2) and d[pos] == 91:  # an array: its bytes end it
                klen = PyBytes_GET_SIZE(self.last_pk) if self.last_pk is not None else 0
                if klen and pos + klen <= size and memcmp(d + pos, PyBytes_AS_STRING(self.last_pk), klen) == 0:
                    end = pos + klen  # the array read before
                else:
                    end = _jskip(d, size, pos, 1)
                    if end > 0:
                        self.last_pk = PyBytes_FromStringAndSize(<const char *>(d + pos), end - pos)
            else:
                end = _jskip(d, size, pos, 1)
            if end < 0 or (seen & bit):
                return -1
            seen |= bit
            pos = _ws(d, size, end)
            if pos >= size:
                return -1
            if d[pos] == 125:
                break
            if d[pos] != 44:
                return -1
            pos = _ws(d, size, pos + 1)
        if _ws(d, size, pos + 1) != size or not (seen & 1):
            return -1
        return 0

    cdef int _map(self, WPlan wp, const unsigned char *d, WCell *cells, Py_ssize_t count) except -1:
        """Each cell's column of the plan, by its name; raises _Declined for a name that is not
        one (or twice), or a type other than the plan's."""
        cdef Plan plan = wp.plan
        cdef int ncols = plan.ncols, col, j
        cdef Py_ssize_t k
        cdef long long *grown
        cdef bytes name
        cdef WCell *c
        if ncols > self.stampcap:
            grown = <long long *>realloc(self.stamp, ncols * sizeof(long long))
            if grown == NULL:
                raise MemoryError()
            for j in range(self.stampcap, ncols):
                grown[j] = 0
            self.stamp = grown
            self.stampcap = ncols
        self.gen += 1
        for k in range(count):
            c = &cells[k]
            if c.bad:
                raise _Declined()
            col = c.col
            if col >= 0 and self.pre is wp:  # _cols matched the column's own name and type
                if self.stamp[col] == self.gen:
                    raise _Declined()
                self.stamp[col] = self.gen
                continue
            col = -1
            if k < ncols:
                name = <bytes>wp.raw_names[k]
                if PyBytes_GET_SIZE(name) == c.nsize and memcmp(PyBytes_AS_STRING(name), d + c.nstart, c.nsize) == 0:
                    col = <int>k
            if col < 0:
                for j in range(ncols):
                    name = <bytes>wp.raw_names[j]
                    if PyBytes_GET_SIZE(name) == c.nsize and memcmp(PyBytes_AS_STRING(name), d + c.nstart, c.nsize) == 0:
                        col = j
                        break
            if col < 0 or self.stamp[col] == self.gen:
                raise _Declined()  # a column the codec does not know (it changed), or one twice
            self.stamp[col] = self.gen
            name = <bytes>wp.raw_types[col]
            if PyBytes_GET_SIZE(name) != c.tsize or memcmp(PyBytes_AS_STRING(name), d + c.tstart, c.tsize) != 0:
                raise _Declined()  # another type: the general path records the change
            c.col = col
        return 0

    cdef int _encode(self, WPlan wp, const unsigned char *d, WMsg *m, bytes head, bytes tx_part,
                     long long commit_lsn, long long seq, bytes now, bint want_image) except -1:
        """The parsed change into the encoder's ``o_*``, as Encoder.change gives them."""
        cdef Encoder e = self.encoder
        cdef Plan plan = wp.plan
        cdef unsigned char action = m.action
        cdef object image = None
        e._cells(plan.ncols if plan.ncols > 0 else 1)
        if action != 68:
            if m.nnew != plan.ncols:
                raise _Declined()  # none, or a column left out (an unchanged TOAST value)
            self._map(wp, d, self.wnew, m.nnew)
        if action != 73:
            if m.nold < 0:
                raise _Declined()  # no identity: the general path says what is wrong
            self._map(wp, d, self.wold, m.nold)
        e.n = 0
        e.total = plan.bound_static
        e._putb(_BEFORE)
        if action == 73:
            e._putb(_NULL)
        else:
            _wobject(e, wp, d, self.wold, m.nold, e.ostart, e.oend, False, False)
        e._putb(_AFTER)
        if action == 68:
            e._putb(_NULL)
        else:
            _wobject(e, wp, d, self.wnew, m.nnew, e.fstart, e.fend, want_image, True)
        e._putb(_SOURCE)
        e._putb(head)
        e._putb(tx_part)
        e._putb(_LSN)
        e._putint(m.lsn)
        e._putb(_SEQUENCE)
        e._putint(commit_lsn)
        e._putb(_SEQ_MID)
        e._putint(m.lsn)
        e._putb(_SEQ_END)
        e._putint(seq)
        e._putb(_OP)
        e._putc(99 if action == 73 else (117 if action == 85 else 100))
        e._putb(_TS)
        e._putb(now)
        e._putb(_END)
        if action == 68:
            if not e._key_into(plan, e.ostart, e.oend):
                raise _Declined()
            return e._out(100, None)
        if not e._key_into(plan, e.fstart, e.fend):
            raise _Declined()
        if action == 85 and not e._same_key(plan, e.fstart, e.fend, e.ostart, e.oend):
            raise _Declined()  # a key change: the general path
        if want_image and plan.nimaged and (plan.unbounded or e.total > TOAST_THRESHOLD):
            image = e._image(plan, e.fstart, e.fend)
        return e._out(99 if action == 73 else 117, image)

    cdef int _step(self, const unsigned char *d, Py_ssize_t size, long long lsn) except -1:
        """One I/U/D message: as :meth:`Changes._step`, the table by the message's schema and name."""
        cdef WMsg m
        cdef tuple key
        cdef _Rel r
        cdef object codec
        cdef bint same
        if self._parse(d, size, &m) < 0 or m.sstart < 0 or m.tstart < 0:
            self.encoder.declined += 1
            return R_PYTHON
        same = (self.last_key is not None and PyBytes_GET_SIZE(self.last_schema) == m.ssize
                and PyBytes_GET_SIZE(self.last_table) == m.tsize
                and memcmp(PyBytes_AS_STRING(self.last_schema), d + m.sstart, m.ssize) == 0
                and memcmp(PyBytes_AS_STRING(self.last_table), d + m.tstart, m.tsize) == 0)
        if same and self.cur is not None and self.cur.epoch == self.epoch:
            r = self.cur  # ``cur`` is the table of ``last_key``, checked this epoch
        else:
            if not same:
                self.cur = None
                self.last_key = (PyUnicode_DecodeUTF8(<const char *>(d + m.sstart), m.ssize, NULL),
                                 PyUnicode_DecodeUTF8(<const char *>(d + m.tstart), m.tsize, NULL))
                self.last_schema = PyBytes_FromStringAndSize(<const char *>(d + m.sstart), m.ssize)
                self.last_table = PyBytes_FromStringAndSize(<const char *>(d + m.tstart), m.tsize)
            key = self.last_key
            codec = self.codecs.get(key)
            if codec is None or key == self.skip:
                self.cur = None
                return R_PYTHON
            r = self.plans.get(key)
            if r is None or r.codec is not codec or r.types is not codec.types:
                r = _Rel()
                self._fill(r, codec, codec.types, self.plan_for(codec))
                self.plans[key] = r
            else:
                self._fill(r, codec, r.types, r.plan)
            self.cur = r
        if r.plan is None or self.held:
            return R_PYTHON
        self.hint = <WPlan>r.plan
        if not self._state(r):
            return R_SKIPPED
        try:
            self._encode(<WPlan>r.plan, d, &m, r.head, self.tx_part, self.commit_lsn, self.seq + 1, self.now,
                         self.staging is not None)
        except _Declined:
            self.encoder.declined += 1
            return R_PYTHON
        self._done()
        return R_DONE


# -- the floors, measured apart (bench.capture_floor) ----------------------------------------------
cdef extern from *:
    """
    /* what any reader of the message must at least do: touch every byte (quotes and commas counted) */
    static long long cdc_scan_floor(const unsigned char *d, Py_ssize_t size) {
        long long k = 0;
        for (Py_ssize_t i = 0; i < size; i++)
            k += (d[i] == 34) | (d[i] == 44);
        return k;
    }
    """
    long long _scan_floor "cdc_scan_floor"(const unsigned char *d, Py_ssize_t size) noexcept nogil

cdef object _cpu = time.process_time

STAGE_SCAN = 0
STAGE_PARSE = 1
STAGE_ENCODE = 2
STAGE_BOTH = 3


def wal2json_stages(Wal2JsonChanges ch, list payloads, WPlan wp, int stage, bytes head, bytes tx_part,
                    bint want_image):
    """The stages of the compiled path apart, over ``payloads`` (I/U/D messages of ``wp``'s table),
    for ``bench.capture_floor``: ``STAGE_SCAN`` every byte touched (a floor for any parser);
    ``STAGE_PARSE`` the JSON walked into its columns' tokens (:meth:`Wal2JsonChanges._parse`), no
    value encoded; ``STAGE_ENCODE`` the encode alone (names mapped, values, envelope, key and value
    bytes) of messages parsed beforehand; ``STAGE_BOTH`` the two, as ``_step`` runs them. Returns
    (the messages taken, the CPU seconds of the stage's loop alone); a message not taken raises
    ValueError."""
    cdef Py_ssize_t i, n = len(payloads), k = 0
    cdef bytes p
    cdef WMsg m
    cdef WMsg *msgs = NULL
    cdef WCell *saved = NULL
    cdef Py_ssize_t *offs = NULL
    cdef Py_ssize_t total = 0
    cdef long long sink = 0
    cdef double t0
    ch.hint = wp  # as _step leaves it after a change of the table
    t0 = _cpu()
    if stage == STAGE_SCAN:
        for i in range(n):
            p = <bytes>payloads[i]
            sink += _scan_floor(<const unsigned char *>PyBytes_AS_STRING(p), PyBytes_GET_SIZE(p))
        return (n if sink >= 0 else 0), _cpu() - t0
    if stage == STAGE_PARSE or stage == STAGE_BOTH:
        for i in range(n):
            p = <bytes>payloads[i]
            if ch._parse(<const unsigned char *>PyBytes_AS_STRING(p), PyBytes_GET_SIZE(p), &m) < 0:
                raise ValueError(f"message {i} not parsed")
            if stage == STAGE_BOTH:
                try:
                    ch._encode(wp, <const unsigned char *>PyBytes_AS_STRING(p), &m, head, tx_part, 1, i + 1,
                               b"0", want_image)
                except _Declined:
                    raise ValueError(f"message {i} declined") from None
        return n, _cpu() - t0
    # STAGE_ENCODE: every message parsed first, its cells kept; then only the encode is run
    msgs = <WMsg *>malloc(max(n, 1) * sizeof(WMsg))
    offs = <Py_ssize_t *>malloc((n + 1) * sizeof(Py_ssize_t))
    try:
        if msgs == NULL or offs == NULL:
            raise MemoryError()
        for i in range(n):
            p = <bytes>payloads[i]
            if ch._parse(<const unsigned char *>PyBytes_AS_STRING(p), PyBytes_GET_SIZE(p), &msgs[i]) < 0:
                raise ValueError(f"message {i} not parsed")
            offs[i] = total
            total += max(msgs[i].nnew, 0) + max(msgs[i].nold, 0)
            saved = <WCell *>realloc(saved, max(total, 1) * sizeof(WCell))
            if saved == NULL:
                raise MemoryError()
            if msgs[i].nnew > 0:
                memcpy(saved + offs[i], ch.wnew, msgs[i].nnew * sizeof(WCell))
            if msgs[i].nold > 0:
                memcpy(saved + offs[i] + max(msgs[i].nnew, 0), ch.wold, msgs[i].nold * sizeof(WCell))
        k = 0
        t0 = _cpu()
        for i in range(n):
            p = <bytes>payloads[i]
            # the cells back where _parse leaves them (a copy of a few dozen bytes per column)
            if msgs[i].nnew > 0:
                memcpy(ch.wnew, saved + offs[i], msgs[i].nnew * sizeof(WCell))
            if msgs[i].nold > 0:
                memcpy(ch.wold, saved + offs[i] + max(msgs[i].nnew, 0), msgs[i].nold * sizeof(WCell))
            try:
                ch._encode(wp, <const unsigned char *>PyBytes_AS_STRING(p), &msgs[i], head, tx_part, 1, i + 1,
                           b"0", want_image)
            except _Declined:
                raise ValueError(f"message {i} declined") from None
            k += 1
        return k, _cpu() - t0
    finally:
        free(msgs)
        free(offs)
        free(saved)
