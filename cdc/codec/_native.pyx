# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False, cdivision=True
"""The per-change path in C: a pgoutput Insert/Update/Delete message's bytes to its event's key and
value bytes (and its packed image), for one relation whose columns a :class:`Plan` describes.

The Python reference is the path it replaces (:meth:`cdc.codec.pgoutput.PgOutput.decode`, then
:meth:`cdc.codec.envelope.EventBuilder.change`); :mod:`cdc.codec.fastpath` drives this module and
``tests/unit/test_native.py`` holds the two byte-identical. Whatever this code is not sure to encode
exactly as the reference does (a key change, an unchanged TOAST value, a value that is not UTF-8 or
not in its type's canonical text, a malformed message) it declines: :meth:`Encoder.change` returns
None and the caller takes the Python path, which gives the event (or the error) as it always did.

A column whose converter has no C counterpart (floats, arrays, anything unknown) goes through its
Python converter and orjson, value by value: :attr:`Encoder.py_values` counts those values.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.unicode cimport PyUnicode_DecodeUTF8
from libc.stdlib cimport free, malloc, realloc
from libc.string cimport memchr, memcmp, memcpy

from cdc.logstore._records cimport Records

import time

import orjson

cdef object _dumps = orjson.dumps
cdef object _monotonic = time.monotonic

# column kinds: how a column's text becomes its JSON
DEF K_TEXT = 0      # a JSON string of the text (text, json, numeric, dates, ...)
DEF K_INT = 1       # the text itself (canonical integer text, checked)
DEF K_BOOL = 2      # true for "t", else false
DEF K_BYTEA = 3     # a JSON string of the text without its "\x"
DEF K_PY = 4        # the Python converter, then orjson

#: what cdc.codec.fastpath expects of this module (a build older than its source is not used)
ABI = 6

KIND_TEXT = K_TEXT
KIND_INT = K_INT
KIND_BOOL = K_BOOL
KIND_BYTEA = K_BYTEA
KIND_PY = K_PY

#: Postgres' TOAST_TUPLE_THRESHOLD with 8 kB pages (cdc.codec.values)
DEF TOAST_THRESHOLD = 2032

cdef char _HEX[16]
_HEX[:] = [48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 97, 98, 99, 100, 101, 102]

# 1: the byte needs escaping in a JSON string as orjson escapes it
cdef unsigned char _ESC[256]
# of a byte that needs escaping: the letter of its two-character escape, 0 for \u00XX
cdef unsigned char _ESC_SHORT[256]
cdef int _i
for _i in range(256):
    _ESC[_i] = 1 if (_i < 0x20 or _i == 34 or _i == 92) else 0
    _ESC_SHORT[_i] = 0
_ESC_SHORT[34] = 34
_ESC_SHORT[92] = 92
_ESC_SHORT[10] = 110
_ESC_SHORT[13] = 114
_ESC_SHORT[9] = 116
_ESC_SHORT[8] = 98
_ESC_SHORT[12] = 102


cdef bytes _BEFORE = b'{"before":'
cdef bytes _AFTER = b',"after":'
cdef bytes _SOURCE = b',"source":'
cdef bytes _LSN = b'"lsn":'
cdef bytes _SEQUENCE = b',"sequence":"[\\"'
cdef bytes _SEQ_MID = b'\\",\\"'
cdef bytes _SEQ_END = b'\\"]","seq":'
cdef bytes _OP = b'},"op":"'
cdef bytes _TS = b'","ts_ms":'
cdef bytes _END = b',"unavailable":[]}'
cdef bytes _NULL = b"null"
cdef bytes _TRUE = b"true"
cdef bytes _FALSE = b"false"


include "_libpq.pxi"


cdef class Plan:
    """How one relation's columns (in the Relation message's order) become an event: their JSON
    names, kinds, Python converters (kind :data:`KIND_PY`), which are excluded, the key columns'
    positions (in key order), the relation's replica-identity flags, the TOAST bound of the row and
    the imaged columns (``TableCodec.imaged``, in its order) with their JSON names."""

    cdef int ncols
    cdef int *kinds
    cdef char *excluded
    cdef char *relkey
    cdef int *dyn_factor
    cdef int *dyn_extra
    cdef int *keypos
    cdef int nkey
    cdef int *imaged
    cdef int nimaged
    cdef long long bound_static
    cdef bint unbounded
    cdef list names          # b'"name":'
    cdef list convs          # Python converters (None but for K_PY)
    cdef list imaged_names   # JSON names of the imaged columns
    cdef bytes key_single    # b'{"k":' when the key is one column

    def __cinit__(self):
        self.kinds = NULL
        self.excluded = NULL
        self.relkey = NULL
        self.dyn_factor = NULL
        self.dyn_extra = NULL
        self.keypos = NULL
        self.imaged = NULL

    def __init__(
        self,
        list names,
        list kinds,
        list convs,
        list excluded,
        list relkey,
        list keypos,
        list dynamic,
        long long bound_static,
        bint unbounded,
        list imaged,
    ):
        """``names``: JSON names (``orjson.dumps(name)``); ``kinds``: ``KIND_*``; ``convs``: the
        Python converter of each :data:`KIND_PY` column; ``excluded``/``relkey``: bools per column;
        ``keypos``: positions of the key columns in key order; ``dynamic``: (factor, extra) per
        column of unbounded width, None for the others; ``imaged``: (position, JSON name) in the
        codec's order."""
        cdef int n = len(names)
        cdef int i
        self.ncols = n
        self.kinds = <int *>malloc(max(n, 1) * sizeof(int))
        self.excluded = <char *>malloc(max(n, 1))
        self.relkey = <char *>malloc(max(n, 1))
        self.dyn_factor = <int *>malloc(max(n, 1) * sizeof(int))
        self.dyn_extra = <int *>malloc(max(n, 1) * sizeof(int))
        self.keypos = <int *>malloc(max(len(keypos), 1) * sizeof(int))
        self.imaged = <int *>malloc(max(len(imaged), 1) * sizeof(int))
        if (self.kinds == NULL or self.excluded == NULL or self.relkey == NULL or self.dyn_factor == NULL
                or self.dyn_extra == NULL or self.keypos == NULL or self.imaged == NULL):
            raise MemoryError()
        self.names = [n_ + b":" for n_ in names]
        self.convs = list(convs)
        for i in range(n):
            self.kinds[i] = kinds[i]
            self.excluded[i] = 1 if excluded[i] else 0
            self.relkey[i] = 1 if relkey[i] else 0
            if dynamic[i] is None:
                self.dyn_factor[i] = -1
                self.dyn_extra[i] = 0
            else:
                self.dyn_factor[i] = dynamic[i][0]
                self.dyn_extra[i] = dynamic[i][1]
        self.nkey = len(keypos)
        for i in range(self.nkey):
            self.keypos[i] = keypos[i]
        self.key_single = (b"{" + names[keypos[0]] + b":") if self.nkey == 1 else b""
        self.nimaged = len(imaged)
        self.imaged_names = []
        for i in range(self.nimaged):
            self.imaged[i] = imaged[i][0]
            self.imaged_names.append(imaged[i][1])
        self.bound_static = bound_static
        self.unbounded = unbounded

    def __dealloc__(self):
        free(self.kinds)
        free(self.excluded)
        free(self.relkey)
        free(self.dyn_factor)
        free(self.dyn_extra)
        free(self.keypos)
        free(self.imaged)


# one column of a tuple: its kind byte (t, n, u) and where its text is
cdef struct Cell:
    char kind
    Py_ssize_t start
    Py_ssize_t size


class _Declined(Exception):
    """Raised inside the encoder when the Python path is to take the change."""


cdef class Encoder:
    """Builds events into a buffer of its own (one encoder per thread). ``py_values``: values
    converted by a Python converter so far; ``declined``: changes handed back to the Python path."""

    cdef char *buf
    cdef Py_ssize_t n
    cdef Py_ssize_t cap
    cdef Cell *new
    cdef Cell *old
    cdef Py_ssize_t *fstart   # each column's fragment in the buffer (after, or before for a delete)
    cdef Py_ssize_t *fend
    cdef Py_ssize_t *ostart   # each column's fragment in ``before`` (an update with an old tuple)
    cdef Py_ssize_t *oend
    cdef int cells
    cdef unsigned char *tmp   # a COPY field unescaped
    cdef Py_ssize_t tmpcap
    cdef object error         # what a Python converter raised (the snapshot names it)
    cdef public long long py_values
    cdef public long long declined
    cdef long long total   # the row's stored-length bound (TableCodec.holds_out_of_line)
    # the last change encoded (:meth:`_try`): its op (c, u, d), key, value and image to keep; the
    # key is in ``kbuf`` and the value in ``buf`` (``o_key``, ``o_value``: made from them on first
    # use, :meth:`_okey`, :meth:`_ovalue`)
    cdef char o_op
    cdef bytes o_key
    cdef bytes o_value
    cdef object o_image
    cdef char *kbuf
    cdef Py_ssize_t kn
    cdef Py_ssize_t kcap

    def __cinit__(self):
        self.cap = 1 << 16
        self.buf = <char *>malloc(self.cap)
        self.n = 0
        self.cells = 0
        self.new = NULL
        self.old = NULL
        self.fstart = self.fend = self.ostart = self.oend = NULL
        self.py_values = 0
        self.declined = 0
        self.tmp = NULL
        self.tmpcap = 0
        self.error = None
        self.kbuf = NULL
        self.kn = 0
        self.kcap = 0
        if self.buf == NULL:
            raise MemoryError()

    def __dealloc__(self):
        free(self.buf)
        free(self.kbuf)
        free(self.tmp)
        free(self.new)
        free(self.old)
        free(self.fstart)
        free(self.fend)
        free(self.ostart)
        free(self.oend)

    cdef int _cells(self, int n) except -1:
        if n <= self.cells:
            return 0
        free(self.new)
        free(self.old)
        free(self.fstart)
        free(self.fend)
        free(self.ostart)
        free(self.oend)
        self.new = <Cell *>malloc(n * sizeof(Cell))
        self.old = <Cell *>malloc(n * sizeof(Cell))
        self.fstart = <Py_ssize_t *>malloc(n * sizeof(Py_ssize_t))
        self.fend = <Py_ssize_t *>malloc(n * sizeof(Py_ssize_t))
        self.ostart = <Py_ssize_t *>malloc(n * sizeof(Py_ssize_t))
        self.oend = <Py_ssize_t *>malloc(n * sizeof(Py_ssize_t))
        if (self.new == NULL or self.old == NULL or self.fstart == NULL or self.fend == NULL
                or self.ostart == NULL or self.oend == NULL):
            self.cells = 0
            raise MemoryError()
        self.cells = n
        return 0

    # -- the buffer ---------------------------------------------------------------------------------
    cdef inline int _reserve(self, Py_ssize_t more) except -1:
        cdef Py_ssize_t want = self.n + more
        cdef Py_ssize_t cap = self.cap
        cdef char *p
        if want <= cap:
            return 0
        while cap < want:
            cap *= 2
        p = <char *>realloc(self.buf, cap)
        if p == NULL:
            raise MemoryError()
        self.buf = p
        self.cap = cap
        return 0

    cdef inline int _put(self, const char *s, Py_ssize_t size) except -1:
        self._reserve(size)
        memcpy(self.buf + self.n, s, size)
        self.n += size
        return 0

    cdef inline int _putb(self, bytes b) except -1:
        return self._put(PyBytes_AS_STRING(b), PyBytes_GET_SIZE(b))

    cdef inline int _putc(self, char c) except -1:
        self._reserve(1)
        self.buf[self.n] = c
        self.n += 1
        return 0

    cdef int _putint(self, long long v) except -1:
        cdef char tmp[24]
        cdef int i = 24
        cdef unsigned long long u
        cdef bint neg = v < 0
        u = <unsigned long long>(-v) if neg else <unsigned long long>v
        if u == 0:
            i -= 1
            tmp[i] = 48
        while u:
            i -= 1
            tmp[i] = <char>(48 + u % 10)
            u //= 10
        if neg:
            i -= 1
            tmp[i] = 45
        return self._put(tmp + i, 24 - i)

    cdef int _string(self, const unsigned char *s, Py_ssize_t size) except -1:
        """A JSON string of ``s`` (UTF-8, checked by the caller), escaped as orjson escapes."""
        cdef Py_ssize_t i = 0, run
        cdef unsigned char c
        self._reserve(size + 2)
        self.buf[self.n] = 34
        self.n += 1
        while i < size:
            run = i
            while run < size and not _ESC[s[run]]:
                run += 1
            if run > i:
                self._put(<const char *>(s + i), run - i)
                i = run
                if i >= size:
                    break
            c = s[i]
            i += 1
            self._reserve(6)
            if _ESC_SHORT[c]:  # \" \\ \n \r \t \b \f
                self.buf[self.n] = 92
                self.buf[self.n + 1] = _ESC_SHORT[c]
                self.n += 2
            else:
                memcpy(self.buf + self.n, <const char *>b"\\u00", 4)
                self.buf[self.n + 4] = _HEX[c >> 4]
                self.buf[self.n + 5] = _HEX[c & 15]
                self.n += 6
        self._putc(34)
        return 0

    # -- values ----------------------------------------------------------------------------------------
    cdef int _value(self, Plan plan, int col, const unsigned char *s, Py_ssize_t size, bint bound) except -1:
        """Append the JSON of column ``col``'s text ``s``; adds to the row's bound when ``bound``.
        Raises _Declined when the reference would encode it otherwise or fail."""
        cdef int kind = plan.kinds[col]
        cdef long long chars
        cdef Py_ssize_t i, start
        cdef bint ascii = _ascii(s, size)
        if not ascii:
            chars = _utf8_chars(s, size)
            if chars < 0:
                raise _Declined()  # not UTF-8: the reference raises its error
        else:
            chars = size
        start = self.n
        if kind == K_TEXT:
            self._string(s, size)
            if bound and plan.dyn_factor[col] >= 0:
                self.total += plan.dyn_factor[col] * (size if ascii else 4 * chars) + plan.dyn_extra[col]
            return 0
        if kind == K_INT:
            if not _canonical_int(s, size):  # a bigint's 19 digits, say: int(), then orjson
                self._python(plan, col, s, size, ascii, chars, bound)
                return 0
            self._put(<const char *>s, size)
        elif kind == K_BOOL:
            if size == 1 and s[0] == 116:
                self._putb(_TRUE)
            else:
                self._putb(_FALSE)
        elif kind == K_BYTEA:
            if size >= 2 and s[0] == 92 and s[1] == 120:
                self._string(s + 2, size - 2)
                if bound and plan.dyn_factor[col] >= 0:
                    self.total += plan.dyn_factor[col] * (size - 2 if ascii else 4 * (chars - 2)) + plan.dyn_extra[col]
                return 0
            self._string(s, size)
        else:
            self._python(plan, col, s, size, ascii, chars, bound)
            return 0
        if bound and plan.dyn_factor[col] >= 0:
            # K_BYTEA without "\x" is a string too; K_INT and K_BOOL: the JSON's length
            if kind == K_BYTEA:
                self.total += plan.dyn_factor[col] * (size if ascii else 4 * chars) + plan.dyn_extra[col]
            else:
                self.total += plan.dyn_factor[col] * (self.n - start) + plan.dyn_extra[col]
        return 0

    cdef int _python(self, Plan plan, int col, const unsigned char *s, Py_ssize_t size,
                     bint ascii, long long chars, bint bound) except -1:
        cdef object text = PyUnicode_DecodeUTF8(<const char *>s, size, NULL)
        cdef object value
        cdef bytes out
        try:
            value = plan.convs[col](text)
            out = _dumps(value)
        except Exception as exc:
            self.error = exc
            raise _Declined()  # the reference raises it, with its context
        self.py_values += 1
        self._putb(out)
        if bound and plan.dyn_factor[col] >= 0:
            if isinstance(value, str):
                self.total += plan.dyn_factor[col] * (
                    len(<str>value) if (<str>value).isascii() else 4 * len(<str>value)
                ) + plan.dyn_extra[col]
            else:
                self.total += plan.dyn_factor[col] * PyBytes_GET_SIZE(out) + plan.dyn_extra[col]
        return 0

    # -- tuples ------------------------------------------------------------------------------------------
    cdef Py_ssize_t _tuple(self, const unsigned char *d, Py_ssize_t size, Py_ssize_t pos, Plan plan,
                           Cell *cells) except -2:
        """Read a TupleData at ``pos`` into ``cells``; its end, or -1 (declined)."""
        cdef int ncols, i
        cdef long long length
        cdef unsigned char k
        if pos + 2 > size:
            return -1
        ncols = (d[pos] << 8) | d[pos + 1]
        if ncols != plan.ncols:
            return -1
        pos += 2
        for i in range(ncols):
            if pos >= size:
                return -1
            k = d[pos]
            if k == 116:  # t
                if pos + 5 > size:
                    return -1
                length = (<long long>d[pos + 1] << 24) | (d[pos + 2] << 16) | (d[pos + 3] << 8) | d[pos + 4]
                if length < 0 or length > 0x7FFFFFFF or pos + 5 + length > size:
                    return -1
                cells[i].kind = 116
                cells[i].start = pos + 5
                cells[i].size = length
                pos += 5 + length
            elif k == 110 or k == 117:  # n, u
                cells[i].kind = <char>k
                pos += 1
            else:
                return -1
        return pos

    cdef int _object(self, Plan plan, const unsigned char *d, Cell *cells, bint relkey_only,
                     Py_ssize_t *fs, Py_ssize_t *fe, bint bound) except -1:
        """Append the row object of ``cells`` (excluded columns left out; only the relation's key
        columns when ``relkey_only``), each column's fragment noted in ``fs``/``fe`` (-1: absent)."""
        cdef int i
        cdef bint first = True
        for i in range(plan.ncols):
            fs[i] = -1
            if cells[i].kind == 117 or plan.excluded[i] or (relkey_only and not plan.relkey[i]):
                continue
            self._putc(123 if first else 44)
            first = False
            self._putb(<bytes>plan.names[i])
            fs[i] = self.n
            if cells[i].kind == 110:
                self._putb(_NULL)
            else:
                self._value(plan, i, d + cells[i].start, cells[i].size, bound)
            fe[i] = self.n
        if first:
            self._putc(123)
        self._putc(125)
        return 0

    cdef int _key_into(self, Plan plan, Py_ssize_t *fs, Py_ssize_t *fe) except -1:
        """The key (``cdc.events.encode_key``) from the fragments into ``kbuf`` (``kn`` bytes): 1, or
        0 when a key column is absent (the reference raises its error)."""
        cdef int i, p
        cdef Py_ssize_t size = 2
        cdef char *o
        for i in range(plan.nkey):
            p = plan.keypos[i]
            if fs[p] < 0:
                return 0
            size += PyBytes_GET_SIZE(<bytes>plan.names[p]) + (fe[p] - fs[p]) + (1 if i else 0)
        if size > self.kcap:
            o = <char *>realloc(self.kbuf, size + 64)
            if o == NULL:
                raise MemoryError()
            self.kbuf = o
            self.kcap = size + 64
        self.kn = size
        o = self.kbuf
        o[0] = 123
        o += 1
        for i in range(plan.nkey):
            p = plan.keypos[i]
            if i:
                o[0] = 44
                o += 1
            size = PyBytes_GET_SIZE(<bytes>plan.names[p])
            memcpy(o, PyBytes_AS_STRING(<bytes>plan.names[p]), size)
            o += size
            memcpy(o, self.buf + fs[p], fe[p] - fs[p])
            o += fe[p] - fs[p]
        o[0] = 125
        return 1

    cdef object _key(self, Plan plan, Py_ssize_t *fs, Py_ssize_t *fe):
        """The key bytes from the fragments; None when a key column is absent."""
        if not self._key_into(plan, fs, fe):
            return None
        return PyBytes_FromStringAndSize(self.kbuf, self.kn)

    cdef bint _same_key(self, Plan plan, Py_ssize_t *fs, Py_ssize_t *fe, Py_ssize_t *os,
                        Py_ssize_t *oe) noexcept:
        """Whether the key of the fragments ``os``/``oe`` is there and is the key of ``fs``/``fe``
        (present): the same bytes exactly when each key column's fragment is the same (each is one
        JSON value, which ends where its text says)."""
        cdef int i, p
        for i in range(plan.nkey):
            p = plan.keypos[i]
            if os[p] < 0 or oe[p] - os[p] != fe[p] - fs[p]:
                return False
            if memcmp(self.buf + os[p], self.buf + fs[p], fe[p] - fs[p]) != 0:
                return False
        return True

    cdef object _image(self, Plan plan, Py_ssize_t *fs, Py_ssize_t *fe):
        """The packed image (``cdc.logstore.images.pack``) of the imaged columns present."""
        cdef list parts = []
        cdef int i, p
        for i in range(plan.nimaged):
            p = plan.imaged[i]
            if fs[p] < 0:
                continue
            parts.append(<bytes>plan.imaged_names[i] + b"\x01" + PyBytes_FromStringAndSize(self.buf + fs[p], fe[p] - fs[p]))
        return b"\x00".join(parts)

    # -- a change -------------------------------------------------------------------------------------
    def change(self, bytes data, Plan plan, bytes head, bytes tx_part, long long lsn,
               long long commit_lsn, long long seq, bytes now, bint want_image):
        """One pgoutput ``I``/``U``/``D`` message of the plan's relation: (op, key, value, image)
        with op ``c``/``u``/``d`` and image the packed image to keep (None: none to keep), or None
        when the Python path is to take it (see the module docstring)."""
        if not self._try(<const unsigned char *>PyBytes_AS_STRING(data), PyBytes_GET_SIZE(data), plan,
                         head, tx_part, lsn, commit_lsn, seq, now, want_image):
            return None
        return self.result()

    cdef tuple result(self):
        """The last change encoded as :meth:`change` returns it."""
        return (PyBytes_FromStringAndSize(&self.o_op, 1), self._okey(), self._ovalue(), self.o_image)

    cdef bytes _okey(self):
        """The key of the change encoded last (made from ``kbuf`` on first use)."""
        if self.o_key is None:
            self.o_key = PyBytes_FromStringAndSize(self.kbuf, self.kn)
        return self.o_key

    cdef bytes _ovalue(self):
        """The value of the change encoded last (made from the buffer on first use: the batch's
        :class:`Records` copies it from the buffer, no bytes object in between)."""
        if self.o_value is None:
            self.o_value = PyBytes_FromStringAndSize(self.buf, self.n)
        return self.o_value

    cdef bint _try(self, const unsigned char *d, Py_ssize_t size, Plan plan, bytes head, bytes tx_part,
                   long long lsn, long long commit_lsn, long long seq, bytes now, bint want_image) except -1:
        """:meth:`change` of the message ``d`` (``size`` bytes) into ``o_*``: False when declined."""
        try:
            self._change(d, size, plan, head, tx_part, lsn, commit_lsn, seq, now, want_image)
            return True
        except _Declined:
            self.declined += 1
            return False

    cdef int _change(self, const unsigned char *d, Py_ssize_t size, Plan plan, bytes head,
                     bytes tx_part, long long lsn, long long commit_lsn, long long seq, bytes now,
                     bint want_image) except -1:
        cdef Py_ssize_t pos
        cdef unsigned char kind, oldkind = 0
        cdef int i
        cdef object image = None
        cdef Py_ssize_t *fs
        cdef Py_ssize_t *fe
        if size < 6:
            raise _Declined()
        self._cells(plan.ncols if plan.ncols > 0 else 1)
        kind = d[0]
        pos = 5
        if kind == 73:  # I
            pos = self._tuple(d, size, 6, plan, self.new)
            if pos < 0:
                raise _Declined()
        elif kind == 85:  # U
            if d[pos] != 78:
                oldkind = d[pos]
                if oldkind != 75 and oldkind != 79:
                    raise _Declined()
                pos = self._tuple(d, size, pos + 1, plan, self.old)
                if pos < 0:
                    raise _Declined()
            pos = self._tuple(d, size, pos + 1, plan, self.new)
            if pos < 0:
                raise _Declined()
        elif kind == 68:  # D
            oldkind = d[pos]
            if oldkind != 75 and oldkind != 79:
                raise _Declined()
            pos = self._tuple(d, size, pos + 1, plan, self.old)
            if pos < 0:
                raise _Declined()
        else:
            raise _Declined()
        if kind != 68:
            for i in range(plan.ncols):
                if self.new[i].kind == 117:
                    raise _Declined()  # an unchanged TOAST value: the general path fills it in
        self.n = 0
        self.total = plan.bound_static
        self._putb(_BEFORE)
        if kind == 73:
            self._putb(_NULL)
        elif kind == 68 or oldkind:
            self._object(plan, d, self.old, oldkind == 75, self.ostart, self.oend, False)
        else:  # no old tuple: the key did not change; ``before`` is the new row's key columns
            self._object(plan, d, self.new, True, self.ostart, self.oend, False)
        self._putb(_AFTER)
        if kind == 68:
            self._putb(_NULL)
        else:
            self._object(plan, d, self.new, False, self.fstart, self.fend, want_image)
        self._putb(_SOURCE)
        self._putb(head)
        self._putb(tx_part)
        self._putb(_LSN)
        self._putint(lsn)
        self._putb(_SEQUENCE)
        self._putint(commit_lsn)
        self._putb(_SEQ_MID)
        self._putint(lsn)
        self._putb(_SEQ_END)
        self._putint(seq)
        self._putb(_OP)
        self._putc(99 if kind == 73 else (117 if kind == 85 else 100))
        self._putb(_TS)
        self._putb(now)
        self._putb(_END)
        if kind == 68:
            if not self._key_into(plan, self.ostart, self.oend):
                raise _Declined()
            return self._out(100, None)
        if not self._key_into(plan, self.fstart, self.fend):
            raise _Declined()
        if kind == 85:
            if not oldkind and not any_relkey(plan):
                raise _Declined()  # no identity at all: the general path says what is wrong
            if not self._same_key(plan, self.fstart, self.fend, self.ostart, self.oend):
                raise _Declined()  # a key change: the general path
        if want_image and plan.nimaged and (plan.unbounded or self.total > TOAST_THRESHOLD):
            image = self._image(plan, self.fstart, self.fend)
        return self._out(99 if kind == 73 else 117, image)

    cdef inline int _out(self, char op, object image) except -1:
        """The change encoded: its op and image into ``o_*``, its key (``kbuf``) and value (the
        buffer) kept until the next change (:meth:`_okey`, :meth:`_ovalue`)."""
        self.o_op = op
        self.o_key = None
        self.o_value = None
        self.o_image = image
        return 0


cdef inline bint any_relkey(Plan plan):
    cdef int i
    for i in range(plan.ncols):
        if plan.relkey[i]:
            return True
    return False


cdef inline bint _ascii(const unsigned char *s, Py_ssize_t size):
    cdef Py_ssize_t i
    for i in range(size):
        if s[i] & 0x80:
            return False
    return True


cdef long long _utf8_chars(const unsigned char *s, Py_ssize_t size):
    """The number of characters of strict UTF-8 (as Python's decoder accepts it), or -1."""
    cdef Py_ssize_t i = 0
    cdef long long chars = 0
    cdef unsigned char c, c1
    while i < size:
        c = s[i]
        if c < 0x80:
            i += 1
        elif 0xC2 <= c <= 0xDF:
            if i + 1 >= size or (s[i + 1] & 0xC0) != 0x80:
                return -1
            i += 2
        elif 0xE0 <= c <= 0xEF:
            if i + 2 >= size:
                return -1
            c1 = s[i + 1]
            if (c1 & 0xC0) != 0x80 or (s[i + 2] & 0xC0) != 0x80:
                return -1
            if (c == 0xE0 and c1 < 0xA0) or (c == 0xED and c1 > 0x9F):
                return -1  # overlong, surrogate
            i += 3
        elif 0xF0 <= c <= 0xF4:
            if i + 3 >= size:
                return -1
            c1 = s[i + 1]
            if (c1 & 0xC0) != 0x80 or (s[i + 2] & 0xC0) != 0x80 or (s[i + 3] & 0xC0) != 0x80:
                return -1
            if (c == 0xF0 and c1 < 0x90) or (c == 0xF4 and c1 > 0x8F):
                return -1
            i += 4
        else:
            return -1
        chars += 1
    return chars


cdef bint _canonical_int(const unsigned char *s, Py_ssize_t size):
    """``-?(0|[1-9][0-9]*)`` of at most 18 digits: int() then orjson give this text back."""
    cdef Py_ssize_t i = 0
    if size and s[0] == 45:
        i = 1
    if i >= size or size - i > 18:
        return False
    if s[i] == 48:
        return size - i == 1 and i == 0
    for i in range(i, size):
        if s[i] < 48 or s[i] > 57:
            return False
    return True


cdef class _Rel:
    """A relation's (a table's) compiled path as a session caches it: its codec, plan and the
    codec's facts the envelope needs, checked against the builder once per call into the
    :class:`Changes` (``epoch``), and its topic's list in the batch being filled."""

    cdef object rel            # pgoutput's Relation (None: wal2json's, by name)
    cdef object codec
    cdef object types          # the codec's ``types`` when the plan was built
    cdef object plan           # Plan (pgoutput), WPlan (wal2json), or None: the Python path's
    cdef object topic
    cdef bytes head            # the codec's ``source_head``
    cdef long long snapshot_lsn
    cdef bint imaged
    cdef long long epoch       # the call it was last checked in
    cdef long long lst_epoch   # the call ``lst`` is the batch's records of
    cdef object lst            # Records (or a list a caller put in the batch)


DEF R_PYTHON = 0    # the Python path takes the change
DEF R_SKIPPED = 1   # a change the table's snapshot contains (or replayed): no records
DEF R_DONE = 2      # encoded: Encoder.o_*, of the table ``cur``


cdef class Changes:
    """One stream session's compiled path (cdc.codec.fastpath.native_changes builds it and
    documents it): called with a pgoutput ``I``/``U``/``D`` message and its ``data_start``, returns
    what ``EventBuilder.change(decoder.decode(data, lsn))`` returns, or ``python`` (the Python path
    takes the message). ``plan_for(rel, codec)``: a relation's :class:`Plan` (None: never compiled);
    ``record``: the log store's ``Record`` class.

    The builder's transaction state (``seq``, ``commit_lsn``, ``tx_part``, the clock ``now``, the
    staging) is read once per call (:meth:`_load`, an *epoch*) and ``seq`` and the staging's
    ``version`` written back when it returns (:meth:`_save`): between two calls only the Python
    path changes them (a Begin, a tick, a change it takes), and a call returns at every message it
    does not take. A table's codec and plan are checked against the builder once per epoch too
    (a Relation message, a schema change or a detached table are all Python's, between calls)."""

    cdef public Encoder encoder
    cdef object relations      # the decoder's relid -> relation dict
    cdef object builder
    cdef dict codecs
    cdef tuple skip
    cdef object plan_for
    cdef object record
    cdef object python
    cdef dict plans            # relid (wal2json: (schema, table)) -> _Rel
    # the builder's state, as of this epoch
    cdef long long epoch
    cdef long long seq
    cdef long long commit_lsn
    cdef long long skip_seq
    cdef bytes tx_part
    cdef bytes now
    cdef object staging
    cdef bint held             # non-finite values held: every change is the Python path's
    cdef long long vseq        # the staging's version to write back (0: none)
    cdef long long last_relid
    cdef _Rel cur              # the table of the last change looked up

    def __init__(self, decoder, builder, tuple skip, plan_for, record, python):
        self.encoder = Encoder()
        self.relations = decoder.relations if decoder is not None else None
        self.builder = builder
        self.codecs = builder.codecs
        self.skip = skip
        self.plan_for = plan_for
        self.record = record
        self.python = python
        self.plans = {}
        self.epoch = 0
        self.last_relid = -1
        self.cur = None

    @property
    def python_values(self):
        return self.encoder.py_values

    @property
    def declined(self):
        return self.encoder.declined

    cdef int _load(self) except -1:
        """A new epoch: the builder's state as the Python path left it."""
        cdef object b = self.builder
        self.epoch += 1
        self.seq = b.seq
        self.commit_lsn = b.commit_lsn
        self.skip_seq = b._skip_seq
        self.tx_part = b.tx_part
        self.now = b.now
        self.staging = b.staging
        self.held = bool(b.nonfinite_held)
        self.vseq = 0
        return 0

    cdef int _save(self) except -1:
        """The builder's state as the changes of this epoch left it."""
        cdef object b = self.builder
        if b.seq != self.seq:
            b.seq = self.seq
        if self.vseq:
            self.staging.version = (self.commit_lsn, self.vseq)
            self.vseq = 0
        return 0

    def __call__(self, bytes data, long long lsn):
        cdef const unsigned char *d = <const unsigned char *>PyBytes_AS_STRING(data)
        cdef int got
        if not self._takes(d, PyBytes_GET_SIZE(data)):
            return self.python
        self._load()
        try:
            got = self._step(d, PyBytes_GET_SIZE(data), lsn)
        finally:
            self._save()
        if got == R_PYTHON:
            return self.python
        if got == R_SKIPPED:
            return None
        return self.cur.topic, self._records()

    cdef bint _takes(self, const unsigned char *d, Py_ssize_t size):
        """Whether the message is one this path takes (else ``pump`` returns it): I, U or D."""
        return size > 0 and (d[0] == 73 or d[0] == 85 or d[0] == 68)

    def pump(self, read, batch, long long max_count, long long budget, CopyStream stream=None):
        """Read messages with ``read`` and append the records of the row changes this path takes
        straight into ``batch`` (a :class:`cdc.logstore.batch.Batch`: its ``records``, ``count``
        and ``started``, as ``Batch.add`` sets them), until ``budget`` messages were taken or the
        batch holds ``max_count`` records (then: ``python``), nothing is ready (None) or a message
        this path does not take (returned: a message other than I/U/D, or one it declined, for the
        Python path). Returns (that, messages taken: every one a change).

        ``stream``: the :class:`CopyStream` under ``read``, read directly (no object per change)
        while the messages it gives are the ones ``read`` would (its decoder's source holds
        nothing); a message this path does not take is handed back to it, and what ``read`` then
        returns is returned."""
        cdef long long k = 0, count = batch.count
        cdef dict records = batch.records
        cdef object raw
        cdef bytes data
        cdef Py_ssize_t size
        cdef int got
        self._load()
        try:
            if stream is not None:
                while k < budget and count < max_count:
                    size = stream._next()
                    if size < 0:
                        return None, k
                    if not self._takes(stream.payload, size):
                        stream._hold()
                        return read(), k
                    got = self._step(stream.payload, size, stream.data_start)
                    if got == R_PYTHON:
                        stream._hold()
                        return read(), k
                    k += 1
                    if got == R_DONE:
                        count = self._append(batch, records, count)
                return self.python, k
            while k < budget and count < max_count:
                raw = read()
                if raw is None:
                    return None, k
                data = raw.payload
                size = PyBytes_GET_SIZE(data)
                if not self._takes(<const unsigned char *>PyBytes_AS_STRING(data), size):
                    return raw, k
                got = self._step(<const unsigned char *>PyBytes_AS_STRING(data), size, raw.data_start)
                if got == R_PYTHON:
                    return raw, k
                k += 1
                if got == R_DONE:
                    count = self._append(batch, records, count)
            return self.python, k
        finally:
            self._save()
            batch.count = count
            if stream is not None:
                stream.direct += k

    cdef list _records(self):
        """The records of the change encoded last (a delete's tombstone after its event), its
        image staged."""
        cdef Encoder e = self.encoder
        cdef _Rel r = self.cur
        if e.o_op == 100:  # d
            if self.staging is not None and r.imaged:
                self.staging.put(r.topic, e._okey(), None)
            return [self.record(e._okey(), e._ovalue()), self.record(e._okey(), None)]
        if e.o_image is not None and self.staging is not None:
            self.staging.put(r.topic, e._okey(), e.o_image)
        return [self.record(e._okey(), e._ovalue())]

    cdef long long _append(self, object batch, dict records, long long count) except -1:
        """The records of the change encoded last into the batch's records of its topic (as
        ``Batch.add`` puts them: a :class:`Records`, its key and value copied straight from the
        encoder, no ``Record``; a list where a caller put one): the batch's new count."""
        cdef Encoder e = self.encoder
        cdef _Rel r = self.cur
        cdef object lst
        cdef Records recs
        if count == 0:
            batch.started = _monotonic()
        if r.lst_epoch != self.epoch or r.lst is None:
            lst = records.get(r.topic)
            if lst is None:
                lst = Records()
                records[r.topic] = lst
            r.lst = lst
            r.lst_epoch = self.epoch
        lst = r.lst
        if e.o_op == 100:  # d
            if self.staging is not None and r.imaged:
                self.staging.put(r.topic, e._okey(), None)
        elif e.o_image is not None and self.staging is not None:
            self.staging.put(r.topic, e._okey(), e.o_image)
        if type(lst) is Records:
            recs = <Records>lst
            recs.put(e.kbuf, e.kn, e.buf, e.n)
            if e.o_op == 100:
                recs.put(e.kbuf, e.kn, NULL, -1)
                return count + 2
            return count + 1
        lst.append(self.record(e._okey(), e._ovalue()))
        if e.o_op == 100:
            lst.append(self.record(e._okey(), None))
            return count + 2
        return count + 1

    cdef int _state(self, _Rel r) except -1:
        """The table's change in the transaction: its ``seq`` (the change's), or 0 when the
        table's snapshot contains it (skipped: ``seq`` counted, no records)."""
        cdef long long seq = self.seq + 1
        if self.commit_lsn < r.snapshot_lsn or seq <= self.skip_seq:
            self.seq = seq
            return 0
        return 1

    cdef int _done(self) except -1:
        """The change encoded: its ``seq`` taken (and staged as the images' version)."""
        self.seq += 1
        if self.staging is not None:
            self.vseq = self.seq
        return 0

    cdef int _fill(self, _Rel r, object codec, object types, object plan) except -1:
        """``r`` for ``codec`` as it is now (checked this epoch)."""
        r.codec = codec
        r.types = types
        r.plan = plan
        r.topic = codec.topic
        r.head = codec.source_head
        r.snapshot_lsn = codec.snapshot_lsn
        r.imaged = bool(codec.imaged)
        r.epoch = self.epoch
        r.lst = None
        r.lst_epoch = 0
        return 0

    cdef _Rel _lookup(self, long long relid):
        """The relation's :class:`_Rel` checked this epoch, or None (the Python path's)."""
        cdef _Rel r
        cdef object rel, codec
        if relid == self.last_relid and self.cur is not None and self.cur.epoch == self.epoch:
            return self.cur
        rel = self.relations.get(relid)
        if rel is None:
            return None
        r = self.plans.get(relid)
        codec = self.codecs.get((rel.schema, rel.table))
        if r is not None and r.rel is rel and r.codec is codec and codec is not None and codec.types is r.types:
            self._fill(r, codec, r.types, r.plan)  # the same plan: the codec's facts again
        else:
            if codec is None or (rel.schema, rel.table) == self.skip:
                return None
            r = _Rel()
            r.rel = rel
            self._fill(r, codec, codec.types, self.plan_for(rel, codec))
            self.plans[relid] = r
        self.last_relid = relid
        self.cur = r
        return r

    cdef int _step(self, const unsigned char *d, Py_ssize_t size, long long lsn) except -1:
        """One I/U/D message: R_PYTHON, R_SKIPPED or R_DONE (its event in the encoder's ``o_*``,
        its table ``cur``)."""
        cdef long long relid
        cdef _Rel r
        if size < 5 or self.held:
            return R_PYTHON
        relid = (<long long>d[1] << 24) | (d[2] << 16) | (d[3] << 8) | d[4]
        r = self._lookup(relid)
        if r is None or r.plan is None:
            return R_PYTHON
        if not self._state(r):
            return R_SKIPPED
        if not self.encoder._try(d, size, <Plan>r.plan, r.head, self.tx_part, lsn, self.commit_lsn,
                                 self.seq + 1, self.now, self.staging is not None):
            return R_PYTHON
        self._done()
        return R_DONE


cdef class CopyRows:
    """The snapshot's rows: ``COPY (SELECT cols ...) TO STDOUT`` (text format) to ``op=r`` records.
    ``plan``: the columns read, in order (none excluded: excluded columns are not read); ``head``
    and ``tail``: the event around its ``after`` object (``source`` and the rest, the same for
    every row); ``record``: the log store's ``Record`` class; ``want_image``: keep each row's image
    (the codec's rule, as the stream's, :meth:`TableCodec.holds_out_of_line`). Values are encoded
    exactly as the stream encodes a row's values (floats and arrays by their Python converter)."""

    cdef Encoder enc
    cdef Plan plan
    cdef bytes head
    cdef bytes tail
    cdef object record
    cdef bint want_image

    def __init__(self, Plan plan, bytes head, bytes tail, record, bint want_image):
        self.enc = Encoder()
        self.enc._cells(plan.ncols if plan.ncols > 0 else 1)
        self.plan = plan
        self.head = head
        self.tail = tail
        self.record = record
        self.want_image = want_image and plan.nimaged > 0

    @property
    def python_values(self):
        return self.enc.py_values

    cdef const unsigned char *_field(self, const unsigned char *s, Py_ssize_t size, Py_ssize_t *out) except NULL:
        """``s`` with COPY's escapes undone (``\\\\``, ``\\b \\f \\n \\r \\t \\v``, octal, ``\\x``)."""
        cdef Encoder e = self.enc
        cdef Py_ssize_t i = 0, n = 0, k
        cdef unsigned char c, v
        cdef unsigned char *p
        if size > e.tmpcap:
            p = <unsigned char *>realloc(e.tmp, size + 64)
            if p == NULL:
                raise MemoryError()
            e.tmp = p
            e.tmpcap = size + 64
        p = e.tmp
        while i < size:
            c = s[i]
            if c != 92 or i + 1 >= size:
                p[n] = c
                n += 1
                i += 1
                continue
            c = s[i + 1]
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
            elif c == 118:
                p[n] = 11
            elif 48 <= c <= 55:
                v = c - 48
                for k in range(2):
                    if i < size and 48 <= s[i] <= 55:
                        v = (v << 3) + (s[i] - 48)
                        i += 1
                p[n] = v
            elif c == 120 and i < size and _hexval(s[i]) >= 0:
                v = _hexval(s[i])
                i += 1
                if i < size and _hexval(s[i]) >= 0:
                    v = (v << 4) + _hexval(s[i])
                    i += 1
                p[n] = v
            else:
                p[n] = c
            n += 1
        out[0] = n
        return p

    def rows(self, bytes data):
        """The records of ``data``, whole rows of the COPY's output, and the images to keep (a list
        of (key, image) pairs; empty when none is kept). A row that is not one of the plan's
        raises ValueError; a value no converter takes, ValueError naming its column (its
        converter's error as the cause)."""
        cdef const unsigned char *d = <const unsigned char *>PyBytes_AS_STRING(data)
        cdef Py_ssize_t size = PyBytes_GET_SIZE(data)
        cdef Py_ssize_t pos = 0, end, flen
        cdef Encoder e = self.enc
        cdef Plan plan = self.plan
        cdef int i, ncols = plan.ncols
        cdef const unsigned char *f
        cdef list records = [], images = []
        cdef object key
        cdef unsigned char stop
        while pos < size:
            e.n = 0
            e.total = plan.bound_static
            e._putb(self.head)
            for i in range(ncols):
                end = pos
                while end < size and d[end] != 9 and d[end] != 10:
                    end += 1
                if end >= size:
                    raise ValueError("the COPY output ends inside a row")
                stop = d[end]
                if (i < ncols - 1) != (stop == 9):
                    raise ValueError(f"a row of the COPY output does not have {ncols} columns")
                e._putc(123 if i == 0 else 44)
                e._putb(<bytes>plan.names[i])
                e.fstart[i] = e.n
                if end - pos == 2 and d[pos] == 92 and d[pos + 1] == 78:  # \N
                    e._putb(_NULL)
                else:
                    f = self._field(d + pos, end - pos, &flen) if memchr(d + pos, 92, end - pos) != NULL else d + pos
                    if f != d + pos:
                        pass
                    else:
                        flen = end - pos
                    try:
                        e._value(plan, i, f, flen, True)
                    except _Declined:
                        err = e.error
                        e.error = None
                        raise ValueError(f"column {i}: a value its converter cannot take") from err
                e.fend[i] = e.n
                pos = end + 1
            if ncols == 0:
                e._putc(123)
            e._putc(125)
            e._putb(self.tail)
            key = e._key(plan, e.fstart, e.fend)
            records.append(self.record(key, PyBytes_FromStringAndSize(e.buf, e.n)))
            if self.want_image and (plan.unbounded or e.total > TOAST_THRESHOLD):
                images.append((key, e._image(plan, e.fstart, e.fend)))
        return records, images


cdef inline int _hexval(unsigned char c):
    if 48 <= c <= 57:
        return c - 48
    if 97 <= c <= 102:
        return c - 87
    if 65 <= c <= 70:
        return c - 55
    return -1


include "_wal2json.pxi"
